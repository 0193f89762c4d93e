//! Volume and snapshot identifiers, name derivation and path validation.
//!
//! A volume id (and a snapshot id) is the lvol's alias `<lvs>/<lvol>`: stable across target
//! restarts, readable in `bdev_get_bdevs`, and directly usable as an SPDK bdev name. Both halves
//! are SPDK names: 1–63 bytes of `[A-Za-z0-9_.-]`, not `.` or `..`.

use std::fmt;
use std::path::{Component, Path, PathBuf};

use crate::error::{CsiError, Result};

/// SPDK's longest lvol/lvstore name (`SPDK_LVOL_NAME_MAX` is 64 with the NUL).
pub const MAX_NAME_LEN: usize = 63;

/// The longest path a unix socket can bind (`sun_path` is 108 bytes with the NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Prefix of the hidden snapshots made to clone a volume from a volume.
pub const CLONE_SOURCE_PREFIX: &str = "clonesrc-";

/// True if `s` is a valid SPDK lvol or lvstore name.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME_LEN
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// 64-bit FNV-1a: a stable, dependency-free hash for deriving names.
pub fn fnv64(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The lvol name for a CSI object name: the name itself when it is a valid SPDK name (e.g.
/// external-provisioner's `pvc-<uuid>`), otherwise `<prefix>-<hash>` — deterministic, so
/// repeated calls with the same name find the same lvol.
pub fn lvol_name_for(csi_name: &str, prefix: &str) -> String {
    if valid_name(csi_name) && !csi_name.starts_with(CLONE_SOURCE_PREFIX) {
        csi_name.to_owned()
    } else {
        format!("{prefix}-{:016x}", fnv64(csi_name))
    }
}

/// A parsed `<lvs>/<lvol>` id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LvolId {
    /// The lvstore name.
    pub lvs: String,
    /// The lvol name inside it.
    pub lvol: String,
}

impl LvolId {
    /// Builds an id from validated parts.
    pub fn new(lvs: &str, lvol: &str) -> Result<Self> {
        if !valid_name(lvs) || !valid_name(lvol) {
            return Err(CsiError::InvalidArgument(format!(
                "invalid lvstore/lvol name {lvs:?}/{lvol:?}"
            )));
        }
        Ok(Self {
            lvs: lvs.to_owned(),
            lvol: lvol.to_owned(),
        })
    }

    /// Parses an id; `None` if it is not of this driver's form (such an id names nothing).
    pub fn parse(id: &str) -> Option<Self> {
        let (lvs, lvol) = id.split_once('/')?;
        Self::new(lvs, lvol).ok()
    }

    /// The alias SPDK knows the lvol by.
    pub fn alias(&self) -> String {
        format!("{}/{}", self.lvs, self.lvol)
    }

    /// The vhost-user-blk controller name for this volume: `ctrlr-<16 hex>` (22 bytes, so
    /// `<store>/block/sockets/<name>` fits `sun_path` for any store path up to 70 bytes).
    pub fn ctrlr_name(&self) -> String {
        format!("ctrlr-{:016x}", fnv64(&self.alias()))
    }
}

impl fmt::Display for LvolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.lvs, self.lvol)
    }
}

/// Parses a volume id a call requires: empty → `InvalidArgument`, malformed → `NotFound`
/// (no volume can have it).
pub fn require_id(id: &str, what: &str) -> Result<LvolId> {
    if id.is_empty() {
        return Err(CsiError::InvalidArgument(format!("{what} is required")));
    }
    LvolId::parse(id)
        .ok_or_else(|| CsiError::NotFound(format!("{what} {} does not exist", shown(id))))
}

/// The longest path accepted from the CO (Linux `PATH_MAX`, with its NUL).
pub const MAX_PATH_LEN: usize = 4095;

/// The longest file name in a path (`NAME_MAX`).
pub const MAX_COMPONENT_LEN: usize = 255;

/// How much of a caller's string an error message repeats.
const SHOWN_LEN: usize = 200;

/// `s` quoted for an error message, cut after 200 bytes (with its length), so an
/// error never echoes a huge input.
pub fn shown(s: &str) -> String {
    if s.len() <= SHOWN_LEN {
        return format!("{s:?}");
    }
    let mut end = SHOWN_LEN;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &s[..end], s.len())
}

