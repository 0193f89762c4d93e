//! Crash tests: the device dies after the N-th write (for many N) and loses or tears what was
//! not flushed; the store must reopen with every acknowledged, flushed write intact.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::*;
use katablk_bdev::sync::SyncIo;
use katablk_bdev::BlockDevice;
use katablk_lvol::{LvStore, LvsOptions};

const CS: u64 = 64 << 10;
const BLK: usize = 4096;
const DEV: usize = 4 << 20;

#[derive(Clone, Debug)]
struct VolM {
    /// Candidate tags per block (the last is the newest; all are possible until a flush).
    blocks: Vec<Vec<u64>>,
    exists_certain: bool,
    /// Blocks that are certainly inside the volume.
    sure_blocks: usize,
}

impl VolM {
    fn new(bytes: u64) -> Self {
        let n = (bytes as usize) / BLK;
        VolM {
            blocks: vec![vec![0]; n],
            exists_certain: true,
            sure_blocks: n,
        }
    }
}

#[derive(Default)]
struct Model {
    vols: BTreeMap<String, VolM>,
    tag: u64,
}

impl Model {
    fn settle(&mut self) {
        for v in self.vols.values_mut() {
            for b in &mut v.blocks {
                let last = *b.last().unwrap();
                *b = vec![last];
            }
        }
    }
}

struct Stop;

fn w(lvs: &LvStore, m: &mut Model, name: &str, blk: usize, nblk: usize) -> Result<(), Stop> {
    let vol = lvs.lvol(name).map_err(|_| Stop)?;
    let mut data = Vec::with_capacity(nblk * BLK);
    for i in 0..nblk {
        m.tag += 1;
        data.extend_from_slice(&pattern(m.tag, BLK));
        m.vols.get_mut(name).unwrap().blocks[blk + i].push(m.tag);
    }
    let mut io = SyncIo::new(&*vol).map_err(|_| Stop)?;
    io.write_at((blk * BLK) as u64, &data).map_err(|_| Stop)
}

fn flush(lvs: &LvStore, m: &mut Model, name: &str) -> Result<(), Stop> {
    let vol = lvs.lvol(name).map_err(|_| Stop)?;
    let mut io = SyncIo::new(&*vol).map_err(|_| Stop)?;
    io.flush().map_err(|_| Stop)?;
    m.settle();
    Ok(())
}

fn md<T, E>(m: &mut Model, r: Result<T, E>) -> Result<T, Stop> {
    match r {
        Ok(t) => {
            m.settle();
            Ok(t)
        }
        Err(_) => Err(Stop),
    }
}

