//! Rate limits through CSI: StorageClass parameters at CreateVolume, a VolumeAttributesClass
//! (`mutable_parameters`) at CreateVolume and at ControllerModifyVolume, each ending up as the
//! lvol's `bdev_set_qos_limit` on the target (read back from `bdev_get_bdevs`), and the
//! refusals for what cannot change or is not a valid limit.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use katablk_csi::csi;
use tonic::Code;

async fn limits(e: &Env, vid: &str) -> katablk_rpc::methods::RateLimits {
    e.driver.rpc.bdev_get_bdevs(Some(vid)).await.unwrap()[0]
        .assigned_rate_limits
        .clone()
}

fn modify(vid: &str, kv: &[(&str, &str)]) -> csi::ControllerModifyVolumeRequest {
    csi::ControllerModifyVolumeRequest {
        volume_id: vid.into(),
        mutable_parameters: kv.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_from_the_class_and_changed_with_modify_volume() {
    let mut e = Env::start().await;
    let caps = e
        .controller
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(caps.capabilities.iter().any(|c| matches!(
        &c.r#type,
        Some(csi::controller_service_capability::Type::Rpc(r))
            if r.r#type == csi::controller_service_capability::rpc::Type::ModifyVolume as i32
    )));

    let mut r = create_req("pvc-qos", 64 << 20);
    r.parameters.insert("rwIosPerSec".into(), "2000".into());
    r.parameters.insert("wMBytesPerSec".into(), "50".into());
    // A VolumeAttributesClass given at creation wins over the StorageClass.
    r.mutable_parameters
        .insert("wMBytesPerSec".into(), "20".into());
    let v = e
        .controller
        .create_volume(r.clone())
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let l = limits(&e, &v.volume_id).await;
    assert_eq!(
        (l.rw_ios_per_sec, l.w_mbytes_per_sec, l.r_mbytes_per_sec),
        (2000, 20, 0)
    );
    // Idempotent retry: the same volume, the same limits.
    let again = e
        .controller
        .create_volume(r)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(again.volume_id, v.volume_id);

    // Changed live, any number of times.
    for (ios, rmb) in [("5000", "10"), ("0", "10"), ("3000", "0")] {
        e.controller
            .controller_modify_volume(modify(
                &v.volume_id,
                &[("rwIosPerSec", ios), ("rMBytesPerSec", rmb)],
            ))
            .await
            .unwrap();
        let l = limits(&e, &v.volume_id).await;
        assert_eq!(l.rw_ios_per_sec.to_string(), ios);
        assert_eq!(l.r_mbytes_per_sec.to_string(), rmb);
        assert_eq!(l.w_mbytes_per_sec, 20, "untouched limits stay");
    }

    // Refusals: a parameter that is not mutable, a bad value, an I/O limit SPDK refuses, a
    // volume that does not exist, an empty id.
    for (kv, want) in [
        (vec![("thinProvision", "true")], Code::InvalidArgument),
        (vec![("rwIosPerSec", "fast")], Code::InvalidArgument),
        (vec![("rwIosPerSec", "1234")], Code::InvalidArgument),
    ] {
        let got = code(
            e.controller
                .controller_modify_volume(modify(&v.volume_id, &kv))
                .await,
        );
        assert_eq!(got, want, "{kv:?}");
    }
    assert_eq!(
        code(
            e.controller
                .controller_modify_volume(modify("lvs0/nosuch", &[("rwIosPerSec", "1000")]))
                .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(e.controller.controller_modify_volume(modify("", &[])).await),
        Code::InvalidArgument
    );
    let mut bad = create_req("pvc-qos-bad", 64 << 20);
    bad.mutable_parameters.insert("lvs".into(), "other".into());
    assert_eq!(
        code(e.controller.create_volume(bad).await),
        Code::InvalidArgument
    );
    let l = limits(&e, &v.volume_id).await;
    assert_eq!(l.rw_ios_per_sec, 3000, "a refused change changes nothing");
}

async fn groups(e: &Env) -> Vec<katablk_rpc::methods::QosGroupInfo> {
    e.driver
        .rpc
        .call_method::<katablk_rpc::methods::KatablkGetQosGroups>(
            &katablk_rpc::methods::NoParams {},
        )
        .await
        .unwrap()
}

async fn pod_volume(e: &mut Env, name: &str, kv: &[(&str, &str)]) -> csi::Volume {
    let mut r = create_req(name, 64 << 20);
    for (k, v) in kv {
        r.parameters.insert((*k).into(), (*v).into());
    }
    e.controller
        .create_volume(r)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
}

fn pod_publish(
    e: &Env,
    v: &csi::Volume,
    pod: &str,
    uid: Option<&str>,
) -> csi::NodePublishVolumeRequest {
    let tp = e.target_path(&format!("{pod}-{}", v.volume_id.replace('/', "-")));
    std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
    let mut pr = publish_req(&v.volume_id, &tp, block_cap(), false);
    pr.volume_context = v.volume_context.clone();
    // What kubelet adds with podInfoOnMount: true (pkg/volume/csi/csi_mounter.go).
    pr.volume_context
        .insert("csi.storage.k8s.io/pod.name".into(), pod.into());
    pr.volume_context
        .insert("csi.storage.k8s.io/pod.namespace".into(), "default".into());
    if let Some(u) = uid {
        pr.volume_context
            .insert("csi.storage.k8s.io/pod.uid".into(), u.into());
    }
    pr
}

/// Every volume of one pod whose class sets `pod*` limits shares one target QoS group,
/// `pod-<uid>`, limited by the strictest of them; it follows publish, unpublish and a target
/// that lost it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_of_one_pod_share_a_group() {
    let mut e = Env::start().await;
    let uid = "7F3C2A10-0000-4000-8000-00000000ABCD";
    let group = format!("pod-{}", uid.to_ascii_lowercase());
    let a = pod_volume(
        &mut e,
        "pvc-pod-a",
        &[("podRwIosPerSec", "5000"), ("podWMBytesPerSec", "40")],
    )
    .await;
    let b = pod_volume(&mut e, "pvc-pod-b", &[("podRwIosPerSec", "3000")]).await;
    let c = pod_volume(&mut e, "pvc-pod-c", &[("rwIosPerSec", "1000")]).await;

    let pa = pod_publish(&e, &a, "web", Some(uid));
    e.node.node_publish_volume(pa.clone()).await.unwrap();
    let g = groups(&e).await;
    assert_eq!(g.len(), 1, "{g:?}");
    assert_eq!(g[0].name, group);
    assert_eq!(g[0].bdevs.len(), 1);
    assert_eq!(
        (
            g[0].assigned_rate_limits.rw_ios_per_sec,
            g[0].assigned_rate_limits.w_mbytes_per_sec
        ),
        (5000, 40)
    );
    // A retry of the same publish changes nothing.
    e.node.node_publish_volume(pa.clone()).await.unwrap();
    assert_eq!(groups(&e).await[0].bdevs.len(), 1);

    let pb = pod_publish(&e, &b, "web", Some(uid));
    e.node.node_publish_volume(pb.clone()).await.unwrap();
    let pc = pod_publish(&e, &c, "web", Some(uid));
    e.node.node_publish_volume(pc.clone()).await.unwrap();
    let g = groups(&e).await;
    assert_eq!(g.len(), 1, "{g:?}");
    assert_eq!(
        g[0].bdevs.len(),
        2,
        "a volume without pod limits is no member"
    );
    let l = &g[0].assigned_rate_limits;
    assert_eq!(
        (l.rw_ios_per_sec, l.w_mbytes_per_sec),
        (3000, 40),
        "strictest wins"
    );
    // The volumes' own limits are untouched by the group.
    assert_eq!(limits(&e, &a.volume_id).await.rw_ios_per_sec, 0);
    assert_eq!(limits(&e, &c.volume_id).await.rw_ios_per_sec, 1000);

    // Per-pod limits without the pod's UID (CSIDriver without podInfoOnMount) are refused
    // before anything is exported; a UID that is no name is refused too.
    let d = pod_volume(&mut e, "pvc-pod-d", &[("podRMBytesPerSec", "10")]).await;
    let st = e
        .node
        .node_publish_volume(pod_publish(&e, &d, "other", None))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition);
    assert!(st.message().contains("podInfoOnMount"), "{}", st.message());
    assert_eq!(
        code(
            e.node
                .node_publish_volume(pod_publish(&e, &d, "other", Some("../../x")))
                .await
        ),
        Code::InvalidArgument
    );
    assert!(!e
        .store()
        .join("block/sockets")
        .join(ctrlr(&d.volume_id))
        .exists());

    // A target that lost the group (restart without its state) gets it back on reconcile.
    e.driver
        .rpc
        .call_method::<katablk_rpc::methods::KatablkDeleteQosGroup>(
            &katablk_rpc::methods::KatablkDeleteQosGroupParams {
                name: group.clone(),
            },
        )
        .await
        .unwrap();
    let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert_eq!(rep.pod_groups, vec![group.clone()]);
    let g = groups(&e).await;
    assert_eq!((g.len(), g[0].bdevs.len()), (1, 2), "{g:?}");
    assert_eq!(g[0].assigned_rate_limits.rw_ios_per_sec, 3000);
    // Nothing to do the second time.
    let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert!(rep.pod_groups.is_empty(), "{:?}", rep.pod_groups);

    // Leaving: the group shrinks and its limits relax, then goes with the last member.
    let tb = std::path::PathBuf::from(&pb.target_path);
    e.node
        .node_unpublish_volume(unpublish_req(&b.volume_id, &tb))
        .await
        .unwrap();
    let g = groups(&e).await;
    assert_eq!((g.len(), g[0].bdevs.len()), (1, 1), "{g:?}");
    assert_eq!(g[0].assigned_rate_limits.rw_ios_per_sec, 5000);
    let ta = std::path::PathBuf::from(&pa.target_path);
    for _ in 0..2 {
        e.node
            .node_unpublish_volume(unpublish_req(&a.volume_id, &ta))
            .await
            .unwrap();
    }
    assert!(groups(&e).await.is_empty());
}

/// The metrics endpoint reports, per published volume, the time its requests waited for its
/// rate limits and how many waited, read from the target at each scrape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_report_time_spent_throttled_per_volume() {
    let mut e = Env::start().await;
    let limited = pod_volume(&mut e, "pvc-throttled", &[("wMBytesPerSec", "1")]).await;
    let free = pod_volume(&mut e, "pvc-free", &[]).await;
    let mut socks = Vec::new();
    for v in [&limited, &free] {
        let tp = e.target_path(&v.volume_id.replace('/', "-"));
        std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
        let mut pr = publish_req(&v.volume_id, &tp, block_cap(), false);
        pr.volume_context = v.volume_context.clone();
        e.node.node_publish_volume(pr).await.unwrap();
        socks.push(e.store().join("block/sockets").join(ctrlr(&v.volume_id)));
    }
    let m = e.driver.render_metrics().await;
    for v in [&limited, &free] {
        assert!(
            m.contains(&format!(
                "katablk_csi_volume_qos_throttled_requests_total{{volume_id=\"{}\"}} 0",
                v.volume_id
            )),
            "{m}"
        );
    }
    // 3 MiB at 1 MB/s: the limited volume waits about two seconds; the free one not at all.
    for s in socks.clone() {
        blk(move || {
            let mut c = blk_client(&s, false).unwrap();
            for i in 0..3u64 {
                assert_eq!(c.write(0, i << 20, &pattern(i, 1 << 20)), 0);
            }
        })
        .await;
    }
    let m = e.driver.render_metrics().await;
    let value = |name: &str, vid: &str| -> f64 {
        let key = format!("{name}{{volume_id=\"{vid}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(&key))
            .unwrap_or_else(|| panic!("{key} missing in\n{m}"))
            .parse()
            .unwrap()
    };
    let secs = "katablk_csi_volume_qos_throttled_seconds_total";
    let reqs = "katablk_csi_volume_qos_throttled_requests_total";
    assert!(value(reqs, &limited.volume_id) >= 1.0, "{m}");
    assert!(value(secs, &limited.volume_id) >= 1.0, "{m}");
    assert_eq!(value(reqs, &free.volume_id), 0.0, "{m}");
    assert_eq!(value(secs, &free.volume_id), 0.0, "{m}");
    // An unpublished volume is no longer reported.
    let tp = e.target_path(&free.volume_id.replace('/', "-"));
    e.node
        .node_unpublish_volume(unpublish_req(&free.volume_id, &tp))
        .await
        .unwrap();
    let m = e.driver.render_metrics().await;
    assert!(
        !m.contains(&format!("volume_id=\"{}\"", free.volume_id)),
        "{m}"
    );
}

/// csi-sanity's `ModifyVolume [Controller Server]` specs, step by step as
/// kubernetes-csi/csi-test `pkg/sanity/controller.go` (v5.5.0) performs them: with the
/// VolumeAttributesClass parameters it is configured with (`-csi.testvolumemutableparameters`,
/// here `rwIosPerSec: "2000"`) and without any (its default, an empty map).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csi_sanity_modify_volume_steps() {
    let mut e = Env::start().await;
    for (round, vac) in [("set", vec![("rwIosPerSec", "2000")]), ("empty", vec![])] {
        // MakeModifyVolumeReq(sc, volID): the configured mutable parameters, no secrets.
        let req = |vid: &str| modify(vid, &vac);
        let fake = |vid: &str| modify(vid, &[("XXX_FakeKey", "XXX_FakeValue")]);
        let mut created = Vec::new();

        // "should fail if no volume id is given"
        assert_eq!(
            code(e.controller.controller_modify_volume(req("")).await),
            Code::InvalidArgument,
            "{round}"
        );
        // "should fail if volume does not exist"
        assert_eq!(
            code(
                e.controller
                    .controller_modify_volume(req("non-existing-volume-id"))
                    .await
            ),
            Code::NotFound,
            "{round}"
        );
        // "should fail if specified mutable parameters are not supported by the volume"
        let v = e
            .controller
            .create_volume(create_req(
                &format!("sanity-modify-volume-unsupported-{round}"),
                64 << 20,
            ))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        created.push(v.volume_id.clone());
        assert_eq!(
            code(
                e.controller
                    .controller_modify_volume(fake(&v.volume_id))
                    .await
            ),
            Code::InvalidArgument,
            "{round}"
        );
        // "should modify a volume created without a volume attribute class"
        let v = e
            .controller
            .create_volume(create_req(
                &format!("sanity-modify-volume-{round}"),
                64 << 20,
            ))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        created.push(v.volume_id.clone());
        e.controller
            .controller_modify_volume(req(&v.volume_id))
            .await
            .unwrap();
        let want = if vac.is_empty() { 0 } else { 2000 };
        assert_eq!(
            limits(&e, &v.volume_id).await.rw_ios_per_sec,
            want,
            "{round}"
        );
        // "should modify a volume created with a volume attribute class", then "should fail to
        // modify a volume created with a volume attribute class if new mutable parameters are
        // not supported by volume"
        for (name, ok) in [("with-vac", true), ("with-vac-not-supported", false)] {
            let mut r = create_req(&format!("sanity-modify-volume-{name}-{round}"), 64 << 20);
            r.mutable_parameters = vac
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect();
            let v = e
                .controller
                .create_volume(r)
                .await
                .unwrap()
                .into_inner()
                .volume
                .unwrap();
            created.push(v.volume_id.clone());
            let got = if ok {
                e.controller
                    .controller_modify_volume(req(&v.volume_id))
                    .await
            } else {
                e.controller
                    .controller_modify_volume(fake(&v.volume_id))
                    .await
            };
            if ok {
                got.unwrap();
            } else {
                assert_eq!(code(got), Code::InvalidArgument, "{round} {name}");
            }
            assert_eq!(
                limits(&e, &v.volume_id).await.rw_ios_per_sec,
                want,
                "{round} {name}"
            );
        }
        // r.Cleanup(): DeleteVolume of what the specs created.
        assert_eq!(created.len(), 4);
        for vid in created {
            e.controller
                .delete_volume(csi::DeleteVolumeRequest {
                    volume_id: vid,
                    ..Default::default()
                })
                .await
                .unwrap();
        }
    }
}
