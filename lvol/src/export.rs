//! Export of a katablk lvstore as an SPDK lvstore (blobstore format version 3, the layout
//! described in [`crate::spdk`]), so that SPDK's lvol module can examine and serve it: the
//! store's name and UUID as xattrs of a super blob; each volume as a blob with its name,
//! UUID, thin/read-only flags, clear method, `SNAP` parent link and the clusters as extent
//! runs; the used-page, used-cluster and used-blob-id masks; a clean super block. Data
//! clusters are copied, packed after the metadata region.

use std::collections::BTreeMap;
use std::sync::Arc;

use katablk_bdev::sync::SyncIo;
use katablk_bdev::BlockDevice;

use crate::cluster_map::Bitmap;
use crate::error::{LvolError, Result};
use crate::md::{crc, put_u32, put_u64, BlobMd, PAGE_SIZE};
use crate::spdk::{
    clear_to_flags, BLOBID_HIGH, DESC_END, DESC_START, D_EXTENT_RLE, D_FLAGS, D_XATTR,
    D_XATTR_INTERNAL, F_INTERNAL_XATTR, F_READ_ONLY, F_THIN, LVS_BSTYPE, NO_PAGE,
};
use crate::store::LvStore;
use crate::superblock::SPDK_SIGNATURE;

/// What [`LvStore::export_spdk`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportReport {
    /// Volumes written (name, SPDK blob id).
    pub lvols: Vec<(String, u64)>,
    /// Clusters copied.
    pub clusters_copied: u64,
    /// Id of the super blob.
    pub super_blob: u64,
    /// Metadata pages of the SPDK store.
    pub md_len: u32,
}

/// Bytes of descriptors of one blob, split into pages.
struct PageWriter {
    pages: Vec<Vec<u8>>,
    cur: usize,
}

impl PageWriter {
    fn new() -> Self {
        PageWriter {
            pages: vec![vec![0u8; PAGE_SIZE]],
            cur: DESC_START,
        }
    }

    fn room(&self) -> usize {
        DESC_END - self.cur
    }

    fn new_page(&mut self) {
        self.pages.push(vec![0u8; PAGE_SIZE]);
        self.cur = DESC_START;
    }

    /// Appends one descriptor (a new page when it does not fit the current one).
    fn desc(&mut self, t: u8, body: &[u8]) {
        if self.room() < 5 + body.len() {
            self.new_page();
        }
        let p = self.pages.last_mut().expect("at least one page");
        p[self.cur] = t;
        put_u32(p, self.cur + 1, body.len() as u32);
        p[self.cur + 5..self.cur + 5 + body.len()].copy_from_slice(body);
        self.cur += 5 + body.len();
    }

    fn xattr(&mut self, t: u8, name: &str, value: &[u8]) {
        let mut b = Vec::with_capacity(4 + name.len() + value.len());
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(&(value.len() as u16).to_le_bytes());
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(value);
        self.desc(t, &b);
    }

    /// Extent runs `(first cluster or 0, length)`, as many descriptors as pages need.
    fn extents(&mut self, runs: &[(u32, u32)]) {
        let mut i = 0;
        while i < runs.len() {
            if self.room() < 5 + 8 {
                self.new_page();
            }
            let n = ((self.room() - 5) / 8).min(runs.len() - i);
            let mut b = Vec::with_capacity(n * 8);
            for &(c, len) in &runs[i..i + n] {
                b.extend_from_slice(&c.to_le_bytes());
                b.extend_from_slice(&len.to_le_bytes());
            }
            self.desc(D_EXTENT_RLE, &b);
            i += n;
        }
    }
}

fn c_string(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

/// Runs of a cluster map: consecutive device clusters, and unallocated stretches (0).
fn runs(map: &[u32]) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &c in map {
        match out.last_mut() {
            Some((s, n)) if *s == 0 && c == 0 => *n += 1,
            Some((s, n)) if *s != 0 && c != 0 && *s + *n == c => *n += 1,
            _ => out.push((c, 1)),
        }
    }
    out
}

fn mask_region(t: u8, bits: &Bitmap, pages: u32) -> Vec<u8> {
    let mut r = vec![0u8; pages as usize * PAGE_SIZE];
    r[0] = t;
    put_u32(&mut r, 1, bits.len() as u32);
    let b = bits.to_bytes();
    r[5..5 + b.len()].copy_from_slice(&b);
    r
}

fn mask_pages(bits: u64) -> u32 {
    (5 + bits.div_ceil(8)).div_ceil(PAGE_SIZE as u64) as u32
}