fn workload(dev: &FaultDev, lvs: &LvStore, m: &mut Model) -> Result<(), Stop> {
    m.vols.insert("a".into(), VolM::new(4 * CS));
    m.vols.get_mut("a").unwrap().exists_certain = false;
    md(m, lvs.create_lvol("a", 4 * CS, false))?;
    m.vols.get_mut("a").unwrap().exists_certain = true;
    m.vols.insert("b".into(), VolM::new(6 * CS));
    m.vols.get_mut("b").unwrap().exists_certain = false;
    md(m, lvs.create_lvol("b", 6 * CS, true))?;
    m.vols.get_mut("b").unwrap().exists_certain = true;
    w(lvs, m, "a", 3, 20)?;
    w(lvs, m, "b", 14, 6)?;
    flush(lvs, m, "a")?;
    w(lvs, m, "b", 40, 3)?;
    w(lvs, m, "a", 0, 1)?;
    flush(lvs, m, "b")?;
    // Snapshot a: its content is a's content now.
    let mut s = m.vols["a"].clone();
    s.exists_certain = false;
    m.vols.insert("sa".into(), s);
    md(m, lvs.snapshot("a", "sa"))?;
    m.vols.get_mut("sa").unwrap().exists_certain = true;
    w(lvs, m, "a", 5, 2)?; // copy-on-write
    w(lvs, m, "b", 1, 1)?;
    flush(lvs, m, "a")?;
    let mut c = m.vols["sa"].clone();
    c.exists_certain = false;
    m.vols.insert("ca".into(), c);
    md(m, lvs.clone("sa", "ca"))?;
    m.vols.get_mut("ca").unwrap().exists_certain = true;
    w(lvs, m, "ca", 30, 4)?;
    w(lvs, m, "ca", 60, 1)?;
    flush(lvs, m, "ca")?;
    // Grow and shrink b.
    m.vols
        .get_mut("b")
        .unwrap()
        .blocks
        .resize(8 * CS as usize / BLK, vec![0]);
    md(m, lvs.resize("b", 8 * CS))?;
    m.vols.get_mut("b").unwrap().sure_blocks = 8 * CS as usize / BLK;
    w(lvs, m, "b", 100, 8)?;
    flush(lvs, m, "b")?;
    m.vols.get_mut("b").unwrap().sure_blocks = 5 * CS as usize / BLK;
    md(m, lvs.resize("b", 5 * CS))?;
    m.vols
        .get_mut("b")
        .unwrap()
        .blocks
        .truncate(5 * CS as usize / BLK);
    // Delete the clone, then the snapshot (merge into a).
    m.vols.get_mut("ca").unwrap().exists_certain = false;
    md(m, lvs.delete("ca"))?;
    m.vols.remove("ca");
    m.vols.get_mut("sa").unwrap().exists_certain = false;
    md(m, lvs.delete("sa"))?;
    m.vols.remove("sa");
    w(lvs, m, "a", 40, 10)?;
    flush(lvs, m, "a")?;
    // The device grows; so does the store.
    dev.resize(DEV + (1 << 20));
    md(m, lvs.grow())?;
    m.vols.insert("t".into(), VolM::new(3 * CS));
    m.vols.get_mut("t").unwrap().exists_certain = false;
    md(m, lvs.create_lvol("t", 3 * CS, true))?;
    m.vols.get_mut("t").unwrap().exists_certain = true;
    w(lvs, m, "t", 2, 30)?;
    w(lvs, m, "a", 12, 1)?;
    flush(lvs, m, "t")?;
    w(lvs, m, "t", 40, 2)?; // never flushed
    Ok(())
}

fn verify(lvs: &LvStore, m: &Model, ctx: &str) {
    let info = lvs.info();
    let list = lvs.list();
    let allocated: u64 = list.iter().map(|l| l.num_allocated_clusters).sum();
    assert_eq!(
        allocated + info.free_clusters,
        info.total_data_clusters,
        "{ctx}: cluster accounting"
    );
    for l in &list {
        assert!(
            m.vols.contains_key(&l.name),
            "{ctx}: unexpected volume {}",
            l.name
        );
    }
    for (name, vm) in &m.vols {
        let Ok(vol) = lvs.lvol(name) else {
            assert!(!vm.exists_certain, "{ctx}: volume {name} lost");
            continue;
        };
        let n = vm.sure_blocks.min(vm.blocks.len());
        assert!(vol.size_bytes() as usize >= n * BLK, "{ctx}: {name} shrank");
        let mut io = SyncIo::new(&*vol).unwrap();
        let mut buf = vec![0u8; n * BLK];
        io.read_at(0, &mut buf).unwrap();
        for (b, cands) in vm.blocks[..n].iter().enumerate() {
            let got = &buf[b * BLK..(b + 1) * BLK];
            for s in 0..BLK / BS {
                let sec = &got[s * BS..(s + 1) * BS];
                let ok = cands
                    .iter()
                    .any(|&t| &pattern(t, BLK)[s * BS..(s + 1) * BS] == sec);
                assert!(
                    ok,
                    "{ctx}: {name} block {b} sector {s}: got tag {:?}, candidates {cands:?}",
                    &sec[..8]
                );
            }
        }
    }
}

fn fresh() -> (FaultDev, LvStore) {
    static BASE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let img = BASE.get_or_init(|| {
        let dev = FaultDev::new(DEV);
        let mut o = LvsOptions::new("lvs0");
        o.cluster_size = CS as u32;
        drop(LvStore::create(dev.arc(), o).unwrap());
        dev.crash_image(CrashMode::KeepAll)
    });
    let dev = FaultDev::from_image(img.clone());
    let lvs = LvStore::open(dev.arc()).unwrap();
    (dev, lvs)
}

