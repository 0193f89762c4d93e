//! Bind mounts of device nodes onto CSI target paths, and mount table queries.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::error::{CsiError, Result};

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| CsiError::InvalidArgument(format!("path {p:?} contains NUL")))
}

/// Decodes the octal escapes (`\040` etc.) of `/proc/self/mountinfo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Mount points listed in `/proc/self/mountinfo` (field 5).
pub fn mount_points() -> Result<Vec<PathBuf>> {
    let p = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(p).map_err(|e| CsiError::io("read", p, e))?;
    Ok(parse_mountinfo(&text))
}

fn parse_mountinfo(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape(m)))
        .collect()
}

/// The file names of `block/devices/*` entries that are bind-mounted somewhere (mountinfo
/// field 4, the mount's root inside its filesystem, ends with `block/devices/<name>`).
pub fn bound_device_names() -> Result<std::collections::BTreeSet<String>> {
    let p = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(p).map_err(|e| CsiError::io("read", p, e))?;
    Ok(parse_bound_devices(&text))
}

fn parse_bound_devices(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.split(' ').nth(3))
        .map(unescape)
        .filter_map(|root| {
            let (dir, name) = root.rsplit_once('/')?;
            dir.ends_with("block/devices").then(|| name.to_owned())
        })
        .collect()
}

/// True if `path` is a mount point.
pub fn is_mount_point(path: &Path) -> Result<bool> {
    Ok(mount_points()?.iter().any(|m| m == path))
}

/// Bind-mounts `src` onto `dst` (read-only if asked, via a second remount as the kernel
/// requires).
pub fn bind_mount(src: &Path, dst: &Path, read_only: bool) -> Result<()> {
    let (s, d) = (cstr(src)?, cstr(dst)?);
    // SAFETY: both are valid NUL-terminated paths alive for the call; null fstype/data are
    // allowed for MS_BIND.
    let r = unsafe {
        libc::mount(
            s.as_ptr(),
            d.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(CsiError::io(
            "bind mount onto",
            dst,
            std::io::Error::last_os_error(),
        ));
    }
    if read_only {
        // SAFETY: as above; remounting the bind mount we just made.
        let r = unsafe {
            libc::mount(
                std::ptr::null(),
                d.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
                std::ptr::null(),
            )
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            let _ = unmount(dst);
            return Err(CsiError::io("remount read-only", dst, e));
        }
    }
    Ok(())
}

/// Unmounts every mount stacked on `path`; "not mounted" is success.
pub fn unmount(path: &Path) -> Result<()> {
    let c = cstr(path)?;
    for _ in 0..16 {
        // SAFETY: valid NUL-terminated path alive for the call.
        let r = unsafe { libc::umount2(c.as_ptr(), 0) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EINVAL) | Some(libc::ENOENT) => Ok(()),
                _ => Err(CsiError::io("unmount", path, e)),
            };
        }
    }
    Ok(())
}

/// Remounts the bind mount at `path` read-only.
pub fn remount_read_only(path: &Path) -> Result<()> {
    let d = cstr(path)?;
    // SAFETY: `d` is a valid NUL-terminated path alive for the call; null source, fstype and
    // data are allowed for a bind remount.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            d.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(CsiError::io(
            "remount read-only",
            path,
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Unmounts every mount stacked on `path` without following a symlink in its last component
/// (`UMOUNT_NOFOLLOW`); "not mounted" is success.
pub fn unmount_nofollow(path: &Path) -> Result<()> {
    let c = cstr(path)?;
    for _ in 0..64 {
        // SAFETY: valid NUL-terminated path alive for the call.
        let r = unsafe { libc::umount2(c.as_ptr(), libc::UMOUNT_NOFOLLOW) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EINVAL) | Some(libc::ENOENT) => Ok(()),
                _ => Err(CsiError::io("unmount", path, e)),
            };
        }
    }
    Ok(())
}

/// True if `path` is mounted read-only (from mountinfo's per-mount options, field 6).
pub fn is_read_only_mount(path: &Path) -> Result<bool> {
    let p = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(p).map_err(|e| CsiError::io("read", p, e))?;
    Ok(text
        .lines()
        .rfind(|l| l.split(' ').nth(4).map(unescape).as_deref() == path.to_str())
        .and_then(|l| l.split(' ').nth(5).map(|o| o.split(',').any(|x| x == "ro")))
        .unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mountinfo() {
        let t = "36 35 98:0 /mnt1 /mnt/a\\040b rw,noatime master:1 - ext3 /dev/root rw\n\
                 37 35 98:0 / /var/lib/kubelet/x ro - ext4 /dev/sda rw\n";
        let m = parse_mountinfo(t);
        assert_eq!(
            m,
            vec![
                PathBuf::from("/mnt/a b"),
                PathBuf::from("/var/lib/kubelet/x")
            ]
        );
        assert_eq!(unescape("a\\134b"), "a\\b");
        let b = parse_bound_devices(
            "50 27 0:23 /kata-containers/vhost-user/block/devices/ctrlr-1 /var/lib/kubelet/p rw - tmpfs tmpfs rw\n\
             51 27 0:23 /other/file /x rw - tmpfs tmpfs rw\n",
        );
        assert_eq!(
            b.into_iter().collect::<Vec<_>>(),
            vec!["ctrlr-1".to_string()]
        );
        assert_eq!(unescape("tail\\04"), "tail\\04");
        assert!(is_mount_point(Path::new("/")).unwrap() || !Path::new("/proc/self").exists());
    }
}
