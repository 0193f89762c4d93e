//! A regular file or a host block device as a [`BlockDevice`].
//!
//! Reads and writes go straight between the caller's buffers and the file (optionally
//! `O_DIRECT`). Discard punches holes (files) or issues `BLKDISCARD` (block devices); write-zeroes
//! uses `FALLOC_FL_ZERO_RANGE` or `BLKZEROOUT`; flush is `fdatasync`.
//!
//! Each channel executes requests in one of the [`IoMode`]s: io_uring (`uring.rs`), a small worker
//! pool running blocking system calls (`pool.rs`), or inline `preadv`/`pwritev` on
//! the submitting thread. [`IoMode::Auto`] (the default) probes io_uring once per device and falls
//! back to the pool when the kernel (or a seccomp filter) refuses it.
//!
//! A file on tmpfs or ramfs opened without `O_DIRECT` is also mapped: in every mode, reads and
//! writes of its allocated pages are copies through the mapping instead of system calls
//! (`memfile.rs`: holes, discards and a file shrunk under the device keep their system-call
//! behaviour).

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use crate::file_io::{
    ioctl_int, ioctl_u64, is_memory_fs, FileInner, BLKGETSIZE64, BLKPBSZGET, BLKSSZGET,
};
use crate::inline::InlineChannel;
use crate::memfile::MemFile;
use crate::pool::PoolChannel;
use crate::uring::{UringChannel, UringSupport};
use crate::{BdevError, BlockDevice, DeviceInfo, IoChannel, ParseIoModeError};

/// How requests are executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoMode {
    /// io_uring when the kernel allows it (probed once per device), else [`IoMode::ThreadPool`].
    #[default]
    Auto,
    /// One io_uring per channel; opening a channel fails when io_uring is unavailable.
    IoUring,
    /// A few worker threads per channel running blocking system calls (works everywhere).
    ThreadPool,
    /// Inline system calls on the submitting thread (best on the page cache and fast devices).
    Inline,
}

impl IoMode {
    /// The canonical name, as accepted by [`IoMode::from_str`].
    pub fn as_str(&self) -> &'static str {
        match self {
            IoMode::Auto => "auto",
            IoMode::IoUring => "io_uring",
            IoMode::ThreadPool => "threads",
            IoMode::Inline => "inline",
        }
    }
}

impl std::fmt::Display for IoMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for IoMode {
    type Err = ParseIoModeError;

    /// Parses `auto`, `io_uring` (or `uring`, `io-uring`), `threads` (or `thread_pool`,
    /// `threadpool`) and `inline`, ignoring ASCII case and surrounding blanks.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "auto" => Ok(IoMode::Auto),
            "io_uring" | "io-uring" | "uring" => Ok(IoMode::IoUring),
            "threads" | "thread_pool" | "threadpool" => Ok(IoMode::ThreadPool),
            "inline" => Ok(IoMode::Inline),
            _ => Err(ParseIoModeError {
                input: s.to_string(),
            }),
        }
    }
}

/// Options for [`FileDevice::open`].
#[derive(Debug, Clone, Default)]
pub struct FileOptions {
    /// Open read-only.
    pub read_only: bool,
    /// Bypass the page cache with `O_DIRECT`.
    pub direct: bool,
    /// Logical block size; default: the device's for block devices, 512 for files.
    pub block_size: Option<u32>,
    /// Execution mode.
    pub mode: IoMode,
}

/// A file or block device.
#[derive(Debug)]
pub struct FileDevice {
    pub(crate) inner: Arc<FileInner>,
    mode: IoMode,
    /// io_uring probe result (or the errno that refused it), computed on first need.
    uring: OnceLock<Result<UringSupport, i32>>,
}