#[test]
fn workload_without_crash() {
    let (dev, lvs) = fresh();
    let mut m = Model::default();
    assert!(workload(&dev, &lvs, &mut m).is_ok());
    verify(&lvs, &m, "live");
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    assert!(lvs.open_report().masks_used, "{:?}", lvs.open_report());
    verify(&lvs, &m, "reopen");
}

#[test]
fn crash_at_every_write() {
    let (dev, lvs) = fresh();
    let base = dev.writes();
    let mut m = Model::default();
    assert!(workload(&dev, &lvs, &mut m).is_ok());
    let total = dev.writes() - base;
    drop(lvs);
    let mut runs = 0;
    for n in 0..=total {
        for mode in [CrashMode::KeepAll, CrashMode::Random(n * 7 + 1)] {
            let (dev, lvs) = fresh();
            dev.fail_after(n);
            let mut m = Model::default();
            let _ = workload(&dev, &lvs, &mut m);
            drop(lvs);
            let img = dev.crash_image(mode);
            let ctx = format!("crash after write {n}/{total} ({mode:?})");
            let dev2 = FaultDev::from_image(img);
            let lvs = LvStore::open(dev2.arc()).unwrap_or_else(|e| panic!("{ctx}: open: {e}"));
            let r = lvs.open_report();
            // Dirty after a crash (masks ignored); clean (masks used) only when the device
            // outlived the workload and the close.
            assert!(
                r.masks_used == r.clean && r.mask_fallback.is_none(),
                "{ctx}: {r:?}"
            );
            verify(&lvs, &m, &ctx);
            // Still usable, and a second open (after the scrub) sees the same.
            let v = lvs.create_lvol("after", CS, true).unwrap();
            write(&*v, 0, &pattern(u64::MAX, BLK));
            drop(v);
            drop(lvs);
            let lvs = LvStore::open(dev2.arc()).unwrap_or_else(|e| panic!("{ctx}: reopen: {e}"));
            let r = lvs.open_report();
            assert!(r.masks_used && r.mask_fallback.is_none(), "{ctx}: {r:?}");
            assert_eq!(
                read(&*lvs.lvol("after").unwrap(), 0, BLK),
                pattern(u64::MAX, BLK)
            );
            lvs.delete("after").unwrap();
            verify(&lvs, &m, &ctx);
            runs += 1;
        }
    }
    eprintln!("{runs} crash points over {total} writes");
    assert!(runs > 100, "only {runs} crash points");
}

#[test]
fn crash_during_create() {
    // An interrupted create must open cleanly or fail with an error, never panic.
    for n in 0..12 {
        let dev = FaultDev::new(DEV);
        dev.fail_after(n);
        let mut o = LvsOptions::new("lvs0");
        o.cluster_size = CS as u32;
        let _ = LvStore::create(dev.arc(), o);
        for mode in [CrashMode::KeepAll, CrashMode::Random(n)] {
            let d2 = FaultDev::from_image(dev.crash_image(mode));
            match LvStore::open(d2.arc()) {
                Ok(l) => assert!(l.list().is_empty()),
                Err(e) => assert!(!e.to_string().is_empty()),
            }
        }
    }
}

#[allow(dead_code)]
fn _unused(_: &dyn BlockDevice) {}

#[derive(Debug, Clone)]
enum COp {
    Create {
        thin: bool,
        clusters: u64,
    },
    Write {
        vol: usize,
        blk: usize,
        n: usize,
    },
    Flush {
        vol: usize,
    },
    Snapshot {
        vol: usize,
    },
    Clone {
        vol: usize,
    },
    Delete {
        vol: usize,
    },
    Resize {
        vol: usize,
        clusters: u64,
    },
    Discard {
        vol: usize,
        blk: usize,
        n: usize,
        whole: bool,
    },
    Reopen,
}

