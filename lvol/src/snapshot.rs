//! Snapshots, clones, inflate, decouple-parent and delete (with the snapshot merge).
//!
//! Semantics follow SPDK's lvol: a snapshot takes over the origin's clusters and becomes its
//! read-only parent, the origin turning into a thin clone of it; clones are thin children of a
//! read-only volume; deleting a snapshot with exactly one clone merges it into the clone.

use std::sync::Arc;

use uuid::Uuid;

use crate::error::{LvolError, Result};
use crate::lvol::Lvol;
use crate::md::BlobMd;
use crate::store::LvStore;

impl LvStore {
    /// Takes a snapshot of `origin` named `snap_name`. The snapshot gets the origin's clusters
    /// and is read-only; the origin becomes an empty thin clone of it. I/O on the origin is
    /// drained first.
    pub fn snapshot(&self, origin: &str, snap_name: &str) -> Result<Arc<Lvol>> {
        crate::store::check_name_pub(snap_name)?;
        let vol = self.lvol(origin)?;
        let _frozen = vol.freeze()?;
        let mut st = self.shared.md();
        let mut o = st.blob(vol.id)?.clone();
        if st.name_taken(snap_name) {
            return Err(LvolError::Exists(snap_name.to_string()));
        }
        if o.read_only {
            return Err(LvolError::NotPermitted(format!(
                "{} is read-only; clone it instead",
                o.name
            )));
        }
        let id = st.new_id();
        let snap = BlobMd {
            id,
            name: snap_name.to_string(),
            uuid: Uuid::new_v4(),
            clusters: o.clusters.clone(),
            thin: o.thin,
            read_only: true,
            snapshot: true,
            parent: o.parent,
            clear: o.clear,
        };
        o.clusters.iter_mut().for_each(|c| *c = 0);
        o.thin = true;
        o.parent = Some(id);
        st.commit(vec![snap, o], &[])?;
        let s = st.add_vol(&self.shared, id);
        st.publish(vol.id);
        Ok(s)
    }

    /// Creates a thin clone of the read-only volume (snapshot) `snap`.
    pub fn clone_lvol(&self, snap: &str, clone_name: &str) -> Result<Arc<Lvol>> {
        crate::store::check_name_pub(clone_name)?;
        let mut st = self.shared.md();
        st.check_ok_pub()?;
        let sid = st.find(snap)?;
        let s = st.blob(sid)?.clone();
        if !s.read_only {
            return Err(LvolError::Invalid(format!(
                "{} is not a snapshot or read-only volume",
                s.name
            )));
        }
        if st.name_taken(clone_name) {
            return Err(LvolError::Exists(clone_name.to_string()));
        }
        let id = st.new_id();
        let b = BlobMd {
            id,
            name: clone_name.to_string(),
            uuid: Uuid::new_v4(),
            clusters: vec![0; s.clusters.len()],
            thin: true,
            read_only: false,
            snapshot: false,
            parent: Some(sid),
            clear: s.clear,
        };
        st.commit(vec![b], &[])?;
        Ok(st.add_vol(&self.shared, id))
    }

    /// Same as [`LvStore::clone_lvol`] (SPDK's `bdev_lvol_clone`).
    pub fn clone(&self, snap: &str, clone_name: &str) -> Result<Arc<Lvol>> {
        self.clone_lvol(snap, clone_name)
    }

    /// Allocates every unallocated cluster of `key` (copying the ancestors' data or zeroes)
    /// and detaches it from its parent: it becomes a thick, independent volume.
    pub fn inflate(&self, key: &str) -> Result<()> {
        self.copy_up(key, true)
    }

    /// Allocates the clusters whose data comes from an ancestor and detaches the volume from
    /// its parent; clusters no ancestor has stay unallocated (the volume stays thin).
    pub fn decouple_parent(&self, key: &str) -> Result<()> {
        self.copy_up(key, false)
    }

    /// Clusters of blob `b` that inflate (`all`) or decouple must fill, with their source.
    fn copy_work(st: &crate::shared::MdState, b: &BlobMd, all: bool) -> Vec<(usize, Option<u32>)> {
        (0..b.clusters.len())
            .filter(|&c| b.clusters[c] == 0)
            .map(|c| (c, st.ancestor_cluster(b.parent, c as u64)))
            .filter(|(_, src)| all || src.is_some())
            .collect()
    }

