//! Metadata pages: the per-volume ("blob") records, their descriptors and checksums.
//!
//! A blob's metadata is a chain of 4 KiB pages in the metadata region. Every update writes a
//! complete new chain to free pages, tagged with the store-wide transaction sequence number, and
//! only then releases the old chain (see `docs/FORMAT.md` for the layout and the recovery rules).

use uuid::Uuid;

use crate::error::{LvolError, Result};

/// Metadata page size.
pub const PAGE_SIZE: usize = 4096;
/// Bytes of the page header.
pub const HDR_LEN: usize = 40;
/// Offset of the `next` field.
pub const NEXT_OFF: usize = PAGE_SIZE - 8;
/// Bytes of descriptors a page holds.
pub const BODY_LEN: usize = NEXT_OFF - HDR_LEN;
/// Largest volume in clusters (thin volumes may be larger than the store, as in SPDK; the
/// bound keeps the in-memory cluster map reasonable: 64 MiB for the largest volume).
pub const MAX_VOL_CLUSTERS: u64 = 1 << 24;
/// "No next page".
pub const NO_PAGE: u32 = u32::MAX;
/// Page flag: the page is a tombstone (the blob is deleted as of this transaction).
pub const PAGE_TOMBSTONE: u32 = 1;

/// Descriptor: end of descriptors in this page.
pub const DESC_PADDING: u8 = 0;
/// Descriptor: run-length encoded cluster map.
pub const DESC_EXTENT_RLE: u8 = 1;
/// Descriptor: user-visible xattr.
pub const DESC_XATTR: u8 = 2;
/// Descriptor: flags.
pub const DESC_FLAGS: u8 = 3;
/// Descriptor: internal xattr.
pub const DESC_XATTR_INTERNAL: u8 = 4;

/// `invalid_flags` bit: thin provisioned (SPDK_BLOB_THIN_PROV).
pub const FLAG_THIN: u64 = 1;
/// `invalid_flags` bit: the blob has internal xattrs (SPDK_BLOB_INTERNAL_XATTR).
pub const FLAG_INTERNAL_XATTR: u64 = 2;
/// `data_ro_flags` bit: read-only (SPDK_BLOB_READ_ONLY).
pub const FLAG_READ_ONLY: u64 = 1;
/// `data_ro_flags` bit: the blob was created as a snapshot.
pub const FLAG_SNAPSHOT: u64 = 2;

/// CRC32C (Castagnoli) of `b`, as SPDK computes its page checksums.
pub fn crc(b: &[u8]) -> u32 {
    crc32c::crc32c(b)
}

pub(crate) fn put_u32(p: &mut [u8], off: usize, v: u32) {
    p[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u64(p: &mut [u8], off: usize, v: u64) {
    p[off..off + 8].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn get_u16(p: &[u8], off: usize) -> u16 {
    let mut b = [0u8; 2];
    b.copy_from_slice(&p[off..off + 2]);
    u16::from_le_bytes(b)
}
pub(crate) fn get_u32(p: &[u8], off: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&p[off..off + 4]);
    u32::from_le_bytes(b)
}
pub(crate) fn get_u64(p: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&p[off..off + 8]);
    u64::from_le_bytes(b)
}

/// What happens to a volume's clusters when they are released (delete, shrink).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClearMethod {
    /// Leave the data in place.
    None,
    /// Discard (unmap) the clusters (SPDK's default).
    #[default]
    Unmap,
    /// Write zeroes over the clusters.
    WriteZeroes,
}

impl ClearMethod {
    /// SPDK's name ("none", "unmap", "write_zeroes").
    pub fn as_str(&self) -> &'static str {
        match self {
            ClearMethod::None => "none",
            ClearMethod::Unmap => "unmap",
            ClearMethod::WriteZeroes => "write_zeroes",
        }
    }

    /// Parses SPDK's name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "none" => Some(ClearMethod::None),
            "unmap" => Some(ClearMethod::Unmap),
            "write_zeroes" => Some(ClearMethod::WriteZeroes),
            _ => None,
        }
    }

    fn code(self) -> u8 {
        match self {
            ClearMethod::None => 0,
            ClearMethod::Unmap => 1,
            ClearMethod::WriteZeroes => 2,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(ClearMethod::None),
            1 => Some(ClearMethod::Unmap),
            2 => Some(ClearMethod::WriteZeroes),
            _ => None,
        }
    }
}

