#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::*;
use katablk_bdev::sync::SyncIo;
use katablk_bdev::BlockDevice;
use katablk_lvol::{LvStore, LvolError, LvsOptions};

const CS: u32 = 64 << 10;

fn opts() -> LvsOptions {
    let mut o = LvsOptions::new("lvs0");
    o.cluster_size = CS;
    o
}

#[test]
fn create_write_reopen() {
    let dev = FaultDev::new(8 << 20);
    let lvs = LvStore::create(dev.arc(), opts()).unwrap();
    let info = lvs.info();
    assert_eq!(info.cluster_size, u64::from(CS));
    let total = info.total_data_clusters;
    assert_eq!(info.free_clusters, total);
    let thick = lvs.create_lvol("thick", 1 << 20, false).unwrap();
    let thin = lvs.create_lvol("thin", 2 << 20, true).unwrap();
    assert_eq!(lvs.info().free_clusters, total - 16);
    assert_eq!(thick.info().num_blocks, (1 << 20) / 512);
    let a = pattern(7, 8192);
    write(&*thick, 60 << 10, &a); // crosses a cluster boundary
    write(&*thin, 124 << 10, &a);
    assert_eq!(read(&*thick, 60 << 10, 8192), a);
    assert_eq!(read(&*thin, 124 << 10, 8192), a);
    assert_eq!(read(&*thin, 0, 4096), vec![0; 4096]);
    assert_eq!(lvs.lvol_info("thin").unwrap().num_allocated_clusters, 2);
    assert_eq!(lvs.lvol_info("lvs0/thin").unwrap().alias, "lvs0/thin");
    let uuid = thin.uuid().to_string();
    drop((thick, thin));
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    let thin = lvs.lvol(&uuid).unwrap();
    assert_eq!(thin.name(), "thin");
    assert_eq!(read(&*thin, 124 << 10, 8192), a);
    assert_eq!(read(&*lvs.lvol("thick").unwrap(), 60 << 10, 8192), a);
    assert_eq!(lvs.info().free_clusters, total - 18);
    assert!(matches!(
        lvs.create_lvol("thin", 1 << 20, true),
        Err(LvolError::Exists(_))
    ));
    assert!(matches!(
        lvs.create_lvol("big", 100 << 20, false),
        Err(LvolError::NoSpace { .. })
    ));
    // Thin volumes may be overprovisioned, as in SPDK.
    let over = lvs.create_lvol("over", 100 << 20, true).unwrap();
    write(&*over, (100 << 20) - 4096, &a[..4096]);
    assert_eq!(read(&*over, (100 << 20) - 4096, 4096), &a[..4096]);
    drop(over);
    lvs.delete("over").unwrap();
}

#[test]
fn snapshot_clone_merge() {
    let dev = FaultDev::new(8 << 20);
    let lvs = LvStore::create(dev.arc(), opts()).unwrap();
    let v = lvs.create_lvol("lvol0", 256 << 10, false).unwrap();
    let a = pattern(1, 256 << 10);
    write(&*v, 0, &a);
    let snap = lvs.snapshot("lvol0", "snap0").unwrap();
    assert!(snap.info().read_only);
    let i = lvs.lvol_info("lvol0").unwrap();
    assert!(i.thin && i.clone && i.base_snapshot.as_deref() == Some("snap0"));
    assert_eq!(i.num_allocated_clusters, 0);
    // Partial write to the origin: copy-on-write from the snapshot.
    let b = pattern(2, 4096);
    write(&*v, 4096, &b);
    let mut expect = a.clone();
    expect[4096..8192].copy_from_slice(&b);
    assert_eq!(read(&*v, 0, 256 << 10), expect);
    assert_eq!(read(&*snap, 0, 256 << 10), a);
    let c = lvs.clone("snap0", "clone0").unwrap();
    assert_eq!(read(&*c, 0, 256 << 10), a);
    let s = lvs.lvol_info("snap0").unwrap();
    assert!(s.snapshot);
    assert_eq!(s.clones, vec!["lvol0".to_string(), "clone0".to_string()]);
    let e = lvs.delete("snap0").unwrap_err();
    assert!(matches!(e, LvolError::NotPermitted(_)));
    assert_eq!(e.errno(), libc::EPERM);
    // Writing to a read-only snapshot fails.
    let mut io = SyncIo::new(&*snap).unwrap();
    assert!(io.write_at(0, &b).is_err());
    drop(io);
    lvs.delete("clone0").unwrap();
    drop((v, snap, c));
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    let free_before = lvs.info().free_clusters;
    lvs.delete("snap0").unwrap(); // merge into lvol0
    let i = lvs.lvol_info("lvol0").unwrap();
    assert!(!i.clone);
    assert_eq!(i.num_allocated_clusters, 4);
    assert_eq!(lvs.info().free_clusters, free_before + 1);
    let v = lvs.lvol("lvol0").unwrap();
    assert_eq!(read(&*v, 0, 256 << 10), expect);
    drop(v);
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    assert_eq!(lvs.list().len(), 1);
    assert_eq!(read(&*lvs.lvol("lvol0").unwrap(), 0, 256 << 10), expect);
}

