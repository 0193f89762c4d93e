//! The super block: the first two 4 KiB pages of the device (two slots, see `docs/FORMAT.md`).

use uuid::Uuid;

use crate::cluster_map::Bitmap;
use crate::error::{LvolError, Result};
use crate::md::{crc, get_u32, get_u64, put_u32, put_u64, PAGE_SIZE};

/// Signature at offset 0 of a katablk super block.
pub const SIGNATURE: &[u8; 8] = b"KATABLOB";
/// Signature of a real SPDK blobstore (recognised to give a clear error).
pub const SPDK_SIGNATURE: &[u8; 8] = b"SPDKBLOB";
/// Current format version (written by [`crate::LvStore::create`]).
pub const VERSION: u32 = 2;
/// The first format version (no persisted masks); still opened and written back as version 1.
pub const VERSION_1: u32 = 1;
/// Longest lvstore or lvol name in bytes (SPDK: 63 characters plus NUL).
pub const MAX_NAME: usize = 63;
/// Number of super block slots (pages 0 and 1).
pub const SLOTS: u64 = 2;
/// First page of the metadata region of a version-1 store (and of a version-2 store whose
/// masks fit one page each).
pub const MD_START: u32 = 4;
/// Bytes of the header of a mask region.
pub const MASK_HDR: usize = 32;
/// Mask type of the used-metadata-page mask (SPDK's `SPDK_MD_MASK_TYPE_USED_PAGES`).
pub const MASK_TYPE_PAGES: u8 = 0;
/// Mask type of the used-cluster mask (SPDK's `SPDK_MD_MASK_TYPE_USED_CLUSTERS`).
pub const MASK_TYPE_CLUSTERS: u8 = 1;

/// Pages a mask region of `bits` bits needs.
pub fn mask_pages(bits: u64) -> u64 {
    (MASK_HDR as u64 + bits.div_ceil(8)).div_ceil(PAGE_SIZE as u64)
}

/// Bits a mask region of `pages` pages holds.
pub fn mask_capacity(pages: u32) -> u64 {
    (u64::from(pages) * PAGE_SIZE as u64).saturating_sub(MASK_HDR as u64) * 8
}

/// Decoded super block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuperBlock {
    /// Format version: [`VERSION`] or [`VERSION_1`].
    pub version: u32,
    /// Bumped on every rewrite; the valid slot with the highest generation wins.
    pub generation: u64,
    /// Cluster size in bytes.
    pub cluster_size: u32,
    /// Block size (SPDK io_unit_size) in bytes.
    pub block_size: u32,
    /// First page of the metadata region.
    pub md_start: u32,
    /// Pages in the metadata region.
    pub md_len: u32,
    /// Bytes of the device covered by the store.
    pub size: u64,
    /// Clusters covered, including those holding the super block and metadata.
    pub num_clusters: u64,
    /// First cluster that can hold data.
    pub first_data_cluster: u64,
    /// Store UUID.
    pub uuid: Uuid,
    /// Store name.
    pub name: String,
    /// The store was closed cleanly (SPDK's `clean` flag); `last_txn` is then meaningful.
    pub clean: bool,
    /// Last metadata transaction committed before a clean shutdown.
    pub last_txn: u64,
    /// First page of the used-metadata-page mask region (version 2; 0 in version 1).
    pub pmask_start: u32,
    /// Pages of the used-metadata-page mask region (0: no masks, as in version 1).
    pub pmask_len: u32,
    /// First page of the used-cluster mask region (version 2; 0 in version 1).
    pub cmask_start: u32,
    /// Pages of the used-cluster mask region; 0 when no cluster mask is kept (version 1, or
    /// the store grew beyond the region's capacity).
    pub cmask_len: u32,
}

/// Writes the checksum of a super block page into its last four bytes.
fn seal(p: &mut [u8]) {
    let c = crc(&p[..PAGE_SIZE - 4]);
    put_u32(p, PAGE_SIZE - 4, c);
}

