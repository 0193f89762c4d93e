//! StorageClass parameters (`ClassParams`) and the volume capabilities this driver serves:
//! parsed and checked at CreateVolume, read again from the volume context at publish.

use std::collections::HashMap;

use katablk_rpc::methods::LvolClearMethod;

use crate::csi::{self, volume_capability as vc};
use crate::error::{CsiError, Result};

/// StorageClass parameter keys.
pub mod params {
    /// Must be `"true"`: the class is for Kata vhost-user-blk volumes.
    pub const SPDK: &str = "spdk";
    /// lvstore name (default: `--lvs`).
    pub const LVS: &str = "lvs";
    /// `"true"` for a thin lvol.
    pub const THIN: &str = "thinProvision";
    /// lvol clear method: `none`, `unmap`, `write_zeroes` (default: the lvstore's).
    pub const CLEAR: &str = "clearMethod";
    /// vhost controller cpumask, e.g. `0x1`.
    pub const CPUMASK: &str = "cpumask";
    /// Filesystem for mount volumes.
    pub const FSTYPE: &str = "csi.storage.k8s.io/fstype";
    /// The Kata runtime of Filesystem volumes: `go` or `rs` (default: the node's
    /// `--kata-runtime`).
    pub const KATA_RUNTIME: &str = "kataRuntime";
    /// `"true"`: a Filesystem volume for runtime-rs handed over unformatted, for a container
    /// mount under `/dev` (runtime-rs then bind-mounts the guest's block device there).
    pub const RAW_BLOCK: &str = "rawBlock";
    /// Rate limit: I/Os per second (a multiple of 1000, as SPDK requires; 0 = unlimited).
    pub const RW_IOS_PER_SEC: &str = "rwIosPerSec";
    /// Rate limit: MiB per second read and written.
    pub const RW_MBYTES_PER_SEC: &str = "rwMBytesPerSec";
    /// Rate limit: MiB per second read.
    pub const R_MBYTES_PER_SEC: &str = "rMBytesPerSec";
    /// Rate limit: MiB per second written.
    pub const W_MBYTES_PER_SEC: &str = "wMBytesPerSec";
    /// The rate-limit keys, also accepted as mutable parameters (VolumeAttributesClass).
    pub const QOS: [&str; 4] = [
        RW_IOS_PER_SEC,
        RW_MBYTES_PER_SEC,
        R_MBYTES_PER_SEC,
        W_MBYTES_PER_SEC,
    ];
    /// Per-pod rate limit: I/Os per second shared by every volume of this class (and of any
    /// other class with pod limits) that one pod mounts. Needs kubelet's pod info on publish
    /// (`podInfoOnMount: true` in the CSIDriver object).
    pub const POD_RW_IOS_PER_SEC: &str = "podRwIosPerSec";
    /// Per-pod rate limit: MiB per second read and written.
    pub const POD_RW_MBYTES_PER_SEC: &str = "podRwMBytesPerSec";
    /// Per-pod rate limit: MiB per second read.
    pub const POD_R_MBYTES_PER_SEC: &str = "podRMBytesPerSec";
    /// Per-pod rate limit: MiB per second written.
    pub const POD_W_MBYTES_PER_SEC: &str = "podWMBytesPerSec";
    /// The per-pod rate-limit keys, in the order of [`QOS`].
    pub const POD_QOS: [&str; 4] = [
        POD_RW_IOS_PER_SEC,
        POD_RW_MBYTES_PER_SEC,
        POD_R_MBYTES_PER_SEC,
        POD_W_MBYTES_PER_SEC,
    ];
    /// The pod UID kubelet passes in the volume context on publish when the CSIDriver has
    /// `podInfoOnMount: true`.
    pub const POD_UID: &str = "csi.storage.k8s.io/pod.uid";
}

