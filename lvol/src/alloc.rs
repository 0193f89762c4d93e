//! The cluster allocation worker: first writes to unallocated clusters of thin volumes and
//! clones are parked by their channel and queued here; the worker fills the clusters, commits
//! the metadata and wakes the channels, so no I/O thread ever waits for metadata. Whole-cluster
//! discards of thin volumes are parked and queued the same way, and the worker gives those
//! clusters back to the store: it unmaps them in a metadata transaction, wakes the discards,
//! and frees the clusters once the requests issued to them before the unmap have finished,
//! without ever waiting for that itself.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use katablk_bdev::IoError;

use crate::lvol::Lvol;
use crate::md::{BlobMd, ClearMethod};
use crate::shared::Shared;

/// Most cluster allocations (or releases) committed in one metadata transaction by the worker.
const ALLOC_BATCH: usize = 32;
/// Longest wait for I/O issued to a released cluster before it was unmapped. After that the
/// cluster stays allocated in memory (and is found free by the next open).
const RELEASE_DRAIN: Duration = Duration::from_secs(30);
/// Longest wait for such I/O when the store closes.
const CLOSE_DRAIN: Duration = Duration::from_secs(5);
/// How often the worker looks at draining clusters while it has nothing else to do.
const DRAIN_POLL: Duration = Duration::from_micros(200);

/// Clusters of one volume unmapped by a committed release, waiting for the requests issued
/// to them before the unmap (counted in `bucket`) before they are cleared and freed.
struct Drain {
    vol: Arc<Lvol>,
    bucket: u8,
    clusters: Vec<u32>,
    clear: ClearMethod,
    deadline: Instant,
    /// The discards that released these clusters: they complete when the clusters are free.
    waiting: Vec<(Arc<Lvol>, u64)>,
}

/// The releases in progress, at most one per volume.
#[derive(Default)]
struct Draining(Vec<Drain>);

impl Draining {
    fn has(&self, vol: u64) -> bool {
        self.0.iter().any(|d| d.vol.id == vol)
    }

    /// Frees the clusters whose requests have finished (or gives up on them after the
    /// deadline: they stay in use until the next open). True if any drain ended.
    fn poll(&mut self, shared: &Shared, now: Instant) -> bool {
        let (done, rest): (Vec<Drain>, Vec<Drain>) = std::mem::take(&mut self.0)
            .into_iter()
            .partition(|d| d.vol.bucket_idle(d.bucket) || now >= d.deadline);
        self.0 = rest;
        if done.is_empty() {
            return false;
        }
        let mut st = shared.md();
        let mut waiting = Vec::new();
        for d in done {
            waiting.extend(d.waiting.iter().cloned());
            shared
                .releasing
                .fetch_sub(d.clusters.len() as u64, Ordering::SeqCst);
            if d.vol.bucket_idle(d.bucket) {
                st.release_clusters(&d.clusters, d.clear);
            } else {
                tracing::error!(
                    "released clusters {:?} of {}: I/O issued to them did not finish in time; \
                     they stay in use until the store is reopened",
                    d.clusters,
                    d.vol.name()
                );
            }
        }
        drop(st);
        let n = waiting.len();
        wake(shared, &waiting, vec![Ok(()); n]);
        true
    }

    /// On close: waits (at most `limit`) for the remaining drains and frees what drained.
    fn finish(&mut self, shared: &Shared, limit: Duration) {
        let end = Instant::now() + limit;
        for d in &mut self.0 {
            d.deadline = d.deadline.min(end);
        }
        while !self.0.is_empty() {
            self.poll(shared, Instant::now());
            if !self.0.is_empty() {
                std::thread::sleep(DRAIN_POLL);
            }
        }
    }
}

