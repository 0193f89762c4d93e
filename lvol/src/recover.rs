//! Examination of a store on open: read the persisted masks of a cleanly shut down store (or
//! scan the whole metadata region), roll back an interrupted transaction, pick each blob's
//! newest chain, cross-check everything, rebuild or check the allocation masks and scrub
//! garbage pages (the rules are in `docs/FORMAT.md`, "Transactions and
//! recovery").

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::cluster_map::Bitmap;
use crate::error::{LvolError, Result};
use crate::md::{decode_blob, parse_page, PageHdr, PageState, NO_PAGE, PAGE_SIZE, PAGE_TOMBSTONE};
use crate::shared::MdState;
use crate::superblock::{decode_mask, MASK_TYPE_CLUSTERS, MASK_TYPE_PAGES};

const PAGE: u64 = PAGE_SIZE as u64;
/// Pages read per request when scanning the metadata region.
const SCAN_CHUNK: u64 = 256;

#[derive(Clone, Copy)]
struct Seen {
    page: u32,
    hdr: PageHdr,
}

/// How a store was opened (see [`crate::LvStore::open_report`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Format version of the store.
    pub version: u32,
    /// The super block said the store had been shut down cleanly.
    pub clean: bool,
    /// The allocation state came from the persisted masks (clean version-2 store): only the
    /// metadata pages marked used were read.
    pub masks_used: bool,
    /// Why the masks of a clean version-2 store were not used (the metadata region was
    /// scanned instead).
    pub mask_fallback: Option<String>,
    /// Metadata pages read.
    pub md_pages_read: u64,
    /// An interrupted transaction that was rolled back.
    pub rolled_back_txn: Option<u64>,
    /// Metadata pages erased (superseded, torn, rolled back, old tombstones).
    pub pages_scrubbed: u64,
}

/// What examining the metadata pages found (nothing written yet).
struct Exam {
    nonzero: Vec<u32>,
    live_pages: HashSet<u32>,
    tomb_pages: Vec<u32>,
    tomb_txn: HashMap<u32, u64>,
    committed_max: u64,
    ignored_txn: Option<u64>,
    pages_read: u64,
}

impl MdState {
    /// Forgets everything [`MdState::examine`] derived, for a second attempt.
    fn reset_tables(&mut self) {
        self.blobs.clear();
        self.pages.clear();
        self.clusters = Bitmap::new(self.sb.num_clusters);
        for c in 0..self.sb.first_data_cluster {
            self.clusters.set(c);
        }
        self.md_used = Bitmap::new(u64::from(self.sb.md_len));
        self.next_id = 0;
        self.next_txn = 1;
    }

    /// Reads the mask regions of a cleanly shut down version-2 store.
    fn load_masks(&mut self) -> std::result::Result<(Bitmap, Option<Bitmap>), String> {
        let sb = self.sb.clone();
        let mut read = |start: u32, len: u32, kind: u8, bits: u64| {
            let mut r = vec![0u8; len as usize * PAGE_SIZE];
            self.io
                .read_at(u64::from(start) * PAGE, &mut r)
                .map_err(|e| format!("reading mask region: {e}"))?;
            decode_mask(&r, kind, sb.generation, bits)
        };
        let pages = read(
            sb.pmask_start,
            sb.pmask_len,
            MASK_TYPE_PAGES,
            u64::from(sb.md_len),
        )
        .map_err(|e| format!("metadata page mask: {e}"))?;
        let clusters = if sb.cmask_len == 0 {
            None
        } else {
            Some(
                read(
                    sb.cmask_start,
                    sb.cmask_len,
                    MASK_TYPE_CLUSTERS,
                    sb.num_clusters,
                )
                .map_err(|e| format!("cluster mask: {e}"))?,
            )
        };
        Ok((pages, clusters))
    }

