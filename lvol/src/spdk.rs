//! Reading lvstores written by SPDK (its blobstore with the lvol module on top), so that
//! volumes made by a real SPDK can be examined and imported into a katablk store
//! ([`crate::LvStore::import_spdk`]).
//!
//! The layout (SPDK's `lib/blob/blobstore.h`, version 3): a 4 KiB super block at page 0,
//! metadata pages of 4 KiB from `md_start`, each `{u64 blob id, u32 sequence number, u32
//! reserved, 4072 bytes of descriptors, u32 next page, u32 CRC32C}`. A blob's chain starts at
//! the metadata page whose index is the low word of its id (the high word is 1) and follows
//! `next`. Descriptors are `{u8 type, u32 length, data}`: extent runs (1), xattrs (2), flags
//! (3), internal xattrs (4), an extent table (5) naming extent pages (6) that hold the
//! cluster indexes in groups of 512. Cluster indexes count from the start of the device. The
//! lvol module keeps the lvstore's `name` and `uuid` as xattrs of the blobstore's super
//! blob, and each volume's `name` and `uuid` as xattrs of its blob; a clone or the origin of
//! a snapshot names its parent in the internal xattr `SNAP`.
//!
//! Everything is read the way SPDK's recovery path reads a store that was not shut down
//! cleanly: every metadata page is examined and the masks are not trusted, so a store that
//! SPDK left dirty reads the same as a clean one.

use std::collections::BTreeMap;
use std::sync::Arc;

use katablk_bdev::sync::SyncIo;
use katablk_bdev::BlockDevice;
use uuid::Uuid;

use crate::error::{LvolError, Result};
use crate::md::{crc, get_u16, get_u32, get_u64, ClearMethod, PAGE_SIZE};
use crate::superblock::SPDK_SIGNATURE;

/// SPDK blobstore format versions this reader understands.
const VERSIONS: [u32; 2] = [2, 3];
/// Type string of a blobstore made by the lvol module (`bstype`).
pub(crate) const LVS_BSTYPE: &[u8] = b"LVOLSTORE";
/// High word of every blob id.
pub(crate) const BLOBID_HIGH: u64 = 1 << 32;
/// `next` of the last page of a chain.
pub(crate) const NO_PAGE: u32 = u32::MAX;
/// Descriptor area of a metadata page: bytes 16 .. 4088.
pub(crate) const DESC_START: usize = 16;
pub(crate) const DESC_END: usize = PAGE_SIZE - 8;
/// Descriptor types.
const D_PADDING: u8 = 0;
pub(crate) const D_EXTENT_RLE: u8 = 1;
pub(crate) const D_XATTR: u8 = 2;
pub(crate) const D_FLAGS: u8 = 3;
pub(crate) const D_XATTR_INTERNAL: u8 = 4;
const D_EXTENT_TABLE: u8 = 5;
const D_EXTENT_PAGE: u8 = 6;
/// Invalid-flags bits (a blob with unknown ones must not be opened).
pub(crate) const F_THIN: u64 = 1;
pub(crate) const F_INTERNAL_XATTR: u64 = 1 << 1;
const F_EXTENT_TABLE: u64 = 1 << 2;
const F_EXTERNAL_SNAPSHOT: u64 = 1 << 3;
/// Data-read-only bit.
pub(crate) const F_READ_ONLY: u64 = 1;
/// Clusters per extent page.
const EXTENTS_PER_PAGE: u64 = 512;
/// Longest chain followed (a loop in `next` pointers is corruption).
const MAX_CHAIN: usize = 1 << 20;

/// The super block fields katablk uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpdkSuperBlock {
    /// Format version (3 for current SPDK).
    pub version: u32,
    /// Clean shutdown flag.
    pub clean: bool,
    /// Id of the super blob (the lvstore's xattrs).
    pub super_blob: u64,
    /// Cluster size in bytes.
    pub cluster_size: u32,
    /// First metadata page.
    pub md_start: u32,
    /// Metadata pages.
    pub md_len: u32,
    /// Blobstore type (`LVOLSTORE` for the lvol module).
    pub bstype: String,
    /// Size of the store in bytes.
    pub size: u64,
    /// I/O unit (block size) in bytes.
    pub io_unit_size: u32,
}