fn cop() -> impl proptest::strategy::Strategy<Value = COp> {
    use proptest::prelude::*;
    prop_oneof![
        2 => (any::<bool>(), 1u64..4).prop_map(|(thin, clusters)| COp::Create { thin, clusters }),
        6 => (any::<usize>(), any::<usize>(), 1usize..20).prop_map(|(vol, blk, n)| COp::Write { vol, blk, n }),
        2 => any::<usize>().prop_map(|vol| COp::Flush { vol }),
        2 => any::<usize>().prop_map(|vol| COp::Snapshot { vol }),
        2 => any::<usize>().prop_map(|vol| COp::Clone { vol }),
        2 => any::<usize>().prop_map(|vol| COp::Delete { vol }),
        1 => (any::<usize>(), 1u64..5).prop_map(|(vol, clusters)| COp::Resize { vol, clusters }),
        2 => (any::<usize>(), any::<usize>(), 1usize..40, any::<bool>())
            .prop_map(|(vol, blk, n, whole)| COp::Discard { vol, blk, n, whole }),
        1 => Just(COp::Reopen),
    ]
}

/// Relations the random workload needs to predict which operations are refused.
#[derive(Default)]
struct Rel {
    ro: std::collections::BTreeSet<String>,
    parent: BTreeMap<String, String>,
    next: u64,
}

