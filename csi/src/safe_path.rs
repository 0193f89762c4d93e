//! Paths below the kubelet directory, resolved without following symlinks.
//!
//! CSI target paths come from the CO, and everything under the kubelet directory can be
//! written by more than kubelet (hostPath pods, a compromised container runtime). Plain path
//! calls follow symlinks in every component: `create_dir_all` would create directories and
//! mount(2) would mount wherever a planted link points, and `umount2` would unmount a
//! filesystem outside. So a target path is walked one component at a time from the kubelet
//! directory with `openat(O_PATH | O_NOFOLLOW)`; a symlink anywhere below the kubelet directory
//! is refused; files and directories are created relative to the parent's descriptor
//! (`mkdirat`, `openat(O_CREAT | O_EXCL | O_NOFOLLOW)`), bind mounts go onto the opened
//! target (`/proc/self/fd/N`), and unmounts use the real path with `UMOUNT_NOFOLLOW`.
//!
//! The kubelet directory itself may be reached through a symlink (`/var/lib/kubelet` →
//! `/data/kubelet` is common): it is resolved once per call, and [`Resolved::real`] is the
//! path the kernel's mount table shows, so mount-point checks compare like with like.

use std::ffi::{CString, OsStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use crate::error::{CsiError, Result};

/// Mode of directories created on the way (kubelet's own `MkdirAll(…, 0750)`).
const DIR_MODE: libc::mode_t = 0o750;

/// What a path's last component is (not following a symlink).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Nothing there.
    Absent,
    /// A directory.
    Dir,
    /// A regular file.
    File,
    /// A symlink (never followed).
    Symlink,
    /// A device node, FIFO or socket.
    Other,
}

/// A path below a root whose parent directory was opened without following any symlink.
#[derive(Debug)]
pub struct Resolved {
    /// The path as given (below the configured root).
    pub path: PathBuf,
    /// The same object's path with the root resolved: what `/proc/self/mountinfo` shows.
    pub real: PathBuf,
    parent: OwnedFd,
    name: CString,
}

fn cstr(s: &OsStr, whole: &Path) -> Result<CString> {
    CString::new(s.as_bytes())
        .map_err(|_| CsiError::InvalidArgument(format!("path {whole:?} contains NUL")))
}

fn last_err() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// `openat(dir, name, flags)`.
fn openat(
    dir: &OwnedFd,
    name: &CString,
    flags: i32,
    mode: libc::mode_t,
) -> std::io::Result<OwnedFd> {
    // SAFETY: `dir` is an open descriptor and `name` a NUL-terminated string, both alive for
    // the call; the result is checked before it is wrapped.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_CLOEXEC,
            libc::c_uint::from(mode),
        )
    };
    if fd < 0 {
        return Err(last_err());
    }
    // SAFETY: `fd` was just returned by openat and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_dir_path(p: &Path) -> std::io::Result<OwnedFd> {
    let c = CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is NUL-terminated and alive for the call; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(last_err());
    }
    // SAFETY: just returned by open, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn stat_fd(fd: &OwnedFd) -> std::io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` is a valid, writable `stat` for the call.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(last_err());
    }
    Ok(st)
}

fn kind_of(mode: libc::mode_t) -> Kind {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => Kind::Dir,
        libc::S_IFREG => Kind::File,
        libc::S_IFLNK => Kind::Symlink,
        _ => Kind::Other,
    }
}

/// Walks `path` (which must be below `root`, checked lexically by the caller) from `root`
/// down to its parent, refusing any symlink or non-directory on the way. With `create`,
/// missing directories are made (0750); without, a missing one is `Ok(None)`.
pub fn resolve(root: &Path, path: &Path, create: bool) -> Result<Option<Resolved>> {
    let rel = path.strip_prefix(root).map_err(|_| {
        CsiError::InvalidArgument(format!(
            "{} is not inside {}",
            path.display(),
            root.display()
        ))
    })?;
    let real_root = root
        .canonicalize()
        .map_err(|e| CsiError::io("resolve", root, e))?;
    let mut parts: Vec<&OsStr> = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(s) => parts.push(s),
            _ => {
                return Err(CsiError::InvalidArgument(format!(
                    "{} must be a plain path below {}",
                    path.display(),
                    root.display()
                )))
            }
        }
    }
    let Some((last, dirs)) = parts.split_last() else {
        return Err(CsiError::InvalidArgument(format!(
            "{} is the directory {} itself",
            path.display(),
            root.display()
        )));
    };
    let mut cur = open_dir_path(&real_root).map_err(|e| CsiError::io("open", &real_root, e))?;
    let mut walked = real_root.clone();
    for d in dirs {
        walked.push(d);
        let name = cstr(d, path)?;
        let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW;
        let next = match openat(&cur, &name, flags, 0) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) && create => {
                // SAFETY: `cur` is an open directory descriptor and `name` NUL-terminated,
                // both alive for the call.
                let r = unsafe { libc::mkdirat(cur.as_raw_fd(), name.as_ptr(), DIR_MODE) };
                if r != 0 && last_err().raw_os_error() != Some(libc::EEXIST) {
                    return Err(CsiError::io("create", &walked, last_err()));
                }
                openat(&cur, &name, flags, 0).map_err(|e| refuse_component(path, &walked, e))?
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            Err(e) => return Err(refuse_component(path, &walked, e)),
        };
        // O_DIRECTORY | O_NOFOLLOW already refuses a link; check the type anyway.
        let st = stat_fd(&next).map_err(|e| CsiError::io("stat", &walked, e))?;
        if kind_of(st.st_mode) != Kind::Dir {
            return Err(refuse_component(
                path,
                &walked,
                std::io::Error::from_raw_os_error(libc::ENOTDIR),
            ));
        }
        cur = next;
    }
    Ok(Some(Resolved {
        path: path.to_path_buf(),
        real: real_root.join(rel),
        parent: cur,
        name: cstr(last, path)?,
    }))
}

