//! The super block: the first two 4 KiB pages of the device (two slots, see `docs/FORMAT.md`).

use uuid::Uuid;

use crate::error::{LvolError, Result};
use crate::md::{crc, get_u32, get_u64, put_u32, put_u64, PAGE_SIZE};

/// Signature at offset 0 of a katablk super block.
pub const SIGNATURE: &[u8; 8] = b"KATABLOB";
/// Signature of a real SPDK blobstore (recognised to give a clear error).
pub const SPDK_SIGNATURE: &[u8; 8] = b"SPDKBLOB";
/// Current format version.
pub const VERSION: u32 = 1;
/// Longest lvstore or lvol name in bytes (SPDK: 63 characters plus NUL).
pub const MAX_NAME: usize = 63;
/// Number of super block slots (pages 0 and 1).
pub const SLOTS: u64 = 2;
/// First page of the metadata region in a store created by this version.
pub const MD_START: u32 = 4;

/// Decoded super block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuperBlock {
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
}

impl SuperBlock {
    /// Encodes into one page.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = vec![0u8; PAGE_SIZE];
        p[0..8].copy_from_slice(SIGNATURE);
        put_u32(&mut p, 8, VERSION);
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
        let c = crc(&p[..PAGE_SIZE - 4]);
        put_u32(&mut p, PAGE_SIZE - 4, c);
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
        if version != VERSION {
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
        let mut u = [0u8; 16];
        u.copy_from_slice(&p[64..80]);
        let sb = SuperBlock {
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
        Ok(())
    }

    /// Slot the next write of this generation goes to.
    pub fn slot(&self) -> u64 {
        self.generation % SLOTS
    }
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
         byte compatible, so it cannot be opened here",
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
}
