//! kubelet's file-descriptor lock on Block volumes, for device nodes no kernel driver owns.
//!
//! After NodePublishVolume, kubelet maps a Block volume (k8s.io/kubernetes
//! `pkg/volume/util/util.go` `MapBlockVolume`): it bind-mounts the publish path
//! `<kubelet>/plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<podUID>` onto its map file
//! `<kubelet>/plugins/kubernetes.io/csi/volumeDevices/<pv>/dev/<podUID>`, symlinks that into the
//! pod, and then "takes a file descriptor lock" with a loop device
//! (`pkg/volume/util/volumepathhandler/volume_path_handler_linux.go` `AttachFileDevice`): it looks
//! for a loop device whose `/sys/block/loop*/loop/backing_file` is the map file and, if there is
//! none, runs `losetup -f <map file>`. That opens the file, which is by then katablk's
//! `b 241:N` node; no kernel driver owns major 241, so `open()` fails with ENXIO, `losetup`
//! fails and the pod never starts.
//!
//! So NodePublishVolume creates the map file itself first, as a small regular file holding
//! [`MARKER`], and attaches a read-only loop device to it. kubelet's bind mount then covers the
//! file (`mapBindMountDevice` keeps an existing file), its sysfs lookup finds the loop device for
//! that path and it never runs `losetup -f`; its unmap (`UnmapBlockVolume`) detaches the loop
//! device (`losetup -d`), unmounts and removes the file. NodeUnpublishVolume and reconciliation
//! remove what is left. A loop device is only ever detached here if reading it gives back
//! [`MARKER`] (loop devices of others are never touched).

use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use crate::error::{CsiError, Result};
use crate::safe_path::{self, Kind};

/// First bytes of every map file this driver creates; then `volume <alias>\n`, then zeroes up
/// to 4 KiB.
pub const MARKER: &[u8] = b"katablk-csi kubelet block-volume lock\n";

/// Size of a map file (one page: the loop device has 8 sectors).
const FILE_LEN: usize = 4096;

/// kubelet's CSI plugin directory for Block volumes, under the kubelet root
/// (`pkg/volume/csi/csi_block.go`: `volumeDevices`, `publish`, `dev`).
const VOLUME_DEVICES: &str = "plugins/kubernetes.io/csi/volumeDevices";

/// Whether Block publications get kubelet's loop-device lock prepared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LockMode {
    /// Prepare it (kubelet is the caller): target paths must follow kubelet's layout.
    #[default]
    Kubelet,
    /// Do not (a caller that is not kubelet and maps nothing itself).
    Off,
}

/// kubelet's map file for a Block publish target path, or an error saying which layout was
/// expected.
pub fn map_file(kubelet_dir: &Path, target: &Path) -> Result<PathBuf> {
    let refuse = || {
        CsiError::InvalidArgument(format!(
            "target_path {} does not follow kubelet's Block volume layout \
             {}/{VOLUME_DEVICES}/publish/<pv>/<pod uid> (start katablk-csi with \
             --kubelet-block-lock=off for a caller that is not kubelet)",
            target.display(),
            kubelet_dir.display()
        ))
    };
    let base = kubelet_dir.join(VOLUME_DEVICES);
    let rest = target.strip_prefix(&base).map_err(|_| refuse())?;
    let parts: Vec<&str> = rest
        .components()
        .map(|c| match c {
            Component::Normal(s) => s.to_str(),
            _ => None,
        })
        .collect::<Option<_>>()
        .ok_or_else(refuse)?;
    match parts.as_slice() {
        ["publish", pv, pod] if !pv.is_empty() && !pod.is_empty() => {
            Ok(base.join(pv).join("dev").join(pod))
        }
        _ => Err(refuse()),
    }
}

/// Removes the `(deleted)` suffix and surrounding space of a sysfs `backing_file`, as kubelet's
/// `cleanBackingFilePath` does.
fn clean_backing(s: &str) -> &str {
    let s = s.trim();
    s.strip_suffix("(deleted)").unwrap_or(s).trim()
}

/// The loop devices (`/dev/loopN`) whose backing file is `path`, found the way kubelet finds them
/// (`getLoopDeviceFromSysfs`: every `/sys/block/loop*/loop/backing_file`, compared with the path
/// and with the path with its directories' symlinks resolved, which is what sysfs shows).
pub fn loops_of(path: &Path) -> Vec<PathBuf> {
    let real = real_path(path);
    all_loops()
        .into_iter()
        .filter(|(_, f)| Path::new(f) == path || Path::new(f) == real)
        .map(|(dev, _)| dev)
        .collect()
}

