//! Volume-level operations of an lvstore: lookup, listing, creation, rename, read-only,
//! resize, and the allocation counters.

use super::*;

impl LvStore {
    /// Looks a volume up by name, alias (`lvs/name`) or UUID.
    pub fn lvol(&self, key: &str) -> Result<Arc<Lvol>> {
        let st = self.shared.md();
        let id = st.find(key)?;
        st.vols.get(&id).cloned().ok_or(LvolError::Closed)
    }

    /// Every volume, in blob id order.
    pub fn list(&self) -> Vec<LvolInfo> {
        let st = self.shared.md();
        st.blobs
            .values()
            .map(|b| st.info_of(b, &self.shared))
            .collect()
    }

    /// One volume's properties.
    pub fn lvol_info(&self, key: &str) -> Result<LvolInfo> {
        let st = self.shared.md();
        let id = st.find(key)?;
        Ok(st.info_of(st.blob(id)?, &self.shared))
    }

    fn clusters_for(&self, size_bytes: u64) -> Result<u64> {
        if size_bytes == 0 {
            return Err(LvolError::Invalid("size must be positive".into()));
        }
        Ok(size_bytes.div_ceil(self.shared.cluster_size))
    }

    /// Creates a volume of `size_bytes` (rounded up to whole clusters).
    pub fn create_lvol(&self, name: &str, size_bytes: u64, thin: bool) -> Result<Arc<Lvol>> {
        self.create_lvol_with(
            name,
            size_bytes,
            LvolOptions {
                thin,
                ..Default::default()
            },
        )
    }

    /// Creates a volume with options.
    pub fn create_lvol_with(
        &self,
        name: &str,
        size_bytes: u64,
        opts: LvolOptions,
    ) -> Result<Arc<Lvol>> {
        check_name(name)?;
        let n = self.clusters_for(size_bytes)?;
        let mut st = self.shared.md();
        st.check_ok()?;
        if st.name_taken(name) {
            return Err(LvolError::Exists(name.to_string()));
        }
        if let Some(u) = opts.uuid {
            if st.blobs.values().any(|b| b.uuid == u) {
                return Err(LvolError::Exists(u.to_string()));
            }
        }
        if n > MAX_VOL_CLUSTERS {
            return Err(LvolError::NoSpace {
                needed: n,
                free: st.free_clusters(),
            });
        }
        let mut clusters = vec![0u32; n as usize];
        if !opts.thin {
            if n > st.free_clusters() {
                return Err(LvolError::NoSpace {
                    needed: n,
                    free: st.free_clusters(),
                });
            }
            let mut prev = None;
            for c in clusters.iter_mut() {
                let p = st.alloc_cluster(prev)?;
                prev = Some(u64::from(p) + 1);
                *c = p;
            }
        }
        let id = st.new_id();
        let b = BlobMd {
            id,
            name: name.to_string(),
            uuid: opts.uuid.unwrap_or_else(Uuid::new_v4),
            clusters: clusters.clone(),
            thin: opts.thin,
            read_only: false,
            snapshot: false,
            parent: None,
            clear: opts.clear_method,
        };
        if let Err(e) = st.commit(vec![b], &[]) {
            for &p in &clusters {
                if p != 0 {
                    st.clusters.clear(u64::from(p));
                }
            }
            return Err(e);
        }
        Ok(st.add_vol(&self.shared, id))
    }

    /// Renames a volume.
    pub fn rename(&self, key: &str, new_name: &str) -> Result<()> {
        check_name(new_name)?;
        let mut st = self.shared.md();
        let id = st.find(key)?;
        if st.blob(id)?.name == new_name {
            return Ok(());
        }
        if st.name_taken(new_name) {
            return Err(LvolError::Exists(new_name.to_string()));
        }
        let mut b = st.blob(id)?.clone();
        b.name = new_name.to_string();
        st.commit(vec![b], &[])?;
        st.publish(id);
        Ok(())
    }

    /// Makes a volume read-only (persistently).
    pub fn set_read_only(&self, key: &str) -> Result<()> {
        let mut st = self.shared.md();
        let id = st.find(key)?;
        let mut b = st.blob(id)?.clone();
        if b.read_only {
            return Ok(());
        }
        b.read_only = true;
        st.commit(vec![b], &[])?;
        st.publish(id);
        Ok(())
    }