impl FileDevice {
    /// Opens `path`. The file must exist; its size (rounded down to the block size) is the
    /// capacity.
    pub fn open(path: impl AsRef<Path>, opts: &FileOptions) -> Result<Self, BdevError> {
        let path = path.as_ref();
        let open_err = |source| BdevError::Open {
            path: path.display().to_string(),
            source,
        };
        let mut oo = OpenOptions::new();
        oo.read(true).write(!opts.read_only);
        if opts.direct {
            oo.custom_flags(libc::O_DIRECT);
        }
        let file = oo.open(path).map_err(open_err)?;
        let meta = file.metadata().map_err(open_err)?;
        let is_blockdev = meta.file_type().is_block_device();
        if !is_blockdev && !meta.file_type().is_file() {
            return Err(open_err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file or block device",
            )));
        }
        let fd = file.as_raw_fd();
        let (size, dev_lbs, dev_pbs) = if is_blockdev {
            let size = ioctl_u64(fd, BLKGETSIZE64).map_err(|e| BdevError::io("BLKGETSIZE64", e))?;
            let lbs = ioctl_int(fd, BLKSSZGET).unwrap_or(512);
            let pbs = ioctl_int(fd, BLKPBSZGET).unwrap_or(lbs);
            (size, lbs, pbs)
        } else {
            (meta.len(), 512, 4096)
        };
        let block_size = opts.block_size.unwrap_or(dev_lbs);
        if !block_size.is_power_of_two() || !(512..=4096).contains(&block_size) {
            return Err(BdevError::Invalid(format!(
                "block size {block_size} must be a power of two from 512 to 4096"
            )));
        }
        if block_size < dev_lbs {
            return Err(BdevError::Invalid(format!(
                "block size {block_size} is below the device's logical block size {dev_lbs}"
            )));
        }
        let num_blocks = size / u64::from(block_size);
        if num_blocks == 0 {
            return Err(BdevError::Invalid(format!(
                "{} is smaller than one {block_size}-byte block",
                path.display()
            )));
        }
        let info = DeviceInfo {
            block_size,
            num_blocks,
            read_only: opts.read_only,
            volatile_cache: true,
            discard: true,
            write_zeroes: true,
            buf_align: if opts.direct {
                block_size.max(dev_lbs)
            } else {
                1
            },
            physical_block_size: dev_pbs.max(block_size),
            optimal_io_size: 0,
        };
        let memory_backed = !is_blockdev && is_memory_fs(file.as_raw_fd());
        let mem = if memory_backed && !opts.direct {
            MemFile::open(&file, num_blocks * u64::from(block_size), !opts.read_only)
        } else {
            None
        };
        Ok(FileDevice {
            inner: Arc::new(FileInner {
                file,
                path: path.to_path_buf(),
                is_blockdev,
                memory_backed,
                page_cache: !is_blockdev && !memory_backed && !opts.direct,
                num_blocks: std::sync::atomic::AtomicU64::new(info.num_blocks),
                info,
                mem,
            }),
            mode: opts.mode,
            uring: OnceLock::new(),
        })
    }

    /// The path the device was opened from.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The mode requested in [`FileOptions::mode`].
    pub fn mode(&self) -> IoMode {
        self.mode
    }

    /// The mode channels actually use: [`IoMode::Auto`] resolves to [`IoMode::IoUring`] when the
    /// probe succeeds and to [`IoMode::ThreadPool`] otherwise; other modes are returned as is.
    pub fn effective_mode(&self) -> IoMode {
        match self.mode {
            IoMode::Auto if self.uring_support().is_ok() => IoMode::IoUring,
            IoMode::Auto => IoMode::ThreadPool,
            m => m,
        }
    }

    fn uring_support(&self) -> Result<UringSupport, i32> {
        *self.uring.get_or_init(|| {
            let r = crate::uring::probe();
            if let Err(errno) = r {
                if self.mode == IoMode::Auto {
                    tracing::warn!(
                        path = %self.inner.path.display(),
                        error = %std::io::Error::from_raw_os_error(errno),
                        "io_uring unavailable, using the thread pool"
                    );
                }
            }
            r
        })
    }

    fn open_uring(&self, depth: usize, max_segments: usize) -> Result<UringChannel, BdevError> {
        let support = self
            .uring_support()
            .map_err(|errno| BdevError::io("io_uring", std::io::Error::from_raw_os_error(errno)))?;
        UringChannel::new(self.inner.clone(), support, depth, max_segments)
    }
}

