//! Files the tests serve or hand to a server: sparse disk images and memfds.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};

/// A sparse file `name` of `size` bytes in `dir` (created, or truncated and resized).
pub fn image(dir: &Path, name: &str, size: u64) -> PathBuf {
    let p = dir.join(name);
    File::create(&p)
        .and_then(|f| f.set_len(size))
        .unwrap_or_else(|e| panic!("create a {size}-byte image {}: {e}", p.display()));
    p
}

/// A memfd of `len` bytes (guest memory, an inflight region, or a file a hostile frontend
/// attaches).
pub fn memfd(len: u64) -> File {
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked below.
    let fd = unsafe { libc::memfd_create(c"katablk-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor owned by nobody else.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).expect("size the memfd");
    f
}
