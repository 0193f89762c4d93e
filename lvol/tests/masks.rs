//! Persisted allocation masks (format version 2): written at a clean shutdown, read by the next
//! open instead of scanning the metadata region, ignored after a crash, checked against the
//! metadata, and absent from version-1 stores.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::*;
use katablk_bdev::BlockDevice;
use katablk_lvol::cluster_map::Bitmap;
use katablk_lvol::superblock::{
    encode_mask, SuperBlock, MASK_TYPE_CLUSTERS, MASK_TYPE_PAGES, VERSION, VERSION_1,
};
use katablk_lvol::{LvStore, LvsOptions};

const CS: u64 = 64 << 10;
const DEV: usize = 4 << 20;
const PAGE: usize = 4096;

fn opts() -> LvsOptions {
    let mut o = LvsOptions::new("lvs0");
    o.cluster_size = CS as u32;
    o
}

/// A store with a thick volume, a thin one with data, a snapshot and a clone, closed cleanly.
fn populated() -> FaultDev {
    let dev = FaultDev::new(DEV);
    let lvs = LvStore::create(dev.arc(), opts()).unwrap();
    let a = lvs.create_lvol("a", 3 * CS, false).unwrap();
    let b = lvs.create_lvol("b", 8 * CS, true).unwrap();
    write(&*a, 0, &pattern(1, PAGE));
    write(&*b, 2 * CS, &pattern(2, PAGE));
    write(&*b, 5 * CS + 4096, &pattern(3, PAGE));
    lvs.snapshot("b", "s").unwrap();
    lvs.clone("s", "c").unwrap();
    write(&*lvs.lvol("c").unwrap(), 0, &pattern(4, PAGE));
    lvs.delete("a").unwrap();
    let a = lvs.create_lvol("a", 3 * CS, false).unwrap();
    write(&*a, 0, &pattern(1, PAGE));
    drop((a, b));
    drop(lvs);
    dev
}

/// Everything [`populated`] wrote is there and the cluster accounting adds up.
fn check(lvs: &LvStore) {
    let r = |n: &str, off: u64| read(&*lvs.lvol(n).unwrap(), off, PAGE);
    assert!(r("a", 0) == pattern(1, PAGE));
    assert!(r("b", 2 * CS) == pattern(2, PAGE));
    assert!(r("b", 5 * CS + 4096) == pattern(3, PAGE));
    assert!(r("s", 2 * CS) == pattern(2, PAGE));
    assert!(r("c", 0) == pattern(4, PAGE));
    assert!(r("c", 2 * CS) == pattern(2, PAGE));
    assert!(r("c", CS) == pattern(0, PAGE));
    let info = lvs.info();
    let list = lvs.list();
    assert_eq!(list.len(), 4);
    let allocated: u64 = list.iter().map(|l| l.num_allocated_clusters).sum();
    assert_eq!(allocated + info.free_clusters, info.total_data_clusters);
}

fn sb_of(img: &[u8]) -> SuperBlock {
    let a = SuperBlock::decode(&img[..PAGE]).ok().flatten();
    let b = SuperBlock::decode(&img[PAGE..2 * PAGE]).ok().flatten();
    match (a, b) {
        (Some(a), Some(b)) => {
            if a.generation > b.generation {
                a
            } else {
                b
            }
        }
        (a, b) => a.or(b).unwrap(),
    }
}

#[test]
fn clean_reopen_reads_only_used_pages() {
    let dev = populated();
    let sb = sb_of(&dev.image());
    assert_eq!(sb.version, VERSION);
    assert!(sb.clean);
    assert_eq!(
        (sb.pmask_start, sb.pmask_len, sb.cmask_start, sb.cmask_len),
        (2, 1, 3, 1)
    );
    assert_eq!(sb.md_start, 4);
    let lvs = LvStore::open(dev.arc()).unwrap();
    let r = lvs.open_report().clone();
    assert!(r.clean && r.masks_used, "{r:?}");
    assert_eq!(r.mask_fallback, None);
    assert_eq!(r.rolled_back_txn, None);
    assert!(
        r.md_pages_read > 0 && r.md_pages_read < 10,
        "read {} of {} pages",
        r.md_pages_read,
        sb.md_len
    );
    check(&lvs);
    // Still fully usable, and the next clean open sees the changes.
    let d = lvs.create_lvol("d", 2 * CS, true).unwrap();
    write(&*d, CS, &pattern(9, PAGE));
    drop(d);
    let free = lvs.info().free_clusters;
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    assert!(lvs.open_report().masks_used, "{:?}", lvs.open_report());
    assert_eq!(lvs.info().free_clusters, free);
    assert!(read(&*lvs.lvol("d").unwrap(), CS, PAGE) == pattern(9, PAGE));
}

