//! Formatting filesystem volumes without exposing the lvol as a host block device.
//!
//! The lvol lives inside the SPDK/katablk target, reachable only through its vhost-user-blk
//! controller socket. So the node plugin runs `mkfs.<fstype>` on a *sparse* temporary file of
//! the volume's size and then copies the file's data extents (`SEEK_DATA`/`SEEK_HOLE`; a fresh
//! ext4 is a few MiB of metadata) into the volume through the controller socket with libblkio's
//! vhost-user-blk driver — a userspace writer, no NBD, no loopback iSCSI, no kernel module.
//! Holes are not written: the volume must read zeros where mkfs left holes, which holds for a
//! new lvol (thin lvols read unallocated clusters as zeros; thick ones are cleared when the
//! clusters were last freed with the lvstore's default `unmap` clear method). Filesystems that
//! tolerate stale blocks (ext4 with lazy inode tables, xfs) are unaffected either way.
//!
//! The same client reads the first 128 KiB to recognise an existing filesystem, so a publish of
//! an already formatted volume never reformats it.

use std::io::{Seek, SeekFrom};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

use crate::error::{CsiError, Result};

/// Filesystems the driver can create (when their `mkfs.<fs>` is installed).
pub const SUPPORTED_FS: &[&str] = &["ext4", "ext3", "ext2", "xfs"];

/// Bytes copied per request.
const CHUNK: usize = 1 << 20;

/// How much of the volume [`detect_fs`] reads.
const PROBE_LEN: usize = 128 << 10;

/// Checks `fs` is a type the driver can format.
pub fn check_fstype(fs: &str) -> Result<()> {
    if SUPPORTED_FS.contains(&fs) {
        Ok(())
    } else {
        Err(CsiError::InvalidArgument(format!(
            "unsupported fstype {fs:?}; supported: {}",
            SUPPORTED_FS.join(", ")
        )))
    }
}

/// Recognises a filesystem from the first bytes of a volume.
pub fn probe_fs(head: &[u8]) -> Option<&'static str> {
    if head.len() >= 4 && &head[0..4] == b"XFSB" {
        return Some("xfs");
    }
    if head.len() >= 0x464 && head[0x438] == 0x53 && head[0x439] == 0xEF {
        let compat = u32::from_le_bytes([head[0x45C], head[0x45D], head[0x45E], head[0x45F]]);
        let incompat = u32::from_le_bytes([head[0x460], head[0x461], head[0x462], head[0x463]]);
        return Some(if incompat & 0x40 != 0 {
            "ext4"
        } else if compat & 0x4 != 0 {
            "ext3"
        } else {
            "ext2"
        });
    }
    if head.len() >= 0x10048 && &head[0x10040..0x10048] == b"_BHRfS_M" {
        return Some("btrfs");
    }
    None
}

/// True if two fs names are the same family for "already formatted" purposes.
pub fn same_family(a: &str, b: &str) -> bool {
    a == b || (a.starts_with("ext") && b.starts_with("ext"))
}

/// A libblkio vhost-user-blk connection with one bounce region.
struct Dev {
    b: Blkio,
    q: Blkioq,
    region: MemoryRegion,
    capacity: u64,
    /// The buffer's memory when it is ours (2 MiB-aligned hugepages, which SPDK's vhost target
    /// needs); dropped after `b` has unmapped it.
    _shm: Option<katablk_bdev::shm::SharedRegion>,
}

/// An I/O buffer of at least `len` bytes for a connected libblkio client, not yet mapped: a
/// 2 MiB-aligned hugepage memfd, which works with every target (SPDK's vhost fails on
/// libblkio's own unaligned memfd), or without free hugepages libblkio's buffer. Keep the
/// `SharedRegion` until the region is unmapped (or the `Blkio` dropped).
pub fn client_buffer(
    b: &mut Blkio,
    len: usize,
) -> std::result::Result<(MemoryRegion, Option<katablk_bdev::shm::SharedRegion>), blkio::Error> {
    match katablk_bdev::shm::SharedRegion::new(len) {
        Ok(r) if r.is_hugepages() => Ok((
            MemoryRegion {
                addr: r.addr() as usize,
                iova: r.addr() as u64,
                len: r.len(),
                fd: r.fd(),
                fd_offset: 0,
                flags: 0,
            },
            Some(r),
        )),
        _ => Ok((b.alloc_mem_region(len)?, None)),
    }
}

