//! Property test: random sequences of volume operations checked against an in-memory model,
//! with the store reopened in between.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::*;
use katablk_bdev::sync::SyncIo;
use katablk_lvol::{LvStore, LvolError, LvsOptions};
use proptest::prelude::*;

const CS: u64 = 64 << 10;
const BLK: usize = 4096;
const PER: usize = (CS as usize) / BLK;

#[derive(Debug, Clone)]
enum Op {
    Create {
        thin: bool,
        clusters: usize,
    },
    Write {
        vol: usize,
        blk: usize,
        n: usize,
    },
    Snapshot {
        vol: usize,
    },
    Clone {
        vol: usize,
    },
    Resize {
        vol: usize,
        clusters: usize,
    },
    Delete {
        vol: usize,
    },
    Inflate {
        vol: usize,
    },
    Decouple {
        vol: usize,
    },
    Rename {
        vol: usize,
    },
    ReadOnly {
        vol: usize,
    },
    Discard {
        vol: usize,
        blk: usize,
        n: usize,
        whole: bool,
    },
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<bool>(), 1usize..5).prop_map(|(thin, clusters)| Op::Create { thin, clusters }),
        6 => (any::<usize>(), any::<usize>(), 1usize..10).prop_map(|(vol, blk, n)| Op::Write { vol, blk, n }),
        2 => any::<usize>().prop_map(|vol| Op::Snapshot { vol }),
        2 => any::<usize>().prop_map(|vol| Op::Clone { vol }),
        2 => (any::<usize>(), 1usize..6).prop_map(|(vol, clusters)| Op::Resize { vol, clusters }),
        2 => any::<usize>().prop_map(|vol| Op::Delete { vol }),
        1 => any::<usize>().prop_map(|vol| Op::Inflate { vol }),
        1 => any::<usize>().prop_map(|vol| Op::Decouple { vol }),
        1 => any::<usize>().prop_map(|vol| Op::Rename { vol }),
        1 => any::<usize>().prop_map(|vol| Op::ReadOnly { vol }),
        2 => (any::<usize>(), any::<usize>(), 1usize..3 * PER, any::<bool>())
            .prop_map(|(vol, blk, n, whole)| Op::Discard { vol, blk, n, whole }),
        1 => Just(Op::Reopen),
    ]
}

#[derive(Debug, Clone)]
struct M {
    blocks: Vec<u64>,
    ro: bool,
    parent: Option<String>,
}

struct Sim {
    dev: FaultDev,
    lvs: Option<LvStore>,
    vols: BTreeMap<String, M>,
    next: u64,
}

impl Sim {
    fn lvs(&self) -> &LvStore {
        self.lvs.as_ref().unwrap()
    }

    fn pick(&self, i: usize) -> Option<String> {
        if self.vols.is_empty() {
            return None;
        }
        self.vols.keys().nth(i % self.vols.len()).cloned()
    }

    fn fresh(&mut self, p: &str) -> String {
        self.next += 1;
        format!("{p}{}", self.next)
    }