    /// Inflate / decouple in chunks: the clusters to fill are listed once, and each chunk of
    /// them is filled and committed (the parent link stays until the end, so every
    /// intermediate state is a valid volume) with the metadata lock released between chunks,
    /// so first writes elsewhere are not stalled for the whole copy. A last pass under one
    /// lock hold fills whatever is missing by then (clusters released by discards meanwhile,
    /// or added by a resize) and detaches the volume in the same transaction, so concurrent
    /// discards cannot keep the operation going.
    fn copy_up(&self, key: &str, all: bool) -> Result<()> {
        const CHUNK: usize = 16;
        let (id, listed) = {
            let st = self.shared.md();
            st.check_ok_pub()?;
            let id = st.find(key)?;
            let b = st.blob(id)?;
            if b.read_only {
                return Err(LvolError::ReadOnly(b.name.clone()));
            }
            if !all && b.parent.is_none() {
                return Err(LvolError::Invalid(format!("{} has no parent", b.name)));
            }
            let work = Self::copy_work(&st, b, all);
            let needed = work.len() as u64;
            if needed > st.free_clusters() {
                return Err(LvolError::NoSpace {
                    needed,
                    free: st.free_clusters(),
                });
            }
            (id, work.into_iter().map(|(c, _)| c).collect::<Vec<usize>>())
        };
        for chunk in listed.chunks(CHUNK) {
            let mut st = self.shared.md();
            st.check_ok_pub()?;
            let b = st.blob(id)?;
            if b.read_only {
                return Err(LvolError::ReadOnly(b.name.clone()));
            }
            let work: Vec<(usize, Option<u32>)> = chunk
                .iter()
                .filter(|&&c| b.clusters.get(c) == Some(&0))
                .map(|&c| (c, st.ancestor_cluster(b.parent, c as u64)))
                .filter(|(_, src)| all || src.is_some())
                .collect();
            if work.is_empty() {
                continue;
            }
            let b = b.clone();
            Self::fill_and_commit(&mut st, b, &work)?;
            st.publish(id);
        }
        let mut st = self.shared.md();
        st.check_ok_pub()?;
        let mut b = st.blob(id)?.clone();
        if b.read_only {
            return Err(LvolError::ReadOnly(b.name));
        }
        let work = Self::copy_work(&st, &b, all);
        if work.is_empty() && b.parent.is_none() && !(all && b.thin) {
            return Ok(());
        }
        b.parent = None;
        if all {
            b.thin = false;
        }
        Self::fill_and_commit(&mut st, b, &work)?;
        st.publish(id);
        Ok(())
    }

    /// Allocates and fills a cluster of `b` for each `(cluster, source)` of `work`, then
    /// commits `b`. On error the new clusters are given back and nothing is committed.
    fn fill_and_commit(
        st: &mut crate::shared::MdState,
        mut b: BlobMd,
        work: &[(usize, Option<u32>)],
    ) -> Result<()> {
        let mut taken = Vec::new();
        let mut r = Ok(());
        for &(c, src) in work {
            let hint = c
                .checked_sub(1)
                .map(|p| b.clusters[p])
                .filter(|&x| x != 0)
                .map(|x| u64::from(x) + 1);
            let p = match st.alloc_cluster(hint) {
                Ok(p) => p,
                Err(e) => {
                    r = Err(e);
                    break;
                }
            };
            taken.push(p);
            if let Err(e) = st.fill_cluster(p, src) {
                r = Err(e);
                break;
            }
            b.clusters[c] = p;
        }
        if r.is_ok() && !work.is_empty() {
            r = st.flush();
        }
        if r.is_ok() {
            r = st.commit(vec![b], &[]);
        }
        if let Err(e) = r {
            for p in taken {
                st.clusters_mut().clear(u64::from(p));
            }
            return Err(e);
        }
        Ok(())
    }

    /// Deletes a volume. A snapshot with one clone is merged into the clone (the clone takes
    /// the clusters it does not have yet and the snapshot's parent); a volume with more than
    /// one clone cannot be deleted.
    pub fn delete(&self, key: &str) -> Result<()> {
        let vol = self.lvol(key)?;
        let clones = self.shared.md().clones_of(vol.id);
        if clones.len() > 1 {
            return Err(LvolError::NotPermitted(format!(
                "{} has {} clones",
                vol.name(),
                clones.len()
            )));
        }
        let child = self.vols(&clones).into_iter().next();
        let _f1 = vol.freeze()?;
        let _f2 = match &child {
            Some(c) => Some(c.freeze()?),
            None => None,
        };
        let mut st = self.shared.md();
        st.check_ok_pub()?;
        let b = st.blob(vol.id)?.clone();
        let clones = st.clones_of(vol.id);
        if clones.len() > 1 || clones.first() != child.as_ref().map(|c| &c.id) {
            return Err(LvolError::Busy(b.name));
        }
        let mut released = Vec::new();
        let mut updates = Vec::new();
        if let Some(cid) = clones.first() {
            let mut c = st.blob(*cid)?.clone();
            for (i, &p) in b.clusters.iter().enumerate() {
                if p == 0 {
                    continue;
                }
                match c.clusters.get_mut(i) {
                    Some(x) if *x == 0 => *x = p,
                    _ => released.push(p),
                }
            }
            c.parent = b.parent;
            updates.push(c);
        } else {
            released = b.clusters.iter().copied().filter(|&p| p != 0).collect();
        }
        st.commit(updates, &[vol.id])?;
        st.remove_vol(vol.id);
        if let Some(cid) = clones.first() {
            st.publish(*cid);
        }
        st.release_clusters(&released, b.clear);
        Ok(())
    }
}
