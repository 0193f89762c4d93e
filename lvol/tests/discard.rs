//! Discards of whole clusters of thin volumes give the clusters back to the store (SPDK
//! releases clusters of thin blobs on unmap); everything else keeps passing discards down.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::*;
use katablk_bdev::sync::SyncIo;
use katablk_bdev::BlockDevice;
use katablk_lvol::{LvStore, LvsOptions};

const CS: u64 = 64 << 10;
const CSZ: usize = CS as usize;
const DEV: usize = 4 << 20;

fn store(dev: &Arc<dyn BlockDevice>) -> LvStore {
    let mut o = LvsOptions::new("lvs0");
    o.cluster_size = CS as u32;
    LvStore::create(dev.clone(), o).unwrap()
}

fn alloc(lvs: &LvStore, name: &str) -> u64 {
    lvs.lvol_info(name).unwrap().num_allocated_clusters
}

fn accounting(lvs: &LvStore) {
    // Clusters released while requests to them were still running become free shortly after.
    assert!(lvs.settle_releases(std::time::Duration::from_secs(10)));
    let info = lvs.info();
    let allocated: u64 = lvs.list().iter().map(|l| l.num_allocated_clusters).sum();
    assert_eq!(allocated + info.free_clusters, info.total_data_clusters);
}

fn is(got: &[u8], want: &[u8]) -> bool {
    got == want
}

#[test]
fn whole_clusters_of_thin_volumes_are_released() {
    let dev = FaultDev::new(DEV);
    let lvs = store(&dev.arc());
    let v = lvs.create_lvol("v", 8 * CS, true).unwrap();
    for c in 0..8 {
        write(&*v, c * CS, &pattern(c + 1, CSZ));
    }
    let free0 = lvs.info().free_clusters;
    assert_eq!(alloc(&lvs, "v"), 8);
    let mut io = SyncIo::new(&*v).unwrap();
    // Clusters 1 and 2 whole, plus a partial range of cluster 4 and half of cluster 5.
    io.discard(CS, 2 * CS).unwrap();
    io.discard(4 * CS + 4096, CS - 4096).unwrap();
    io.discard(5 * CS, CS / 2).unwrap();
    assert_eq!(lvs.info().free_clusters, free0 + 2);
    assert_eq!(alloc(&lvs, "v"), 6);
    accounting(&lvs);
    // Write-zeroes with unmap releases too; without unmap it does not.
    io.write_zeroes(6 * CS, CS, true).unwrap();
    io.write_zeroes(7 * CS, CS, false).unwrap();
    assert_eq!(lvs.info().free_clusters, free0 + 3);
    assert_eq!(alloc(&lvs, "v"), 5);
    let check = |v: &dyn BlockDevice| {
        for c in [1, 2, 6, 7] {
            assert!(is(&read(v, c * CS, CSZ), &[0u8; CSZ]), "cluster {c}");
        }
        for c in [0, 3] {
            assert!(
                is(&read(v, c * CS, CSZ), &pattern(c + 1, CSZ)),
                "cluster {c}"
            );
        }
        assert!(is(&read(v, 4 * CS, 4096), &pattern(5, CSZ)[..4096]));
        assert!(is(
            &read(v, 5 * CS + CS / 2, CSZ / 2),
            &pattern(6, CSZ)[CSZ / 2..]
        ));
    };
    check(&*v);
    io.flush().unwrap();
    drop(io);
    drop(v);
    let free = lvs.info().free_clusters;
    // A crash now: the releases were committed.
    let crashed = FaultDev::from_image(dev.crash_image(CrashMode::KeepAll));
    drop(lvs);
    for d in [dev, crashed] {
        let lvs = LvStore::open(d.arc()).unwrap();
        assert_eq!(lvs.info().free_clusters, free);
        assert_eq!(alloc(&lvs, "v"), 5);
        let v = lvs.lvol("v").unwrap();
        check(&*v);
        // A released cluster is allocated again by the next write.
        write(&*v, CS + 8192, &pattern(99, 4096));
        assert_eq!(alloc(&lvs, "v"), 6);
        let got = read(&*v, CS, CSZ);
        assert!(is(&got[8192..12288], &pattern(99, 4096)));
        assert!(got[..8192].iter().chain(&got[12288..]).all(|&b| b == 0));
        accounting(&lvs);
    }
}

