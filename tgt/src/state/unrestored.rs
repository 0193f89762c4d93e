//! Saved configuration entries that could not be restored (see the [parent docs](super)):
//! how they are kept, reported, replaced and retried.

use std::time::{SystemTime, UNIX_EPOCH};

use katablk_rpc::methods::{ConfigEntry, UnrestoredEntry, VhostCreateBlkControllerParams};
use katablk_rpc::{codes, SpdkError};
use tracing::{info, warn};
use uuid::Uuid;

use super::{Inner, Target};

/// Subsystem of a saved entry, by method.
pub(super) fn subsystem_of(method: &str) -> &'static str {
    if method.starts_with("vhost_") {
        "vhost_blk"
    } else {
        "bdev"
    }
}

/// The object a saved entry creates: `name` for bdevs, `ctrlr` for controllers.
fn entry_name(method: &str, params: &Option<serde_json::Value>) -> String {
    let key = if subsystem_of(method) == "vhost_blk" {
        "ctrlr"
    } else {
        "name"
    };
    params
        .as_ref()
        .and_then(|p| p.get(key))
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Target {
    /// A new bdev `name` created by `method` against an unrestored entry of that name: an aio
    /// bdev on the same file restores it (its saved UUID is returned, to keep it); a RAM bdev
    /// replaces an unrestored RAM bdev; anything else is refused, so that the saved entry of
    /// a missing disk is never lost by accident.
    pub(super) fn check_unrestored_name(
        inner: &Inner,
        name: &str,
        method: &str,
        filename: Option<&str>,
    ) -> Result<Option<Uuid>, SpdkError> {
        let Some(u) = inner
            .unrestored
            .iter()
            .find(|u| u.subsystem == "bdev" && u.name == name)
        else {
            return Ok(None);
        };
        let saved = |k: &str| {
            u.params
                .as_ref()
                .and_then(|p| p.get(k))
                .and_then(serde_json::Value::as_str)
        };
        let same = match (u.method.as_str(), filename) {
            ("bdev_aio_create", Some(f)) => saved("filename") == Some(f),
            ("bdev_aio_create", None) => false,
            (m, _) => m != "bdev_aio_create" && method != "bdev_aio_create",
        };
        if !same {
            return Err(SpdkError::new(
                -libc::EEXIST,
                format!(
                    "File exists: bdev {name} is in the saved configuration ({} {}) but could \
                     not be restored ({}); create it again the same way, or delete it to forget it",
                    u.method,
                    u.params.as_ref().map(|p| p.to_string()).unwrap_or_default(),
                    u.error
                ),
            ));
        }
        Ok(saved("uuid").and_then(|s| Uuid::parse_str(s).ok()))
    }

    /// Retries every unrestored controller whose bdev now exists.
    pub(super) fn retry_controllers(&self, inner: &mut Inner) {
        let pending: Vec<UnrestoredEntry> = inner
            .unrestored
            .iter()
            .filter(|u| u.subsystem == "vhost_blk")
            .cloned()
            .collect();
        for u in pending {
            let Ok(p) =
                katablk_rpc::wire::typed::<VhostCreateBlkControllerParams>(u.params.clone())
            else {
                continue;
            };
            if inner.find(&p.dev_name).is_none() {
                continue;
            }
            let pos = inner
                .unrestored
                .iter()
                .position(|x| x.subsystem == "vhost_blk" && x.name == u.name);
            match self.create_controller_locked(inner, &p) {
                Ok(()) => {
                    if let Some(i) = pos {
                        inner.unrestored.remove(i);
                    }
                    info!(ctrlr = %p.ctrlr, bdev = %p.dev_name, "unrestored controller is back");
                }
                Err(e) => {
                    warn!(ctrlr = %p.ctrlr, "unrestored controller still cannot be created: {}", e.message);
                    if let Some(x) = pos.and_then(|i| inner.unrestored.get_mut(i)) {
                        x.error = e.message;
                        x.attempts += 1;
                    }
                }
            }
        }
    }

    /// Keeps a saved entry that could not be restored (see the [`crate::state`] docs); an entry
    /// refused because the object already exists (`-17`) is not kept.
    pub fn keep_unrestored(&self, entry: &ConfigEntry, err: &SpdkError) {
        if err.code == codes::EEXIST {
            return;
        }
        let Ok(mut inner) = self.lock() else {
            return;
        };
        let subsystem = subsystem_of(&entry.method);
        let name = entry_name(&entry.method, &entry.params);
        match inner
            .unrestored
            .iter_mut()
            .find(|u| u.subsystem == subsystem && u.name == name && u.method == entry.method)
        {
            Some(u) => {
                u.error = err.message.clone();
                u.attempts += 1;
                u.params = entry.params.clone();
            }
            None => inner.unrestored.push(UnrestoredEntry {
                subsystem: subsystem.to_string(),
                name,
                method: entry.method.clone(),
                params: entry.params.clone(),
                error: err.message.clone(),
                since: unix_now(),
                attempts: 1,
            }),
        }
    }

    /// `katablk_get_unrestored`: saved entries not restored (yet).
    pub fn unrestored(&self) -> Result<Vec<UnrestoredEntry>, SpdkError> {
        Ok(self.lock()?.unrestored.clone())
    }

    /// Number of saved entries not restored (yet).
    pub fn unrestored_count(&self) -> usize {
        self.lock().map(|i| i.unrestored.len()).unwrap_or(0)
    }

    /// Retries unrestored controllers (their bdevs may have come back by other means).
    pub fn retry_unrestored_controllers(&self) {
        if let Ok(mut inner) = self.lock() {
            self.retry_controllers(&mut inner);
        }
    }
}