fn refuse_component(path: &Path, at: &Path, e: std::io::Error) -> CsiError {
    match e.raw_os_error() {
        Some(libc::ENOTDIR) | Some(libc::ELOOP) => CsiError::InvalidArgument(format!(
            "{}: {} is a symlink or not a directory; paths below the kubelet directory are \
             never followed through links",
            path.display(),
            at.display()
        )),
        _ => CsiError::io("open", at, e),
    }
}

impl Resolved {
    /// What the last component is, without following it.
    pub fn kind(&self) -> Result<Kind> {
        // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `parent` is open, `name` NUL-terminated and `st` writable for the call.
        let r = unsafe {
            libc::fstatat(
                self.parent.as_raw_fd(),
                self.name.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if r != 0 {
            let e = last_err();
            return match e.raw_os_error() {
                Some(libc::ENOENT) => Ok(Kind::Absent),
                _ => Err(CsiError::io("stat", &self.path, e)),
            };
        }
        Ok(kind_of(st.st_mode))
    }

    fn refuse_symlink(&self) -> CsiError {
        CsiError::InvalidArgument(format!(
            "{} is a symlink; paths below the kubelet directory are never followed through links",
            self.path.display()
        ))
    }

    /// Makes the last component a directory (an existing one is kept).
    pub fn create_dir(&self) -> Result<()> {
        // SAFETY: `parent` is open and `name` NUL-terminated for the call.
        let r = unsafe { libc::mkdirat(self.parent.as_raw_fd(), self.name.as_ptr(), DIR_MODE) };
        if r == 0 {
            return Ok(());
        }
        let e = last_err();
        match self.kind()? {
            Kind::Dir => Ok(()),
            Kind::Symlink => Err(self.refuse_symlink()),
            _ => Err(CsiError::io("create directory", &self.path, e)),
        }
    }

    /// Creates the last component as a regular file (mode `mode`) and opens it for writing;
    /// `Ok(None)` if a regular file is there already. A symlink is refused.
    pub fn create_file(&self, mode: libc::mode_t) -> Result<Option<std::fs::File>> {
        let flags = libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_NOFOLLOW;
        match openat(&self.parent, &self.name, flags, mode) {
            Ok(fd) => Ok(Some(std::fs::File::from(fd))),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => match self.kind()? {
                Kind::File => Ok(None),
                Kind::Symlink => Err(self.refuse_symlink()),
                _ => Err(CsiError::io("create", &self.path, e)),
            },
            Err(e) => Err(CsiError::io("create", &self.path, e)),
        }
    }

    /// Opens the last component for writing, created (mode `mode`) or truncated; a symlink is
    /// refused.
    pub fn open_write(&self, mode: libc::mode_t) -> Result<std::fs::File> {
        let flags = libc::O_CREAT | libc::O_TRUNC | libc::O_WRONLY | libc::O_NOFOLLOW;
        let fd =
            openat(&self.parent, &self.name, flags, mode).map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => self.refuse_symlink(),
                _ => CsiError::io("open", &self.path, e),
            })?;
        Ok(std::fs::File::from(fd))
    }