fn blk_err(e: blkio::Error) -> CsiError {
    CsiError::Internal(format!("vhost-user-blk client: {e}"))
}

/// How long [`Dev::connect`] retries a refused connection: a controller's socket file appears
/// at `bind()`, a moment before the target listens on it.
const CONNECT_RETRY: std::time::Duration = std::time::Duration::from_secs(2);

impl Dev {
    fn connect(socket: &Path, read_only: bool) -> Result<Self> {
        let t0 = std::time::Instant::now();
        loop {
            match Self::connect_once(socket, read_only) {
                Err(e) if t0.elapsed() < CONNECT_RETRY => {
                    tracing::debug!(socket = %socket.display(), error = %e, "retrying connect");
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                r => return r,
            }
        }
    }

    fn connect_once(socket: &Path, read_only: bool) -> Result<Self> {
        let path = socket
            .to_str()
            .ok_or_else(|| CsiError::Internal(format!("socket path {socket:?} is not UTF-8")))?;
        let mut b = Blkio::new("virtio-blk-vhost-user").map_err(blk_err)?;
        b.set_str("path", path).map_err(blk_err)?;
        b.set_bool("read-only", read_only).map_err(blk_err)?;
        b.connect().map_err(blk_err)?;
        b.set_i32("num-queues", 1).map_err(blk_err)?;
        b.set_i32("queue-size", 64).map_err(blk_err)?;
        let mut out = b.start().map_err(blk_err)?;
        let capacity = b.get_u64("capacity").map_err(blk_err)?;
        let (region, shm) = client_buffer(&mut b, CHUNK).map_err(blk_err)?;
        b.map_mem_region(&region).map_err(blk_err)?;
        let q = out
            .queues
            .pop()
            .ok_or_else(|| CsiError::Internal("vhost-user-blk client: no queue".into()))?;
        Ok(Self {
            b,
            q,
            region,
            capacity,
            _shm: shm,
        })
    }

    fn wait(&mut self, what: &str) -> Result<()> {
        let mut c = [std::mem::MaybeUninit::<Completion>::uninit()];
        let mut t = Duration::from_secs(60);
        let n = self
            .q
            .do_io(&mut c, 1, Some(&mut t), None)
            .map_err(blk_err)?;
        if n != 1 {
            return Err(CsiError::Internal(format!("{what}: request timed out")));
        }
        // SAFETY: do_io reported one completion, so c[0] is initialised.
        let ret = unsafe { c[0].assume_init_ref() }.ret;
        if ret != 0 {
            return Err(CsiError::Internal(format!("{what}: error {ret}")));
        }
        Ok(())
    }

    fn read(&mut self, off: u64, len: usize) -> Result<Vec<u8>> {
        let len = len.min(self.region.len);
        let buf = self.region.addr as *mut u8;
        self.q.read(off, buf, len, 0, ReqFlags::empty());
        self.wait("read")?;
        let mut v = vec![0u8; len];
        // SAFETY: the region is mapped, at least `len` bytes long and holds what was just read.
        unsafe { std::ptr::copy_nonoverlapping(buf, v.as_mut_ptr(), len) };
        Ok(v)
    }

    fn write(&mut self, off: u64, data: &[u8]) -> Result<()> {
        let len = data.len().min(self.region.len);
        let buf = self.region.addr as *mut u8;
        // SAFETY: the region is ours, mapped and at least `len` bytes long; `data` has `len`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf, len) };
        self.q.write(off, buf, len, 0, ReqFlags::empty());
        self.wait("write")
    }

    fn flush(&mut self) -> Result<()> {
        self.q.flush(0, ReqFlags::empty());
        self.wait("flush")
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        self.b.unmap_mem_region(&self.region);
    }
}

/// Reads the first 128 KiB through `socket` and names the filesystem found, if any.
pub fn detect_fs(socket: &Path) -> Result<Option<&'static str>> {
    let mut d = Dev::connect(socket, true)?;
    let n = PROBE_LEN.min(usize::try_from(d.capacity).unwrap_or(PROBE_LEN));
    let head = d.read(0, n)?;
    Ok(probe_fs(&head))
}

fn mkfs_command(fs: &str, image: &Path) -> Command {
    let mut c = Command::new(format!("mkfs.{fs}"));
    if fs.starts_with("ext") {
        // -F: a regular file; lazy inode tables so holes stay holes.
        c.args(["-F", "-q", "-E", "lazy_itable_init=1,nodiscard"]);
    } else {
        c.args(["-f", "-q"]);
    }
    c.arg(image);
    c
}