#[test]
fn open_clears_clean_flag_first_and_crash_ignores_masks() {
    let dev = populated();
    let lvs = LvStore::open(dev.arc()).unwrap();
    // The open itself made the store dirty on disk, before any change.
    assert!(!sb_of(&dev.crash_image(CrashMode::KeepAll)).clean);
    // Changes after the open leave the persisted masks stale.
    lvs.delete("c").unwrap();
    let e = lvs.create_lvol("e", 4 * CS, true).unwrap();
    write(&*e, 0, &pattern(7, 4 * CS as usize));
    katablk_bdev::sync::SyncIo::new(&*e)
        .unwrap()
        .flush()
        .unwrap();
    drop(e);
    for mode in [CrashMode::KeepAll, CrashMode::Random(5)] {
        let d2 = FaultDev::from_image(dev.crash_image(mode));
        let l2 = LvStore::open(d2.arc()).unwrap();
        let r = l2.open_report();
        assert!(
            !r.clean && !r.masks_used && r.mask_fallback.is_none(),
            "{r:?}"
        );
        let sb = sb_of(&d2.image());
        assert_eq!(r.md_pages_read, u64::from(sb.md_len), "full scan");
        assert!(l2.lvol("c").is_err());
        assert!(read(&*l2.lvol("e").unwrap(), 0, 4 * CS as usize) == pattern(7, 4 * CS as usize));
        let info = l2.info();
        let allocated: u64 = l2.list().iter().map(|l| l.num_allocated_clusters).sum();
        assert_eq!(allocated + info.free_clusters, info.total_data_clusters);
        drop(l2);
        // And the clean shutdown after the recovery writes masks that are used again.
        let l3 = LvStore::open(d2.arc()).unwrap();
        assert!(l3.open_report().masks_used, "{:?}", l3.open_report());
        assert_eq!(l3.info(), info);
    }
}

#[test]
fn crash_during_clean_shutdown() {
    // Count the writes of a clean close, then crash at each of them.
    let base = populated();
    let setup = |dev: &FaultDev| {
        let lvs = LvStore::open(dev.arc()).unwrap();
        let f = lvs.create_lvol("f", 2 * CS, true).unwrap();
        write(&*f, 0, &pattern(8, PAGE));
        drop(f);
        lvs.delete("c").unwrap();
        lvs
    };
    let dev = FaultDev::from_image(base.image());
    let lvs = setup(&dev);
    let before = dev.writes();
    drop(lvs);
    let total = dev.writes() - before;
    assert!(total >= 3, "masks and super block: {total} writes");
    for n in 0..=total {
        for mode in [CrashMode::KeepAll, CrashMode::Random(n + 1)] {
            let dev = FaultDev::from_image(base.image());
            let lvs = setup(&dev);
            dev.fail_after(n);
            drop(lvs);
            let d2 = FaultDev::from_image(dev.crash_image(mode));
            let l2 = LvStore::open(d2.arc()).unwrap_or_else(|e| panic!("crash at {n}: {e}"));
            let r = l2.open_report().clone();
            // Only a complete shutdown (masks flushed, then the super block) is trusted.
            assert_eq!(r.masks_used, n >= total, "crash at {n}/{total}: {r:?}");
            assert_eq!(r.mask_fallback, None, "crash at {n}/{total}");
            assert!(read(&*l2.lvol("f").unwrap(), 0, PAGE) == pattern(8, PAGE));
            assert!(l2.lvol("c").is_err());
            let info = l2.info();
            let allocated: u64 = l2.list().iter().map(|l| l.num_allocated_clusters).sum();
            assert_eq!(allocated + info.free_clusters, info.total_data_clusters);
        }
    }
}