/// The persistent state of one volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobMd {
    /// Blob id (`1 << 32 | n`, as SPDK's ids have the high word set).
    pub id: u64,
    /// Volume name (xattr `name`).
    pub name: String,
    /// Volume UUID (xattr `uuid`, stored as its 36-character string).
    pub uuid: Uuid,
    /// Physical cluster of each logical cluster; 0 = not allocated (cluster 0 always holds
    /// the super block, so it is never a data cluster).
    pub clusters: Vec<u32>,
    /// Thin provisioned.
    pub thin: bool,
    /// Read-only (writes refused).
    pub read_only: bool,
    /// Created as a snapshot.
    pub snapshot: bool,
    /// Blob whose data shows through unallocated clusters.
    pub parent: Option<u64>,
    /// Clear method for released clusters.
    pub clear: ClearMethod,
}

/// Header fields of a metadata page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageHdr {
    /// Blob id.
    pub blob_id: u64,
    /// Index of this page in its chain.
    pub seq_num: u32,
    /// `PAGE_*` flags.
    pub flags: u32,
    /// Transaction sequence number.
    pub txn: u64,
    /// Number of blobs written by the transaction.
    pub members: u32,
    /// Pages in this chain.
    pub chain_len: u32,
    /// Number of live blobs in the store after the transaction.
    pub live: u32,
    /// Next page in the chain or [`NO_PAGE`].
    pub next: u32,
}

/// Builds a complete page from a header and a body of at most [`BODY_LEN`] bytes.
pub fn build_page(h: &PageHdr, body: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; PAGE_SIZE];
    put_u64(&mut p, 0, h.blob_id);
    put_u32(&mut p, 8, h.seq_num);
    put_u32(&mut p, 12, h.flags);
    put_u64(&mut p, 16, h.txn);
    put_u32(&mut p, 24, h.members);
    put_u32(&mut p, 28, h.chain_len);
    put_u32(&mut p, 32, h.live);
    let n = body.len().min(BODY_LEN);
    p[HDR_LEN..HDR_LEN + n].copy_from_slice(&body[..n]);
    put_u32(&mut p, NEXT_OFF, h.next);
    let c = crc(&p[..PAGE_SIZE - 4]);
    put_u32(&mut p, PAGE_SIZE - 4, c);
    p
}

/// What a page of the metadata region holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageState {
    /// All zeroes (free).
    Zero,
    /// A valid page.
    Valid(PageHdr),
    /// Neither: a torn write or corruption.
    Bad,
}

/// Classifies one page.
pub fn parse_page(p: &[u8]) -> PageState {
    if p.iter().all(|&b| b == 0) {
        return PageState::Zero;
    }
    if crc(&p[..PAGE_SIZE - 4]) != get_u32(p, PAGE_SIZE - 4) {
        return PageState::Bad;
    }
    let h = PageHdr {
        blob_id: get_u64(p, 0),
        seq_num: get_u32(p, 8),
        flags: get_u32(p, 12),
        txn: get_u64(p, 16),
        members: get_u32(p, 24),
        chain_len: get_u32(p, 28),
        live: get_u32(p, 32),
        next: get_u32(p, NEXT_OFF),
    };
    if h.blob_id == 0 || h.chain_len == 0 || h.seq_num >= h.chain_len || h.members == 0 {
        return PageState::Bad;
    }
    PageState::Valid(h)
}

fn push_desc(descs: &mut Vec<Vec<u8>>, ty: u8, payload: &[u8]) {
    let mut d = Vec::with_capacity(5 + payload.len());
    d.push(ty);
    d.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    d.extend_from_slice(payload);
    descs.push(d);
}

fn xattr(name: &str, value: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + name.len() + value.len());
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(&(value.len() as u16).to_le_bytes());
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(value);
    v
}

/// Run-length encodes a cluster map: `(first physical cluster or 0, run length)` pairs.
pub fn rle(clusters: &[u32]) -> Vec<(u32, u32)> {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &c in clusters {
        if let Some(last) = runs.last_mut() {
            let contig = if last.0 == 0 {
                c == 0
            } else {
                c != 0 && u64::from(c) == u64::from(last.0) + u64::from(last.1)
            };
            if contig && last.1 < u32::MAX {
                last.1 += 1;
                continue;
            }
        }
        runs.push((c, 1));
    }
    runs
}

