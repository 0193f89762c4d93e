//! Damaged and foreign devices must give clear errors, never panics or silent data loss.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use katablk_lvol::md::{build_page, encode_blob, BlobMd, ClearMethod, PageHdr, NO_PAGE};
use katablk_lvol::{LvStore, LvolError, LvsOptions};

const CS: u32 = 64 << 10;
const DEV: usize = 4 << 20;
const MD0: usize = 4 * 4096;

fn store() -> FaultDev {
    let dev = FaultDev::new(DEV);
    let mut o = LvsOptions::new("lvs0");
    o.cluster_size = CS;
    let lvs = LvStore::create(dev.arc(), o).unwrap();
    let v = lvs.create_lvol("v1", 4 * u64::from(CS), true).unwrap();
    write(&*v, 0, &pattern(5, 4096));
    lvs.create_lvol("v2", u64::from(CS), false).unwrap();
    drop(v);
    drop(lvs);
    dev
}

/// Indexes of non-zero metadata pages.
fn md_pages(dev: &FaultDev) -> Vec<usize> {
    let img = dev.image();
    (0..64)
        .filter(|i| {
            img[MD0 + i * 4096..MD0 + (i + 1) * 4096]
                .iter()
                .any(|&b| b != 0)
        })
        .collect()
}

fn open(dev: &FaultDev) -> Result<LvStore, LvolError> {
    LvStore::open(dev.arc())
}

#[test]
fn corrupt_super_block() {
    let dev = store();
    // One damaged slot: the other one is used.
    let mut p = dev.image()[..4096].to_vec();
    p[90] ^= 0x40;
    dev.poke(0, &p);
    let l = open(&dev).unwrap();
    assert_eq!(l.list().len(), 2);
    drop(l);
    // Both damaged.
    for slot in 0..2 {
        let mut p = dev.image()[slot * 4096..(slot + 1) * 4096].to_vec();
        p[90] ^= 0x40;
        dev.poke(slot * 4096, &p);
    }
    let e = open(&dev).unwrap_err();
    assert!(matches!(e, LvolError::CorruptSuperblock(_)), "{e}");
}

#[test]
fn unsupported_version() {
    let dev = store();
    for slot in 0..2 {
        let mut p = dev.image()[slot * 4096..(slot + 1) * 4096].to_vec();
        p[8] = 9;
        let c = crc32c::crc32c(&p[..4092]);
        p[4092..].copy_from_slice(&c.to_le_bytes());
        dev.poke(slot * 4096, &p);
    }
    assert!(matches!(open(&dev), Err(LvolError::UnsupportedVersion(9))));
}

#[test]
fn md_page_bad_crc_is_an_error() {
    for victim in 0..2 {
        let dev = store();
        let pages = md_pages(&dev);
        assert!(pages.len() >= 2, "{pages:?}");
        let off = MD0 + pages[victim] * 4096 + 100;
        let mut b = dev.image()[off..off + 1].to_vec();
        b[0] ^= 0xff;
        dev.poke(off, &b);
        let e = open(&dev).unwrap_err();
        assert!(matches!(e, LvolError::CorruptMetadata(_)), "{e}");
        assert_eq!(e.errno(), libc::EILSEQ);
    }
}

#[test]
fn md_page_valid_crc_bad_content() {
    let dev = store();
    // A well-formed page that refers to a missing parent, written into the metadata region of
    // a store that was not shut down cleanly (the image is taken while it is open), so that
    // the open scans the whole region.
    let lvs = open(&dev).unwrap();
    let dirty = FaultDev::from_image(dev.crash_image(CrashMode::KeepAll));
    drop(lvs);
    let b = BlobMd {
        id: 1 << 32 | 50,
        name: "evil".into(),
        uuid: uuid::Uuid::new_v4(),
        clusters: vec![0, 0, 0, 0],
        thin: true,
        read_only: false,
        snapshot: false,
        parent: Some(1 << 32 | 99),
        clear: ClearMethod::Unmap,
    };
    let body = &encode_blob(&b)[0];
    let h = PageHdr {
        blob_id: b.id,
        seq_num: 0,
        flags: 0,
        txn: 1,
        members: 1,
        chain_len: 1,
        live: 2,
        next: NO_PAGE,
    };
    dirty.poke(MD0 + 60 * 4096, &build_page(&h, body));
    let e = open(&dirty).unwrap_err();
    assert!(matches!(e, LvolError::CorruptMetadata(_)), "{e}");
    // After a clean shutdown only the pages the persisted mask marks used are read (as in
    // SPDK), so a page outside them is not looked at.
    dev.poke(MD0 + 60 * 4096, &build_page(&h, body));
    let l = open(&dev).unwrap();
    assert!(l.open_report().masks_used, "{:?}", l.open_report());
    assert_eq!(l.list().len(), 2);
}

#[test]
fn truncated_device() {
    let dev = store();
    let img = dev.image();
    let short = FaultDev::from_image(img[..DEV - (1 << 20)].to_vec());
    let e = open(&short).unwrap_err();
    assert!(matches!(e, LvolError::DeviceTooSmall { .. }), "{e}");
    let tiny = FaultDev::from_image(img[..4096].to_vec());
    assert!(matches!(open(&tiny), Err(LvolError::NotAnLvstore(_))));
}