#[test]
fn damaged_masks_fall_back_to_scanning() {
    let good = populated();
    let img = good.image();
    let sb = sb_of(&img);
    // A flipped byte in either mask region (bad checksum).
    for (page, what) in [
        (sb.pmask_start, "metadata page mask"),
        (sb.cmask_start, "cluster mask"),
    ] {
        let dev = FaultDev::from_image(img.clone());
        let off = page as usize * PAGE + 40;
        dev.poke(off, &[img[off] ^ 0x10]);
        let lvs = LvStore::open(dev.arc()).unwrap();
        let r = lvs.open_report();
        assert!(r.clean && !r.masks_used, "{r:?}");
        let why = r.mask_fallback.clone().unwrap();
        assert!(why.contains(what) && why.contains("checksum"), "{why}");
        assert_eq!(r.md_pages_read, u64::from(sb.md_len));
        check(&lvs);
    }
    // Well-formed masks that disagree with the metadata: a used cluster marked free (would
    // be handed out twice), a used page marked free (a chain would be missed), a free page
    // marked used.
    let cm =
        Bitmap::from_bytes(sb.num_clusters, &img[sb.cmask_start as usize * PAGE + 32..]).unwrap();
    let pm = Bitmap::from_bytes(
        u64::from(sb.md_len),
        &img[sb.pmask_start as usize * PAGE + 32..],
    )
    .unwrap();
    let used_cluster = (sb.first_data_cluster..sb.num_clusters)
        .find(|&c| cm.get(c))
        .unwrap();
    let used_page = pm.find_set(0).unwrap();
    let free_page = (0..u64::from(sb.md_len)).find(|&p| !pm.get(p)).unwrap();
    let cases: Vec<(u32, u8, Bitmap, u32)> = vec![
        (
            sb.cmask_start,
            MASK_TYPE_CLUSTERS,
            {
                let mut m = cm.clone();
                m.clear(used_cluster);
                m
            },
            sb.cmask_len,
        ),
        (
            sb.pmask_start,
            MASK_TYPE_PAGES,
            {
                let mut m = pm.clone();
                m.clear(used_page);
                m
            },
            sb.pmask_len,
        ),
        (
            sb.pmask_start,
            MASK_TYPE_PAGES,
            {
                let mut m = pm.clone();
                m.set(free_page);
                m
            },
            sb.pmask_len,
        ),
    ];
    for (start, kind, mask, len) in cases {
        let dev = FaultDev::from_image(img.clone());
        dev.poke(
            start as usize * PAGE,
            &encode_mask(kind, sb.generation, &mask, len),
        );
        let lvs = LvStore::open(dev.arc()).unwrap();
        let r = lvs.open_report();
        assert!(!r.masks_used && r.mask_fallback.is_some(), "{r:?}");
        check(&lvs);
        // The cluster the bad mask called free is still owned: new allocations avoid it.
        let before = lvs.info().free_clusters;
        let n = lvs.create_lvol("fill", before * CS, false).unwrap();
        assert_eq!(lvs.info().free_clusters, 0);
        drop(n);
        lvs.delete("fill").unwrap();
        check(&lvs);
    }
    // Masks from an older clean shutdown (a stale generation) are not used either.
    let dev = FaultDev::from_image(img.clone());
    dev.poke(
        sb.cmask_start as usize * PAGE,
        &encode_mask(MASK_TYPE_CLUSTERS, sb.generation - 2, &cm, sb.cmask_len),
    );
    let lvs = LvStore::open(dev.arc()).unwrap();
    let why = lvs.open_report().mask_fallback.clone().unwrap();
    assert!(why.contains("generation"), "{why}");
    check(&lvs);
}

/// Rewrites a version-2 image as the version-1 code wrote it: no mask fields, pages 2-3 zero.
fn make_v1(img: &mut [u8]) {
    for slot in 0..2 {
        let p = &img[slot * PAGE..(slot + 1) * PAGE];
        if let Ok(Some(mut sb)) = SuperBlock::decode(p) {
            assert_eq!(sb.md_start, 4);
            sb.version = VERSION_1;
            (sb.pmask_start, sb.pmask_len, sb.cmask_start, sb.cmask_len) = (0, 0, 0, 0);
            let enc = sb.encode();
            assert_eq!(u32::from_le_bytes(enc[8..12].try_into().unwrap()), 1);
            assert!(enc[168..184].iter().all(|&b| b == 0));
            img[slot * PAGE..(slot + 1) * PAGE].copy_from_slice(&enc);
        }
    }
    img[2 * PAGE..4 * PAGE].fill(0);
}

