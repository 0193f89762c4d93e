//! The cluster allocation worker: first writes to unallocated clusters of thin volumes and
//! clones are parked by their channel and queued here; the worker fills the clusters, commits
//! the metadata and wakes the channels, so no I/O thread ever waits for metadata.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use katablk_bdev::IoError;

use crate::lvol::Lvol;
use crate::md::BlobMd;
use crate::store::Shared;

/// Most cluster allocations committed in one metadata transaction by the worker.
const ALLOC_BATCH: usize = 32;

/// Allocates clusters for first writes, in batches: fill every new cluster (copy from the
/// parent or zero), flush, commit one metadata transaction, publish, wake the waiters.
pub(crate) fn alloc_worker(shared: Arc<Shared>) {
    loop {
        let batch: Vec<(Arc<Lvol>, u64)> = {
            let mut q = shared.aq();
            while q.queue.is_empty() && !q.closed {
                q = shared.alloc_cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            if q.closed {
                return;
            }
            // Bounded batches: one metadata commit amortised over many first writes, without
            // making the first waiter wait for an unbounded number of cluster fills.
            let n = q.queue.len().min(ALLOC_BATCH);
            q.queue.drain(..n).collect()
        };
        let results = alloc_batch(&shared, &batch);
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