impl BlockDevice for FileDevice {
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }

    fn open_channel(
        &self,
        depth: usize,
        max_segments: usize,
    ) -> Result<Box<dyn IoChannel>, BdevError> {
        match self.mode {
            IoMode::Inline => Ok(Box::new(InlineChannel::new(
                self.inner.clone(),
                depth,
                max_segments,
            ))),
            IoMode::IoUring => Ok(Box::new(self.open_uring(depth, max_segments)?)),
            IoMode::ThreadPool => Ok(Box::new(PoolChannel::new(
                self.inner.clone(),
                depth,
                max_segments,
            )?)),
            IoMode::Auto => {
                if self.uring_support().is_ok() {
                    match self.open_uring(depth, max_segments) {
                        Ok(ch) => return Ok(Box::new(ch)),
                        Err(e) => tracing::warn!(
                            path = %self.inner.path.display(),
                            error = %e,
                            "cannot set up an io_uring channel, using the thread pool"
                        ),
                    }
                }
                Ok(Box::new(PoolChannel::new(
                    self.inner.clone(),
                    depth,
                    max_segments,
                )?))
            }
        }
    }

    fn rescan(&self) -> Result<DeviceInfo, BdevError> {
        self.inner.rescan()
    }

    fn describe(&self) -> String {
        format!(
            "{} {} ({})",
            if self.inner.is_blockdev {
                "blockdev"
            } else {
                "file"
            },
            self.inner.path.display(),
            match self.mode {
                IoMode::Auto => format!("auto: {}", self.effective_mode()),
                m => m.to_string(),
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::SyncIo;

    #[test]
    fn file_roundtrip() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let dev = FileDevice::open(f.path(), &FileOptions::default()).unwrap();
        assert_eq!(dev.info().num_blocks, 2048);
        let mut io = SyncIo::new(&dev).unwrap();
        let data = vec![0xa5u8; 65536];
        io.write_at(8192, &data).unwrap();
        io.flush().unwrap();
        let mut back = vec![0u8; 65536];
        io.read_at(8192, &mut back).unwrap();
        assert_eq!(back, data);
        io.write_zeroes(8192, 4096, false).unwrap();
        io.discard(12288, 4096).unwrap();
        io.read_at(8192, &mut back).unwrap();
        assert!(back[..8192].iter().all(|&b| b == 0));
        assert!(back[8192..].iter().all(|&b| b == 0xa5));
    }

    /// Where io_uring is refused (seccomp, sysctl), `Auto` falls back to the thread pool and
    /// `IoUring` fails with the reason.
    #[test]
    fn auto_falls_back_when_uring_is_refused() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let dev = FileDevice::open(f.path(), &FileOptions::default()).unwrap();
        dev.uring.set(Err(libc::EPERM)).unwrap();
        assert_eq!(dev.mode(), IoMode::Auto);
        assert_eq!(dev.effective_mode(), IoMode::ThreadPool);
        assert!(
            dev.describe().contains("auto: threads"),
            "{}",
            dev.describe()
        );
        let ch = dev.open_channel(4, 4).unwrap();
        assert!(ch.notify_fd().is_some());
        drop(ch);
        let mut io = SyncIo::new(&dev).unwrap();
        io.write_at(0, &[9u8; 512]).unwrap();
        let mut back = [0u8; 512];
        io.read_at(0, &mut back).unwrap();
        assert_eq!(back, [9u8; 512]);

        let opts = FileOptions {
            mode: IoMode::IoUring,
            ..Default::default()
        };
        let dev = FileDevice::open(f.path(), &opts).unwrap();
        dev.uring.set(Err(libc::EPERM)).unwrap();
        let e = dev.open_channel(4, 4).err().unwrap();
        assert!(e.to_string().contains("io_uring"), "{e}");
    }

    #[test]
    fn missing_file_is_clear() {
        let e = FileDevice::open("/nonexistent/x.img", &FileOptions::default()).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/x.img"), "{e}");
    }
}

#[cfg(test)]
mod memfs_tests {
    use super::*;

    #[test]
    fn tmpfs_files_are_detected() {
        if !std::path::Path::new("/dev/shm").is_dir() {
            eprintln!("skipped: no /dev/shm");
            return;
        }
        let f = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let dev = FileDevice::open(f.path(), &FileOptions::default()).unwrap();
        assert_eq!(dev.effective_mode(), IoMode::IoUring);
        assert!(dev.inner.memory_backed);
        let mut io = crate::sync::SyncIo::new(&dev).unwrap();
        io.write_at(0, &[7u8; 4096]).unwrap();
        let mut b = [0u8; 4096];
        io.read_at(0, &mut b).unwrap();
        assert_eq!(b, [7u8; 4096]);
    }
}

#[cfg(test)]
mod rescan_tests {
    use super::*;

    #[test]
    fn rescan_sees_a_grown_file() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let dev = FileDevice::open(f.path(), &FileOptions::default()).unwrap();
        assert_eq!(dev.info().num_blocks, 2048);
        f.as_file().set_len(4 << 20).unwrap();
        assert_eq!(dev.info().num_blocks, 2048, "size is cached until rescan");
        assert_eq!(dev.rescan().unwrap().num_blocks, 8192);
        assert_eq!(dev.info().num_blocks, 8192);
        let mut io = crate::sync::SyncIo::new(&dev).unwrap();
        io.write_at((4 << 20) - 4096, &[1u8; 4096]).unwrap();
    }
}
