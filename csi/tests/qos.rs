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