    /// Opens the last component for reading, not following a symlink.
    pub fn open_read(&self) -> Result<std::fs::File> {
        let fd = openat(
            &self.parent,
            &self.name,
            libc::O_RDONLY | libc::O_NOFOLLOW,
            0,
        )
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => self.refuse_symlink(),
            _ => CsiError::io("open", &self.path, e),
        })?;
        Ok(std::fs::File::from(fd))
    }

    /// An `O_PATH` descriptor of the last component itself (a symlink is refused).
    fn open_target(&self) -> Result<OwnedFd> {
        let fd = openat(&self.parent, &self.name, libc::O_PATH | libc::O_NOFOLLOW, 0)
            .map_err(|e| CsiError::io("open", &self.path, e))?;
        let st = stat_fd(&fd).map_err(|e| CsiError::io("stat", &self.path, e))?;
        if kind_of(st.st_mode) == Kind::Symlink {
            return Err(self.refuse_symlink());
        }
        Ok(fd)
    }

    /// Whether the last component is a mount point (by its real path in the mount table).
    pub fn is_mount_point(&self) -> Result<bool> {
        crate::mounts::is_mount_point(&self.real)
    }

    /// Bind-mounts `src` onto the last component (which must exist), read-only if asked.
    pub fn bind_from(&self, src: &Path, read_only: bool) -> Result<()> {
        let fd = self.open_target()?;
        crate::mounts::bind_mount(src, &fd_path(&fd), false).map_err(|e| {
            CsiError::Internal(format!("bind mount onto {}: {e}", self.path.display()))
        })?;
        if read_only {
            // The descriptor still names the file under the new mount: open the mount's root.
            let top = self.open_target()?;
            if let Err(e) = crate::mounts::remount_read_only(&fd_path(&top)) {
                let _ = self.unmount_all();
                return Err(CsiError::Internal(format!(
                    "remount {} read-only: {e}",
                    self.path.display()
                )));
            }
        }
        Ok(())
    }

    /// Unmounts every mount stacked on the last component (a symlink there is never followed).
    pub fn unmount_all(&self) -> Result<()> {
        crate::mounts::unmount_nofollow(&self.real)
    }

    /// Removes the last component (file, symlink or empty directory); absent is success.
    pub fn remove(&self) -> Result<()> {
        let flags = match self.kind()? {
            Kind::Absent => return Ok(()),
            Kind::Dir => libc::AT_REMOVEDIR,
            _ => 0,
        };
        // SAFETY: `parent` is open and `name` NUL-terminated for the call.
        let r = unsafe { libc::unlinkat(self.parent.as_raw_fd(), self.name.as_ptr(), flags) };
        if r != 0 {
            let e = last_err();
            if e.raw_os_error() != Some(libc::ENOENT) {
                return Err(CsiError::io("remove", &self.path, e));
            }
        }
        Ok(())
    }
}

/// `/proc/self/fd/<fd>`: the opened object itself, for calls that take a path.
fn fd_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_without_links() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("kubelet");
        std::fs::create_dir(&root).unwrap();
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        // Creating the parents of a new path.
        let p = root.join("pods/a/volumes/x/mount");
        let r = resolve(&root, &p, true).unwrap().unwrap();
        assert_eq!(r.kind().unwrap(), Kind::Absent);
        r.create_dir().unwrap();
        r.create_dir().unwrap();
        assert!(p.is_dir());
        assert_eq!(
            r.real,
            root.canonicalize().unwrap().join("pods/a/volumes/x/mount")
        );
        // Absent parents without `create`.
        assert!(resolve(&root, &root.join("nope/x"), false)
            .unwrap()
            .is_none());
        // A symlinked ancestor is refused, and nothing is made through it.
        std::os::unix::fs::symlink(&outside, root.join("pods/evil")).unwrap();
        let e = resolve(&root, &root.join("pods/evil/sub/dir/mount"), true).unwrap_err();
        assert!(e.to_string().contains("symlink"), "{e}");
        assert!(std::fs::read_dir(&outside).unwrap().next().is_none());
        // A symlinked last component is seen, never followed.
        std::fs::write(outside.join("f"), b"x").unwrap();
        std::os::unix::fs::symlink(outside.join("f"), root.join("pods/a/link")).unwrap();
        let r = resolve(&root, &root.join("pods/a/link"), false)
            .unwrap()
            .unwrap();
        assert_eq!(r.kind().unwrap(), Kind::Symlink);
        assert!(r.create_file(0o640).is_err());
        assert!(r.create_dir().is_err());
        assert!(r.open_read().is_err());
        r.remove().unwrap();
        assert!(outside.join("f").exists());
        // A root reached through a symlink: `real` is the resolved path.
        let alias = d.path().join("alias");
        std::os::unix::fs::symlink(&root, &alias).unwrap();
        let r = resolve(&alias, &alias.join("pods/a/f"), false)
            .unwrap()
            .unwrap();
        assert!(r.create_file(0o640).unwrap().is_some());
        assert!(r.create_file(0o640).unwrap().is_none());
        assert_eq!(r.real, root.canonicalize().unwrap().join("pods/a/f"));
        // `..` and the root itself are refused.
        assert!(resolve(&root, &root.join("a/../b"), true).is_err());
        assert!(resolve(&root, &root, true).is_err());
    }
}