fn random_workload(
    dev: &FaultDev,
    lvs: &mut Option<LvStore>,
    m: &mut Model,
    rel: &mut Rel,
    ops: &[COp],
) -> Result<(), Stop> {
    for op in ops {
        let names: Vec<String> = m.vols.keys().cloned().collect();
        let pick = |i: usize| names.get(i % names.len().max(1)).cloned();
        let l = lvs.as_ref().ok_or(Stop)?;
        match op {
            COp::Create { thin, clusters } => {
                rel.next += 1;
                let name = format!("v{}", rel.next);
                let mut v = VolM::new(clusters * CS);
                v.exists_certain = false;
                m.vols.insert(name.clone(), v);
                md(m, l.create_lvol(&name, clusters * CS, *thin))?;
                m.vols.get_mut(&name).unwrap().exists_certain = true;
            }
            COp::Write { vol, blk, n } => {
                let Some(name) = pick(*vol) else { continue };
                if rel.ro.contains(&name) {
                    continue;
                }
                let len = m.vols[&name].blocks.len();
                let blk = blk % len;
                let n = (*n).min(len - blk);
                w(l, m, &name, blk, n)?;
            }
            COp::Flush { vol } => {
                let Some(name) = pick(*vol) else { continue };
                flush(l, m, &name)?;
            }
            COp::Snapshot { vol } => {
                let Some(name) = pick(*vol) else { continue };
                if rel.ro.contains(&name) {
                    continue;
                }
                rel.next += 1;
                let s = format!("s{}", rel.next);
                let mut sm = m.vols[&name].clone();
                sm.exists_certain = false;
                m.vols.insert(s.clone(), sm);
                md(m, l.snapshot(&name, &s))?;
                m.vols.get_mut(&s).unwrap().exists_certain = true;
                if let Some(p) = rel.parent.get(&name).cloned() {
                    rel.parent.insert(s.clone(), p);
                }
                rel.parent.insert(name, s.clone());
                rel.ro.insert(s);
            }
            COp::Clone { vol } => {
                let Some(name) = pick(*vol) else { continue };
                if !rel.ro.contains(&name) {
                    continue;
                }
                rel.next += 1;
                let c = format!("c{}", rel.next);
                let mut cm = m.vols[&name].clone();
                cm.exists_certain = false;
                m.vols.insert(c.clone(), cm);
                md(m, l.clone(&name, &c))?;
                m.vols.get_mut(&c).unwrap().exists_certain = true;
                rel.parent.insert(c, name);
            }
            COp::Delete { vol } => {
                let Some(name) = pick(*vol) else { continue };
                let clones: Vec<String> = rel
                    .parent
                    .iter()
                    .filter(|(_, p)| **p == name)
                    .map(|(c, _)| c.clone())
                    .collect();
                if clones.len() > 1 {
                    continue;
                }
                m.vols.get_mut(&name).unwrap().exists_certain = false;
                md(m, l.delete(&name))?;
                m.vols.remove(&name);
                let gp = rel.parent.remove(&name);
                for c in clones {
                    match &gp {
                        Some(g) => rel.parent.insert(c, g.clone()),
                        None => rel.parent.remove(&c),
                    };
                }
                rel.ro.remove(&name);
            }
            COp::Resize { vol, clusters } => {
                let Some(name) = pick(*vol) else { continue };
                if rel.ro.contains(&name) {
                    continue;
                }
                let nb = (clusters * CS) as usize / BLK;
                let v = m.vols.get_mut(&name).unwrap();
                let old = v.blocks.len();
                v.sure_blocks = old.min(nb);
                if nb > old {
                    v.blocks.resize(nb, vec![0]);
                }
                if nb == old {
                    // Nothing changes, nothing is written: not a flush of earlier writes.
                    l.resize(&name, clusters * CS).map_err(|_| Stop)?;
                    continue;
                }
                md(m, l.resize(&name, clusters * CS))?;
                let v = m.vols.get_mut(&name).unwrap();
                v.blocks.truncate(nb);
                v.sure_blocks = nb;
            }
            COp::Discard { vol, blk, n, whole } => {
                // Volumes without a parent only: discarded blocks then read as zeroes (released
                // clusters, or the device's discard), or as before until a flush.
                let Some(name) = pick(*vol) else { continue };
                if rel.ro.contains(&name) || rel.parent.contains_key(&name) {
                    continue;
                }
                let per = CS as usize / BLK;
                let len = m.vols[&name].blocks.len();
                let (mut blk, mut n) = (blk % len, (*n).min(len - blk % len));
                if *whole {
                    blk = blk / per * per;
                    n = (n.div_ceil(per) * per).min(len - blk);
                }
                for b in &mut m.vols.get_mut(&name).unwrap().blocks[blk..blk + n] {
                    b.push(0);
                }
                let vol = l.lvol(&name).map_err(|_| Stop)?;
                let mut io = SyncIo::new(&*vol).map_err(|_| Stop)?;
                io.discard((blk * BLK) as u64, (n * BLK) as u64)
                    .map_err(|_| Stop)?;
            }
            COp::Reopen => {
                *lvs = None;
                *lvs = Some(LvStore::open(dev.arc()).map_err(|_| Stop)?);
            }
        }
    }
    Ok(())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 32, ..Default::default() })]

    #[test]
    fn random_workload_crash(
        ops in proptest::collection::vec(cop(), 1..25),
        permille in 0u64..1000,
        seed in 0u64..1000,
    ) {
        // Count the writes of a clean run, then crash at a point inside it.
        let (dev, lvs) = fresh();
        let base = dev.writes();
        let mut m = Model::default();
        let mut lvs = Some(lvs);
        let clean = random_workload(&dev, &mut lvs, &mut m, &mut Rel::default(), &ops);
        let total = dev.writes() - base;
        drop(lvs);
        proptest::prop_assume!(clean.is_ok());
        let n = total * permille / 1000;
        let (dev, lvs) = fresh();
        dev.fail_after(n);
        let mut m = Model::default();
        let mut lvs = Some(lvs);
        let _ = random_workload(&dev, &mut lvs, &mut m, &mut Rel::default(), &ops);
        drop(lvs);
        let mode = if seed % 2 == 0 { CrashMode::KeepAll } else { CrashMode::Random(seed) };
        let ctx = format!("crash after write {n}/{total} ({mode:?})");
        let d2 = FaultDev::from_image(dev.crash_image(mode));
        let lvs = LvStore::open(d2.arc()).unwrap_or_else(|e| panic!("{ctx}: open: {e}"));
        verify(&lvs, &m, &ctx);
        drop(lvs);
        let lvs = LvStore::open(d2.arc()).unwrap_or_else(|e| panic!("{ctx}: reopen: {e}"));
        let r = lvs.open_report();
        proptest::prop_assert!(r.masks_used && r.mask_fallback.is_none(), "{}: {:?}", ctx, r);
        verify(&lvs, &m, &ctx);
    }
}