impl LvStore {
    /// Writes this store to `dst` as an SPDK lvstore (see the module documentation of
    /// `export.rs`) with the same name, UUID, cluster size and volumes. Volumes are frozen
    /// for the duration (their I/O waits); `dst` must hold the metadata plus every allocated
    /// cluster, and its old content is lost. The SPDK store's block size is `dst`'s.
    pub fn export_spdk(&self, dst: Arc<dyn BlockDevice>) -> Result<ExportReport> {
        let vols: Vec<_> = self.shared.md().vols.values().cloned().collect();
        let mut frozen = Vec::with_capacity(vols.len());
        for v in &vols {
            frozen.push(v.freeze()?);
        }
        let mut st = self.shared.md();
        st.check_ok()?;
        let cs = st.cs();
        let dinfo = dst.info();
        if dinfo.read_only {
            return Err(LvolError::Invalid("destination is read-only".into()));
        }
        let size = dinfo.size_bytes() / cs * cs;
        let num_clusters = size / cs;
        if num_clusters > u64::from(u32::MAX) {
            return Err(LvolError::Invalid("destination too large".into()));
        }
        // Parents before children, so SNAP values refer to blobs already numbered.
        let blobs: Vec<BlobMd> = {
            let mut order: Vec<BlobMd> = Vec::new();
            let mut left: Vec<&BlobMd> = st.blobs.values().collect();
            while !left.is_empty() {
                let before = left.len();
                left.retain(|b| {
                    if b.parent.is_none_or(|p| order.iter().any(|o| o.id == p)) {
                        order.push((*b).clone());
                        false
                    } else {
                        true
                    }
                });
                if left.len() == before {
                    return Err(LvolError::CorruptMetadata("parent links loop".into()));
                }
            }
            order
        };
        // SPDK's default metadata reservation: one page per cluster, at least what we need.
        let md_len = (num_clusters as u32).max(blobs.len() as u32 * 4 + 16);
        let pmask = mask_pages(u64::from(md_len));
        let cmask = mask_pages(num_clusters);
        let bmask = mask_pages(u64::from(md_len));
        let pmask_start = 1u32;
        let cmask_start = pmask_start + pmask;
        let bmask_start = cmask_start + cmask;
        let md_start = bmask_start + bmask;
        let md_end = (u64::from(md_start) + u64::from(md_len)) * PAGE_SIZE as u64;
        let first_data = md_end.div_ceil(cs);
        let allocated: u64 = blobs
            .iter()
            .map(|b| b.clusters.iter().filter(|&&c| c != 0).count() as u64)
            .sum();
        if first_data + allocated > num_clusters {
            return Err(LvolError::NoSpace {
                needed: first_data + allocated,
                free: num_clusters,
            });
        }
        // Blob ids: the super blob at page 0, then one first page per volume.
        let super_blob = BLOBID_HIGH;
        let mut ids: BTreeMap<u64, u64> = BTreeMap::new();
        for (i, b) in blobs.iter().enumerate() {
            ids.insert(b.id, BLOBID_HIGH | (i as u64 + 1));
        }
        let mut dio = SyncIo::new(&*dst)?;
        // Data first, clusters handed out in order after the metadata.
        let mut next = first_data as u32;
        let mut used = Bitmap::new(num_clusters);
        for c in 0..first_data {
            used.set(c);
        }
        let mut buf = vec![0u8; cs as usize];
        let mut maps: Vec<Vec<u32>> = Vec::with_capacity(blobs.len());
        for b in &blobs {
            let mut m = vec![0u32; b.clusters.len()];
            for (i, &p) in b.clusters.iter().enumerate() {
                if p == 0 {
                    continue;
                }
                st.io.read_at(u64::from(p) * cs, &mut buf)?;
                dio.write_at(u64::from(next) * cs, &buf)?;
                used.set(u64::from(next));
                m[i] = next;
                next += 1;
            }
            maps.push(m);
        }
        // Metadata chains: first pages 0..=n, continuation pages after them.
        let mut chains: Vec<(u64, Vec<Vec<u8>>)> = Vec::new();
        let mut sw = PageWriter::new();
        sw.desc(D_FLAGS, &[0u8; 24]);
        sw.xattr(D_XATTR, "uuid", &c_string(&st.sb.uuid.to_string()));
        sw.xattr(D_XATTR, "name", &c_string(&st.sb.name));
        chains.push((super_blob, sw.pages));
        let mut report = ExportReport {
            super_blob,
            md_len,
            clusters_copied: allocated,
            ..Default::default()
        };
        for (b, m) in blobs.iter().zip(&maps) {
            let id = ids[&b.id];
            let mut w = PageWriter::new();
            let mut flags = [0u8; 24];
            let parent = b.parent.and_then(|p| ids.get(&p).copied());
            let mut invalid = if b.thin { F_THIN } else { 0 };
            if parent.is_some() {
                invalid |= F_INTERNAL_XATTR;
            }
            put_u64(&mut flags, 0, invalid);
            put_u64(&mut flags, 8, if b.read_only { F_READ_ONLY } else { 0 });
            put_u64(&mut flags, 16, clear_to_flags(b.clear));
            w.desc(D_FLAGS, &flags);
            w.xattr(D_XATTR, "name", &c_string(&b.name));
            w.xattr(D_XATTR, "uuid", &c_string(&b.uuid.to_string()));
            if let Some(p) = parent {
                w.xattr(D_XATTR_INTERNAL, "SNAP", &p.to_le_bytes());
            }
            if !m.is_empty() {
                w.extents(&runs(m));
            }
            chains.push((id, w.pages));
            report.lvols.push((b.name.clone(), id));
        }
        let mut md_used = Bitmap::new(u64::from(md_len));
        let mut blobids = Bitmap::new(u64::from(md_len));
        let mut extra = chains.len() as u32;
        let mut md = vec![0u8; md_len as usize * PAGE_SIZE];
        for (first, (id, pages)) in chains.iter().enumerate() {
            let first = first as u32;
            let idx: Vec<u32> = std::iter::once(first)
                .chain((1..pages.len()).map(|k| extra + k as u32 - 1))
                .collect();
            extra += pages.len() as u32 - 1;
            if idx.iter().any(|&p| p >= md_len) {
                return Err(LvolError::MdFull(md_len));
            }
            blobids.set(u64::from(first));
            for (k, page) in pages.iter().enumerate() {
                let mut p = page.clone();
                put_u64(&mut p, 0, *id);
                put_u32(&mut p, 8, k as u32);
                put_u32(&mut p, DESC_END, idx.get(k + 1).copied().unwrap_or(NO_PAGE));
                let c = crc(&p[..PAGE_SIZE - 4]);
                put_u32(&mut p, PAGE_SIZE - 4, c);
                let at = idx[k] as usize * PAGE_SIZE;
                md[at..at + PAGE_SIZE].copy_from_slice(&p);
                md_used.set(u64::from(idx[k]));
            }
        }
        for (i, chunk) in md.chunks(1 << 20).enumerate() {
            dio.write_at(
                u64::from(md_start) * PAGE_SIZE as u64 + (i as u64) * (1 << 20),
                chunk,
            )?;
        }
        for (start, region) in [
            (pmask_start, mask_region(0, &md_used, pmask)),
            (cmask_start, mask_region(1, &used, cmask)),
            (bmask_start, mask_region(2, &blobids, bmask)),
        ] {
            dio.write_at(u64::from(start) * PAGE_SIZE as u64, &region)?;
        }
        dio.flush()?;
        let mut sb = vec![0u8; PAGE_SIZE];
        sb[0..8].copy_from_slice(SPDK_SIGNATURE);
        put_u32(&mut sb, 8, 3);
        put_u32(&mut sb, 12, PAGE_SIZE as u32);
        put_u32(&mut sb, 16, 1);
        put_u64(&mut sb, 20, super_blob);
        put_u32(&mut sb, 28, cs as u32);
        put_u32(&mut sb, 32, pmask_start);
        put_u32(&mut sb, 36, pmask);
        put_u32(&mut sb, 40, cmask_start);
        put_u32(&mut sb, 44, cmask);
        put_u32(&mut sb, 48, md_start);
        put_u32(&mut sb, 52, md_len);
        sb[56..56 + LVS_BSTYPE.len()].copy_from_slice(LVS_BSTYPE);
        put_u32(&mut sb, 72, bmask_start);
        put_u32(&mut sb, 76, bmask);
        put_u64(&mut sb, 80, size);
        put_u32(&mut sb, 88, dinfo.block_size);
        put_u32(&mut sb, 92, PAGE_SIZE as u32);
        let c = crc(&sb[..PAGE_SIZE - 4]);
        put_u32(&mut sb, PAGE_SIZE - 4, c);
        dio.write_at(0, &sb)?;
        dio.flush()?;
        drop(st);
        drop(frozen);
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_group_consecutive_clusters_and_holes() {
        assert_eq!(
            runs(&[5, 6, 7, 0, 0, 9, 3, 4, 0]),
            vec![(5, 3), (0, 2), (9, 1), (3, 2), (0, 1)]
        );
        assert_eq!(runs(&[]), vec![]);
    }

    #[test]
    fn many_runs_span_pages() {
        let mut w = PageWriter::new();
        let r: Vec<(u32, u32)> = (0..2000).map(|i| (i * 2 + 10, 1)).collect();
        w.extents(&r);
        assert!(w.pages.len() >= 4);
    }
}
