//! `--state-dir`: the bdev and controller configuration, saved atomically after every change in
//! SPDK's `save_config` format and replayed at start, so a restart brings back the same
//! controllers on the same sockets (lvols come back with their lvstore when the aio bdev is
//! re-created, as with SPDK's examine).
//!
//! An entry that cannot be restored (its file is missing, say) is not dropped: the target
//! keeps it as *unrestored* ([`Target::keep_unrestored`]), saves it with the rest, reports it
//! (`katablk_get_unrestored`, and a warning in the log) and [`retry_unrestored`] tries it
//! again (the daemon does so every `--restore-retry` seconds).

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;

use katablk_rpc::methods::{Config, ConfigEntry, SubsystemConfig};
use katablk_rpc::SpdkError;
use serde::de::DeserializeOwned;
use tracing::{debug, info, warn};

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
                        Err(err) => {
                            warn!(method = %e.method, params = %params_text(e),
                                "not restored; kept in the saved configuration and retried: {}",
                                err.message);
                            target.keep_unrestored(e, &err);
                        }
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

/// Retries every unrestored entry: bdevs first (an aio bdev only once its file exists again),
/// then controllers. Returns how many came back.
pub fn retry_unrestored(target: &Target) -> usize {
    let before = target.unrestored_count();
    for u in target.unrestored().unwrap_or_default() {
        if u.subsystem != "bdev" {
            continue;
        }
        let file = u
            .params
            .as_ref()
            .and_then(|p| p.get("filename"))
            .and_then(serde_json::Value::as_str);
        if file.is_some_and(|f| std::fs::metadata(f).is_err()) {
            continue;
        }
        let e = ConfigEntry {
            method: u.method.clone(),
            params: u.params.clone(),
        };
        match apply(target, &e) {
            Ok(()) => info!(method = %e.method, bdev = %u.name, "unrestored entry restored"),
            Err(err) => {
                debug!(method = %e.method, bdev = %u.name, "still not restored: {}", err.message);
                target.keep_unrestored(&e, &err);
            }
        }
    }
    target.retry_unrestored_controllers();
    before.saturating_sub(target.unrestored_count())
}

fn params_text(e: &ConfigEntry) -> String {
    e.params.as_ref().map(|p| p.to_string()).unwrap_or_default()
}

fn params<P: DeserializeOwned>(e: &ConfigEntry) -> Result<P, SpdkError> {
    katablk_rpc::wire::typed(e.params.clone())
}

fn apply(t: &Target, e: &ConfigEntry) -> Result<(), SpdkError> {
    match e.method.as_str() {
        "bdev_aio_create" => t.aio_create(&params(e)?).map(|_| ()),
        "bdev_malloc_create" => t.malloc_create(&params(e)?).map(|_| ()),
        "bdev_null_create" => t.null_create(&params(e)?).map(|_| ()),
        "bdev_wait_for_examine" => Ok(()),
        "bdev_set_qos_limit" => t.set_qos_limit(&params(e)?).map(|_| ()),
        "katablk_set_qos_group" => t.set_qos_group(&params(e)?).map(|_| ()),
        "vhost_create_blk_controller" => t.create_controller(&params(e)?).map(|_| ()),
        other => Err(SpdkError::method_not_found().with_data(other.into())),
    }
}
