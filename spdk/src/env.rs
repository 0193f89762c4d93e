//! Options of the SPDK environment (DPDK EAL) and application framework, checked before any
//! SPDK call: the reactor core mask, hugepage memory, shared-memory id, and the name.

use thiserror::Error;

/// Why options are invalid.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EnvError {
    /// The core mask is empty or not hexadecimal.
    #[error("invalid core mask {0:?} (hex, e.g. 0x3)")]
    CoreMask(String),
    /// The application name is empty or too long.
    #[error("invalid application name {0:?}")]
    Name(String),
    /// `no_huge` without a memory size (DPDK needs one then).
    #[error("running without hugepages needs a memory size (-s)")]
    NoHugeNeedsMemSize,
    /// A path option is unusable.
    #[error("{0}")]
    Path(String),
    /// Hugepage memory below what SPDK needs to start.
    #[error("{0} MiB of hugepage memory is below SPDK's minimum of {MIN_MEM_MIB} MiB")]
    TooLittleMemory(u32),
}

/// Smallest hugepage pool SPDK starts with, in MiB.
pub const MIN_MEM_MIB: u32 = 64;

/// What `spdk_app_opts`/`spdk_env_opts` get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvOptions {
    /// Application name (also the DPDK file prefix).
    pub name: String,
    /// Reactor cores, as a hex mask.
    pub core_mask: String,
    /// Hugepage memory in MiB (`-s`); `None`: SPDK's default.
    pub mem_size_mib: Option<u32>,
    /// Shared-memory id (`-i`), to run several instances.
    pub shm_id: Option<i32>,
    /// Do not probe PCI devices (no NVMe needed for aio/malloc/lvol bdevs).
    pub no_pci: bool,
    /// Directory of the hugetlbfs mount to use.
    pub hugedir: Option<String>,
    /// Run without hugepages (`--no-huge`; DPDK then uses anonymous memory: fine for AIO,
    /// malloc, null and lvol bdevs, not for NVMe or other DMA devices). Needs `mem_size_mib`.
    pub no_huge: bool,
    /// JSON-RPC listen address (`-r`): a unix socket path. `None`: no RPC server.
    pub rpc_addr: Option<String>,
    /// SPDK JSON configuration to load at start (`--json`, the format of `save_config`).
    pub json_config: Option<String>,
    /// Do not lock the reactor cores (`--disable-cpumask-locks`), so that several SPDK
    /// processes may share cores (tests, benchmarks next to another SPDK).
    pub disable_cpumask_locks: bool,
}

impl Default for EnvOptions {
    fn default() -> Self {
        EnvOptions {
            name: "katablk".into(),
            core_mask: "0x1".into(),
            mem_size_mib: None,
            shm_id: None,
            no_pci: true,
            hugedir: None,
            no_huge: false,
            rpc_addr: None,
            json_config: None,
            disable_cpumask_locks: false,
        }
    }
}

impl EnvOptions {
    /// Checks the options; returns the cores of the mask.
    pub fn validate(&self) -> Result<Vec<u32>, EnvError> {
        if self.name.is_empty()
            || self.name.len() > 32
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(EnvError::Name(self.name.clone()));
        }
        if let Some(m) = self.mem_size_mib {
            if m < MIN_MEM_MIB {
                return Err(EnvError::TooLittleMemory(m));
            }
        }
        if self.no_huge && self.mem_size_mib.is_none() {
            return Err(EnvError::NoHugeNeedsMemSize);
        }
        if let Some(r) = &self.rpc_addr {
            if r.is_empty() || r.len() > 107 || r.contains('\0') {
                return Err(EnvError::Path(format!(
                    "RPC socket path {r:?} must be 1 to 107 bytes"
                )));
            }
        }
        if let Some(j) = &self.json_config {
            if j.is_empty() || j.contains('\0') {
                return Err(EnvError::Path(format!("invalid JSON config path {j:?}")));
            }
        }
        let hex = self
            .core_mask
            .strip_prefix("0x")
            .or_else(|| self.core_mask.strip_prefix("0X"))
            .unwrap_or(&self.core_mask);
        let mut cores = Vec::new();
        for (i, c) in hex.chars().rev().enumerate() {
            let d = c
                .to_digit(16)
                .ok_or_else(|| EnvError::CoreMask(self.core_mask.clone()))?;
            for b in 0..4 {
                if d & (1 << b) != 0 {
                    cores.push((i * 4 + b) as u32);
                }
            }
        }
        if cores.is_empty() {
            return Err(EnvError::CoreMask(self.core_mask.clone()));
        }
        Ok(cores)
    }

    /// The equivalent SPDK application command line (for logs and for `spdk_app_parse_args`).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![self.name.clone(), "-m".into(), self.core_mask.clone()];
        if let Some(m) = self.mem_size_mib {
            v.extend(["-s".into(), m.to_string()]);
        }
        if let Some(i) = self.shm_id {
            v.extend(["-i".into(), i.to_string()]);
        }
        if self.no_pci {
            v.push("--no-pci".into());
        }
        if let Some(h) = &self.hugedir {
            v.extend(["--huge-dir".into(), h.clone()]);
        }
        if self.no_huge {
            v.push("--no-huge".into());
        }
        if let Some(r) = &self.rpc_addr {
            v.extend(["-r".into(), r.clone()]);
        }
        if let Some(j) = &self.json_config {
            v.extend(["--json".into(), j.clone()]);
        }
        if self.disable_cpumask_locks {
            v.push("--disable-cpumask-locks".into());
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_and_args() {
        let o = EnvOptions {
            core_mask: "0x5".into(),
            mem_size_mib: Some(256),
            shm_id: Some(3),
            ..Default::default()
        };
        assert_eq!(o.validate().unwrap(), vec![0, 2]);
        assert_eq!(
            o.to_args(),
            vec!["katablk", "-m", "0x5", "-s", "256", "-i", "3", "--no-pci"]
        );
        for bad in ["", "0x", "0x0", "zz"] {
            let o = EnvOptions {
                core_mask: bad.into(),
                ..Default::default()
            };
            assert!(matches!(o.validate(), Err(EnvError::CoreMask(_))), "{bad}");
        }
        let o = EnvOptions {
            mem_size_mib: Some(16),
            ..Default::default()
        };
        assert_eq!(o.validate(), Err(EnvError::TooLittleMemory(16)));
        let o = EnvOptions {
            no_huge: true,
            ..Default::default()
        };
        assert_eq!(o.validate(), Err(EnvError::NoHugeNeedsMemSize));
        let o = EnvOptions {
            no_huge: true,
            mem_size_mib: Some(512),
            rpc_addr: Some("/var/tmp/katablk-spdk.sock".into()),
            json_config: Some("/etc/katablk/spdk.json".into()),
            ..Default::default()
        };
        assert_eq!(o.validate().unwrap(), vec![0]);
        assert_eq!(
            o.to_args(),
            vec![
                "katablk",
                "-m",
                "0x1",
                "-s",
                "512",
                "--no-pci",
                "--no-huge",
                "-r",
                "/var/tmp/katablk-spdk.sock",
                "--json",
                "/etc/katablk/spdk.json"
            ]
        );
        let o = EnvOptions {
            rpc_addr: Some("x".repeat(108)),
            ..Default::default()
        };
        assert!(matches!(o.validate(), Err(EnvError::Path(_))));
        let o = EnvOptions {
            name: "bad name".into(),
            ..Default::default()
        };
        assert!(matches!(o.validate(), Err(EnvError::Name(_))));
    }
}