/// Rate limits asked for a volume, in SPDK's `bdev_set_qos_limit` units; `None` leaves a limit
/// as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QosParams {
    /// I/Os per second.
    pub rw_ios_per_sec: Option<u64>,
    /// MiB per second, reads and writes.
    pub rw_mbytes_per_sec: Option<u64>,
    /// MiB per second, reads.
    pub r_mbytes_per_sec: Option<u64>,
    /// MiB per second, writes.
    pub w_mbytes_per_sec: Option<u64>,
}

impl QosParams {
    /// Parses the rate-limit keys of `p` (other keys are the caller's business). I/O limits
    /// must be multiples of 1000 (SPDK's `SPDK_BDEV_QOS_MIN_IOS_PER_SEC`).
    pub fn parse(p: &HashMap<String, String>) -> Result<Self> {
        Self::parse_keys(p, params::QOS)
    }

    /// Parses the per-pod rate-limit keys of `p` ([`params::POD_QOS`]).
    pub fn parse_pod(p: &HashMap<String, String>) -> Result<Self> {
        Self::parse_keys(p, params::POD_QOS)
    }

    /// Parses the keys `keys` (I/Os, MiB read+written, MiB read, MiB written) of `p`.
    fn parse_keys(p: &HashMap<String, String>, keys: [&str; 4]) -> Result<Self> {
        let [k_ios, k_rw, k_r, k_w] = keys;
        let get = |k: &str| -> Result<Option<u64>> {
            match p.get(k) {
                None => Ok(None),
                Some(v) => v.trim().parse::<u64>().map(Some).map_err(|_| {
                    CsiError::InvalidArgument(format!(
                        "parameter {k}={} is not a non-negative integer",
                        crate::volume::shown(v)
                    ))
                }),
            }
        };
        let q = QosParams {
            rw_ios_per_sec: get(k_ios)?,
            rw_mbytes_per_sec: get(k_rw)?,
            r_mbytes_per_sec: get(k_r)?,
            w_mbytes_per_sec: get(k_w)?,
        };
        if let Some(n) = q.rw_ios_per_sec {
            if n % 1000 != 0 {
                return Err(CsiError::InvalidArgument(format!(
                    "parameter {k_ios}={n} must be a multiple of 1000 (0 = unlimited)"
                )));
            }
        }
        for (k, v) in [
            (k_rw, q.rw_mbytes_per_sec),
            (k_r, q.r_mbytes_per_sec),
            (k_w, q.w_mbytes_per_sec),
        ] {
            if v.is_some_and(|v| v > u64::MAX >> 20) {
                return Err(CsiError::InvalidArgument(format!(
                    "parameter {k} is too large"
                )));
            }
        }
        Ok(q)
    }

    /// `self` with every limit `other` gives replaced by it.
    pub fn overlay(&self, other: &QosParams) -> QosParams {
        QosParams {
            rw_ios_per_sec: other.rw_ios_per_sec.or(self.rw_ios_per_sec),
            rw_mbytes_per_sec: other.rw_mbytes_per_sec.or(self.rw_mbytes_per_sec),
            r_mbytes_per_sec: other.r_mbytes_per_sec.or(self.r_mbytes_per_sec),
            w_mbytes_per_sec: other.w_mbytes_per_sec.or(self.w_mbytes_per_sec),
        }
    }

    /// Whether any limit is given.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }

    /// Whether any limit is given and not 0 (unlimited).
    pub fn limits_anything(&self) -> bool {
        self.fields().iter().any(|v| v.is_some_and(|v| v != 0))
    }

    fn fields(&self) -> [Option<u64>; 4] {
        [
            self.rw_ios_per_sec,
            self.rw_mbytes_per_sec,
            self.r_mbytes_per_sec,
            self.w_mbytes_per_sec,
        ]
    }