/// Formats the volume behind `socket` (`size` bytes) with `fs`, building the image in
/// `scratch_dir`.
pub fn format(socket: &Path, fs: &str, size: u64, scratch_dir: &Path) -> Result<()> {
    check_fstype(fs)?;
    std::fs::create_dir_all(scratch_dir).map_err(|e| CsiError::io("create", scratch_dir, e))?;
    let img = tempfile::Builder::new()
        .prefix("mkfs-")
        .tempfile_in(scratch_dir)
        .map_err(|e| CsiError::io("create temp image in", scratch_dir, e))?;
    img.as_file()
        .set_len(size)
        .map_err(|e| CsiError::io("size", img.path(), e))?;
    let out = mkfs_command(fs, img.path())
        .output()
        .map_err(|e| CsiError::FailedPrecondition(format!("cannot run mkfs.{fs}: {e}")))?;
    if !out.status.success() {
        return Err(CsiError::Internal(format!(
            "mkfs.{fs} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let mut d = Dev::connect(socket, false)?;
    if d.capacity < size {
        return Err(CsiError::Internal(format!(
            "device capacity {} is smaller than the volume size {size}",
            d.capacity
        )));
    }
    let mut f = img
        .reopen()
        .map_err(|e| CsiError::io("open", img.path(), e))?;
    for (start, end) in data_extents(&f, size)? {
        let mut off = start;
        while off < end {
            let len = usize::try_from((end - off).min(CHUNK as u64)).unwrap_or(CHUNK);
            let mut buf = vec![0u8; len];
            f.seek(SeekFrom::Start(off))
                .map_err(|e| CsiError::io("seek", img.path(), e))?;
            std::io::Read::read_exact(&mut f, &mut buf)
                .map_err(|e| CsiError::io("read", img.path(), e))?;
            d.write(off, &buf)?;
            off += len as u64;
        }
    }
    d.flush()
}

/// The `[start, end)` data ranges of a sparse file, aligned out to 4 KiB and clipped to `size`.
fn data_extents(f: &std::fs::File, size: u64) -> Result<Vec<(u64, u64)>> {
    let fd = f.as_raw_fd();
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut pos: i64 = 0;
    let size_i = i64::try_from(size).unwrap_or(i64::MAX);
    while pos < size_i {
        // SAFETY: lseek on a file descriptor we own; no memory is passed.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: no more data
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let hole = if hole < 0 { size_i } else { hole.min(size_i) };
        let s = (data as u64) & !4095;
        let e = ((hole as u64).saturating_add(4095) & !4095).min(size);
        match out.last_mut() {
            Some(last) if last.1 >= s => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
        pos = hole;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_filesystems() {
        let mut h = vec![0u8; 0x10100];
        assert_eq!(probe_fs(&h), None);
        h[0x438] = 0x53;
        h[0x439] = 0xEF;
        assert_eq!(probe_fs(&h), Some("ext2"));
        h[0x45C] = 4;
        assert_eq!(probe_fs(&h), Some("ext3"));
        h[0x460] = 0x40;
        assert_eq!(probe_fs(&h), Some("ext4"));
        let mut x = vec![0u8; 512];
        x[..4].copy_from_slice(b"XFSB");
        assert_eq!(probe_fs(&x), Some("xfs"));
        assert!(same_family("ext4", "ext3"));
        assert!(!same_family("ext4", "xfs"));
        assert!(check_fstype("ext4").is_ok());
        assert!(check_fstype("ntfs").is_err());
    }

    #[test]
    fn mkfs_image_extents_are_sparse() {
        if Command::new("mkfs.ext4").arg("-V").output().is_err() {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("img");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(256 << 20).unwrap();
        assert!(mkfs_command("ext4", &p).status().unwrap().success());
        let f = std::fs::File::open(&p).unwrap();
        let ext = data_extents(&f, 256 << 20).unwrap();
        let total: u64 = ext.iter().map(|(s, e)| e - s).sum();
        assert!(!ext.is_empty());
        assert!(
            total < 64 << 20,
            "{total} bytes of data in a 256 MiB ext4 image"
        );
        let head = std::fs::read(&p).unwrap();
        assert_eq!(probe_fs(&head[..PROBE_LEN]), Some("ext4"));
    }
}