/// One volume of an SPDK lvstore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpdkLvol {
    /// Blob id.
    pub blob_id: u64,
    /// Volume name (xattr `name`).
    pub name: String,
    /// Volume UUID (xattr `uuid`).
    pub uuid: Uuid,
    /// Thin provisioned.
    pub thin: bool,
    /// Data read-only (snapshots, and volumes set read-only).
    pub read_only: bool,
    /// Blob id of the parent (internal xattr `SNAP`).
    pub parent: Option<u64>,
    /// Device cluster of each volume cluster; 0 = not allocated.
    pub clusters: Vec<u32>,
    /// Clear method (SPDK's md-read-only flag bits 0–1).
    pub clear: ClearMethod,
}

impl SpdkLvol {
    /// Size in bytes.
    pub fn size_bytes(&self, cluster_size: u32) -> u64 {
        self.clusters.len() as u64 * u64::from(cluster_size)
    }

    /// Allocated clusters.
    pub fn allocated(&self) -> u64 {
        self.clusters.iter().filter(|&&c| c != 0).count() as u64
    }
}

/// An SPDK lvstore read from a device.
pub struct SpdkLvstore {
    dev: Arc<dyn BlockDevice>,
    /// The super block.
    pub sb: SpdkSuperBlock,
    /// Lvstore name.
    pub name: String,
    /// Lvstore UUID.
    pub uuid: Uuid,
    /// The volumes, by blob id.
    pub lvols: BTreeMap<u64, SpdkLvol>,
    /// Blobs that were skipped, with the reason (not volumes, or left over by an
    /// interrupted operation that SPDK itself would clean up).
    pub skipped: Vec<(u64, String)>,
}

impl std::fmt::Debug for SpdkLvstore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpdkLvstore")
            .field("name", &self.name)
            .field("uuid", &self.uuid)
            .field("lvols", &self.lvols.len())
            .finish()
    }
}

fn corrupt(s: impl Into<String>) -> LvolError {
    LvolError::CorruptMetadata(format!("SPDK lvstore: {}", s.into()))
}

/// Whether the device starts with an SPDK blobstore super block.
pub fn is_spdk_blobstore(dev: &dyn BlockDevice) -> bool {
    let mut p = vec![0u8; PAGE_SIZE];
    let Ok(mut io) = SyncIo::new(dev) else {
        return false;
    };
    io.read_at(0, &mut p).is_ok() && &p[0..8] == SPDK_SIGNATURE
}

/// Parses an SPDK super block page.
pub fn parse_super(p: &[u8]) -> Result<SpdkSuperBlock> {
    if p.len() < PAGE_SIZE || &p[0..8] != SPDK_SIGNATURE {
        return Err(LvolError::NotSpdkLvstore(
            "no SPDK blobstore signature at page 0".into(),
        ));
    }
    if crc(&p[..PAGE_SIZE - 4]) != get_u32(p, PAGE_SIZE - 4) {
        return Err(LvolError::CorruptSuperblock(
            "SPDK super block checksum mismatch".into(),
        ));
    }
    let version = get_u32(p, 8);
    if !VERSIONS.contains(&version) {
        return Err(LvolError::UnsupportedVersion(version));
    }
    if get_u32(p, 12) as usize != PAGE_SIZE {
        return Err(LvolError::CorruptSuperblock(format!(
            "SPDK super block length {}",
            get_u32(p, 12)
        )));
    }
    let md_page_size = get_u32(p, 92);
    if md_page_size != 0 && md_page_size as usize != PAGE_SIZE {
        return Err(LvolError::Invalid(format!(
            "SPDK metadata page size {md_page_size} (only 4096 is supported)"
        )));
    }
    let sb = SpdkSuperBlock {
        version,
        clean: get_u32(p, 16) == 1,
        super_blob: get_u64(p, 20),
        cluster_size: get_u32(p, 28),
        md_start: get_u32(p, 48),
        md_len: get_u32(p, 52),
        bstype: p[56..72]
            .iter()
            .take_while(|&&b| b != 0)
            .map(|&b| b as char)
            .collect(),
        size: get_u64(p, 80),
        io_unit_size: match get_u32(p, 88) {
            0 => 512,
            n => n,
        },
    };
    if sb.cluster_size < PAGE_SIZE as u32 || !sb.cluster_size.is_power_of_two() {
        return Err(LvolError::CorruptSuperblock(format!(
            "SPDK cluster size {}",
            sb.cluster_size
        )));
    }
    if !sb.io_unit_size.is_power_of_two() || sb.io_unit_size > sb.cluster_size {
        return Err(LvolError::CorruptSuperblock(format!(
            "SPDK io unit size {}",
            sb.io_unit_size
        )));
    }
    if sb.md_start == 0 || sb.md_len == 0 {
        return Err(LvolError::CorruptSuperblock(
            "SPDK super block without a metadata region".into(),
        ));
    }
    Ok(sb)
}