    /// The strictest of several limits, field by field (a limit that is not given, or 0,
    /// limits nothing); every field is given in the result, 0 where none limits it. The order
    /// of `all` does not matter.
    pub fn strictest<'a>(all: impl IntoIterator<Item = &'a QosParams>) -> QosParams {
        let mut out = [0u64; 4];
        for q in all {
            for (o, v) in out.iter_mut().zip(q.fields()) {
                if let Some(v) = v.filter(|v| *v != 0) {
                    *o = if *o == 0 { v } else { (*o).min(v) };
                }
            }
        }
        QosParams {
            rw_ios_per_sec: Some(out[0]),
            rw_mbytes_per_sec: Some(out[1]),
            r_mbytes_per_sec: Some(out[2]),
            w_mbytes_per_sec: Some(out[3]),
        }
    }

    /// These limits as `(key, value)` pairs of the given keys ([`params::QOS`] or
    /// [`params::POD_QOS`]), for a volume context.
    pub fn to_context(&self, keys: [&'static str; 4]) -> Vec<(&'static str, String)> {
        keys.into_iter()
            .zip(self.fields())
            .filter_map(|(k, v)| v.map(|v| (k, v.to_string())))
            .collect()
    }

    /// The `bdev_set_qos_limit` call for bdev `name`.
    pub fn rpc_params(&self, name: &str) -> katablk_rpc::methods::BdevSetQosLimitParams {
        katablk_rpc::methods::BdevSetQosLimitParams {
            name: name.to_owned(),
            rw_ios_per_sec: self.rw_ios_per_sec,
            rw_mbytes_per_sec: self.rw_mbytes_per_sec,
            r_mbytes_per_sec: self.r_mbytes_per_sec,
            w_mbytes_per_sec: self.w_mbytes_per_sec,
        }
    }
}

/// Parsed StorageClass parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassParams {
    /// lvstore.
    pub lvs: String,
    /// Thin provisioning.
    pub thin: bool,
    /// Clear method.
    pub clear: Option<LvolClearMethod>,
    /// Controller cpumask.
    pub cpumask: Option<String>,
    /// Filesystem type.
    pub fstype: Option<String>,
    /// Kata runtime (None: the node's default).
    pub kata_runtime: Option<crate::kata::KataRuntime>,
    /// Unformatted hand-over for runtime-rs.
    pub raw_block: bool,
    /// Rate limits.
    pub qos: QosParams,
    /// Per-pod rate limits (a group of every volume with pod limits one pod mounts).
    pub pod_qos: QosParams,
}

fn parse_bool(k: &str, v: &str) -> Result<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "yes" | "1" => Ok(true),
        "false" | "no" | "0" => Ok(false),
        _ => Err(CsiError::InvalidArgument(format!(
            "parameter {k}={v:?} is not a boolean"
        ))),
    }
}

/// Validates a cpumask: hex with optional `0x`, or a `[list]` of cores.
pub fn valid_cpumask(s: &str) -> bool {
    let h = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    if !h.is_empty() && h.len() <= 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) {
        return true;
    }
    s.len() > 2
        && s.len() <= 128
        && s.starts_with('[')
        && s.ends_with(']')
        && s[1..s.len() - 1]
            .bytes()
            .all(|b| b.is_ascii_digit() || b == b',' || b == b'-')
}