#[test]
fn inflate_decouple_resize_rename() {
    let dev = FaultDev::new(8 << 20);
    let lvs = LvStore::create(dev.arc(), opts()).unwrap();
    let v = lvs.create_lvol("v", 256 << 10, true).unwrap();
    let a = pattern(3, 64 << 10);
    write(&*v, 64 << 10, &a);
    lvs.snapshot("v", "s").unwrap();
    let c1 = lvs.clone("s", "c1").unwrap();
    let c2 = lvs.clone("s", "c2").unwrap();
    lvs.decouple_parent("c1").unwrap();
    let i = lvs.lvol_info("c1").unwrap();
    assert!(i.thin && !i.clone && i.num_allocated_clusters == 1);
    lvs.inflate("c2").unwrap();
    let i = lvs.lvol_info("c2").unwrap();
    assert!(!i.thin && !i.clone && i.num_allocated_clusters == 4);
    assert_eq!(read(&*c1, 64 << 10, 64 << 10), a);
    assert_eq!(read(&*c2, 64 << 10, 64 << 10), a);
    assert_eq!(read(&*c2, 0, 64 << 10), vec![0; 64 << 10]);
    // Shrink the clone-of-snapshot then grow: the regrown part reads zeroes, not the parent.
    lvs.resize("v", 64 << 10).unwrap();
    lvs.resize("v", 256 << 10).unwrap();
    assert_eq!(read(&*v, 64 << 10, 64 << 10), vec![0; 64 << 10]);
    lvs.rename("c1", "d1").unwrap();
    assert!(lvs.lvol("c1").is_err());
    lvs.set_read_only("d1").unwrap();
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    let d1 = lvs.lvol("lvs0/d1").unwrap();
    assert!(d1.info().read_only);
    assert_eq!(d1.size_bytes(), 256 << 10);
    assert_eq!(read(&*d1, 64 << 10, 64 << 10), a);
    assert_eq!(
        read(&*lvs.lvol("v").unwrap(), 64 << 10, 64 << 10),
        vec![0; 64 << 10]
    );
}

#[test]
fn grow_and_destroy() {
    let dev = FaultDev::new(4 << 20);
    let lvs = LvStore::create(dev.arc(), opts()).unwrap();
    let before = lvs.info().total_data_clusters;
    dev.resize(8 << 20);
    assert_eq!(lvs.grow().unwrap(), before + 64);
    lvs.create_lvol("big", 6 << 20, false).unwrap();
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    assert_eq!(lvs.info().total_data_clusters, before + 64);
    lvs.destroy().unwrap();
    assert!(matches!(
        LvStore::open(dev.arc()),
        Err(LvolError::NotAnLvstore(_))
    ));
}

#[test]
fn malloc_default_cluster_size() {
    let dev: Arc<dyn BlockDevice> =
        Arc::new(katablk_bdev::malloc::MallocDevice::new((256 << 20) / 512, 512).unwrap());
    let lvs = LvStore::create(dev.clone(), LvsOptions::new("lvs0")).unwrap();
    let i = lvs.info();
    // Same numbers as SPDK on a 256 MiB bdev.
    assert_eq!(i.cluster_size, 4 << 20);
    assert_eq!(i.total_data_clusters, 63);
    let v = lvs.create_lvol("lvol0", 64 << 20, false).unwrap();
    assert_eq!(lvs.info().free_clusters, 47);
    let a = pattern(9, 1 << 20);
    write(&*v, (4 << 20) - (512 << 10), &a);
    assert_eq!(read(&*v, (4 << 20) - (512 << 10), 1 << 20), a);
}