/// Encodes a blob into page bodies (each at most [`BODY_LEN`] bytes).
pub fn encode_blob(b: &BlobMd) -> Vec<Vec<u8>> {
    let mut descs = Vec::new();
    let mut flags = [0u8; 24];
    // The clear method is always stored as an internal xattr.
    put_u64(
        &mut flags,
        0,
        FLAG_INTERNAL_XATTR | if b.thin { FLAG_THIN } else { 0 },
    );
    let ro = (if b.read_only { FLAG_READ_ONLY } else { 0 })
        | (if b.snapshot { FLAG_SNAPSHOT } else { 0 });
    put_u64(&mut flags, 8, ro);
    push_desc(&mut descs, DESC_FLAGS, &flags);
    push_desc(&mut descs, DESC_XATTR, &xattr("name", b.name.as_bytes()));
    let u = b.uuid.hyphenated().to_string();
    push_desc(&mut descs, DESC_XATTR, &xattr("uuid", u.as_bytes()));
    if let Some(p) = b.parent {
        push_desc(
            &mut descs,
            DESC_XATTR_INTERNAL,
            &xattr("SNAP", &p.to_le_bytes()),
        );
    }
    push_desc(
        &mut descs,
        DESC_XATTR_INTERNAL,
        &xattr("clear_method", &[b.clear.code()]),
    );
    // Always at least one extent descriptor so that the size (sum of run lengths) is explicit.
    let runs = rle(&b.clusters);
    let per_desc = (BODY_LEN - 5) / 8;
    let mut chunks: Vec<&[(u32, u32)]> = runs.chunks(per_desc).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    for ch in chunks {
        let mut pl = Vec::with_capacity(ch.len() * 8);
        for &(c, n) in ch {
            pl.extend_from_slice(&c.to_le_bytes());
            pl.extend_from_slice(&n.to_le_bytes());
        }
        push_desc(&mut descs, DESC_EXTENT_RLE, &pl);
    }
    let mut bodies: Vec<Vec<u8>> = vec![Vec::new()];
    for d in descs {
        let fits = bodies.last().is_some_and(|b| b.len() + d.len() <= BODY_LEN);
        if !fits {
            bodies.push(Vec::new());
        }
        if let Some(last) = bodies.last_mut() {
            last.extend_from_slice(&d);
        }
    }
    bodies
}