impl ClassParams {
    /// Parses CreateVolume parameters.
    pub fn parse(p: &HashMap<String, String>, default_lvs: Option<&str>) -> Result<Self> {
        match p.get(params::SPDK).map(String::as_str) {
            Some("true") => {}
            _ => {
                return Err(CsiError::InvalidArgument(
                    "this driver serves Kata vhost-user-blk volumes only: the StorageClass \
                     must set parameter spdk: \"true\""
                        .into(),
                ))
            }
        }
        for k in p.keys() {
            let known = [
                params::SPDK,
                params::LVS,
                params::THIN,
                params::CLEAR,
                params::CPUMASK,
                params::FSTYPE,
                params::KATA_RUNTIME,
                params::RAW_BLOCK,
            ]
            .contains(&k.as_str())
                || params::QOS.contains(&k.as_str())
                || params::POD_QOS.contains(&k.as_str());
            if !known && !k.starts_with("csi.storage.k8s.io/") {
                return Err(CsiError::InvalidArgument(format!(
                    "unknown parameter {k:?}"
                )));
            }
        }
        let lvs = p
            .get(params::LVS)
            .map(String::as_str)
            .or(default_lvs)
            .ok_or_else(|| {
                CsiError::InvalidArgument("no lvstore: set parameter lvs or --lvs".into())
            })?;
        if !crate::volume::valid_name(lvs) {
            return Err(CsiError::InvalidArgument(format!(
                "invalid lvstore name {lvs:?}"
            )));
        }
        let thin = match p.get(params::THIN) {
            Some(v) => parse_bool(params::THIN, v)?,
            None => false,
        };
        let clear = match p.get(params::CLEAR).map(String::as_str) {
            None => None,
            Some("none") => Some(LvolClearMethod::None),
            Some("unmap") => Some(LvolClearMethod::Unmap),
            Some("write_zeroes") => Some(LvolClearMethod::WriteZeroes),
            Some(v) => {
                return Err(CsiError::InvalidArgument(format!(
                    "clearMethod {v:?}: use none, unmap or write_zeroes"
                )))
            }
        };
        let cpumask = match p.get(params::CPUMASK) {
            Some(m) if !valid_cpumask(m) => {
                return Err(CsiError::InvalidArgument(format!("invalid cpumask {m:?}")))
            }
            m => m.cloned(),
        };
        let fstype = match p.get(params::FSTYPE) {
            Some(f) => {
                crate::format::check_fstype(f)?;
                Some(f.clone())
            }
            None => None,
        };
        let kata_runtime = p
            .get(params::KATA_RUNTIME)
            .map(|v| crate::kata::KataRuntime::parse(v))
            .transpose()?;
        let raw_block = match p.get(params::RAW_BLOCK) {
            Some(v) => parse_bool(params::RAW_BLOCK, v)?,
            None => false,
        };
        if raw_block && kata_runtime != Some(crate::kata::KataRuntime::Rs) {
            return Err(CsiError::InvalidArgument(format!(
                "{}: true needs {}: rs (it is runtime-rs' way to a raw device; Kata's Go \
                 runtime takes Block PVs)",
                params::RAW_BLOCK,
                params::KATA_RUNTIME
            )));
        }
        if let (Some(rt), Some(fs)) = (kata_runtime, &fstype) {
            if let Some(why) = rt.refuses(fs, raw_block) {
                return Err(CsiError::InvalidArgument(why));
            }
        }
        let qos = QosParams::parse(p)?;
        let pod_qos = QosParams::parse_pod(p)?;
        Ok(Self {
            lvs: lvs.to_owned(),
            thin,
            clear,
            cpumask,
            fstype,
            kata_runtime,
            raw_block,
            qos,
            pod_qos,
        })
    }
}

