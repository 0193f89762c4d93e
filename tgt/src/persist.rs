//! `--state-dir`: the bdev and controller configuration, saved atomically after every change in
//! SPDK's `save_config` format and replayed at start, so a restart brings back the same
//! controllers on the same sockets (lvols come back with their lvstore when the aio bdev is
//! re-created, as with SPDK's examine).

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;

use katablk_rpc::methods::{Config, ConfigEntry, SubsystemConfig};
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use crate::state::Target;

/// Subsystems the target configures, in load order.
pub const SUBSYSTEMS: &[&str] = &["bdev", "vhost_blk"];

/// Where the configuration lives.
#[derive(Debug, Clone)]
pub struct StateDir {
    dir: PathBuf,
    file: Option<PathBuf>,
}

impl StateDir {
    /// Uses `dir` (created if missing).
    pub fn new(dir: impl Into<PathBuf>) -> std::io::Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)?;
        Ok(StateDir { dir, file: None })
    }

    /// A configuration file to restore from (not saved to).
    pub fn from_file(file: &std::path::Path) -> Self {
        StateDir {
            dir: file.parent().map(PathBuf::from).unwrap_or_default(),
            file: file.file_name().map(PathBuf::from),
        }
    }

    /// The configuration file.
    pub fn path(&self) -> PathBuf {
        self.dir
            .join(self.file.as_deref().unwrap_or("config.json".as_ref()))
    }

    /// Writes the target's configuration: to a temporary file, fsynced, renamed over the old
    /// one, and the directory fsynced, so a crash leaves either the old or the new file.
    pub fn save(&self, target: &Target) -> std::io::Result<()> {
        let cfg = current_config(target);
        let data = serde_json::to_vec_pretty(&cfg).map_err(std::io::Error::other)?;
        let tmp = self.dir.join(".config.json.tmp");
        {
            let mut f = File::create(&tmp)?;
            f.write_all(&data)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, self.path())?;
        File::open(&self.dir)?.sync_all()
    }

    /// Replays a saved configuration. Entries that fail (a file that disappeared, say) are
    /// logged and skipped; the rest is restored.
    pub fn restore(&self, target: &Target) -> std::io::Result<usize> {
        let p = self.path();
        if !p.exists() {
            return Ok(0);
        }
        let cfg: Config = serde_json::from_slice(&std::fs::read(&p)?)
            .map_err(|e| std::io::Error::other(format!("{}: {e}", p.display())))?;
        let mut n = 0;
        for name in SUBSYSTEMS {
            for sub in cfg.subsystems.iter().filter(|s| s.subsystem == *name) {
                for e in sub.config.iter().flatten() {
                    match apply(target, e) {
                        Ok(()) => n += 1,
                        Err(err) => warn!(method = %e.method, "not restored: {err}"),
                    }
                }
            }
        }
        info!(entries = n, file = %p.display(), "configuration restored");
        Ok(n)
    }
}

/// The configuration of every subsystem.
pub fn current_config(target: &Target) -> Config {
    Config {
        subsystems: SUBSYSTEMS
            .iter()
            .map(|s| SubsystemConfig {
                subsystem: s.to_string(),
                config: target.config(s).ok(),
            })
            .collect(),
    }
}

fn params<P: DeserializeOwned>(e: &ConfigEntry) -> Result<P, String> {
    katablk_rpc::wire::typed(e.params.clone()).map_err(|e| e.message)
}

fn apply(t: &Target, e: &ConfigEntry) -> Result<(), String> {
    let r = match e.method.as_str() {
        "bdev_aio_create" => t.aio_create(&params(e)?).map(|_| ()),
        "bdev_malloc_create" => t.malloc_create(&params(e)?).map(|_| ()),
        "bdev_null_create" => t.null_create(&params(e)?).map(|_| ()),
        "bdev_wait_for_examine" => Ok(()),
        "vhost_create_blk_controller" => t.create_controller(&params(e)?).map(|_| ()),
        other => return Err(format!("unknown method {other}")),
    };
    r.map_err(|e| e.message)
}
