//! `bdev_set_qos_limit` on katablk-target: SPDK's parameters, checks and errors, the limits
//! reported in `bdev_get_bdevs`, applied live to a controller serving a guest, an lvol's limit
//! independent of its lvstore's base, and kept across a restart (and a kill -9).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use katablk_rpc::methods::*;
use katablk_rpc::{RpcClient, RpcError};

thread_local! {
    /// One runtime for the whole test: a client's connection lives on the runtime it was
    /// made on.
    static RT: tokio::runtime::Runtime = rt();
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    RT.with(|r| r.block_on(f))
}

fn set(rpc: &RpcClient, p: BdevSetQosLimitParams) -> Result<bool, RpcError> {
    block_on(rpc.call_method::<BdevSetQosLimit>(&p))
}

fn limits(rpc: &RpcClient, name: &str) -> RateLimits {
    block_on(rpc.bdev_get_bdevs(Some(name))).unwrap()[0]
        .assigned_rate_limits
        .clone()
}

fn code(r: Result<bool, RpcError>) -> i32 {
    match r {
        Err(e) => e
            .code()
            .unwrap_or_else(|| panic!("expected an RPC error, got {e:?}")),
        Ok(v) => panic!("expected an RPC error, got {v:?}"),
    }
}

/// 4 KiB reads, one at a time, for `dur`; returns how many completed.
fn reads_for(blk: &mut Client, dur: Duration) -> u64 {
    let t0 = Instant::now();
    let mut n = 0;
    while t0.elapsed() < dur {
        blk.read_ok(0, (n % 64) * 4096, 4096);
        n += 1;
    }
    n
}

#[test]
fn limits_are_checked_reported_applied_live_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let img = image(dir.path(), "disk.img", 64 * MIB);
    let mut t = Target::start(dir.path(), &["--state-dir", state.to_str().unwrap()]);
    let rpc = client(&t);
    block_on(provision_lvol(&rpc, &img, 8, false));
    let q = |name: &str| BdevSetQosLimitParams {
        name: name.into(),
        ..Default::default()
    };
    // SPDK's refusals: no limit given, an I/O limit not a multiple of 1000, no such bdev.
    assert_eq!(code(set(&rpc, q("lvs0/vol"))), -32602);
    assert_eq!(
        code(set(
            &rpc,
            BdevSetQosLimitParams {
                rw_ios_per_sec: Some(1500),
                ..q("lvs0/vol")
            }
        )),
        -22
    );
    assert_eq!(
        code(set(
            &rpc,
            BdevSetQosLimitParams {
                rw_ios_per_sec: Some(1000),
                ..q("nosuch")
            }
        )),
        -19
    );
    assert_eq!(limits(&rpc, "lvs0/vol"), RateLimits::default());

    // A guest already running: unlimited first.
    let mut blk = Client::connect(&t.ctrlr_socket("ctrlr0"), 1, false).unwrap();
    let free = reads_for(&mut blk, Duration::from_millis(500));
    // 1000 I/Os per second, set while it runs, on the lvol only.
    assert!(set(
        &rpc,
        BdevSetQosLimitParams {
            rw_ios_per_sec: Some(1000),
            r_mbytes_per_sec: Some(10),
            ..q("lvs0/vol")
        }
    )
    .unwrap());
    let got = limits(&rpc, "lvs0/vol");
    assert_eq!(got.rw_ios_per_sec, 1000);
    assert_eq!(got.r_mbytes_per_sec, 10);
    assert_eq!(got.rw_mbytes_per_sec, 0);
    assert_eq!(
        limits(&rpc, "aio0"),
        RateLimits::default(),
        "the base is not limited"
    );
    let t0 = Instant::now();
    let n = reads_for(&mut blk, Duration::from_secs(1));
    let secs = t0.elapsed().as_secs_f64();
    assert!(
        n as f64 <= 1000.0 * secs * 1.05 + 60.0,
        "{n} in {secs:.2} s"
    );
    assert!(
        free < 550 || n < free * 2,
        "not throttled: {n} in 1 s vs {free} in 0.5 s free"
    );
    // The time spent waiting is counted, per bdev (katablk's extension to bdev_get_iostat).
    let st = block_on(
        rpc.bdev_get_iostat(&katablk_rpc::methods::BdevGetIostatParams {
            name: Some("lvs0/vol".into()),
            ..Default::default()
        }),
    )
    .unwrap();
    let vol = &st.bdevs[0];
    if n + 100 < free * 2 {
        assert!(vol.katablk_qos_throttled_requests.unwrap() > 0, "{vol:?}");
        assert!(
            vol.katablk_qos_throttled_ns.unwrap() > 100_000_000,
            "{vol:?}"
        );
    }
    // Partial update: the I/O limit goes, the read limit stays.
    assert!(set(
        &rpc,
        BdevSetQosLimitParams {
            rw_ios_per_sec: Some(0),
            ..q("lvs0/vol")
        }
    )
    .unwrap());
    let got = limits(&rpc, "lvs0/vol");
    assert_eq!((got.rw_ios_per_sec, got.r_mbytes_per_sec), (0, 10));
    drop(blk);

    // Kept across a kill -9 and a restart, in the saved configuration.
    assert!(set(
        &rpc,
        BdevSetQosLimitParams {
            rw_ios_per_sec: Some(2000),
            ..q("lvs0/vol")
        }
    )
    .unwrap());
    let saved = std::fs::read_to_string(state.join("config.json")).unwrap();
    assert!(saved.contains("bdev_set_qos_limit"), "{saved}");
    t.kill9();
    t.spawn();
    let rpc = client(&t);
    let got = limits(&rpc, "lvs0/vol");
    assert_eq!((got.rw_ios_per_sec, got.r_mbytes_per_sec), (2000, 10));
    let mut blk = Client::connect(&t.ctrlr_socket("ctrlr0"), 1, false).unwrap();
    let t0 = Instant::now();
    let n = reads_for(&mut blk, Duration::from_millis(800));
    let secs = t0.elapsed().as_secs_f64();
    assert!(
        n as f64 <= 2000.0 * secs * 1.05 + 110.0,
        "{n} in {secs:.2} s"
    );
    drop(blk);
    // A deleted volume's limits go with it.
    block_on(rpc.vhost_delete_controller("ctrlr0")).unwrap();
    block_on(rpc.bdev_lvol_delete("lvs0/vol")).unwrap();
    let saved = std::fs::read_to_string(state.join("config.json")).unwrap();
    assert!(!saved.contains("bdev_set_qos_limit"), "{saved}");
    assert!(t.term().success());
}