#[test]
fn store_is_send_sync() {
    fn ok<T: Send + Sync>() {}
    ok::<LvStore>();
    ok::<katablk_lvol::Lvol>();
    ok::<Arc<katablk_lvol::Lvol>>();
}

#[test]
fn on_a_file() {
    use katablk_bdev::file::{FileDevice, FileOptions};
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(32 << 20).unwrap();
    let dev: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(f.path(), &FileOptions::default()).unwrap());
    let mut o = LvsOptions::new("lvs0");
    o.cluster_size = 1 << 20;
    let lvs = LvStore::create(dev, o).unwrap();
    let v = lvs.create_lvol("thin0", 8 << 20, true).unwrap();
    let a = pattern(11, 3 << 20);
    write(&*v, 512 << 10, &a);
    let s = lvs.snapshot("thin0", "snap0").unwrap();
    let c = lvs.clone("snap0", "clone0").unwrap();
    write(&*c, 1 << 20, &pattern(12, 4096));
    drop((v, s, c));
    drop(lvs);
    let dev: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(f.path(), &FileOptions::default()).unwrap());
    let lvs = LvStore::open(dev).unwrap();
    assert_eq!(read(&*lvs.lvol("thin0").unwrap(), 512 << 10, 3 << 20), a);
    let mut want = a.clone();
    let o = (1 << 20) - (512 << 10);
    want[o..o + 4096].copy_from_slice(&pattern(12, 4096));
    assert_eq!(
        read(&*lvs.lvol("clone0").unwrap(), 512 << 10, 3 << 20),
        want
    );
    let i = lvs.lvol_info("snap0").unwrap();
    assert_eq!(i.clones, vec!["thin0".to_string(), "clone0".to_string()]);
    assert_eq!(i.num_allocated_clusters, 4);
}

#[test]
fn metadata_region_full() {
    let dev = FaultDev::new(8 << 20);
    let mut o = opts();
    o.md_pages = Some(8);
    let lvs = LvStore::create(dev.arc(), o).unwrap();
    let mut made = 0;
    let err = loop {
        match lvs.create_lvol(&format!("v{made}"), u64::from(CS), true) {
            Ok(_) => made += 1,
            Err(e) => break e,
        }
        assert!(made < 100);
    };
    assert!(matches!(err, LvolError::MdFull(8)), "{err}");
    assert_eq!(err.errno(), libc::ENOSPC);
    assert_eq!(made, 4);
    // Still consistent: delete one, create again, reopen.
    lvs.delete("v0").unwrap();
    lvs.create_lvol("again", u64::from(CS), false).unwrap();
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    assert_eq!(lvs.list().len(), made);
    assert_eq!(lvs.info().free_md_pages as usize, 8 - made);
}

#[test]
fn handles_after_close_and_destroy() {
    let dev = FaultDev::new(8 << 20);
    let lvs = LvStore::create(dev.arc(), opts()).unwrap();
    let v = lvs.create_lvol("v", 4 * u64::from(CS), true).unwrap();
    write(&*v, 0, &pattern(1, 4096));
    lvs.snapshot("v", "s").unwrap();
    lvs.close();
    // Metadata changes are refused once closed (the super block says clean).
    assert!(matches!(
        lvs.create_lvol("x", 4096, true),
        Err(LvolError::Closed)
    ));
    // The clone still reads through its snapshot; allocating writes fail.
    let mut io = SyncIo::new(&*v).unwrap();
    let mut b = vec![0u8; 4096];
    io.read_at(0, &mut b).unwrap();
    assert_eq!(b, pattern(1, 4096));
    assert!(io.write_at(0, &b).is_err());
    drop(io);
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    let v = lvs.lvol("v").unwrap();
    lvs.destroy().unwrap();
    assert!(v.is_deleted());
    let mut io = SyncIo::new(&*v);
    assert!(io.is_err() || io.as_mut().unwrap().read_at(0, &mut b).is_err());
}