/// `path` with the symlinks of its directories resolved (the last component as it is).
fn real_path(path: &Path) -> PathBuf {
    match (path.parent().map(Path::canonicalize), path.file_name()) {
        (Some(Ok(dir)), Some(name)) => dir.join(name),
        _ => path.to_path_buf(),
    }
}

/// Whether `map` is locked the way kubelet wants: a loop device backs it, or kubelet's mapping
/// has already bind-mounted the device node over it (then the loop device belongs to kubelet's
/// own steps).
pub fn is_held(map: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let mapped = std::fs::metadata(map).is_ok_and(|m| m.file_type().is_block_device());
    mapped || !loops_of(map).is_empty()
}

/// Every attached loop device with its backing file.
fn all_loops() -> Vec<(PathBuf, String)> {
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut out: Vec<(PathBuf, String)> = rd
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with("loop") {
                return None;
            }
            let f = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            Some((
                PathBuf::from("/dev").join(&name),
                clean_backing(&f).to_owned(),
            ))
        })
        .collect();
    out.sort();
    out
}

/// The volume (alias) named by a map file's contents, if it starts with [`MARKER`].
fn parse_marker(head: &[u8]) -> Option<String> {
    let rest = head.strip_prefix(MARKER)?;
    let line = rest.split(|&b| b == b'\n').next()?;
    let alias = std::str::from_utf8(line.strip_prefix(b"volume ")?).ok()?;
    Some(alias.to_owned())
}

/// Reads the first bytes of a file or device (fewer if it is shorter).
fn head_of(path: &Path) -> std::io::Result<Vec<u8>> {
    read_head(std::fs::File::open(path)?)
}

fn read_head(f: std::fs::File) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(512);
    f.take(512).read_to_end(&mut buf)?;
    Ok(buf)
}

/// The volume whose map file the loop device serves, if reading it gives back [`MARKER`]: a
/// loop device of this driver.
fn owner_of_loop(dev: &Path) -> Option<String> {
    parse_marker(&head_of(dev).ok()?)
}

fn is_ours(dev: &Path) -> bool {
    owner_of_loop(dev).is_some()
}