impl SuperBlock {
    /// Encodes into one page.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = vec![0u8; PAGE_SIZE];
        p[0..8].copy_from_slice(SIGNATURE);
        put_u32(&mut p, 8, self.version);
        put_u32(&mut p, 12, PAGE_SIZE as u32);
        put_u32(&mut p, 16, u32::from(self.clean));
        put_u64(&mut p, 160, self.last_txn);
        put_u32(&mut p, 20, self.cluster_size);
        put_u32(&mut p, 24, self.block_size);
        put_u32(&mut p, 28, self.md_start);
        put_u32(&mut p, 32, self.md_len);
        put_u64(&mut p, 40, self.generation);
        put_u64(&mut p, 48, self.size);
        put_u64(&mut p, 56, self.num_clusters);
        p[64..80].copy_from_slice(self.uuid.as_bytes());
        let name = self.name.as_bytes();
        let n = name.len().min(MAX_NAME);
        p[80] = n as u8;
        p[81..81 + n].copy_from_slice(&name[..n]);
        put_u64(&mut p, 152, self.first_data_cluster);
        put_u32(&mut p, 168, self.pmask_start);
        put_u32(&mut p, 172, self.pmask_len);
        put_u32(&mut p, 176, self.cmask_start);
        put_u32(&mut p, 180, self.cmask_len);
        seal(&mut p);
        p
    }

    /// Decodes one slot. `Ok(None)` means the slot has no signature at all.
    pub fn decode(p: &[u8]) -> Result<Option<SuperBlock>> {
        if p.len() < PAGE_SIZE {
            return Err(LvolError::CorruptSuperblock("short page".into()));
        }
        if &p[0..8] != SIGNATURE {
            return Ok(None);
        }
        let stored = get_u32(p, PAGE_SIZE - 4);
        if crc(&p[..PAGE_SIZE - 4]) != stored {
            return Err(LvolError::CorruptSuperblock("checksum mismatch".into()));
        }
        let version = get_u32(p, 8);
        if version != VERSION && version != VERSION_1 {
            return Err(LvolError::UnsupportedVersion(version));
        }
        let bad = |m: String| Err(LvolError::CorruptSuperblock(m));
        if get_u32(p, 12) != PAGE_SIZE as u32 {
            return bad(format!("length {}", get_u32(p, 12)));
        }
        let n = p[80] as usize;
        if n > MAX_NAME {
            return bad(format!("name length {n}"));
        }
        let name = match std::str::from_utf8(&p[81..81 + n]) {
            Ok(s) => s.to_string(),
            Err(_) => return bad("name is not UTF-8".into()),
        };
        // Names are created non-empty and without NUL (`check_name`).
        if name.is_empty() || name.contains('\0') {
            return bad(format!("name {name:?}"));
        }
        let mut u = [0u8; 16];
        u.copy_from_slice(&p[64..80]);
        let sb = SuperBlock {
            version,
            generation: get_u64(p, 40),
            cluster_size: get_u32(p, 20),
            block_size: get_u32(p, 24),
            md_start: get_u32(p, 28),
            md_len: get_u32(p, 32),
            size: get_u64(p, 48),
            num_clusters: get_u64(p, 56),
            first_data_cluster: get_u64(p, 152),
            uuid: Uuid::from_bytes(u),
            name,
            clean: match get_u32(p, 16) {
                0 => false,
                1 => true,
                x => return bad(format!("clean flag {x}")),
            },
            last_txn: get_u64(p, 160),
            pmask_start: get_u32(p, 168),
            pmask_len: get_u32(p, 172),
            cmask_start: get_u32(p, 176),
            cmask_len: get_u32(p, 180),
        };
        sb.validate()?;
        Ok(Some(sb))
    }

    /// Checks the fields for internal consistency.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(LvolError::CorruptSuperblock(m));
        let cs = self.cluster_size;
        if !cs.is_power_of_two() || (cs as usize) < PAGE_SIZE {
            return bad(format!("cluster size {cs}"));
        }
        if !matches!(self.block_size, 512 | 1024 | 2048 | 4096) {
            return bad(format!("block size {}", self.block_size));
        }
        if (self.md_start as u64) < SLOTS || self.md_len == 0 {
            return bad(format!("metadata region {}+{}", self.md_start, self.md_len));
        }
        let md_end = (u64::from(self.md_start) + u64::from(self.md_len)) * PAGE_SIZE as u64;
        let fdc = md_end.div_ceil(u64::from(cs));
        if fdc != self.first_data_cluster {
            return bad(format!(
                "first data cluster {} (expected {fdc})",
                self.first_data_cluster
            ));
        }
        if self.num_clusters < self.first_data_cluster
            || self.num_clusters.checked_mul(u64::from(cs)) != Some(self.size)
        {
            return bad(format!(
                "{} clusters of {cs} bytes vs size {}",
                self.num_clusters, self.size
            ));
        }
        if self.num_clusters > u64::from(u32::MAX) {
            return bad("too many clusters".into());
        }
        self.validate_masks()
    }

    fn validate_masks(&self) -> Result<()> {
        let bad = |m: String| Err(LvolError::CorruptSuperblock(m));
        let regions = [
            (self.pmask_start, self.pmask_len),
            (self.cmask_start, self.cmask_len),
        ];
        if self.version == VERSION_1 {
            if regions.iter().any(|&(s, l)| s != 0 || l != 0) {
                return bad("version 1 super block with mask regions".into());
            }
            return Ok(());
        }
        if self.pmask_len == 0 && self.cmask_len != 0 {
            return bad("cluster mask without metadata page mask".into());
        }
        let mut used: Vec<(u64, u64)> = Vec::new();
        for (s, l) in regions {
            if l == 0 {
                continue;
            }
            let (s, e) = (u64::from(s), u64::from(s) + u64::from(l));
            if s < SLOTS || e > u64::from(self.md_start) {
                return bad(format!(
                    "mask region {s}..{e} outside pages {SLOTS}..{}",
                    self.md_start
                ));
            }
            if used.iter().any(|&(a, b)| s < b && a < e) {
                return bad("overlapping mask regions".into());
            }
            used.push((s, e));
        }
        if self.pmask_len != 0 && mask_capacity(self.pmask_len) < u64::from(self.md_len) {
            return bad(format!(
                "metadata page mask of {} pages cannot hold {} pages",
                self.pmask_len, self.md_len
            ));
        }
        if self.cmask_len != 0 && mask_capacity(self.cmask_len) < self.num_clusters {
            return bad(format!(
                "cluster mask of {} pages cannot hold {} clusters",
                self.cmask_len, self.num_clusters
            ));
        }
        Ok(())
    }

    /// Whether a clean shutdown of this store writes (and a clean open may read) the masks.
    pub fn has_masks(&self) -> bool {
        self.version >= VERSION && self.pmask_len != 0
    }

    /// Slot the next write of this generation goes to.
    pub fn slot(&self) -> u64 {
        self.generation % SLOTS
    }
}