    /// Resizes a volume to `size_bytes` (rounded up to whole clusters). Shrinking releases the
    /// clusters beyond the new end (after draining I/O).
    pub fn resize(&self, key: &str, size_bytes: u64) -> Result<()> {
        let n = self.clusters_for(size_bytes)? as usize;
        let vol = self.lvol(key)?;
        let shrinking = vol.st().map.len() > n;
        let _frozen = if shrinking { Some(vol.freeze()?) } else { None };
        let mut st = self.shared.md();
        st.check_ok()?;
        let mut b = st.blob(vol.id)?.clone();
        if b.read_only {
            return Err(LvolError::ReadOnly(b.name));
        }
        let old = b.clusters.len();
        let mut released = Vec::new();
        let mut taken = Vec::new();
        let mut fill = false;
        if n < old {
            released = b.clusters[n..]
                .iter()
                .copied()
                .filter(|&c| c != 0)
                .collect();
            b.clusters.truncate(n);
        } else if n > old {
            let extra = (n - old) as u64;
            if !b.thin && extra > st.free_clusters() {
                return Err(LvolError::NoSpace {
                    needed: extra,
                    free: st.free_clusters(),
                });
            }
            if n as u64 > MAX_VOL_CLUSTERS {
                return Err(LvolError::NoSpace {
                    needed: n as u64,
                    free: st.free_clusters(),
                });
            }
            let mut prev = b
                .clusters
                .last()
                .filter(|&&c| c != 0)
                .map(|&c| u64::from(c) + 1);
            let mut r = Ok(());
            for c in old..n {
                // A grown clone must not expose ancestor data beyond its old end: such clusters
                // get zeroed clusters of their own.
                let masked = b.thin && st.ancestor_cluster(b.parent, c as u64).is_some();
                if b.thin && !masked {
                    b.clusters.push(0);
                    continue;
                }
                let p = match st.alloc_cluster(prev) {
                    Ok(p) => p,
                    Err(e) => {
                        r = Err(e);
                        break;
                    }
                };
                prev = Some(u64::from(p) + 1);
                taken.push(p);
                b.clusters.push(p);
                if masked {
                    fill = true;
                    if let Err(e) = st.fill_cluster(p, None) {
                        r = Err(e);
                        break;
                    }
                }
            }
            if let Err(e) = r {
                for p in taken {
                    st.clusters.clear(u64::from(p));
                }
                return Err(e);
            }
        } else {
            return Ok(());
        }
        let clear = b.clear;
        let r = if !fill { Ok(()) } else { st.flush() };
        if let Err(e) = r.and_then(|_| st.commit(vec![b], &[])) {
            for p in taken {
                st.clusters.clear(u64::from(p));
            }
            return Err(e);
        }
        st.publish(vol.id);
        st.release_clusters(&released, clear);
        Ok(())
    }

    /// Volumes of the store that are still open.
    pub(crate) fn vols(&self, ids: &[u64]) -> Vec<Arc<Lvol>> {
        let st = self.shared.md();
        ids.iter().filter_map(|i| st.vols.get(i).cloned()).collect()
    }

    /// Number of cluster allocations done by the write path since open (for tests).
    pub fn allocations(&self) -> u64 {
        self.shared.allocations.load(Ordering::Relaxed)
    }

    /// Clusters released by discards that are no longer in any volume but not free yet:
    /// requests issued to them before the discard are still running. They become free (or,
    /// if those requests never finish, stay in use until the store is reopened) without
    /// anything else waiting for them.
    pub fn releasing_clusters(&self) -> u64 {
        self.shared.releasing.load(Ordering::SeqCst)
    }

    /// Waits until no released cluster is waiting for earlier requests (at most `timeout`);
    /// true if none is.
    pub fn settle_releases(&self, timeout: std::time::Duration) -> bool {
        let start = std::time::Instant::now();
        while self.releasing_clusters() != 0 {
            if start.elapsed() >= timeout {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        true
    }
}