#[test]
fn a_group_shares_one_budget_and_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let mut t = Target::start(dir.path(), &["--state-dir", state.to_str().unwrap()]);
    let rpc = client(&t);
    block_on(async {
        for i in 0..2 {
            rpc.bdev_malloc_create(&BdevMallocCreateParams {
                name: Some(format!("m{i}")),
                num_blocks: 16384,
                block_size: 512,
                ..Default::default()
            })
            .await
            .unwrap();
            rpc.vhost_create_blk_controller(&VhostCreateBlkControllerParams {
                ctrlr: format!("c{i}"),
                dev_name: format!("m{i}"),
                ..Default::default()
            })
            .await
            .unwrap();
        }
    });
    let group = |bdevs: Option<Vec<String>>, ios: Option<u64>| KatablkSetQosGroupParams {
        name: "pod-1".into(),
        rw_ios_per_sec: ios,
        bdevs,
        ..Default::default()
    };
    let set_group =
        |p: KatablkSetQosGroupParams| block_on(rpc.call_method::<KatablkSetQosGroup>(&p));
    // A member that does not exist: -19, nothing made.
    assert_eq!(
        set_group(group(Some(vec!["nosuch".into()]), Some(1000)))
            .unwrap_err()
            .code(),
        Some(-19)
    );
    assert!(
        block_on(rpc.call_method::<KatablkGetQosGroups>(&NoParams {}))
            .unwrap()
            .is_empty()
    );
    assert!(set_group(group(Some(vec!["m0".into(), "m1".into()]), Some(1000))).unwrap());
    let g = block_on(rpc.call_method::<KatablkGetQosGroups>(&NoParams {})).unwrap();
    assert_eq!(g.len(), 1);
    assert_eq!(g[0].assigned_rate_limits.rw_ios_per_sec, 1000);
    assert_eq!(g[0].bdevs, ["m0", "m1"]);
    // The members' own limits are untouched.
    assert_eq!(limits(&rpc, "m0"), RateLimits::default());

    let run_both = |t: &Target, dur: Duration| -> u64 {
        let socks = [t.ctrlr_socket("c0"), t.ctrlr_socket("c1")];
        let hs: Vec<_> = socks
            .into_iter()
            .map(|s| {
                std::thread::spawn(move || {
                    let mut b = Client::connect(&s, 1, false).unwrap();
                    reads_for(&mut b, dur)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    };
    let t0 = Instant::now();
    let n = run_both(&t, Duration::from_secs(1));
    let secs = t0.elapsed().as_secs_f64();
    assert!(
        n as f64 <= 1000.0 * secs * 1.05 + 110.0,
        "{n} in {secs:.2} s"
    );

    // Kept across a restart.
    assert!(t.term().success());
    t.spawn();
    let rpc2 = client(&t);
    let g = block_on(rpc2.call_method::<KatablkGetQosGroups>(&NoParams {})).unwrap();
    assert_eq!((g.len(), g[0].bdevs.len()), (1, 2), "{g:?}");
    let t0 = Instant::now();
    let n = run_both(&t, Duration::from_millis(800));
    let secs = t0.elapsed().as_secs_f64();
    assert!(
        n as f64 <= 1000.0 * secs * 1.05 + 110.0,
        "{n} in {secs:.2} s"
    );
    // Deleted: the members are free again.
    assert!(block_on(
        rpc2.call_method::<KatablkDeleteQosGroup>(&KatablkDeleteQosGroupParams {
            name: "pod-1".into()
        })
    )
    .unwrap());
    let t0 = Instant::now();
    let n = run_both(&t, Duration::from_millis(800));
    assert!(
        n as f64 > 1000.0 * t0.elapsed().as_secs_f64() * 1.2 || n > 2000,
        "still throttled after the group was deleted: {n}"
    );
    assert!(t.term().success());
}