/// Validates a path the CO passes: absolute, at most [`MAX_PATH_LEN`] bytes, no empty, `.` or
/// `..` segment, no NUL, and inside `root`. Returns it unchanged. Symlinks are dealt with where
/// the path is used ([`crate::safe_path`]: never followed below `root`).
pub fn validate_path(p: &str, root: &Path, what: &str) -> Result<PathBuf> {
    if p.is_empty() {
        return Err(CsiError::InvalidArgument(format!("{what} is required")));
    }
    if p.len() > MAX_PATH_LEN {
        return Err(CsiError::InvalidArgument(format!(
            "{what} {} is longer than {MAX_PATH_LEN} bytes",
            shown(p)
        )));
    }
    let path = Path::new(p);
    if !path.is_absolute() || p.contains('\0') {
        return Err(CsiError::InvalidArgument(format!(
            "{what} {} must be an absolute path",
            shown(p)
        )));
    }
    // By segment, not by `components()`, which drops inner `.` and doubled slashes.
    let segs: Vec<&str> = p[1..].split('/').collect();
    if segs
        .iter()
        .enumerate()
        .any(|(i, s)| *s == "." || *s == ".." || (s.is_empty() && i + 1 < segs.len()))
    {
        return Err(CsiError::InvalidArgument(format!(
            "{what} {} must not contain ., .. or empty segments",
            shown(p)
        )));
    }
    if segs.iter().any(|s| s.len() > MAX_COMPONENT_LEN) {
        return Err(CsiError::InvalidArgument(format!(
            "{what} {} has a segment longer than {MAX_COMPONENT_LEN} bytes",
            shown(p)
        )));
    }
    if path
        .components()
        .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
        || !path.starts_with(root)
        || path == root
    {
        return Err(CsiError::InvalidArgument(format!(
            "{what} {} is not inside {}",
            shown(p),
            root.display()
        )));
    }
    Ok(path.to_path_buf())
}

/// Checks a unix socket path fits `sun_path`.
pub fn check_socket_path(p: &Path) -> Result<()> {
    let len = p.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(CsiError::FailedPrecondition(format!(
            "socket path {} is {len} bytes, over the {MAX_SOCKET_PATH}-byte unix socket limit",
            p.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("pvc-0d4b4f1e-6a43-4b7a-9d87-1d1b1f1f1f1f"));
        assert!(!valid_name(""));
        assert!(!valid_name(".."));
        assert!(!valid_name("a/b"));
        assert!(!valid_name(&"x".repeat(64)));
        assert_eq!(lvol_name_for("pvc-1", "vol"), "pvc-1");
        let long = "sanity-Controller Service-CreateVolume-123";
        let n = lvol_name_for(long, "vol");
        assert!(n.starts_with("vol-") && valid_name(&n));
        assert_eq!(n, lvol_name_for(long, "vol"));
        assert_ne!(lvol_name_for("clonesrc-x", "vol"), "clonesrc-x");
    }

    #[test]
    fn ids() {
        let id = LvolId::parse("lvs0/pvc-1").unwrap();
        assert_eq!(id.alias(), "lvs0/pvc-1");
        assert_eq!(id.to_string(), "lvs0/pvc-1");
        assert!(LvolId::parse("lvs0").is_none());
        assert!(LvolId::parse("lvs0/a/b").is_none());
        assert!(LvolId::parse("../x").is_none());
        assert!(LvolId::parse("lvs0/..").is_none());
        assert_eq!(id.ctrlr_name().len(), 22);
        assert_eq!(
            id.ctrlr_name(),
            LvolId::parse("lvs0/pvc-1").unwrap().ctrlr_name()
        );
        assert_eq!(
            require_id("", "volume id").unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            require_id("nope", "volume id").unwrap_err().code(),
            tonic::Code::NotFound
        );
    }

    #[test]
    fn paths() {
        let root = Path::new("/var/lib/kubelet");
        assert!(validate_path("/var/lib/kubelet/pods/x/volumes/v", root, "t").is_ok());
        assert!(validate_path("/var/lib/kubelet/../etc/x", root, "t").is_err());
        assert!(validate_path("relative", root, "t").is_err());
        assert!(validate_path("/etc/passwd", root, "t").is_err());
        assert!(validate_path("/var/lib/kubelet", root, "t").is_err());
        assert!(validate_path("", root, "t").is_err());
        assert!(validate_path("/var/lib/kubelet/./pods/x", root, "t").is_err());
        assert!(validate_path("/var/lib/kubelet/pods/x/.", root, "t").is_err());
        assert!(validate_path("/var/lib/kubelet//pods/x", root, "t").is_err());
        assert!(validate_path("/var/lib/kubeletx/pods", root, "t").is_err());
        let long = format!("/var/lib/kubelet/{}", "a/".repeat(3000));
        let e = validate_path(&long, root, "t").unwrap_err().to_string();
        assert!(e.contains("longer than") && e.len() < 400, "{e}");
        let seg = format!("/var/lib/kubelet/{}", "a".repeat(256));
        assert!(validate_path(&seg, root, "t").is_err());
        assert!(shown(&"é".repeat(300)).contains("(600 bytes)"));
        let e = require_id(&"x".repeat(1 << 20), "volume")
            .unwrap_err()
            .to_string();
        assert!(e.len() < 400, "{}", e.len());
        assert!(check_socket_path(Path::new(&"/x".repeat(60))).is_err());
        assert!(check_socket_path(Path::new("/run/s.sock")).is_ok());
    }
}