/// Allocates clusters for first writes, in batches: fill every new cluster (copy from the
/// parent or zero), flush, commit one metadata transaction, publish, wake the waiters.
/// Releases are committed at once; the released clusters are freed, and their discards
/// completed, when the requests issued to them before have drained (checked between batches,
/// so a slow request delays only the discard that waits for it).
pub(crate) fn alloc_worker(shared: Arc<Shared>) {
    let mut draining = Draining::default();
    // Allocations that found no free cluster while released clusters were still draining:
    // they wait (at the head of the queue) until a drain ends, instead of failing.
    let mut starved = false;
    loop {
        if draining.poll(&shared, Instant::now()) {
            starved = false;
        }
        let (batch, releases) = {
            let mut q = shared.aq();
            loop {
                let allocs = !starved && !q.queue.is_empty();
                let releases = q.releases.iter().any(|(v, _)| !draining.has(v.id));
                if q.closed || allocs || releases {
                    break;
                }
                if draining.0.is_empty() {
                    q = shared.alloc_cv.wait(q).unwrap_or_else(|e| e.into_inner());
                } else {
                    q = shared
                        .alloc_cv
                        .wait_timeout(q, DRAIN_POLL)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                    break;
                }
            }
            if q.closed {
                drop(q);
                draining.finish(&shared, CLOSE_DRAIN);
                return;
            }
            // Bounded batches: one metadata commit amortised over many first writes, without
            // making the first waiter wait for an unbounded number of cluster fills.
            let batch: Vec<(Arc<Lvol>, u64)> = if starved {
                Vec::new()
            } else {
                let n = q.queue.len().min(ALLOC_BATCH);
                q.queue.drain(..n).collect()
            };
            // A volume with a release still draining gets its next one after that drain.
            let mut releases = Vec::new();
            let mut i = 0;
            while i < q.releases.len() && releases.len() < ALLOC_BATCH {
                if draining.has(q.releases[i].0.id) {
                    i += 1;
                } else {
                    releases.push(q.releases.remove(i));
                }
            }
            (batch, releases)
        };
        if !batch.is_empty() {
            let (results, retry) = alloc_batch(&shared, &batch, !draining.0.is_empty());
            let mut done = Vec::with_capacity(batch.len());
            let mut done_results = Vec::with_capacity(batch.len());
            let mut again = Vec::new();
            for ((work, r), retry) in batch.into_iter().zip(results).zip(retry) {
                if retry {
                    again.push(work);
                } else {
                    done.push(work);
                    done_results.push(r);
                }
            }
            if !again.is_empty() {
                starved = true;
                let mut q = shared.aq();
                let rest = std::mem::take(&mut q.queue);
                q.queue = again;
                q.queue.extend(rest);
            }
            wake(&shared, &done, done_results);
        }
        if !releases.is_empty() {
            let results = release_batch(&shared, &releases, &mut draining);
            let (now, rs): (Vec<_>, Vec<_>) = releases
                .into_iter()
                .zip(results)
                .filter_map(|(w, r)| r.map(|r| (w, r)))
                .unzip();
            wake(&shared, &now, rs);
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
/// metadata transaction (after which a crash finds them free) and publish the new maps; the
/// clusters are cleared and marked free at once if no earlier I/O to the volume is running,
/// else by [`Draining::poll`] once it has finished. Returns each entry's result, `None` for
/// the entries whose discard completes with that drain. Clusters that cannot be released (no longer allocated, read-only, an
/// ancestor has data there, or the commit failed) are left alone; their waiters then pass the
/// discard to the device as before. The caller guarantees that no volume of `batch` has a
/// drain in progress.
fn release_batch(
    shared: &Arc<Shared>,
    batch: &[(Arc<Lvol>, u64)],
    draining: &mut Draining,
) -> Vec<Option<Result<(), IoError>>> {
    let ok = vec![Some(Ok(())); batch.len()];
    let mut st = shared.md();
    if st.check_ok().is_err() {
        return ok;
    }
    let mut changed: BTreeMap<u64, BlobMd> = BTreeMap::new();
    let mut freed: BTreeMap<u64, (Arc<Lvol>, Vec<u32>)> = BTreeMap::new();
    let mut released = vec![false; batch.len()];
    for (i, (vol, c)) in batch.iter().enumerate() {
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
        freed
            .entry(vol.id)
            .or_insert_with(|| (vol.clone(), Vec::new()))
            .1
            .push(p);
        released[i] = true;
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
    for id in changed.keys() {
        st.publish(*id);
    }
    drop(st);
    // The maps no longer lead to the clusters; requests issued before are counted in the
    // epoch that ends now. Usually none is running: free the clusters right away.
    let deadline = Instant::now() + RELEASE_DRAIN;
    let mut now_free = Vec::new();
    let mut results = ok;
    for (id, (vol, clusters)) in freed {
        let clear = clear.get(&id).copied().unwrap_or_default();
        let bucket = vol.begin_drain();
        if vol.bucket_idle(bucket) {
            now_free.push((clusters, clear));
            continue;
        }
        shared
            .releasing
            .fetch_add(clusters.len() as u64, Ordering::SeqCst);
        let mut waiting = Vec::new();
        for (i, (v, c)) in batch.iter().enumerate() {
            if released[i] && v.id == id {
                waiting.push((v.clone(), *c));
                results[i] = None;
            }
        }
        draining.0.push(Drain {
            clear,
            vol,
            bucket,
            clusters,
            deadline,
            waiting,
        });
    }
    if !now_free.is_empty() {
        let mut st = shared.md();
        for (clusters, clear) in now_free {
            st.release_clusters(&clusters, clear);
        }
    }
    results
}

/// Allocates the clusters of `batch`. Returns each entry's result and whether it must be
/// retried later (no free cluster now, but `draining`: released clusters will be free soon).
fn alloc_batch(
    shared: &Arc<Shared>,
    batch: &[(Arc<Lvol>, u64)],
    draining: bool,
) -> (Vec<Result<(), IoError>>, Vec<bool>) {
    let mut st = shared.md();
    let mut results: Vec<Result<(), IoError>> = vec![Ok(()); batch.len()];
    let mut retry = vec![false; batch.len()];
    if st.check_ok().is_err() {
        return (vec![Err(IoError::Errno(libc::EIO)); batch.len()], retry);
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
                retry[i] = draining;
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
            (results, retry)
        }
        Err(e) => {
            tracing::error!("cluster allocation failed: {e}");
            for p in taken {
                st.clusters.clear(u64::from(p));
            }
            let errno = e.errno();
            let results = results
                .into_iter()
                .map(|r| r.and(Err(IoError::Errno(errno))))
                .collect();
            (results, vec![false; batch.len()])
        }
    }
}