impl ClassParams {
    /// Refuses capabilities the class's Kata runtime cannot take: a Filesystem type
    /// runtime-rs does not mount, a Block volume for runtime-rs (it has no vhost-user for
    /// container devices), and a raw hand-over asked for as anything but a Filesystem volume.
    pub fn check_capabilities(&self, caps: &[csi::VolumeCapability]) -> Result<()> {
        let Some(rt) = self.kata_runtime else {
            return Ok(());
        };
        for c in caps {
            match &c.access_type {
                Some(vc::AccessType::Mount(m)) => {
                    let fs = if m.fs_type.is_empty() {
                        self.fstype.as_deref().unwrap_or("ext4")
                    } else {
                        &m.fs_type
                    };
                    if let Some(why) = rt.refuses(fs, self.raw_block) {
                        return Err(CsiError::InvalidArgument(why));
                    }
                }
                Some(vc::AccessType::Block(_)) if rt == crate::kata::KataRuntime::Rs => {
                    return Err(CsiError::InvalidArgument(
                        "Kata runtime-rs cannot attach Block PVs (it looks container devices \
                         up in /sys/dev/block, where a vhost-user-blk node has no entry): use \
                         a Filesystem PV, with rawBlock: \"true\" for the raw device"
                            .into(),
                    ))
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// The rate limits of a VolumeAttributesClass (`mutable_parameters` of CreateVolume and
/// ControllerModifyVolume): only the rate-limit keys may change after creation.
pub fn mutable_qos(p: &HashMap<String, String>) -> Result<QosParams> {
    if let Some(k) = p.keys().find(|k| !params::QOS.contains(&k.as_str())) {
        return Err(CsiError::InvalidArgument(format!(
            "mutable parameter {} cannot be changed; mutable: {}",
            crate::volume::shown(k),
            params::QOS.join(", ")
        )));
    }
    QosParams::parse(p)
}

/// Why a capability is not supported, if it is not.
pub fn unsupported_capability(c: &csi::VolumeCapability) -> Option<String> {
    use vc::access_mode::Mode;
    match &c.access_type {
        None => return Some("access_type (block or mount) is required".into()),
        Some(vc::AccessType::Mount(m)) if !m.fs_type.is_empty() => {
            if let Err(e) = crate::format::check_fstype(&m.fs_type) {
                return Some(e.to_string());
            }
        }
        _ => {}
    }
    let mode = c.access_mode.as_ref().map(|m| m.mode);
    match mode.and_then(|m| Mode::try_from(m).ok()) {
        Some(
            Mode::SingleNodeWriter | Mode::SingleNodeReaderOnly | Mode::SingleNodeSingleWriter,
        ) => None,
        Some(m) => Some(format!(
            "access mode {} is not supported: volumes are node-local and single-attach",
            m.as_str_name()
        )),
        None => Some("access_mode is required".into()),
    }
}

/// Refuses an empty capability list or any capability [`unsupported_capability`] names.
pub(crate) fn check_capabilities(caps: &[csi::VolumeCapability]) -> Result<()> {
    if caps.is_empty() {
        return Err(CsiError::InvalidArgument(
            "volume_capabilities are required".into(),
        ));
    }
    for c in caps {
        if let Some(why) = unsupported_capability(c) {
            return Err(CsiError::InvalidArgument(why));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn class_params() {
        let e = ClassParams::parse(&m(&[]), Some("lvs0")).unwrap_err();
        assert!(e.to_string().contains("Kata vhost-user-blk"));
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let p = ClassParams::parse(&m(&[("spdk", "true")]), Some("lvs0")).unwrap();
        assert_eq!(p.lvs, "lvs0");
        assert!(!p.thin);
        let p = ClassParams::parse(
            &m(&[
                ("spdk", "true"),
                ("lvs", "lvs1"),
                ("thinProvision", "true"),
                ("clearMethod", "unmap"),
                ("cpumask", "0x3"),
                ("csi.storage.k8s.io/fstype", "ext4"),
                ("csi.storage.k8s.io/pvc/name", "x"),
            ]),
            None,
        )
        .unwrap();
        assert_eq!(p.lvs, "lvs1");
        assert!(p.thin);
        assert_eq!(p.clear, Some(LvolClearMethod::Unmap));
        assert_eq!(p.cpumask.as_deref(), Some("0x3"));
        assert_eq!(p.fstype.as_deref(), Some("ext4"));
        for bad in [
            &[("spdk", "true"), ("lvs", "a/b")][..],
            &[("spdk", "true"), ("thinProvision", "maybe")],
            &[("spdk", "true"), ("clearMethod", "shred")],
            &[("spdk", "true"), ("cpumask", "zz")],
            &[("spdk", "true"), ("typo", "1")],
            &[("spdk", "false")],
            &[("spdk", "true"), ("kataRuntime", "java")],
            &[("spdk", "true"), ("rawBlock", "true")],
            &[
                ("spdk", "true"),
                ("kataRuntime", "go"),
                ("rawBlock", "true"),
            ],
            &[
                ("spdk", "true"),
                ("kataRuntime", "rs"),
                ("rawBlock", "sometimes"),
            ],
            &[
                ("spdk", "true"),
                ("kataRuntime", "rs"),
                ("csi.storage.k8s.io/fstype", "xfs"),
            ],
        ] {
            assert!(
                ClassParams::parse(&m(bad), Some("lvs0")).is_err(),
                "{bad:?}"
            );
        }
        assert!(ClassParams::parse(&m(&[("spdk", "true")]), None).is_err());
        assert!(valid_cpumask("[0,2-3]"));
        let rs = ClassParams::parse(
            &m(&[
                ("spdk", "true"),
                ("kataRuntime", "rs"),
                ("rawBlock", "true"),
            ]),
            Some("lvs0"),
        )
        .unwrap();
        assert_eq!(rs.kata_runtime, Some(crate::kata::KataRuntime::Rs));
        assert!(rs.raw_block);
        assert!(!rs.qos.any());
        let q = ClassParams::parse(
            &m(&[
                ("spdk", "true"),
                ("rwIosPerSec", "20000"),
                ("wMBytesPerSec", "0"),
            ]),
            Some("lvs0"),
        )
        .unwrap()
        .qos;
        assert_eq!(q.rw_ios_per_sec, Some(20000));
        assert_eq!(q.w_mbytes_per_sec, Some(0));
        assert_eq!(q.rw_mbytes_per_sec, None);
        let r = q.rpc_params("lvs0/v");
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            serde_json::json!({"name": "lvs0/v", "rw_ios_per_sec": 20000, "w_mbytes_per_sec": 0})
        );
    }

    #[test]
    fn class_runtime_refuses_capabilities() {
        let cap = |t| csi::VolumeCapability {
            access_type: Some(t),
            access_mode: Some(csi::volume_capability::AccessMode {
                mode: vc::access_mode::Mode::SingleNodeWriter as i32,
            }),
        };
        let mount = |fs: &str| {
            cap(vc::AccessType::Mount(vc::MountVolume {
                fs_type: fs.into(),
                ..Default::default()
            }))
        };
        let block = cap(vc::AccessType::Block(vc::BlockVolume {}));
        let p = |kv: &[(&str, &str)]| ClassParams::parse(&m(kv), Some("lvs0")).unwrap();
        let rs = p(&[("spdk", "true"), ("kataRuntime", "rs")]);
        assert!(rs.check_capabilities(&[mount("ext4")]).is_ok());
        assert!(rs.check_capabilities(&[mount("")]).is_ok());
        let e = rs.check_capabilities(&[mount("xfs")]).unwrap_err();
        assert!(e.to_string().contains("runtime-rs"), "{e}");
        let e = rs
            .check_capabilities(std::slice::from_ref(&block))
            .unwrap_err();
        assert!(e.to_string().contains("rawBlock"), "{e}");
        let raw = p(&[
            ("spdk", "true"),
            ("kataRuntime", "rs"),
            ("rawBlock", "true"),
        ]);
        assert!(raw.check_capabilities(&[mount("xfs")]).is_ok());
        let go = p(&[("spdk", "true"), ("kataRuntime", "go")]);
        assert!(go
            .check_capabilities(&[mount("xfs"), block.clone()])
            .is_ok());
        let none = p(&[("spdk", "true")]);
        assert!(none.check_capabilities(&[mount("xfs"), block]).is_ok());
    }

    #[test]
    fn capabilities() {
        use vc::access_mode::Mode;
        let cap = |mode: Mode, block: bool| csi::VolumeCapability {
            access_type: Some(if block {
                vc::AccessType::Block(vc::BlockVolume {})
            } else {
                vc::AccessType::Mount(vc::MountVolume::default())
            }),
            access_mode: Some(vc::AccessMode { mode: mode as i32 }),
        };
        assert!(unsupported_capability(&cap(Mode::SingleNodeWriter, true)).is_none());
        assert!(unsupported_capability(&cap(Mode::SingleNodeReaderOnly, false)).is_none());
        assert!(unsupported_capability(&cap(Mode::MultiNodeMultiWriter, true)).is_some());
        assert!(unsupported_capability(&csi::VolumeCapability::default()).is_some());
        assert!(check_capabilities(&[]).is_err());
    }
}