    fn clones(&self, name: &str) -> usize {
        self.vols
            .values()
            .filter(|m| m.parent.as_deref() == Some(name))
            .count()
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Create { thin, clusters } => {
                let name = self.fresh("v");
                match self.lvs().create_lvol(&name, *clusters as u64 * CS, *thin) {
                    Ok(_) => {
                        self.vols.insert(
                            name,
                            M {
                                blocks: vec![0; clusters * PER],
                                ro: false,
                                parent: None,
                            },
                        );
                    }
                    Err(LvolError::NoSpace { .. }) => {}
                    Err(e) => panic!("create: {e}"),
                }
            }
            Op::Write { vol, blk, n } => {
                let Some(name) = self.pick(*vol) else { return };
                let m = &self.vols[&name];
                let blk = blk % m.blocks.len();
                let n = (*n).min(m.blocks.len() - blk);
                let mut data = Vec::new();
                let mut tags = Vec::new();
                for _ in 0..n {
                    self.next += 1;
                    tags.push(self.next);
                    data.extend_from_slice(&pattern(self.next, BLK));
                }
                let v = self.lvs().lvol(&name).unwrap();
                let mut io = SyncIo::new(&*v).unwrap();
                let r = io.write_at((blk * BLK) as u64, &data);
                if m.ro {
                    assert!(r.is_err(), "write to read-only {name} succeeded");
                } else {
                    r.unwrap();
                    let m = self.vols.get_mut(&name).unwrap();
                    m.blocks[blk..blk + n].copy_from_slice(&tags);
                }
            }
            Op::Snapshot { vol } => {
                let Some(name) = self.pick(*vol) else { return };
                let s = self.fresh("s");
                let r = self.lvs().snapshot(&name, &s);
                let m = self.vols[&name].clone();
                if m.ro {
                    assert!(r.is_err());
                    return;
                }
                r.unwrap();
                self.vols.insert(
                    s.clone(),
                    M {
                        blocks: m.blocks.clone(),
                        ro: true,
                        parent: m.parent.clone(),
                    },
                );
                self.vols.get_mut(&name).unwrap().parent = Some(s);
            }
            Op::Clone { vol } => {
                let Some(name) = self.pick(*vol) else { return };
                let c = self.fresh("c");
                let r = self.lvs().clone(&name, &c);
                let m = self.vols[&name].clone();
                if !m.ro {
                    assert!(r.is_err());
                    return;
                }
                r.unwrap();
                self.vols.insert(
                    c,
                    M {
                        blocks: m.blocks,
                        ro: false,
                        parent: Some(name),
                    },
                );
            }
            Op::Resize { vol, clusters } => {
                let Some(name) = self.pick(*vol) else { return };
                let r = self.lvs().resize(&name, *clusters as u64 * CS);
                let m = self.vols.get_mut(&name).unwrap();
                if m.ro {
                    assert!(r.is_err());
                    return;
                }
                match r {
                    Ok(()) => m.blocks.resize(clusters * PER, 0),
                    Err(LvolError::NoSpace { .. }) => {}
                    Err(e) => panic!("resize: {e}"),
                }
            }
            Op::Delete { vol } => {
                let Some(name) = self.pick(*vol) else { return };
                let r = self.lvs().delete(&name);
                if self.clones(&name) > 1 {
                    assert!(matches!(r, Err(LvolError::NotPermitted(_))));
                    return;
                }
                r.unwrap();
                let m = self.vols.remove(&name).unwrap();
                for x in self.vols.values_mut() {
                    if x.parent.as_deref() == Some(name.as_str()) {
                        x.parent = m.parent.clone();
                    }
                }
            }
            Op::Inflate { vol } | Op::Decouple { vol } => {
                let Some(name) = self.pick(*vol) else { return };
                let inflate = matches!(op, Op::Inflate { .. });
                let r = if inflate {
                    self.lvs().inflate(&name)
                } else {
                    self.lvs().decouple_parent(&name)
                };
                let m = self.vols.get_mut(&name).unwrap();
                if m.ro || (!inflate && m.parent.is_none()) {
                    assert!(r.is_err());
                    return;
                }
                match r {
                    Ok(()) => m.parent = None,
                    Err(LvolError::NoSpace { .. }) => {}
                    Err(e) => panic!("inflate/decouple: {e}"),
                }
            }
            Op::Rename { vol } => {
                let Some(name) = self.pick(*vol) else { return };
                let new = self.fresh("r");
                self.lvs().rename(&name, &new).unwrap();
                let m = self.vols.remove(&name).unwrap();
                self.vols.insert(new.clone(), m);
                for x in self.vols.values_mut() {
                    if x.parent.as_deref() == Some(name.as_str()) {
                        x.parent = Some(new.clone());
                    }
                }
            }
            Op::ReadOnly { vol } => {
                let Some(name) = self.pick(*vol) else { return };
                self.lvs().set_read_only(&name).unwrap();
                self.vols.get_mut(&name).unwrap().ro = true;
            }
            Op::Discard { vol, blk, n, whole } => {
                // Only volumes without a parent: their discarded blocks read as zeroes whether
                // the clusters are released (thin, whole clusters) or the device discards
                // them (which the test device zeroes).
                let Some(name) = self.pick(*vol) else { return };
                let m = &self.vols[&name];
                if m.parent.is_some() {
                    return;
                }
                let len = m.blocks.len();
                let (mut blk, mut n) = (blk % len, (*n).min(len - blk % len));
                if *whole {
                    blk = blk / PER * PER;
                    n = n.div_ceil(PER) * PER;
                    n = n.min(len - blk);
                }
                let v = self.lvs().lvol(&name).unwrap();
                let mut io = SyncIo::new(&*v).unwrap();
                let r = io.discard((blk * BLK) as u64, (n * BLK) as u64);
                if m.ro {
                    assert!(r.is_err(), "discard of read-only {name} succeeded");
                    return;
                }
                r.unwrap();
                let m = self.vols.get_mut(&name).unwrap();
                m.blocks[blk..blk + n].fill(0);
            }
            Op::Reopen => {
                self.lvs = None;
                self.lvs = Some(LvStore::open(self.dev.arc()).unwrap());
                // A clean shutdown: the persisted masks must agree with the metadata.
                let r = self.lvs().open_report();
                assert!(r.masks_used && r.mask_fallback.is_none(), "{r:?}");
            }
        }
    }

    fn check(&self) {
        let lvs = self.lvs();
        let list = lvs.list();
        let names: Vec<&str> = list.iter().map(|l| l.name.as_str()).collect();
        let want: Vec<&str> = self.vols.keys().map(|s| s.as_str()).collect();
        let mut names_sorted = names.clone();
        names_sorted.sort();
        assert_eq!(names_sorted, want);
        let info = lvs.info();
        let alloc: u64 = list.iter().map(|l| l.num_allocated_clusters).sum();
        assert_eq!(alloc + info.free_clusters, info.total_data_clusters);
        for l in &list {
            let m = &self.vols[&l.name];
            assert_eq!(l.size_bytes as usize, m.blocks.len() * BLK, "{}", l.name);
            assert_eq!(l.read_only, m.ro, "{}", l.name);
            assert_eq!(l.base_snapshot, m.parent, "{}", l.name);
            let v = lvs.lvol(&l.name).unwrap();
            let mut io = SyncIo::new(&*v).unwrap();
            let mut buf = vec![0u8; m.blocks.len() * BLK];
            io.read_at(0, &mut buf).unwrap();
            for (i, &t) in m.blocks.iter().enumerate() {
                assert!(
                    buf[i * BLK..(i + 1) * BLK] == pattern(t, BLK)[..],
                    "{} block {i}: want tag {t}, got {:?}",
                    l.name,
                    &buf[i * BLK..i * BLK + 8]
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_ops_match_model(ops in proptest::collection::vec(op(), 1..60)) {
        let dev = FaultDev::new(24 << 20);
        let mut o = LvsOptions::new("lvs0");
        o.cluster_size = CS as u32;
        let lvs = LvStore::create(dev.arc(), o).unwrap();
        let mut sim = Sim { dev, lvs: Some(lvs), vols: BTreeMap::new(), next: 0 };
        for op in &ops {
            sim.apply(op);
            sim.check();
        }
        sim.apply(&Op::Reopen);
        sim.check();
    }
}