/// A blob as decoded from its chain (and extent pages).
#[derive(Default)]
struct RawBlob {
    invalid: u64,
    data_ro: u64,
    md_ro: u64,
    xattrs: BTreeMap<String, Vec<u8>>,
    internal: BTreeMap<String, Vec<u8>>,
    clusters: Vec<u32>,
    rle_seen: bool,
    table: Option<(u64, Vec<u32>)>,
}

/// Calls `f(type, body)` for each descriptor of a metadata page.
fn descriptors(page: &[u8], mut f: impl FnMut(u8, &[u8]) -> Result<()>) -> Result<()> {
    let area = &page[DESC_START..DESC_END];
    let mut cur = 0usize;
    while cur + 5 <= area.len() {
        let t = area[cur];
        let len = get_u32(area, cur + 1) as usize;
        if t == D_PADDING && len == 0 {
            break;
        }
        let body = area
            .get(cur + 5..cur + 5 + len)
            .ok_or_else(|| corrupt(format!("descriptor of type {t} runs past its page")))?;
        if t != D_PADDING {
            f(t, body)?;
        }
        cur += 5 + len;
    }
    Ok(())
}

fn parse_xattr(body: &[u8]) -> Result<(String, Vec<u8>)> {
    if body.len() < 4 {
        return Err(corrupt("short xattr descriptor"));
    }
    let nl = usize::from(get_u16(body, 0));
    let vl = usize::from(get_u16(body, 2));
    if 4 + nl + vl != body.len() {
        return Err(corrupt("xattr lengths do not match its descriptor"));
    }
    let name = String::from_utf8_lossy(&body[4..4 + nl]).into_owned();
    Ok((name, body[4 + nl..].to_vec()))
}

/// The clear method in SPDK's md-read-only flag bits 0–1 (0, the default, is unmap).
fn clear_from_flags(md_ro: u64) -> ClearMethod {
    match md_ro & 3 {
        1 => ClearMethod::None,
        3 => ClearMethod::WriteZeroes,
        _ => ClearMethod::Unmap,
    }
}

/// [`clear_from_flags`] the other way round.
pub(crate) fn clear_to_flags(c: ClearMethod) -> u64 {
    match c {
        ClearMethod::None => 1,
        ClearMethod::Unmap => 2,
        ClearMethod::WriteZeroes => 3,
    }
}