fn losetup(args: &[&std::ffi::OsStr]) -> Result<String> {
    let out = Command::new("losetup")
        .args(args)
        .output()
        .map_err(|e| CsiError::Internal(format!("cannot run losetup: {e}")))?;
    if !out.status.success() {
        return Err(CsiError::Internal(format!(
            "losetup {} failed ({}): {}",
            args.iter()
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// What [`prepare`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    /// A loop device of ours serves the map file (attached now or before).
    Loop(PathBuf),
    /// kubelet had already mapped the volume (the map file is a device node): its lock step is
    /// behind it, nothing to prepare.
    AlreadyMapped,
}

/// Makes kubelet's lock step for `map` succeed: the map file exists as a regular file of this
/// driver's, naming volume `alias`, and a read-only loop device is attached to it. Idempotent.
/// `map` is below `kubelet_dir` and walked without following symlinks
/// ([`crate::safe_path`]).
pub fn prepare(kubelet_dir: &Path, map: &Path, alias: &str) -> Result<Prepared> {
    let r = safe_path::resolve(kubelet_dir, map, true)?.ok_or_else(|| {
        CsiError::Internal(format!("map file {} has no directory", map.display()))
    })?;
    match r.kind()? {
        Kind::File => {
            let head = r
                .open_read()
                .and_then(|f| read_head(f).map_err(|e| CsiError::io("read", map, e)))?;
            if head.is_empty() {
                // Empty: created by kubelet's mapBindMountDevice before a failed mount.
                write_map_file(&r, alias)?;
            } else if parse_marker(&head).as_deref() != Some(alias) {
                return Err(CsiError::FailedPrecondition(format!(
                    "kubelet map file {} exists and is not katablk's for volume {alias}; \
                     not touched",
                    map.display()
                )));
            }
        }
        Kind::Other if is_device_at(&r.real) => return Ok(Prepared::AlreadyMapped),
        Kind::Absent => write_map_file(&r, alias)?,
        _ => {
            return Err(CsiError::FailedPrecondition(format!(
                "kubelet map file {} exists and is not a regular file",
                map.display()
            )))
        }
    }
    if let Some(dev) = loops_of(&r.real).into_iter().find(|d| is_ours(d)) {
        return Ok(Prepared::Loop(dev));
    }
    let dev = losetup(&[
        "-r".as_ref(),
        "-f".as_ref(),
        "--show".as_ref(),
        r.real.as_os_str(),
    ])?;
    tracing::info!(map = %map.display(), loop_device = %dev, "kubelet lock prepared");
    Ok(Prepared::Loop(PathBuf::from(dev)))
}

fn is_device_at(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|md| is_device(&md))
}

fn is_device(md: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    md.file_type().is_block_device() || md.file_type().is_char_device()
}

fn write_map_file(r: &safe_path::Resolved, alias: &str) -> Result<()> {
    use std::io::Write;
    let mut text = MARKER.to_vec();
    text.extend_from_slice(format!("volume {alias}\n").as_bytes());
    if text.len() > 512 {
        return Err(CsiError::InvalidArgument(format!(
            "volume name {alias:?} too long for a map file"
        )));
    }
    let mut data = vec![0u8; FILE_LEN];
    data[..text.len()].copy_from_slice(&text);
    let mut f = r.open_write(0o600)?;
    f.write_all(&data)
        .and_then(|()| f.sync_all())
        .map_err(|e| CsiError::io("write", &r.path, e))
}

/// Undoes [`prepare`] for `map` (below `kubelet_dir`): detaches the loop devices of ours on it
/// and removes the file if it is still this driver's regular file (kubelet's unmap normally did
/// both already). Returns the loop devices detached.
pub fn release(kubelet_dir: &Path, map: &Path) -> Result<Vec<PathBuf>> {
    let mut gone = Vec::new();
    for dev in loops_of(map) {
        if !is_ours(&dev) {
            tracing::warn!(map = %map.display(), loop_device = %dev.display(),
                "loop device on a kubelet map file is not katablk's; left alone");
            continue;
        }
        losetup(&["-d".as_ref(), dev.as_os_str()])?;
        tracing::info!(map = %map.display(), loop_device = %dev.display(), "kubelet lock released");
        gone.push(dev);
    }
    if let Some(r) = safe_path::resolve(kubelet_dir, map, false)? {
        if r.kind()? == Kind::File
            && !r.is_mount_point()?
            && r.open_read()
                .ok()
                .and_then(|f| read_head(f).ok())
                .is_some_and(|h| parse_marker(&h).is_some())
        {
            r.remove()?;
        }
    }
    Ok(gone)
}

/// Loop devices of this driver on kubelet map files under `kubelet_dir` that kubelet does not
/// map (the file is not covered by a bind mount), with the volume each names: candidates for
/// reconciliation, which releases those no publication wants (left behind when the driver was
/// killed between its steps, or a pod went away while it was down).
///
/// sysfs shows backing files with the kubelet directory's symlinks resolved; the map files
/// returned are under `kubelet_dir` as configured (what publications record).
pub fn unmapped_locks(kubelet_dir: &Path) -> Vec<(PathBuf, String)> {
    let base = kubelet_dir.join(VOLUME_DEVICES);
    let real_base = kubelet_dir
        .canonicalize()
        .map_or_else(|_| base.clone(), |k| k.join(VOLUME_DEVICES));
    let mut out = Vec::new();
    for (dev, backing) in all_loops() {
        let backing = PathBuf::from(backing);
        let Ok(rest) = backing
            .strip_prefix(&real_base)
            .or_else(|_| backing.strip_prefix(&base))
        else {
            continue;
        };
        let file = base.join(rest);
        let shape = rest.components().count() == 3
            && rest
                .components()
                .nth(1)
                .is_some_and(|c| c.as_os_str() == "dev");
        if !shape || crate::mounts::is_mount_point(&backing).unwrap_or(true) {
            continue;
        }
        if let Some(alias) = owner_of_loop(&dev) {
            out.push((file, alias));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_file_follows_kubelets_layout() {
        let k = Path::new("/var/lib/kubelet");
        let t = k.join("plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1/uid-2");
        assert_eq!(
            map_file(k, &t).unwrap(),
            k.join("plugins/kubernetes.io/csi/volumeDevices/pvc-1/dev/uid-2")
        );
        for bad in [
            "/var/lib/kubelet/pods/uid/volumes/x",
            "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1",
            "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1/uid/x",
            "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/staging/pvc-1/uid",
            "/tmp/target",
        ] {
            let e = map_file(k, Path::new(bad)).unwrap_err();
            assert!(
                e.to_string().contains("--kubelet-block-lock=off"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn marker_names_the_volume() {
        let mut h = MARKER.to_vec();
        h.extend_from_slice(b"volume lvs0/v1\n\0\0");
        assert_eq!(parse_marker(&h).as_deref(), Some("lvs0/v1"));
        assert_eq!(parse_marker(b"something else"), None);
        assert_eq!(parse_marker(MARKER), None);
    }

    #[test]
    fn backing_file_suffixes_are_cleaned_like_kubelet() {
        assert_eq!(clean_backing("/a/b (deleted)\n"), "/a/b");
        assert_eq!(clean_backing("/a/b\n"), "/a/b");
    }
}
