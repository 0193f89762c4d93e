//! The sequence recorded from a real SPDK in `shared/spdk-rpc-samples/` gives the same reported
//! numbers and flags here.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use katablk_bdev::malloc::MallocDevice;
use katablk_bdev::BlockDevice;
use katablk_lvol::{LvStore, LvolInfo, LvsOptions};

fn flags(i: &LvolInfo) -> (bool, bool, bool, u64) {
    (i.thin, i.snapshot, i.clone, i.num_allocated_clusters)
}

#[test]
fn same_numbers_as_spdk() {
    // SPDK's aio0 in the samples: a 256 MiB file with 512-byte blocks.
    let dev: Arc<dyn BlockDevice> = Arc::new(MallocDevice::new((256 << 20) / 512, 512).unwrap());
    let lvs = LvStore::create(dev.clone(), LvsOptions::new("lvs0")).unwrap();
    let i = lvs.info();
    assert_eq!((i.cluster_size, i.block_size), (4194304, 512));
    assert_eq!((i.total_data_clusters, i.free_clusters), (63, 63));
    let lvol0 = lvs.create_lvol("lvol0", 64 << 20, false).unwrap();
    let thin0 = lvs.create_lvol("thin0", 128 << 20, true).unwrap();
    assert_eq!(lvol0.info().num_blocks, 131072);
    assert_eq!(thin0.info().num_blocks, 262144);
    assert_eq!(lvs.lvol_info("lvs0/lvol0").unwrap().alias, "lvs0/lvol0");
    assert_eq!(
        flags(&lvs.lvol_info("lvol0").unwrap()),
        (false, false, false, 16)
    );
    assert_eq!(
        flags(&lvs.lvol_info("thin0").unwrap()),
        (true, false, false, 0)
    );
    assert_eq!(lvs.info().free_clusters, 47);
    // Errors: duplicate (-17), oversized (no space), delete snapshot with clones (EPERM).
    assert_eq!(
        lvs.create_lvol("lvol0", 16 << 20, false)
            .unwrap_err()
            .errno(),
        libc::EEXIST
    );
    assert_eq!(
        lvs.create_lvol("big", 999999 << 20, false)
            .unwrap_err()
            .errno(),
        libc::ENOSPC
    );
    let snap0 = lvs.snapshot("lvs0/lvol0", "snap0").unwrap();
    lvs.clone("lvs0/snap0", "clone0").unwrap();
    let l0 = lvs.lvol_info("lvol0").unwrap();
    assert_eq!(flags(&l0), (true, false, true, 0));
    assert_eq!(l0.base_snapshot.as_deref(), Some("snap0"));
    assert_eq!(lvol0.info().num_blocks, 131072);
    let s0 = lvs.lvol_info("snap0").unwrap();
    assert_eq!(flags(&s0), (false, true, false, 16));
    assert_eq!(s0.clones, vec!["lvol0".to_string(), "clone0".to_string()]);
    assert!(snap0.info().read_only);
    let c0 = lvs.lvol_info("clone0").unwrap();
    assert_eq!(flags(&c0), (true, false, true, 0));
    assert_eq!(c0.num_blocks, 131072);
    lvs.resize("lvs0/thin0", 192 << 20).unwrap();
    assert_eq!(thin0.info().num_blocks, 393216);
    assert_eq!(lvs.delete("lvs0/snap0").unwrap_err().errno(), libc::EPERM);
    let fin = lvs.list();
    let names: Vec<&str> = fin.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["lvol0", "thin0", "snap0", "clone0"]);
    let i = lvs.info();
    assert_eq!((i.total_data_clusters, i.free_clusters), (63, 47));
    let uuids: Vec<String> = fin.iter().map(|l| l.uuid.to_string()).collect();
    drop((lvol0, thin0, snap0));
    drop(lvs);
    // "reload": the same report after examine.
    let lvs = LvStore::open(dev).unwrap();
    assert_eq!(lvs.list(), fin);
    for u in &uuids {
        assert!(lvs.lvol(u).is_ok());
    }
}