#[test]
fn foreign_data() {
    // Random bytes.
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let img: Vec<u8> = (0..DEV)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let e = open(&FaultDev::from_image(img)).unwrap_err();
    assert!(matches!(e, LvolError::NotAnLvstore(_)), "{e}");
    // Blank.
    let e = open(&FaultDev::new(DEV)).unwrap_err();
    assert!(e.to_string().contains("blank"), "{e}");
    // An ext4 super block at 1024 (magic 0xEF53 at 1080).
    let mut img = vec![0u8; DEV];
    img[1024..1028].copy_from_slice(&1024u32.to_le_bytes());
    img[1080] = 0x53;
    img[1081] = 0xef;
    let e = open(&FaultDev::from_image(img)).unwrap_err();
    assert!(e.to_string().contains("ext2/3/4"), "{e}");
    // A real SPDK blobstore signature.
    let mut img = vec![0u8; DEV];
    img[..8].copy_from_slice(b"SPDKBLOB");
    img[8..12].copy_from_slice(&3u32.to_le_bytes());
    img[28..32].copy_from_slice(&(4u32 << 20).to_le_bytes());
    img[56..65].copy_from_slice(b"LVOLSTORE");
    let c = crc32c::crc32c(&img[..4092]);
    img[4092..4096].copy_from_slice(&c.to_le_bytes());
    let e = open(&FaultDev::from_image(img)).unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("SPDK blobstore")
            && m.contains("version 3")
            && m.contains("4194304")
            && m.contains("LVOLSTORE")
            && m.contains("checksum valid"),
        "{m}"
    );
}

#[test]
fn garbage_everywhere_never_panics() {
    // Valid super block, random metadata region: must be an error or an empty store.
    let dev = store();
    let mut x: u64 = 77;
    for round in 0..20 {
        let d = FaultDev::from_image(dev.image());
        let mut junk = vec![0u8; 64 * 4096];
        for b in junk.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = if round % 2 == 0 {
                x as u8
            } else {
                (x as u8) & 0x3
            };
        }
        d.poke(MD0, &junk);
        let _ = open(&d).map(|l| l.list());
    }
}

#[test]
fn error_codes_like_spdk() {
    let dev = store();
    let lvs = open(&dev).unwrap();
    assert_eq!(
        lvs.create_lvol("v1", 4096, true).unwrap_err().errno(),
        libc::EEXIST
    );
    assert_eq!(
        lvs.create_lvol("huge", 1 << 30, false).unwrap_err().errno(),
        libc::ENOSPC
    );
    assert_eq!(lvs.delete("nope").unwrap_err().errno(), libc::ENODEV);
    assert!(lvs.create_lvol("a/b", 4096, true).is_err());
    assert!(lvs.create_lvol("", 4096, true).is_err());
}

#[test]
fn probe_and_dirty_corruption() {
    let dev = store();
    assert!(LvStore::probe(&dev).unwrap());
    assert!(!LvStore::probe(&FaultDev::new(DEV)).unwrap());
    // Simulate a dirty shutdown: clear the clean flag in both slots.
    for slot in 0..2 {
        let mut p = dev.image()[slot * 4096..(slot + 1) * 4096].to_vec();
        p[16] = 0;
        let c = crc32c::crc32c(&p[..4092]);
        p[4092..].copy_from_slice(&c.to_le_bytes());
        dev.poke(slot * 4096, &p);
    }
    let base = dev.image();
    let pages = md_pages(&dev);
    let mut errors = 0;
    for &victim in &pages {
        let d = FaultDev::from_image(base.clone());
        let off = MD0 + victim * 4096 + 200;
        d.poke(off, &[base[off] ^ 0x5a]);
        match open(&d) {
            Err(e) => {
                assert!(matches!(e, LvolError::CorruptMetadata(_)), "{e}");
                errors += 1;
            }
            // Only the newest transaction may be rolled back (indistinguishable from a torn
            // write after a crash): the older volume must still be there.
            Ok(l) => assert!(l.lvol("v1").is_ok()),
        }
    }
    assert!(
        errors >= 1,
        "no corruption detected among {} pages",
        pages.len()
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, ..Default::default() })]

    /// Metadata pages with arbitrary content but a correct checksum: open must return (Ok or a
    /// clear error), never panic, and never accept a cluster claimed twice.
    #[test]
    fn mutated_md_pages_with_valid_crc(
        page in 0usize..4,
        edits in proptest::collection::vec((0usize..4092, proptest::prelude::any::<u8>()), 1..12),
        sb_edit in proptest::option::of((0usize..4092, proptest::prelude::any::<u8>())),
    ) {
        static BASE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let base = BASE.get_or_init(|| {
            let dev = store();
            let lvs = open(&dev).unwrap();
            lvs.snapshot("v1", "s1").unwrap();
            lvs.clone("s1", "c1").unwrap();
            drop(lvs);
            dev.image()
        });
        let dev = FaultDev::from_image(base.clone());
        let pages = md_pages(&dev);
        let idx = pages[page % pages.len()];
        let off = MD0 + idx * 4096;
        let mut p = base[off..off + 4096].to_vec();
        for (i, b) in edits {
            p[i] = b;
        }
        let c = crc32c::crc32c(&p[..4092]);
        p[4092..].copy_from_slice(&c.to_le_bytes());
        dev.poke(off, &p);
        if let Some((i, b)) = sb_edit {
            for slot in 0..2 {
                let mut s = base[slot * 4096..(slot + 1) * 4096].to_vec();
                s[i] = b;
                let c = crc32c::crc32c(&s[..4092]);
                s[4092..].copy_from_slice(&c.to_le_bytes());
                dev.poke(slot * 4096, &s);
            }
        }
        if let Ok(lvs) = open(&dev) {
            let info = lvs.info();
            let alloc: u64 = lvs.list().iter().map(|l| l.num_allocated_clusters).sum();
            proptest::prop_assert_eq!(alloc + info.free_clusters, info.total_data_clusters);
            for l in lvs.list() {
                let v = lvs.lvol(&l.name).unwrap();
                let n = v.size_bytes().min(1 << 20) as usize;
                let _ = read(&*v, 0, n);
            }
        }
    }
}
