//! The cluster allocation worker: first writes to unallocated clusters of thin volumes and
//! clones are parked by their channel and queued here; the worker fills the clusters, commits
//! the metadata and wakes the channels, so no I/O thread ever waits for metadata. Whole-cluster
//! discards of thin volumes are parked and queued the same way, and the worker gives those
//! clusters back to the store.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use katablk_bdev::IoError;

use crate::lvol::Lvol;
use crate::md::BlobMd;
use crate::store::Shared;

/// Most cluster allocations (or releases) committed in one metadata transaction by the worker.
const ALLOC_BATCH: usize = 32;
/// Longest wait for I/O issued to a released cluster before it was unmapped. After that the
/// cluster stays allocated in memory (and is found free by the next open).
const RELEASE_DRAIN: Duration = Duration::from_secs(30);

/// Allocates clusters for first writes, in batches: fill every new cluster (copy from the
/// parent or zero), flush, commit one metadata transaction, publish, wake the waiters.
pub(crate) fn alloc_worker(shared: Arc<Shared>) {
    loop {
        let (batch, releases) = {
            let mut q = shared.aq();
            while q.queue.is_empty() && q.releases.is_empty() && !q.closed {
                q = shared.alloc_cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            if q.closed {
                return;
            }
            // Bounded batches: one metadata commit amortised over many first writes, without
            // making the first waiter wait for an unbounded number of cluster fills.
            let n = q.queue.len().min(ALLOC_BATCH);
            let batch: Vec<(Arc<Lvol>, u64)> = q.queue.drain(..n).collect();
            let n = q.releases.len().min(ALLOC_BATCH);
            let releases: Vec<(Arc<Lvol>, u64)> = q.releases.drain(..n).collect();
            (batch, releases)
        };
        if !batch.is_empty() {
            let results = alloc_batch(&shared, &batch);
            wake(&shared, &batch, results);
        }
        if !releases.is_empty() {
            let results = release_batch(&shared, &releases);
            wake(&shared, &releases, results);
        }
    }
}

/// Tells the channels waiting for each (volume, cluster) of `batch` the result.
fn wake(shared: &Shared, batch: &[(Arc<Lvol>, u64)], results: Vec<Result<(), IoError>>) {
    let mut notes = Vec::new();
    {
        let mut q = shared.aq();
        for ((vol, c), r) in batch.iter().zip(results) {
            if let Some(ws) = q.pending.remove(&(vol.id, *c)) {
                for w in ws {
                    notes.push((w, *c, r));
                }
            }
        }
    }
    for (w, c, r) in notes {
        w.chan.notify(w.slot, c, r);
    }
}

/// Gives whole discarded clusters of thin volumes back to the store: unmap them in one
/// metadata transaction (after which a crash finds them free), publish the new maps, wait for
/// the I/O issued to them before, then clear them and mark them free. Clusters that cannot be
/// released (no longer allocated, read-only, an ancestor has data there, or the commit failed)
/// are left alone; their waiters then pass the discard to the device as before.
fn release_batch(shared: &Arc<Shared>, batch: &[(Arc<Lvol>, u64)]) -> Vec<Result<(), IoError>> {
    let ok = vec![Ok(()); batch.len()];
    let mut st = shared.md();
    if st.check_ok().is_err() {
        return ok;
    }
    let mut changed: BTreeMap<u64, BlobMd> = BTreeMap::new();
    let mut freed: Vec<(Arc<Lvol>, u32)> = Vec::new();
    for (vol, c) in batch {
        let c = *c as usize;
        let b = match changed.get_mut(&vol.id) {
            Some(b) => b,
            None => match st.blobs.get(&vol.id) {
                Some(b) => changed.entry(vol.id).or_insert_with(|| b.clone()),
                None => continue,
            },
        };
        let Some(&p) = b.clusters.get(c) else {
            continue;
        };
        if p == 0 || !b.thin || b.read_only {
            continue;
        }
        let parent = b.parent;
        if st.ancestor_cluster(parent, c as u64).is_some() {
            continue;
        }
        if let Some(b) = changed.get_mut(&vol.id) {
            b.clusters[c] = 0;
        }
        freed.push((vol.clone(), p));
    }
    if freed.is_empty() {
        return ok;
    }
    changed.retain(|id, b| st.blobs.get(id) != Some(b));
    let clear: BTreeMap<u64, _> = changed.values().map(|b| (b.id, b.clear)).collect();
    if let Err(e) = st.commit(changed.values().cloned().collect(), &[]) {
        tracing::warn!("releasing discarded clusters: {e}");
        return ok;
    }
    let ids: Vec<u64> = changed.keys().copied().collect();
    for id in &ids {
        st.publish(*id);
    }
    drop(st);
    // The maps no longer lead to the clusters; wait for requests issued before that.
    let mut drained: BTreeMap<u64, bool> = BTreeMap::new();
    for (vol, _) in &freed {
        drained
            .entry(vol.id)
            .or_insert_with(|| vol.drain_epoch(RELEASE_DRAIN));
    }
    let mut st = shared.md();
    for (vol, p) in &freed {
        if drained.get(&vol.id) == Some(&true) {
            let how = clear.get(&vol.id).copied().unwrap_or_default();
            st.release_clusters(&[*p], how);
        } else {
            tracing::error!(
                "released cluster {p} of {}: I/O issued to it did not finish in time; it stays \
                 in use until the store is reopened",
                vol.name()
            );
        }
    }
    ok
}

fn alloc_batch(shared: &Arc<Shared>, batch: &[(Arc<Lvol>, u64)]) -> Vec<Result<(), IoError>> {
    let mut st = shared.md();
    let mut results: Vec<Result<(), IoError>> = vec![Ok(()); batch.len()];
    if st.check_ok().is_err() {
        return vec![Err(IoError::Errno(libc::EIO)); batch.len()];
    }
    let mut changed: BTreeMap<u64, BlobMd> = BTreeMap::new();
    let mut taken: Vec<u32> = Vec::new();
    let mut failed = None;
    for (i, (vol, c)) in batch.iter().enumerate() {
        let c = *c as usize;
        let b = match changed.get(&vol.id) {
            Some(b) => b.clone(),
            None => match st.blobs.get(&vol.id) {
                Some(b) => b.clone(),
                None => {
                    results[i] = Err(IoError::Errno(libc::ENODEV));
                    continue;
                }
            },
        };
        if c >= b.clusters.len() {
            results[i] = Err(IoError::Errno(libc::EINVAL));
            continue;
        }
        if b.clusters[c] != 0 {
            continue;
        }
        if b.read_only {
            results[i] = Err(IoError::Errno(libc::EROFS));
            continue;
        }
        let hint = c
            .checked_sub(1)
            .and_then(|p| b.clusters.get(p))
            .filter(|&&x| x != 0)
            .map(|&x| u64::from(x) + 1);
        let p = match st.alloc_cluster(hint) {
            Ok(p) => p,
            Err(_) => {
                results[i] = Err(IoError::Errno(libc::ENOSPC));
                continue;
            }
        };
        taken.push(p);
        let src = st.ancestor_cluster(b.parent, c as u64);
        if let Err(e) = st.fill_cluster(p, src) {
            failed = Some(e);
            break;
        }
        let mut b = b;
        b.clusters[c] = p;
        changed.insert(vol.id, b);
    }
    let mut r = match failed {
        Some(e) => Err(e),
        None => st.flush(),
    };
    if r.is_ok() && !changed.is_empty() {
        r = st.commit(changed.values().cloned().collect(), &[]);
    }
    match r {
        Ok(()) => {
            for id in changed.keys() {
                st.publish(*id);
            }
            shared
                .allocations
                .fetch_add(taken.len() as u64, Ordering::Relaxed);
            results
        }
        Err(e) => {
            tracing::error!("cluster allocation failed: {e}");
            for p in taken {
                st.clusters.clear(u64::from(p));
            }
            let errno = e.errno();
            results
                .into_iter()
                .map(|r| r.and(Err(IoError::Errno(errno))))
                .collect()
        }
    }
}