#[test]
fn version_1_store_opens_by_scanning_and_stays_version_1() {
    let mut img = populated().image();
    make_v1(&mut img);
    let dev = FaultDev::from_image(img);
    let lvs = LvStore::open(dev.arc()).unwrap();
    let r = lvs.open_report().clone();
    assert_eq!(r.version, 1);
    assert!(
        r.clean && !r.masks_used && r.mask_fallback.is_none(),
        "{r:?}"
    );
    assert_eq!(r.md_pages_read, u64::from(sb_of(&dev.image()).md_len));
    check(&lvs);
    let g = lvs.create_lvol("g", CS, true).unwrap();
    write(&*g, 0, &pattern(11, PAGE));
    drop(g);
    drop(lvs);
    let img = dev.image();
    let sb = sb_of(&img);
    assert_eq!((sb.version, sb.clean, sb.pmask_len), (1, true, 0));
    assert!(
        img[2 * PAGE..4 * PAGE].iter().all(|&b| b == 0),
        "no masks in v1"
    );
    // A crashed version-1 store recovers as before.
    let lvs = LvStore::open(dev.arc()).unwrap();
    let d2 = FaultDev::from_image(dev.crash_image(CrashMode::Random(3)));
    drop(lvs);
    let l2 = LvStore::open(d2.arc()).unwrap();
    assert!(!l2.open_report().clean);
    assert!(read(&*l2.lvol("g").unwrap(), 0, PAGE) == pattern(11, PAGE));
    check_counts(&l2);
}

fn check_counts(lvs: &LvStore) {
    let info = lvs.info();
    let allocated: u64 = lvs.list().iter().map(|l| l.num_allocated_clusters).sum();
    assert_eq!(allocated + info.free_clusters, info.total_data_clusters);
}

#[test]
fn grow_beyond_the_cluster_mask_region() {
    use katablk_bdev::file::{FileDevice, FileOptions};
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(8 << 20).unwrap();
    let open_dev = || -> Arc<dyn BlockDevice> {
        Arc::new(FileDevice::open(f.path(), &FileOptions::default()).unwrap())
    };
    let mut o = LvsOptions::new("lvs0");
    o.cluster_size = 4096;
    let lvs = LvStore::create(open_dev(), o).unwrap();
    let v = lvs.create_lvol("v", 64 << 10, true).unwrap();
    write(&*v, 4096, &pattern(1, PAGE));
    drop(v);
    drop(lvs);
    // Growth within the reserved room (4 times the size) keeps the cluster mask.
    f.as_file().set_len(24 << 20).unwrap();
    let lvs = LvStore::open(open_dev()).unwrap();
    assert!(lvs.open_report().masks_used);
    lvs.grow().unwrap();
    drop(lvs);
    let lvs = LvStore::open(open_dev()).unwrap();
    assert!(lvs.open_report().masks_used, "{:?}", lvs.open_report());
    assert!(lvs.info().total_data_clusters > (8 << 20) / 4096);
    drop(lvs);
    // Beyond it (32512 clusters per mask page): only the metadata page mask is kept.
    f.as_file().set_len(140 << 20).unwrap();
    let lvs = LvStore::open(open_dev()).unwrap();
    let n = lvs.grow().unwrap();
    let w = lvs.create_lvol("w", 64 << 10, false).unwrap();
    write(&*w, 0, &pattern(2, PAGE));
    drop(w);
    let free = lvs.info().free_clusters;
    drop(lvs);
    let lvs = LvStore::open(open_dev()).unwrap();
    let r = lvs.open_report();
    assert!(r.masks_used && r.mask_fallback.is_none(), "{r:?}");
    assert!(r.md_pages_read < 10, "{r:?}");
    assert_eq!(lvs.info().total_data_clusters, n);
    assert_eq!(lvs.info().free_clusters, free);
    assert!(read(&*lvs.lvol("v").unwrap(), 4096, PAGE) == pattern(1, PAGE));
    assert!(read(&*lvs.lvol("w").unwrap(), 0, PAGE) == pattern(2, PAGE));
    check_counts(&lvs);
}