/// Encodes a mask region of `pages` pages: header (type, bit count, the generation of the super
/// block written with it, CRC32C) followed by the bits (see `docs/FORMAT.md`, "Mask regions").
pub fn encode_mask(kind: u8, generation: u64, bits: &Bitmap, pages: u32) -> Vec<u8> {
    let mut r = vec![0u8; pages as usize * PAGE_SIZE];
    let bytes = bits.to_bytes();
    r[0] = kind;
    put_u64(&mut r, 8, bits.len());
    put_u64(&mut r, 16, generation);
    r[MASK_HDR..MASK_HDR + bytes.len()].copy_from_slice(&bytes);
    let c = mask_crc(&r);
    put_u32(&mut r, 24, c);
    r
}

/// CRC32C of a whole mask region, with its CRC field taken as zero.
fn mask_crc(r: &[u8]) -> u32 {
    let c = crc32c::crc32c(&r[..24]);
    let c = crc32c::crc32c_append(c, &[0u8; 4]);
    crc32c::crc32c_append(c, &r[28..])
}

/// Decodes a mask region written by [`encode_mask`], checking its type, its length of `bits`
/// bits, its generation and its CRC. The error says what does not match.
pub fn decode_mask(
    r: &[u8],
    kind: u8,
    generation: u64,
    bits: u64,
) -> std::result::Result<Bitmap, String> {
    if r.len() < MASK_HDR {
        return Err("mask region too short".into());
    }
    if r[0] != kind {
        return Err(format!("mask type {} (expected {kind})", r[0]));
    }
    let len = get_u64(r, 8);
    if len != bits {
        return Err(format!("mask of {len} bits (expected {bits})"));
    }
    let end = usize::try_from(bits.div_ceil(8))
        .ok()
        .and_then(|n| n.checked_add(MASK_HDR))
        .filter(|&e| e <= r.len())
        .ok_or_else(|| format!("mask of {bits} bits does not fit its region"))?;
    if mask_crc(r) != get_u32(r, 24) {
        return Err("mask checksum mismatch".into());
    }
    let g = get_u64(r, 16);
    if g != generation {
        return Err(format!(
            "mask written with super block generation {g}, not {generation}"
        ));
    }
    Bitmap::from_bytes(bits, &r[MASK_HDR..end]).ok_or_else(|| "bits set beyond the end".into())
}