    /// Opens the store: from the persisted masks when the store was shut down cleanly and has
    /// them, otherwise (or when they do not check out) by scanning the whole metadata region;
    /// then clears the clean flag and scrubs (see FORMAT.md, "Opening a store").
    pub(crate) fn recover(&mut self) -> Result<OpenReport> {
        let mut report = OpenReport {
            version: self.sb.version,
            clean: self.sb.clean,
            ..Default::default()
        };
        let mut exam = None;
        if self.sb.clean && self.sb.has_masks() {
            let r = self.load_masks().and_then(|(pmask, cmask)| {
                let ex = self.examine(Some(&pmask)).map_err(|e| e.to_string())?;
                report.md_pages_read = ex.pages_read;
                self.check_masks(&ex, &pmask, cmask.as_ref())?;
                Ok(ex)
            });
            match r {
                Ok(ex) => {
                    report.masks_used = true;
                    exam = Some(ex);
                }
                Err(why) => {
                    tracing::warn!(
                        "lvstore {}: not using the persisted allocation masks ({why}); \
                         scanning the metadata region",
                        self.sb.name
                    );
                    report.mask_fallback = Some(why);
                    self.reset_tables();
                }
            }
        }
        let ex = match exam {
            Some(ex) => ex,
            None => self.examine(None)?,
        };
        report.md_pages_read += ex.pages_read;
        report.rolled_back_txn = ex.ignored_txn;
        report.pages_scrubbed = self.finish_open(ex)?;
        tracing::info!(
            "opened lvstore {} ({}): {} volumes, {} free clusters, {} metadata pages read{}, \
             {} pages scrubbed",
            self.sb.name,
            self.sb.uuid,
            self.blobs.len(),
            self.free_clusters(),
            report.md_pages_read,
            if report.masks_used {
                " (persisted masks)"
            } else {
                ""
            },
            report.pages_scrubbed,
        );
        Ok(report)
    }

    /// The persisted masks must say exactly what the chains say: every page marked used is
    /// part of a current chain or a tombstone (no garbage), and the used clusters are exactly
    /// those the volumes map. Free to check, as the chains are decoded anyway.
    fn check_masks(
        &self,
        ex: &Exam,
        pmask: &Bitmap,
        cmask: Option<&Bitmap>,
    ) -> std::result::Result<(), String> {
        if ex.ignored_txn.is_some() || ex.nonzero.len() != ex.live_pages.len() + ex.tomb_pages.len()
        {
            return Err("pages marked used hold no current metadata".into());
        }
        if &self.md_used != pmask {
            return Err(format!(
                "{} pages marked used, {} in use by the chains",
                pmask.count_set(),
                self.md_used.count_set()
            ));
        }
        if let Some(c) = cmask {
            if &self.clusters != c {
                return Err(format!(
                    "{} clusters marked used, {} in use by the volumes",
                    c.count_set(),
                    self.clusters.count_set()
                ));
            }
        }
        Ok(())
    }

    /// Reads the metadata pages (all of them, or those set in `only`) and rebuilds the
    /// in-memory state; writes nothing.
    fn examine(&mut self, only: Option<&Bitmap>) -> Result<Exam> {
        let md_len = u64::from(self.sb.md_len);
        let mut seen: Vec<Seen> = Vec::new();
        let mut nonzero: Vec<u32> = Vec::new();
        let mut bodies: HashMap<u32, Vec<u8>> = HashMap::new();
        let mut buf = vec![0u8; (SCAN_CHUNK * PAGE) as usize];
        let mut pages_read = 0;
        let mut p = 0;
        while p < md_len {
            let mut n = SCAN_CHUNK.min(md_len - p);
            if let Some(m) = only {
                // Skip to the next used page and read only the run of used pages from there.
                match m.find_set(p) {
                    Some(x) => p = x,
                    None => break,
                }
                n = 1;
                while n < SCAN_CHUNK && p + n < md_len && m.get(p + n) {
                    n += 1;
                }
            }
            let b = &mut buf[..(n * PAGE) as usize];
            let off = (u64::from(self.sb.md_start) + p) * PAGE;
            self.io.read_at(off, b)?;
            pages_read += n;
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
        Ok(Exam {
            nonzero,
            live_pages,
            tomb_pages,
            tomb_txn,
            committed_max,
            ignored_txn,
            pages_read,
        })
    }

    /// Clears the clean flag (durably, before anything else is written), then scrubs.
    /// Returns the number of pages erased.
    fn finish_open(&mut self, ex: Exam) -> Result<u64> {
        let Exam {
            nonzero,
            live_pages,
            tomb_pages,
            tomb_txn,
            committed_max,
            ..
        } = ex;
        // From here on the store is in use: clear the clean flag before touching anything, so
        // that the masks written at the last clean shutdown are never trusted again.
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
        Ok((garbage.len() + old_tombs.len()) as u64)
    }
}
