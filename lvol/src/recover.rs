//! Examination of a store on open: scan the metadata region, roll back an interrupted
//! transaction, pick each blob's newest chain, cross-check everything, rebuild the allocation
//! masks and scrub garbage pages (the rules are in `docs/FORMAT.md`, "Transactions and
//! recovery").

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::error::{LvolError, Result};
use crate::md::{decode_blob, parse_page, PageHdr, PageState, NO_PAGE, PAGE_SIZE, PAGE_TOMBSTONE};
use crate::store::MdState;

const PAGE: u64 = PAGE_SIZE as u64;
/// Pages read per request when scanning the metadata region.
const SCAN_CHUNK: u64 = 256;

#[derive(Clone, Copy)]
struct Seen {
    page: u32,
    hdr: PageHdr,
}

impl MdState {
    /// Scans the metadata region and rebuilds the in-memory state (see FORMAT.md, "Recovery").
    pub(crate) fn recover(&mut self) -> Result<()> {
        let md_len = u64::from(self.sb.md_len);
        let mut seen: Vec<Seen> = Vec::new();
        let mut nonzero: Vec<u32> = Vec::new();
        let mut bodies: HashMap<u32, Vec<u8>> = HashMap::new();
        let mut buf = vec![0u8; (SCAN_CHUNK * PAGE) as usize];
        let mut p = 0;
        while p < md_len {
            let n = SCAN_CHUNK.min(md_len - p);
            let b = &mut buf[..(n * PAGE) as usize];
            let off = (u64::from(self.sb.md_start) + p) * PAGE;
            self.io.read_at(off, b)?;
            for i in 0..n {
                let pg = &b[(i * PAGE) as usize..((i + 1) * PAGE) as usize];
                let idx = (p + i) as u32;
                match parse_page(pg) {
                    PageState::Zero => {}
                    PageState::Bad => nonzero.push(idx),
                    PageState::Valid(h) => {
                        nonzero.push(idx);
                        seen.push(Seen { page: idx, hdr: h });
                        bodies.insert(idx, pg[crate::md::HDR_LEN..crate::md::NEXT_OFF].to_vec());
                    }
                }
            }
            p += n;
        }
        // Group pages by (blob, txn).
        let mut groups: BTreeMap<(u64, u64), Vec<Seen>> = BTreeMap::new();
        for s in &seen {
            groups
                .entry((s.hdr.blob_id, s.hdr.txn))
                .or_default()
                .push(*s);
        }
        let complete = |g: &[Seen]| -> Option<Vec<Seen>> {
            let n = g[0].hdr.chain_len as usize;
            if g.len() != n
                || g.iter().any(|s| {
                    s.hdr.chain_len != g[0].hdr.chain_len
                        || s.hdr.flags != g[0].hdr.flags
                        || s.hdr.members != g[0].hdr.members
                        || s.hdr.live != g[0].hdr.live
                })
            {
                return None;
            }
            let mut ordered: Vec<Option<Seen>> = vec![None; n];
            for s in g {
                let slot = ordered.get_mut(s.hdr.seq_num as usize)?;
                if slot.is_some() {
                    return None;
                }
                *slot = Some(*s);
            }
            let ordered: Vec<Seen> = ordered.into_iter().collect::<Option<Vec<_>>>()?;
            for (i, s) in ordered.iter().enumerate() {
                let want = ordered.get(i + 1).map(|x| x.page).unwrap_or(NO_PAGE);
                if s.hdr.next != want {
                    return None;
                }
            }
            Some(ordered)
        };
        let max_txn = seen.iter().map(|s| s.hdr.txn).max().unwrap_or(0);
        self.next_txn = max_txn + 1;
        // Was the newest transaction completely written?
        let mut ignored_txn = None;
        if max_txn > 0 {
            let top: Vec<&Vec<Seen>> = groups
                .iter()
                .filter(|((_, t), _)| *t == max_txn)
                .map(|(_, g)| g)
                .collect();
            let members = top[0][0].hdr.members as usize;
            let consistent = top
                .iter()
                .all(|g| g.iter().all(|s| s.hdr.members as usize == members));
            let ok = top.iter().filter(|g| complete(g).is_some()).count();
            if !consistent || ok != members {
                tracing::warn!(
                    "lvstore {}: transaction {max_txn} was interrupted; rolling it back",
                    self.sb.name
                );
                ignored_txn = Some(max_txn);
            }
        }
        // The newest surviving chain of each blob must be complete.
        let mut newest: BTreeMap<u64, u64> = BTreeMap::new();
        for s in &seen {
            if Some(s.hdr.txn) == ignored_txn {
                continue;
            }
            let e = newest.entry(s.hdr.blob_id).or_insert(0);
            *e = (*e).max(s.hdr.txn);
        }
        let committed_max = newest.values().copied().max().unwrap_or(0);
        let mut live_pages: HashSet<u32> = HashSet::new();
        let mut tomb_pages: Vec<u32> = Vec::new();
        let mut tomb_txn: HashMap<u32, u64> = HashMap::new();
        let mut expected_live = None;
        for (&id, &txn) in &newest {
            let g = &groups[&(id, txn)];
            let chain = complete(g).ok_or_else(|| {
                LvolError::CorruptMetadata(format!(
                    "blob {id:#x}: newest metadata (transaction {txn}) is damaged or incomplete \
                     ({} of {} pages readable)",
                    g.len(),
                    g[0].hdr.chain_len
                ))
            })?;
            if txn == committed_max {
                expected_live = Some(chain[0].hdr.live);
            }
            if chain[0].hdr.flags & PAGE_TOMBSTONE != 0 {
                tomb_pages.extend(chain.iter().map(|s| s.page));
                tomb_txn.extend(chain.iter().map(|s| (s.page, txn)));
                continue;
            }
            let refs: Vec<&[u8]> = chain
                .iter()
                .map(|s| bodies.get(&s.page).map(|v| v.as_slice()).unwrap_or(&[]))
                .collect();
            let blob = decode_blob(id, &refs, self.sb.num_clusters)?;
            for s in &chain {
                live_pages.insert(s.page);
            }
            self.pages
                .insert(id, chain.iter().map(|s| s.page).collect());
            self.next_id = self.next_id.max((id & 0xffff_ffff) + 1);
            self.blobs.insert(id, blob);
        }
        if let Some(n) = expected_live {
            if n as usize != self.blobs.len() {
                return Err(LvolError::CorruptMetadata(format!(
                    "the last transaction recorded {n} volumes but {} were found: metadata \
                     pages are missing or damaged",
                    self.blobs.len()
                )));
            }
        }
        // Cross-checks: clusters in range and never shared; parents exist; names unique.
        let mut names = HashSet::new();
        for b in self.blobs.values() {
            if !names.insert(b.name.clone()) {
                return Err(LvolError::CorruptMetadata(format!(
                    "two volumes are named {:?}",
                    b.name
                )));
            }
            if let Some(p) = b.parent {
                if !self.blobs.contains_key(&p) || p == b.id {
                    return Err(LvolError::CorruptMetadata(format!(
                        "volume {:?} refers to missing parent {p:#x}",
                        b.name
                    )));
                }
            }
            for &c in &b.clusters {
                if c == 0 {
                    continue;
                }
                if u64::from(c) < self.sb.first_data_cluster {
                    return Err(LvolError::CorruptMetadata(format!(
                        "volume {:?} maps metadata cluster {c}",
                        b.name
                    )));
                }
                if !self.clusters.set(u64::from(c)) {
                    return Err(LvolError::CorruptMetadata(format!(
                        "cluster {c} is claimed twice (volume {:?})",
                        b.name
                    )));
                }
            }
        }
        for b in self.blobs.values() {
            let mut p = b.parent;
            let mut hops = 0;
            while let Some(x) = p {
                hops += 1;
                if hops > self.blobs.len() {
                    return Err(LvolError::CorruptMetadata(format!(
                        "parent cycle through {:?}",
                        b.name
                    )));
                }
                p = self.blobs.get(&x).and_then(|y| y.parent);
            }
        }
        if self.sb.clean && (ignored_txn.is_some() || max_txn != self.sb.last_txn) {
            return Err(LvolError::CorruptMetadata(format!(
                "the store was shut down cleanly after transaction {} but the newest intact \
                 transaction is {}: metadata pages are damaged",
                self.sb.last_txn,
                if ignored_txn.is_some() {
                    committed_max
                } else {
                    max_txn
                }
            )));
        }
        for &p in live_pages.iter().chain(tomb_pages.iter()) {
            self.md_used.set(u64::from(p));
        }
        // From here on the store is in use: clear the clean flag before touching anything.
        let mut sb = self.sb.clone();
        sb.clean = false;
        self.write_sb(sb)?;
        // Scrub: erase superseded, torn and rolled-back pages first, tombstones after.
        let garbage: Vec<u32> = nonzero
            .iter()
            .copied()
            .filter(|p| !live_pages.contains(p) && !tomb_pages.contains(p))
            .collect();
        let zero = vec![0u8; PAGE_SIZE];
        if !garbage.is_empty() {
            for &p in &garbage {
                self.io.write_at(self.page_off(p), &zero)?;
            }
            self.flush()?;
        }
        // Tombstones of the newest transaction stay until the next commit, so that the
        // newest transaction is always entirely on disk (the clean-shutdown check needs it).
        let (keep, old_tombs): (Vec<u32>, Vec<u32>) = tomb_pages
            .iter()
            .partition(|p| tomb_txn.get(p) == Some(&committed_max));
        if !old_tombs.is_empty() {
            for &p in &old_tombs {
                self.io.write_at(self.page_off(p), &zero)?;
                self.md_used.clear(u64::from(p));
            }
            self.flush()?;
        }
        self.deferred_zero = keep;
        self.last_committed = committed_max;
        tracing::info!(
            "opened lvstore {} ({}): {} volumes, {} free clusters, {} pages scrubbed",
            self.sb.name,
            self.sb.uuid,
            self.blobs.len(),
            self.free_clusters(),
            garbage.len() + old_tombs.len()
        );
        Ok(())
    }
}