/// Decodes a blob from its page bodies, checking every field. `max_cluster` bounds physical
/// cluster numbers.
pub fn decode_blob(id: u64, bodies: &[&[u8]], max_cluster: u64) -> Result<BlobMd> {
    let bad = |m: String| LvolError::CorruptMetadata(format!("blob {id:#x}: {m}"));
    let mut name = None;
    let mut uuid = None;
    let mut parent = None;
    let mut clear = ClearMethod::default();
    let mut flags = None;
    let mut clusters = Vec::new();
    for body in bodies {
        let mut off = 0;
        while off + 5 <= body.len() {
            let ty = body[off];
            if ty == DESC_PADDING {
                break;
            }
            let len = get_u32(body, off + 1) as usize;
            let start = off + 5;
            let end = start
                .checked_add(len)
                .filter(|&e| e <= body.len())
                .ok_or_else(|| bad(format!("descriptor at {off} overruns the page")))?;
            let d = &body[start..end];
            match ty {
                DESC_FLAGS => {
                    if d.len() != 24 {
                        return Err(bad("flags descriptor length".into()));
                    }
                    let inv = get_u64(d, 0);
                    let ro = get_u64(d, 8);
                    if inv & !(FLAG_THIN | FLAG_INTERNAL_XATTR) != 0
                        || ro & !(FLAG_READ_ONLY | FLAG_SNAPSHOT) != 0
                    {
                        return Err(bad(format!("unknown flags {inv:#x}/{ro:#x}")));
                    }
                    flags = Some((
                        inv & FLAG_THIN != 0,
                        ro & FLAG_READ_ONLY != 0,
                        ro & FLAG_SNAPSHOT != 0,
                    ));
                }
                DESC_XATTR | DESC_XATTR_INTERNAL => {
                    if d.len() < 4 {
                        return Err(bad("short xattr".into()));
                    }
                    let nl = get_u16(d, 0) as usize;
                    let vl = get_u16(d, 2) as usize;
                    if 4 + nl + vl != d.len() {
                        return Err(bad("xattr length".into()));
                    }
                    let k = &d[4..4 + nl];
                    let v = &d[4 + nl..];
                    match (ty, k) {
                        (DESC_XATTR, b"name") => {
                            let s = std::str::from_utf8(v)
                                .map_err(|_| bad("name is not UTF-8".into()))?;
                            name = Some(s.to_string());
                        }
                        (DESC_XATTR, b"uuid") => {
                            let s = std::str::from_utf8(v)
                                .ok()
                                .and_then(|s| Uuid::parse_str(s.trim_end_matches('\0')).ok())
                                .ok_or_else(|| bad("bad uuid".into()))?;
                            uuid = Some(s);
                        }
                        (DESC_XATTR_INTERNAL, b"SNAP") => {
                            if v.len() != 8 {
                                return Err(bad("parent length".into()));
                            }
                            parent = Some(get_u64(v, 0));
                        }
                        (DESC_XATTR_INTERNAL, b"clear_method") => {
                            clear = v
                                .first()
                                .and_then(|&c| ClearMethod::from_code(c))
                                .ok_or_else(|| bad("clear method".into()))?;
                        }
                        // Unknown user xattrs are kept by SPDK; we ignore them.
                        _ => {}
                    }
                }
                DESC_EXTENT_RLE => {
                    if d.len() % 8 != 0 {
                        return Err(bad("extent descriptor length".into()));
                    }
                    for r in d.chunks_exact(8) {
                        let c = get_u32(r, 0);
                        let n = get_u32(r, 4);
                        if n == 0 {
                            return Err(bad("empty extent".into()));
                        }
                        if c != 0 && u64::from(c) + u64::from(n) > max_cluster {
                            return Err(bad(format!("extent {c}+{n} beyond the store")));
                        }
                        if clusters.len() as u64 + u64::from(n) > MAX_VOL_CLUSTERS {
                            return Err(bad("volume larger than the store".into()));
                        }
                        for i in 0..n {
                            clusters.push(if c == 0 { 0 } else { c + i });
                        }
                    }
                }
                other => return Err(bad(format!("unknown descriptor type {other}"))),
            }
            off = end;
        }
    }
    let (thin, read_only, snapshot) = flags.ok_or_else(|| bad("no flags".into()))?;
    Ok(BlobMd {
        id,
        name: name.ok_or_else(|| bad("no name".into()))?,
        uuid: uuid.ok_or_else(|| bad("no uuid".into()))?,
        clusters,
        thin,
        read_only,
        snapshot,
        parent,
        clear,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_roundtrip_multi_page() {
        let clusters: Vec<u32> = (0..3000u32)
            .map(|i| if i % 3 == 0 { 0 } else { 5000 - i })
            .collect();
        let b = BlobMd {
            id: 1 << 32 | 7,
            name: "vol".into(),
            uuid: Uuid::new_v4(),
            clusters,
            thin: true,
            read_only: false,
            snapshot: true,
            parent: Some(1 << 32 | 3),
            clear: ClearMethod::WriteZeroes,
        };
        let bodies = encode_blob(&b);
        assert!(bodies.len() > 1);
        assert!(bodies.iter().all(|x| x.len() <= BODY_LEN));
        let refs: Vec<&[u8]> = bodies.iter().map(|v| v.as_slice()).collect();
        assert_eq!(decode_blob(b.id, &refs, 10000).unwrap(), b);
        assert!(decode_blob(b.id, &refs, 100).is_err());
    }

    #[test]
    fn page_states() {
        let h = PageHdr {
            blob_id: 9,
            seq_num: 0,
            flags: 0,
            txn: 4,
            members: 1,
            chain_len: 1,
            live: 1,
            next: NO_PAGE,
        };
        let mut p = build_page(&h, b"abc");
        assert_eq!(parse_page(&p), PageState::Valid(h));
        p[50] ^= 0xff;
        assert_eq!(parse_page(&p), PageState::Bad);
        assert_eq!(parse_page(&[0u8; PAGE_SIZE]), PageState::Zero);
    }
}