/// Describes an SPDK blobstore super block (layout of SPDK's `struct spdk_bs_super_block`),
/// or `None` when `p` does not start with SPDK's signature.
pub fn describe_spdk(p: &[u8]) -> Option<String> {
    if p.len() < PAGE_SIZE || &p[0..8] != SPDK_SIGNATURE {
        return None;
    }
    let crc_ok = crc(&p[..PAGE_SIZE - 4]) == get_u32(p, PAGE_SIZE - 4);
    let bstype: String = p[56..72]
        .iter()
        .take_while(|&&b| b != 0)
        .map(|&b| if b.is_ascii_graphic() { b as char } else { '?' })
        .collect();
    Some(format!(
        "found an SPDK blobstore super block (version {}, cluster size {}, metadata pages {}+{}, \
         type {:?}, {}, checksum {}); katablk's on-disk format is modelled on SPDK's but not \
         byte compatible, so it cannot be opened here: copy it into a katablk lvstore with \
         `katablk-lvs import-spdk`, or serve it with katablk-spdk",
        get_u32(p, 8),
        get_u32(p, 28),
        get_u32(p, 48),
        get_u32(p, 52),
        bstype,
        if get_u32(p, 16) == 1 {
            "clean"
        } else {
            "dirty"
        },
        if crc_ok { "valid" } else { "bad" },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb() -> SuperBlock {
        SuperBlock {
            version: VERSION,
            generation: 3,
            cluster_size: 1 << 20,
            block_size: 512,
            md_start: MD_START,
            md_len: 60,
            size: 64 << 20,
            num_clusters: 64,
            first_data_cluster: 1,
            uuid: Uuid::new_v4(),
            name: "lvs0".into(),
            clean: true,
            last_txn: 77,
            pmask_start: 2,
            pmask_len: 1,
            cmask_start: 3,
            cmask_len: 1,
        }
    }

    #[test]
    fn roundtrip_and_damage() {
        let s = sb();
        let mut p = s.encode();
        assert_eq!(SuperBlock::decode(&p).unwrap(), Some(s));
        p[100] ^= 1;
        assert!(matches!(
            SuperBlock::decode(&p),
            Err(LvolError::CorruptSuperblock(_))
        ));
        p[0] = b'X';
        assert!(SuperBlock::decode(&p).unwrap().is_none());
    }

    #[test]
    fn names_with_nul_or_empty_are_corrupt() {
        // A longer name length over the zero padding: "lvs0" and NULs (the name once became a
        // thread name, and a NUL in one panics).
        for len in [20, 0] {
            let mut p = sb().encode();
            p[80] = len;
            seal(&mut p);
            assert!(
                matches!(
                    SuperBlock::decode(&p),
                    Err(LvolError::CorruptSuperblock(m)) if m.contains("name")
                ),
                "name length {len}"
            );
        }
    }

    #[test]
    fn mask_roundtrip_and_damage() {
        let mut b = Bitmap::new(100);
        b.set(3);
        b.set(99);
        let r = encode_mask(MASK_TYPE_CLUSTERS, 7, &b, 1);
        assert_eq!(r.len(), PAGE_SIZE);
        assert_eq!(decode_mask(&r, MASK_TYPE_CLUSTERS, 7, 100), Ok(b));
        assert!(decode_mask(&r, MASK_TYPE_PAGES, 7, 100).is_err());
        assert!(decode_mask(&r, MASK_TYPE_CLUSTERS, 8, 100).is_err());
        assert!(decode_mask(&r, MASK_TYPE_CLUSTERS, 7, 101).is_err());
        assert!(decode_mask(&r[..10], MASK_TYPE_CLUSTERS, 7, 100).is_err());
        let mut bad = r.clone();
        bad[MASK_HDR] ^= 1;
        assert!(decode_mask(&bad, MASK_TYPE_CLUSTERS, 7, 100).is_err());
        let mut big = r;
        put_u64(&mut big, 8, u64::MAX);
        assert!(decode_mask(&big, MASK_TYPE_CLUSTERS, 7, u64::MAX).is_err());
    }

    #[test]
    fn version_1_and_mask_regions() {
        let mut s = sb();
        s.version = VERSION_1;
        assert!(s.validate().is_err());
        (s.pmask_start, s.pmask_len, s.cmask_start, s.cmask_len) = (0, 0, 0, 0);
        assert_eq!(SuperBlock::decode(&s.encode()).unwrap(), Some(s.clone()));
        assert!(!s.has_masks());
        let mut s = sb();
        assert!(s.has_masks());
        s.cmask_start = 2;
        assert!(s.validate().is_err(), "overlap");
        let mut s = sb();
        s.cmask_start = 4;
        assert!(s.validate().is_err(), "inside the metadata region");
        let mut s = sb();
        s.num_clusters = mask_capacity(1) + 1;
        s.size = s.num_clusters << 20;
        assert!(s.validate().is_err(), "cluster mask too small");
        s.cmask_len = 0;
        s.validate().unwrap();
        assert_eq!(mask_pages(mask_capacity(1)), 1);
        assert_eq!(mask_pages(mask_capacity(1) + 1), 2);
    }
}