/// A C string value (the lvol module stores names and UUIDs with their NUL).
fn c_string(v: &[u8]) -> String {
    let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

impl RawBlob {
    fn page(&mut self, page: &[u8], num_clusters: u64) -> Result<()> {
        descriptors(page, |t, b| {
            match t {
                D_FLAGS => {
                    if b.len() != 24 {
                        return Err(corrupt("flags descriptor of the wrong length"));
                    }
                    self.invalid = get_u64(b, 0);
                    self.data_ro = get_u64(b, 8);
                    self.md_ro = get_u64(b, 16);
                }
                D_XATTR | D_XATTR_INTERNAL => {
                    let (k, v) = parse_xattr(b)?;
                    if t == D_XATTR {
                        self.xattrs.insert(k, v);
                    } else {
                        self.internal.insert(k, v);
                    }
                }
                D_EXTENT_RLE => {
                    if self.table.is_some() || b.is_empty() || b.len() % 8 != 0 {
                        return Err(corrupt("bad extent descriptor"));
                    }
                    self.rle_seen = true;
                    for e in b.chunks_exact(8) {
                        let (start, n) = (get_u32(e, 0), get_u32(e, 4));
                        if self.clusters.len() as u64 + u64::from(n) > num_clusters {
                            return Err(corrupt("extent runs beyond the device"));
                        }
                        for j in 0..n {
                            self.clusters.push(if start == 0 { 0 } else { start + j });
                        }
                    }
                }
                D_EXTENT_TABLE => {
                    if self.rle_seen || b.len() < 8 || (b.len() - 8) % 8 != 0 {
                        return Err(corrupt("bad extent table descriptor"));
                    }
                    let n = get_u64(b, 0);
                    let t = self.table.get_or_insert_with(|| (n, Vec::new()));
                    if t.0 != n {
                        return Err(corrupt("extent tables disagree on the cluster count"));
                    }
                    for e in b[8..].chunks_exact(8) {
                        let (page_idx, pages) = (get_u32(e, 0), get_u32(e, 4));
                        if page_idx != 0 {
                            t.1.push(page_idx);
                        } else {
                            if u64::from(pages) > num_clusters {
                                return Err(corrupt("extent table run too long"));
                            }
                            t.1.extend(std::iter::repeat_n(0, pages as usize));
                        }
                    }
                }
                // Extent pages are not part of a chain; anything else is a newer feature
                // that SPDK guards with an invalid flag (checked later).
                _ => {}
            }
            Ok(())
        })
    }
}

impl SpdkLvstore {
    /// Reads the SPDK lvstore on `dev`.
    pub fn open(dev: Arc<dyn BlockDevice>) -> Result<Self> {
        let mut io = SyncIo::new(&*dev)?;
        let mut p = vec![0u8; PAGE_SIZE];
        io.read_at(0, &mut p)?;
        let sb = parse_super(&p)?;
        if sb.bstype.as_bytes() != LVS_BSTYPE {
            return Err(LvolError::NotSpdkLvstore(format!(
                "SPDK blobstore of type {:?}, not made by the lvol module",
                sb.bstype
            )));
        }
        let dev_size = dev.info().size_bytes();
        let cs = u64::from(sb.cluster_size);
        let md_end = (u64::from(sb.md_start) + u64::from(sb.md_len)) * PAGE_SIZE as u64;
        if sb.size > dev_size || md_end > sb.size {
            return Err(LvolError::DeviceTooSmall {
                needed: sb.size.max(md_end),
                actual: dev_size,
            });
        }
        let num_clusters = sb.size / cs;
        // The whole metadata region, read in large pieces.
        let mut md = vec![0u8; sb.md_len as usize * PAGE_SIZE];
        for (i, chunk) in md.chunks_mut(1 << 20).enumerate() {
            let off = u64::from(sb.md_start) * PAGE_SIZE as u64 + (i as u64) * (1 << 20);
            io.read_at(off, chunk)?;
        }
        let page = |i: u32| -> Option<&[u8]> {
            let s = i as usize * PAGE_SIZE;
            let p = md.get(s..s + PAGE_SIZE)?;
            (crc(&p[..PAGE_SIZE - 4]) == get_u32(p, PAGE_SIZE - 4)).then_some(p)
        };
        let mut blobs: BTreeMap<u64, RawBlob> = BTreeMap::new();
        for i in 0..sb.md_len {
            let Some(first) = page(i) else { continue };
            let id = BLOBID_HIGH | u64::from(i);
            if get_u64(first, 0) != id || get_u32(first, 8) != 0 {
                continue;
            }
            let mut raw = RawBlob::default();
            let mut cur = first;
            let mut seq = 0u32;
            loop {
                raw.page(cur, num_clusters)?;
                let next = get_u32(cur, PAGE_SIZE - 8);
                if next == NO_PAGE {
                    break;
                }
                seq += 1;
                if seq as usize > MAX_CHAIN {
                    return Err(corrupt(format!("blob {id:#x}: metadata chain loops")));
                }
                cur = page(next).ok_or_else(|| {
                    corrupt(format!("blob {id:#x}: page {next} of its chain is damaged"))
                })?;
                if get_u64(cur, 0) != id || get_u32(cur, 8) != seq {
                    return Err(corrupt(format!(
                        "blob {id:#x}: page {next} belongs to another chain"
                    )));
                }
            }
            if let Some((n, pages)) = raw.table.take() {
                for (k, &ep) in pages.iter().enumerate() {
                    let start = k as u64 * EXTENTS_PER_PAGE;
                    if start >= n {
                        break;
                    }
                    let want = (n - start).min(EXTENTS_PER_PAGE);
                    if ep == 0 {
                        raw.clusters.extend(std::iter::repeat_n(0, want as usize));
                        continue;
                    }
                    let epage = page(ep).ok_or_else(|| {
                        corrupt(format!("blob {id:#x}: extent page {ep} is damaged"))
                    })?;
                    // No check of the page's blob id: when SPDK snapshots a volume, the
                    // snapshot takes over the origin's extent pages, which keep its id.
                    let mut got = Vec::new();
                    descriptors(epage, |t, b| {
                        if t == D_EXTENT_PAGE {
                            if b.len() < 8 || b.len() % 4 != 0 {
                                return Err(corrupt("bad extent page descriptor"));
                            }
                            if u64::from(get_u32(b, 0)) != start {
                                return Err(corrupt("extent page out of order"));
                            }
                            got.extend(b[4..].chunks_exact(4).map(|c| get_u32(c, 0)));
                        }
                        Ok(())
                    })?;
                    if got.len() as u64 > want {
                        return Err(corrupt("extent page longer than its blob"));
                    }
                    got.resize(want as usize, 0);
                    raw.clusters.extend(got);
                }
                if (raw.clusters.len() as u64) < n {
                    raw.clusters.resize(n as usize, 0);
                }
            }
            blobs.insert(id, raw);
        }
        let sup = blobs
            .remove(&sb.super_blob)
            .ok_or_else(|| corrupt(format!("super blob {:#x} not found", sb.super_blob)))?;
        let name = sup
            .xattrs
            .get("name")
            .map(|v| c_string(v))
            .ok_or_else(|| corrupt("super blob without the lvstore name"))?;
        let uuid = sup
            .xattrs
            .get("uuid")
            .and_then(|v| Uuid::parse_str(&c_string(v)).ok())
            .ok_or_else(|| corrupt("super blob without a valid lvstore uuid"))?;
        let mut lvols = BTreeMap::new();
        let mut skipped = Vec::new();
        for (id, raw) in blobs {
            if raw.invalid & !(F_THIN | F_INTERNAL_XATTR | F_EXTENT_TABLE | F_EXTERNAL_SNAPSHOT)
                != 0
            {
                return Err(LvolError::Invalid(format!(
                    "SPDK blob {id:#x} uses features unknown here (invalid flags {:#x})",
                    raw.invalid
                )));
            }
            if raw.invalid & F_EXTERNAL_SNAPSHOT != 0 {
                return Err(LvolError::Invalid(format!(
                    "SPDK blob {id:#x} is a clone of an external snapshot (not supported)"
                )));
            }
            if raw.internal.contains_key("SNAPTMP") {
                skipped.push((
                    id,
                    "an unfinished snapshot (SPDK deletes it on load)".into(),
                ));
                continue;
            }
            if raw.internal.contains_key("SNAPRM") {
                return Err(LvolError::Invalid(format!(
                    "SPDK blob {id:#x} is a snapshot whose removal was interrupted; load the \
                     store with SPDK once to finish it"
                )));
            }
            let Some(name) = raw.xattrs.get("name").map(|v| c_string(v)) else {
                skipped.push((id, "no name xattr: not an lvol".into()));
                continue;
            };
            let uuid = raw
                .xattrs
                .get("uuid")
                .and_then(|v| Uuid::parse_str(&c_string(v)).ok())
                .ok_or_else(|| corrupt(format!("lvol {name:?} without a valid uuid")))?;
            let parent = match raw.internal.get("SNAP") {
                None => None,
                Some(v) if v.len() == 8 => Some(get_u64(v, 0)),
                Some(_) => return Err(corrupt(format!("lvol {name:?}: bad SNAP xattr"))),
            };
            let thin = raw.invalid & F_THIN != 0;
            if raw.clusters.iter().any(|&c| u64::from(c) >= num_clusters) {
                return Err(corrupt(format!(
                    "lvol {name:?} maps a cluster beyond the store"
                )));
            }
            if !thin && raw.clusters.contains(&0) {
                return Err(corrupt(format!(
                    "thick lvol {name:?} has unallocated clusters"
                )));
            }
            let clear = clear_from_flags(raw.md_ro);
            lvols.insert(
                id,
                SpdkLvol {
                    blob_id: id,
                    name,
                    uuid,
                    thin,
                    read_only: raw.data_ro & F_READ_ONLY != 0,
                    parent,
                    clusters: raw.clusters,
                    clear,
                },
            );
        }
        // Parents must exist and not loop; no device cluster may belong to two volumes.
        let mut owner: BTreeMap<u32, u64> = BTreeMap::new();
        for (id, l) in &lvols {
            let mut p = l.parent;
            let mut hops = 0;
            while let Some(pid) = p {
                let pl = lvols.get(&pid).ok_or_else(|| {
                    corrupt(format!("lvol {:?}: parent {pid:#x} missing", l.name))
                })?;
                hops += 1;
                if hops > lvols.len() {
                    return Err(corrupt(format!("lvol {:?}: parent chain loops", l.name)));
                }
                p = pl.parent;
            }
            for &c in l.clusters.iter().filter(|&&c| c != 0) {
                if let Some(other) = owner.insert(c, *id) {
                    return Err(corrupt(format!(
                        "cluster {c} used by blobs {other:#x} and {id:#x}"
                    )));
                }
            }
        }
        Ok(SpdkLvstore {
            dev,
            sb,
            name,
            uuid,
            lvols,
            skipped,
        })
    }

    /// Finds a volume by name, alias `<lvs>/<lvol>` or UUID string.
    pub fn find(&self, key: &str) -> Option<&SpdkLvol> {
        let name = key.strip_prefix(&format!("{}/", self.name)).unwrap_or(key);
        self.lvols
            .values()
            .find(|l| l.name == name || l.uuid.to_string() == key)
    }

    /// Whether `id` is the parent of some volume (SPDK reports those as snapshots).
    pub fn has_clones(&self, id: u64) -> bool {
        self.lvols.values().any(|l| l.parent == Some(id))
    }

    /// The device cluster holding volume cluster `c` of `lvol`, looking through parents; 0 if
    /// no ancestor has it (it reads as zeroes).
    pub fn resolve(&self, lvol: &SpdkLvol, c: usize) -> u32 {
        let mut l = lvol;
        loop {
            match l.clusters.get(c) {
                Some(&p) if p != 0 => return p,
                Some(_) => {}
                None => return 0,
            }
            match l.parent.and_then(|p| self.lvols.get(&p)) {
                Some(p) => l = p,
                None => return 0,
            }
        }
    }

    /// Reads `buf.len()` bytes of `lvol` at `off` (a multiple of the io unit).
    pub fn read_at(&self, lvol: &SpdkLvol, off: u64, buf: &mut [u8]) -> Result<()> {
        let cs = u64::from(self.sb.cluster_size);
        let end = off
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= lvol.size_bytes(self.sb.cluster_size))
            .ok_or_else(|| LvolError::Invalid("read beyond the end of the volume".into()))?;
        let mut io = SyncIo::new(&*self.dev)?;
        let mut o = off;
        while o < end {
            let c = o / cs;
            let n = ((c + 1) * cs).min(end) - o;
            let dst = &mut buf[(o - off) as usize..(o - off + n) as usize];
            match self.resolve(lvol, c as usize) {
                0 => dst.fill(0),
                p => io.read_at(u64::from(p) * cs + (o - c * cs), dst)?,
            }
            o += n;
        }
        Ok(())
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.dev
    }
}