#[test]
fn block_size_4096() {
    let dev: Arc<dyn BlockDevice> =
        Arc::new(katablk_bdev::malloc::MallocDevice::new((32 << 20) / 4096, 4096).unwrap());
    let mut o = opts();
    o.cluster_size = 1 << 20;
    let lvs = LvStore::create(dev.clone(), o).unwrap();
    assert_eq!(lvs.info().block_size, 4096);
    let v = lvs.create_lvol("v", 4 << 20, true).unwrap();
    assert_eq!(v.info().block_size, 4096);
    assert_eq!(v.info().num_blocks, 1024);
    let a = pattern(3, 12288);
    write(&*v, (1 << 20) - 4096, &a);
    let mut io = SyncIo::new(&*v).unwrap();
    let mut b = vec![0u8; 512];
    assert!(
        io.read_at(0, &mut b).is_err(),
        "512-byte read on a 4096-byte volume"
    );
    drop(io);
    drop(v);
    drop(lvs);
    let lvs = LvStore::open(dev).unwrap();
    assert_eq!(read(&*lvs.lvol("v").unwrap(), (1 << 20) - 4096, 12288), a);
}

#[test]
fn inflate_in_chunks() {
    let dev = FaultDev::new(16 << 20);
    let lvs = LvStore::create(dev.arc(), opts()).unwrap();
    let v = lvs.create_lvol("v", 40 * u64::from(CS), true).unwrap();
    for c in (0..40u64).step_by(3) {
        write(&*v, c * u64::from(CS) + 512, &pattern(c + 1, 4096));
    }
    lvs.snapshot("v", "s").unwrap();
    let c1 = lvs.clone("s", "c1").unwrap();
    let c2 = lvs.clone("s", "c2").unwrap();
    write(&*c1, 5 * u64::from(CS), &pattern(99, 4096));
    lvs.inflate("c1").unwrap();
    lvs.decouple_parent("c2").unwrap();
    let i1 = lvs.lvol_info("c1").unwrap();
    assert!(!i1.thin && !i1.clone && i1.num_allocated_clusters == 40);
    let i2 = lvs.lvol_info("c2").unwrap();
    assert!(i2.thin && !i2.clone && i2.num_allocated_clusters == 14);
    drop((c1, c2));
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    let c1 = lvs.lvol("c1").unwrap();
    let c2 = lvs.lvol("c2").unwrap();
    let cs = u64::from(CS);
    for c in 0..40u64 {
        let want = if c % 3 == 0 {
            pattern(c + 1, 4096)
        } else {
            vec![0; 4096]
        };
        let off = c * cs + 512;
        if c == 5 {
            assert_eq!(read(&*c1, 5 * cs, 4096), pattern(99, 4096));
        } else {
            assert_eq!(read(&*c1, off, 4096), want, "c1 cluster {c}");
        }
        assert_eq!(read(&*c2, off, 4096), want, "c2 cluster {c}");
    }
    drop(v);
}

#[test]
fn rename_store_persists_and_aliases_follow() {
    use katablk_bdev::malloc::MallocDevice;
    use katablk_lvol::{LvStore, LvsOptions};
    use std::sync::Arc;
    let dev: Arc<dyn katablk_bdev::BlockDevice> = Arc::new(MallocDevice::new(65536, 512).unwrap());
    let lvs = LvStore::create(dev.clone(), LvsOptions::new("old")).unwrap();
    lvs.create_lvol("v", 4 << 20, true).unwrap();
    lvs.rename_store("new").unwrap();
    assert_eq!(lvs.name(), "new");
    assert_eq!(lvs.list()[0].alias, "new/v");
    assert!(lvs.lvol("new/v").is_ok());
    assert!(lvs.rename_store("").is_err());
    assert!(lvs.rename_store("a/b").is_err());
    assert!(
        lvs.rename_store("a\0b").is_err(),
        "a NUL would make the super block unreadable"
    );
    drop(lvs);
    let lvs = LvStore::open(dev).unwrap();
    assert_eq!(lvs.name(), "new");
    assert_eq!(lvs.lvol("new/v").unwrap().alias(), "new/v");
}