#[test]
fn thick_volumes_keep_their_clusters() {
    let dev = FaultDev::new(DEV);
    let lvs = store(&dev.arc());
    let v = lvs.create_lvol("v", 4 * CS, false).unwrap();
    write(&*v, 0, &pattern(1, 4 * CSZ));
    let free = lvs.info().free_clusters;
    let mut io = SyncIo::new(&*v).unwrap();
    io.discard(0, 4 * CS).unwrap();
    io.write_zeroes(0, CS, true).unwrap();
    assert_eq!(lvs.info().free_clusters, free);
    assert_eq!(alloc(&lvs, "v"), 4);
    // The discard reached the device (which reads discarded blocks as zeroes).
    assert!(read(&*v, 0, 4 * CSZ).iter().all(|&b| b == 0));
}

#[test]
fn clone_discard_never_exposes_parent_data() {
    let dev = FaultDev::new(DEV);
    let lvs = store(&dev.arc());
    let v = lvs.create_lvol("v", 8 * CS, true).unwrap();
    write(&*v, 0, &pattern(1, 4 * CSZ)); // clusters 0-3
    lvs.snapshot("v", "s").unwrap();
    let c = lvs.clone("s", "c").unwrap();
    // Own clusters of the clone: 1 over parent data, 6 with nothing below.
    write(&*c, CS, &pattern(2, CSZ));
    write(&*c, 6 * CS, &pattern(3, CSZ));
    assert_eq!(alloc(&lvs, "c"), 2);
    let free = lvs.info().free_clusters;
    let mut io = SyncIo::new(&*c).unwrap();
    io.discard(0, 8 * CS).unwrap();
    // Cluster 6 was released; cluster 1 kept (releasing it would show the snapshot's data).
    assert_eq!(lvs.info().free_clusters, free + 1);
    assert_eq!(alloc(&lvs, "c"), 1);
    let got = read(&*c, CS, CSZ);
    assert!(
        !is(&got, &pattern(1, 4 * CSZ)[CSZ..2 * CSZ]),
        "parent data exposed"
    );
    assert!(got.iter().all(|&b| b == 0));
    assert!(read(&*c, 6 * CS, CSZ).iter().all(|&b| b == 0));
    // Unallocated clusters of the clone still read through to the snapshot (SPDK semantics:
    // a discard never allocates).
    assert!(is(&read(&*c, 0, CSZ), &pattern(1, CSZ)));
    // Write-zeroes with unmap over parent data allocates zeroes instead.
    io.write_zeroes(2 * CS, CS, true).unwrap();
    assert!(read(&*c, 2 * CS, CSZ).iter().all(|&b| b == 0));
    assert!(is(
        &read(&*lvs.lvol("s").unwrap(), 0, 4 * CSZ),
        &pattern(1, 4 * CSZ)
    ));
    // The snapshot itself is read-only.
    let s = lvs.lvol("s").unwrap();
    assert!(SyncIo::new(&*s).unwrap().discard(0, CS).is_err());
    accounting(&lvs);
}

