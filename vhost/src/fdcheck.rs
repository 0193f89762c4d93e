//! Checks on the memory files a frontend hands over before the backend maps them.
//!
//! A shared mapping may be longer than the file behind it: `mmap` accepts it, and the first
//! access past the end of the file raises `SIGBUS`, which kills the whole process (every device
//! it serves). So every descriptor that is going to be mapped (`SET_MEM_TABLE`, `ADD_MEM_REG`,
//! `SET_INFLIGHT_FD`) must be a regular file (a memfd, a tmpfs or hugetlbfs file, a plain file)
//! whose size covers the mapped range `[offset, offset + size)`. What a frontend does to the
//! file afterwards (shrinking it under a running queue) is caught by the SIGBUS handler
//! (`katablk_bdev::sigbus`).

use std::fs::File;
use std::os::fd::AsRawFd;

/// Why a memory file was refused.
#[derive(Debug, thiserror::Error)]
pub enum FdError {
    /// `fstat` failed on the descriptor.
    #[error("{what}: cannot stat the file descriptor: {source}")]
    Stat {
        /// What the descriptor was sent for (e.g. "memory region 0").
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The descriptor is not a regular file (directory, FIFO, socket, device...).
    #[error("{what}: the file descriptor is a {kind}, not a regular file or memfd")]
    NotRegular {
        /// What the descriptor was sent for.
        what: String,
        /// The kind of file found.
        kind: &'static str,
    },
    /// The mapped range is empty.
    #[error("{what}: empty mapping (offset {offset:#x}, size 0)")]
    Empty {
        /// What the descriptor was sent for.
        what: String,
        /// Offset in the file.
        offset: u64,
    },
    /// `offset + size` overflows.
    #[error("{what}: offset {offset:#x} + size {size:#x} overflows")]
    Overflow {
        /// What the descriptor was sent for.
        what: String,
        /// Offset in the file.
        offset: u64,
        /// Size of the mapping.
        size: u64,
    },
    /// The file ends before the end of the mapped range.
    #[error(
        "{what}: offset {offset:#x} + size {size:#x} goes past the end of the file \
         ({file_size:#x} bytes)"
    )]
    TooSmall {
        /// What the descriptor was sent for.
        what: String,
        /// Offset in the file.
        offset: u64,
        /// Size of the mapping.
        size: u64,
        /// Size of the file.
        file_size: u64,
    },
}

/// What the checks found out about an accepted memory file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemFile {
    /// File size in bytes.
    pub size: u64,
    /// Preferred I/O block size of the file: the huge page size on hugetlbfs.
    pub block_size: u64,
}

fn kind_of(mode: libc::mode_t) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => "directory",
        libc::S_IFIFO => "FIFO",
        libc::S_IFSOCK => "socket",
        libc::S_IFCHR => "character device",
        libc::S_IFBLK => "block device",
        libc::S_IFLNK => "symbolic link",
        _ => "file of unknown type",
    }
}

/// Checks that `file` can back a shared mapping of `size` bytes at `offset`: it is a regular
/// file (memfds are) and at least `offset + size` bytes long. `what` names the mapping in the
/// error (e.g. "memory region 1 (gpa 0x100000)").
///
/// Character devices (e.g. device-DAX) are refused too: their size cannot be checked.
pub fn check_mappable(
    file: &File,
    what: impl Into<String>,
    offset: u64,
    size: u64,
) -> Result<MemFile, FdError> {
    let what = what.into();
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct; fstat overwrites it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `file` owns a live descriptor for the duration of the call and `st` is a valid,
    // writable `stat` buffer.
    if unsafe { libc::fstat(file.as_raw_fd(), &mut st) } != 0 {
        return Err(FdError::Stat {
            what,
            source: std::io::Error::last_os_error(),
        });
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(FdError::NotRegular {
            what,
            kind: kind_of(st.st_mode),
        });
    }
    if size == 0 {
        return Err(FdError::Empty { what, offset });
    }
    let Some(end) = offset.checked_add(size) else {
        return Err(FdError::Overflow { what, offset, size });
    };
    // A regular file's size is never negative; treat a nonsensical one as empty.
    let file_size = u64::try_from(st.st_size).unwrap_or(0);
    if end > file_size {
        return Err(FdError::TooSmall {
            what,
            offset,
            size,
            file_size,
        });
    }
    Ok(MemFile {
        size: file_size,
        block_size: u64::try_from(st.st_blksize).unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn memfd(len: u64) -> File {
        // SAFETY: memfd_create with a NUL-terminated name; checked below.
        let fd = unsafe { libc::memfd_create(c"fdcheck".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor owned by nobody else.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(len).unwrap();
        f
    }

    #[test]
    fn sizes_are_checked() {
        let f = memfd(1 << 20);
        let ok = check_mappable(&f, "r", 0, 1 << 20).unwrap();
        assert_eq!(ok.size, 1 << 20);
        check_mappable(&f, "r", 4096, (1 << 20) - 4096).unwrap();
        let e = check_mappable(&f, "region 3", 4096, 1 << 20).unwrap_err();
        assert!(matches!(e, FdError::TooSmall { file_size, .. } if file_size == 1 << 20));
        let msg = e.to_string();
        assert!(
            msg.contains("region 3") && msg.contains("0x100000"),
            "{msg}"
        );
        assert!(matches!(
            check_mappable(&f, "r", 2 << 20, 4096),
            Err(FdError::TooSmall { .. })
        ));
        assert!(matches!(
            check_mappable(&f, "r", u64::MAX - 10, 4096),
            Err(FdError::Overflow { .. })
        ));
        assert!(matches!(
            check_mappable(&f, "r", 0, 0),
            Err(FdError::Empty { .. })
        ));
        assert!(matches!(
            check_mappable(&memfd(0), "r", 0, 4096),
            Err(FdError::TooSmall { file_size: 0, .. })
        ));
    }

    #[test]
    fn only_regular_files() {
        let dir = tempfile::tempdir().unwrap();
        let d = File::open(dir.path()).unwrap();
        assert!(matches!(
            check_mappable(&d, "r", 0, 4096),
            Err(FdError::NotRegular {
                kind: "directory",
                ..
            })
        ));
        let null = File::open("/dev/null").unwrap();
        assert!(matches!(
            check_mappable(&null, "r", 0, 4096),
            Err(FdError::NotRegular {
                kind: "character device",
                ..
            })
        ));
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors are fresh and owned by nobody else.
        let (r, _w) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        assert!(matches!(
            check_mappable(&r, "r", 0, 4096),
            Err(FdError::NotRegular { kind: "FIFO", .. })
        ));
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let a = File::from(std::os::fd::OwnedFd::from(a));
        assert!(matches!(
            check_mappable(&a, "r", 0, 4096),
            Err(FdError::NotRegular { kind: "socket", .. })
        ));
    }
}