#[test]
fn discards_race_writes_on_several_channels() {
    let dev = AsyncDev {
        inner: FaultDev::new(DEV),
    };
    let dev: Arc<dyn BlockDevice> = Arc::new(dev);
    let lvs = Arc::new(store(&dev));
    let v = lvs.create_lvol("v", 16 * CS, true).unwrap();
    let w = lvs.create_lvol("w", 24 * CS, true).unwrap();
    const ROUNDS: u64 = 12;
    let mut threads = Vec::new();
    // Writers on clusters 0-5 of v, each on its own channel: data must stay intact.
    for t in 0..2u64 {
        let v = v.clone();
        threads.push(std::thread::spawn(move || {
            let mut io = SyncIo::new(&*v).unwrap();
            for r in 0..ROUNDS * 4 {
                for c in (t * 3)..(t * 3 + 3) {
                    let tag = 1000 * (t + 1) + r * 16 + c;
                    io.write_at(c * CS + (r % 16) * 4096, &pattern(tag, 4096))
                        .unwrap();
                    let mut b = vec![0u8; 4096];
                    io.read_at(c * CS + (r % 16) * 4096, &mut b).unwrap();
                    assert!(b == pattern(tag, 4096), "writer {t} cluster {c} round {r}");
                }
            }
        }));
    }
    // Writers that fill clusters 8-15 of v and discard them again, with readers alongside.
    for t in 0..2u64 {
        let v = v.clone();
        threads.push(std::thread::spawn(move || {
            let mut io = SyncIo::new(&*v).unwrap();
            for r in 0..ROUNDS {
                for c in (8 + t * 4)..(12 + t * 4) {
                    let tag = 50_000 + t * 10_000 + r * 16 + c;
                    io.write_at(c * CS, &pattern(tag, CSZ)).unwrap();
                    let mut b = vec![0u8; CSZ];
                    io.read_at(c * CS, &mut b).unwrap();
                    assert!(b == pattern(tag, CSZ), "cluster {c} round {r}");
                    io.discard(c * CS, CS).unwrap();
                    io.read_at(c * CS, &mut b).unwrap();
                    assert!(b.iter().all(|&x| x == 0), "cluster {c} round {r} not zero");
                }
            }
        }));
    }
    {
        let v = v.clone();
        threads.push(std::thread::spawn(move || {
            let mut io = SyncIo::new(&*v).unwrap();
            let mut b = vec![0u8; CSZ];
            for r in 0..ROUNDS * 8 {
                let c = 8 + r % 8;
                io.read_at(c * CS, &mut b).unwrap();
                let tag = u64::from_le_bytes(b[..8].try_into().unwrap());
                // Zeroes, or the whole pattern of one of the writers of that cluster.
                assert!(
                    tag == 0 && b.iter().all(|&x| x == 0)
                        || (50_000..80_000).contains(&tag) && b == pattern(tag, CSZ),
                    "cluster {c}: foreign data (tag {tag})"
                );
            }
        }));
    }
    // Another volume allocating clusters meanwhile (it gets the released ones) and checking
    // that nobody else's writes land in them.
    {
        let w = w.clone();
        threads.push(std::thread::spawn(move || {
            let mut io = SyncIo::new(&*w).unwrap();
            for r in 0..ROUNDS * 2 {
                for c in 0..24 {
                    let tag = 90_000 + r * 32 + c;
                    io.write_at(c * CS, &pattern(tag, CSZ)).unwrap();
                }
                for c in 0..24 {
                    let mut b = vec![0u8; CSZ];
                    io.read_at(c * CS, &mut b).unwrap();
                    assert!(b == pattern(90_000 + r * 32 + c, CSZ), "w cluster {c}");
                }
                for c in (r % 2..24).step_by(2) {
                    io.discard(c * CS, CS).unwrap();
                }
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    accounting(&lvs);
    assert!(lvs.info().free_clusters > 0);
    drop((v, w));
    let lvs = Arc::try_unwrap(lvs).unwrap();
    drop(lvs);
    let lvs = LvStore::open(dev).unwrap();
    assert!(lvs.open_report().masks_used, "{:?}", lvs.open_report());
    accounting(&lvs);
}

#[test]
fn release_waits_for_reads_in_flight() {
    // A read of a cluster is slow; meanwhile the cluster is discarded and another volume
    // allocates. The released cluster must not be reused before the read has finished.
    let dev: Arc<dyn BlockDevice> = Arc::new(AsyncDev {
        inner: FaultDev::new(DEV),
    });
    let lvs = store(&dev);
    let v = lvs.create_lvol("v", CS, true).unwrap();
    let w = lvs.create_lvol("w", 64 * CS, true).unwrap();
    write(&*v, 0, &pattern(1, CSZ));
    // Make the free clusters other than the one v will give back unattractive: fill them.
    let free = lvs.info().free_clusters;
    let mut wio = SyncIo::new(&*w).unwrap();
    for c in 1..=free {
        wio.write_at(c * CS, &pattern(2, 4096)).unwrap();
    }
    assert_eq!(lvs.info().free_clusters, 0);
    READ_DELAY_US.store(40_000, std::sync::atomic::Ordering::SeqCst);
    let v2 = v.clone();
    let reader = std::thread::spawn(move || read(&*v2, 0, CSZ));
    std::thread::sleep(std::time::Duration::from_millis(10));
    SyncIo::new(&*v).unwrap().discard(0, CS).unwrap();
    // w gets the released cluster and overwrites it.
    wio.write_at(0, &pattern(3, CSZ)).unwrap();
    let got = reader.join().unwrap();
    READ_DELAY_US.store(0, std::sync::atomic::Ordering::SeqCst);
    assert!(
        got == pattern(1, CSZ),
        "the read saw data written after the release"
    );
    assert!(read(&*w, 0, CSZ) == pattern(3, CSZ));
    assert!(read(&*v, 0, CSZ).iter().all(|&b| b == 0));
    accounting(&lvs);
}

#[test]
fn a_release_waiting_for_a_read_holds_up_nothing_else() {
    // A read of v's cluster takes 2 s. Meanwhile the cluster is discarded: the cluster is out
    // of v at once but free (and the discard complete) only when the read has finished, and
    // the first write of another volume is served meanwhile (it gets another cluster).
    let dev: Arc<dyn BlockDevice> = Arc::new(AsyncDev {
        inner: FaultDev::new(DEV),
    });
    let lvs = store(&dev);
    let v = lvs.create_lvol("v", CS, true).unwrap();
    let w = lvs.create_lvol("w", 4 * CS, true).unwrap();
    write(&*v, 0, &pattern(1, CSZ));
    let free0 = lvs.info().free_clusters;
    READ_DELAY_US.store(2_000_000, std::sync::atomic::Ordering::SeqCst);
    let read_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (v2, rd) = (v.clone(), read_done.clone());
    let reader = std::thread::spawn(move || {
        let got = read(&*v2, 0, CSZ);
        rd.store(true, std::sync::atomic::Ordering::SeqCst);
        got
    });
    std::thread::sleep(std::time::Duration::from_millis(100));
    let v3 = v.clone();
    let discarder = std::thread::spawn(move || SyncIo::new(&*v3).unwrap().discard(0, CS));
    let t = std::time::Instant::now();
    while lvs.releasing_clusters() == 0 {
        assert!(t.elapsed().as_secs() < 10, "the release was not committed");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(alloc(&lvs, "v"), 0);
    assert_eq!(lvs.info().free_clusters, free0);
    SyncIo::new(&*w)
        .unwrap()
        .write_at(0, &pattern(2, 4096))
        .unwrap();
    assert!(
        !read_done.load(std::sync::atomic::Ordering::SeqCst),
        "the first write of w waited for the read of v"
    );
    assert_eq!(alloc(&lvs, "w"), 1);
    let got = reader.join().unwrap();
    discarder.join().unwrap().unwrap();
    // The discard completed after the read, with its cluster free.
    assert_eq!(lvs.releasing_clusters(), 0);
    assert_eq!(lvs.info().free_clusters, free0);
    READ_DELAY_US.store(0, std::sync::atomic::Ordering::SeqCst);
    assert!(got == pattern(1, CSZ));
    accounting(&lvs);
    // Closing with nothing in flight writes consistent masks: the clean reopen uses them.
    drop(v);
    drop(w);
    lvs.close();
    drop(lvs);
    let lvs = LvStore::open(dev.clone()).unwrap();
    assert!(lvs.open_report().masks_used, "{:?}", lvs.open_report());
    accounting(&lvs);
}

#[test]
fn inflate_ends_while_discards_keep_releasing() {
    // Inflate fills every unallocated cluster of a thin volume; a discarder keeps releasing
    // whole clusters of it meanwhile. The inflate must finish, with every cluster allocated.
    let dev = FaultDev::new(DEV);
    let lvs = Arc::new(store(&dev.arc()));
    let n = 24;
    let v = lvs.create_lvol("v", n * CS, true).unwrap();
    for c in 0..n {
        write(&*v, c * CS, &pattern(c + 1, 4096));
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (v2, stop2) = (v.clone(), stop.clone());
    let discarder = std::thread::spawn(move || {
        let mut io = SyncIo::new(&*v2).unwrap();
        let mut c = 0;
        let mut rounds = 0u64;
        while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
            io.discard(c * CS, CS).unwrap();
            c = (c + 1) % n;
            rounds += 1;
        }
        rounds
    });
    std::thread::sleep(std::time::Duration::from_millis(20));
    lvs.inflate("v").unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let rounds = discarder.join().unwrap();
    assert!(rounds > 0);
    let info = lvs.lvol_info("v").unwrap();
    assert!(!info.thin);
    assert_eq!(info.num_allocated_clusters, n);
    accounting(&lvs);
}

/// Writes, flushes and whole-cluster discards on "v"; `stage` counts the completed steps
/// that are durable (each ends with a flush or a committed release).
fn release_workload(lvs: &LvStore, stage: &mut u32) -> Result<(), ()> {
    let v = lvs.lvol("v").map_err(|_| ())?;
    let mut io = SyncIo::new(&*v).map_err(|_| ())?;
    for c in 0..6 {
        io.write_at(c * CS, &pattern(c + 1, CSZ)).map_err(|_| ())?;
    }
    io.flush().map_err(|_| ())?;
    *stage = 1;
    io.discard(CS, 2 * CS).map_err(|_| ())?;
    io.discard(4 * CS, CS).map_err(|_| ())?;
    *stage = 2;
    io.write_at(2 * CS, &pattern(20, CSZ)).map_err(|_| ())?;
    io.flush().map_err(|_| ())?;
    *stage = 3;
    io.discard(0, CS).map_err(|_| ())?;
    *stage = 4;
    let w = lvs.create_lvol("w", 2 * CS, true).map_err(|_| ())?;
    let mut wio = SyncIo::new(&*w).map_err(|_| ())?;
    wio.write_at(0, &pattern(30, 2 * CSZ)).map_err(|_| ())?;
    wio.flush().map_err(|_| ())?;
    *stage = 5;
    Ok(())
}

#[test]
fn crash_during_releases() {
    let base = {
        let dev = FaultDev::new(DEV);
        let lvs = store(&dev.arc());
        lvs.create_lvol("v", 6 * CS, true).unwrap();
        drop(lvs);
        dev.image()
    };
    let dev = FaultDev::from_image(base.clone());
    let lvs = LvStore::open(dev.arc()).unwrap();
    let before = dev.writes();
    release_workload(&lvs, &mut 0).unwrap();
    let total = dev.writes() - before;
    drop(lvs);
    for n in 0..=total {
        for mode in [CrashMode::KeepAll, CrashMode::Random(n + 3)] {
            let dev = FaultDev::from_image(base.clone());
            let lvs = LvStore::open(dev.arc()).unwrap();
            dev.fail_after(n);
            let mut stage = 0;
            let _ = release_workload(&lvs, &mut stage);
            drop(lvs);
            let ctx = format!("crash after write {n}/{total} ({mode:?}), stage {stage}");
            let d2 = FaultDev::from_image(dev.crash_image(mode));
            // Opening checks that no cluster is claimed twice.
            let lvs = LvStore::open(d2.arc()).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            accounting(&lvs);
            let v = lvs.lvol("v").unwrap();
            let c = |i: u64| read(&*v, i * CS, CSZ);
            let zero = vec![0u8; CSZ];
            if stage >= 1 {
                assert!(c(3) == pattern(4, CSZ) && c(5) == pattern(6, CSZ), "{ctx}");
                assert!(
                    c(0) == pattern(1, CSZ) || (stage >= 3 && c(0) == zero),
                    "{ctx}"
                );
                for (i, t) in [(1, 2), (4, 5)] {
                    let ok = if stage >= 2 {
                        c(i) == zero
                    } else {
                        c(i) == zero || c(i) == pattern(t, CSZ)
                    };
                    assert!(ok, "{ctx}: cluster {i}");
                }
            }
            if stage >= 3 {
                assert!(c(2) == pattern(20, CSZ), "{ctx}");
            }
            if stage >= 4 {
                assert!(c(0) == zero, "{ctx}");
            }
            if stage >= 5 {
                let w = lvs.lvol("w").unwrap();
                assert!(read(&*w, 0, 2 * CSZ) == pattern(30, 2 * CSZ), "{ctx}");
            }
            drop(v);
            drop(lvs);
            let lvs = LvStore::open(d2.arc()).unwrap_or_else(|e| panic!("{ctx}: reopen {e}"));
            assert!(lvs.open_report().masks_used, "{ctx}");
            accounting(&lvs);
        }
    }
}
