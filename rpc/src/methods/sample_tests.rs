//! Round-trip every real SPDK reply in `tests/samples/` through the typed structs, and parse
//! every recorded request's params.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;

use super::*;
use crate::wire::{typed, Response};

fn samples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/samples")
}

fn read_json(name: &str) -> (Vec<u8>, Value) {
    let bytes = std::fs::read(samples_dir().join(name)).unwrap();
    let v = serde_json::from_slice(&bytes).unwrap();
    (bytes, v)
}

fn requests() -> BTreeMap<String, Value> {
    let (_, v) = read_json("_requests.json");
    serde_json::from_value(v).unwrap()
}

/// Decode `result` as `M::Result`, re-encode, and compare; returns the re-encoded value.
fn roundtrip<M: Method>(result: &Value) -> Value {
    let typed: M::Result = serde_json::from_value(result.clone())
        .unwrap_or_else(|e| panic!("{}: {e}\n{result}", M::NAME));
    let back = serde_json::to_value(&typed).unwrap();
    assert_eq!(&back, result, "{} result changed in a round trip", M::NAME);
    back
}

fn roundtrip_result(method: &str, result: &Value) -> Value {
    match method {
        "spdk_get_version" => roundtrip::<SpdkGetVersion>(result),
        "rpc_get_methods" => roundtrip::<RpcGetMethods>(result),
        "framework_wait_init" => roundtrip::<FrameworkWaitInit>(result),
        "framework_get_subsystems" => roundtrip::<FrameworkGetSubsystems>(result),
        "spdk_kill_instance" => roundtrip::<SpdkKillInstance>(result),
        "bdev_get_bdevs" => roundtrip::<BdevGetBdevs>(result),
        "bdev_get_iostat" => roundtrip::<BdevGetIostat>(result),
        "bdev_wait_for_examine" => roundtrip::<BdevWaitForExamine>(result),
        "bdev_aio_create" => roundtrip::<BdevAioCreate>(result),
        "bdev_aio_delete" => roundtrip::<BdevAioDelete>(result),
        "bdev_malloc_create" => roundtrip::<BdevMallocCreate>(result),
        "bdev_null_create" => roundtrip::<BdevNullCreate>(result),
        "bdev_lvol_create_lvstore" => roundtrip::<BdevLvolCreateLvstore>(result),
        "bdev_lvol_get_lvstores" => roundtrip::<BdevLvolGetLvstores>(result),
        "bdev_lvol_create" => roundtrip::<BdevLvolCreate>(result),
        "bdev_lvol_get_lvols" => roundtrip::<BdevLvolGetLvols>(result),
        "bdev_lvol_delete" => roundtrip::<BdevLvolDelete>(result),
        "bdev_lvol_resize" => roundtrip::<BdevLvolResize>(result),
        "bdev_lvol_snapshot" => roundtrip::<BdevLvolSnapshot>(result),
        "bdev_lvol_clone" => roundtrip::<BdevLvolClone>(result),
        "vhost_create_blk_controller" => roundtrip::<VhostCreateBlkController>(result),
        "vhost_delete_controller" => roundtrip::<VhostDeleteController>(result),
        "vhost_get_controllers" => roundtrip::<VhostGetControllers>(result),
        other => panic!("sample for untyped method {other}"),
    }
}

fn parse_params<M: Method>(params: Option<Value>) {
    typed::<M::Params>(params.clone())
        .unwrap_or_else(|e| panic!("{}: {e:?} for {params:?}", M::NAME));
}

fn check_params(method: &str, params: Option<Value>) {
    match method {
        "spdk_get_version" => parse_params::<SpdkGetVersion>(params),
        "rpc_get_methods" => parse_params::<RpcGetMethods>(params),
        "framework_get_subsystems" => parse_params::<FrameworkGetSubsystems>(params),
        "spdk_kill_instance" => parse_params::<SpdkKillInstance>(params),
        "bdev_get_bdevs" => parse_params::<BdevGetBdevs>(params),
        "bdev_get_iostat" => parse_params::<BdevGetIostat>(params),
        "bdev_wait_for_examine" => parse_params::<BdevWaitForExamine>(params),
        "bdev_aio_create" => parse_params::<BdevAioCreate>(params),
        "bdev_aio_delete" => parse_params::<BdevAioDelete>(params),
        "bdev_malloc_create" => parse_params::<BdevMallocCreate>(params),
        "bdev_null_create" => parse_params::<BdevNullCreate>(params),
        "bdev_lvol_create_lvstore" => parse_params::<BdevLvolCreateLvstore>(params),
        "bdev_lvol_get_lvstores" => parse_params::<BdevLvolGetLvstores>(params),
        "bdev_lvol_create" => parse_params::<BdevLvolCreate>(params),
        "bdev_lvol_get_lvols" => parse_params::<BdevLvolGetLvols>(params),
        "bdev_lvol_delete" => parse_params::<BdevLvolDelete>(params),
        "bdev_lvol_resize" => parse_params::<BdevLvolResize>(params),
        "bdev_lvol_snapshot" => parse_params::<BdevLvolSnapshot>(params),
        "bdev_lvol_clone" => parse_params::<BdevLvolClone>(params),
        "vhost_create_blk_controller" => parse_params::<VhostCreateBlkController>(params),
        "vhost_delete_controller" => parse_params::<VhostDeleteController>(params),
        "vhost_get_controllers" => parse_params::<VhostGetControllers>(params),
        other => panic!("request for untyped method {other}"),
    }
}

#[test]
fn every_sample_reply_round_trips() {
    let reqs = requests();
    let mut results = 0;
    let mut errors = 0;
    for (name, req) in &reqs {
        if req.get("method").is_none() {
            continue; // save_config, err_malformed_json: not plain replies
        }
        let method = req["method"].as_str().unwrap();
        let (bytes, value) = read_json(&format!("{name}.json"));
        let resp = Response::from_value(value.clone()).unwrap();
        match &resp.payload {
            Ok(result) => {
                results += 1;
                let back = roundtrip_result(method, result);
                // Field order is SPDK's too: the re-encoded reply is byte-identical.
                let again = Response::result(resp.id.clone(), back).to_bytes();
                assert_eq!(
                    String::from_utf8(again).unwrap(),
                    String::from_utf8(bytes).unwrap(),
                    "{name}: bytes differ"
                );
            }
            Err(e) => {
                errors += 1;
                assert_eq!(
                    Response::error(resp.id.clone(), e.clone()).to_bytes(),
                    bytes,
                    "{name}"
                );
            }
        }
    }
    assert!(results >= 40, "only {results} result samples");
    assert!(errors >= 11, "only {errors} error samples");
}

#[test]
fn every_sample_request_parses_into_typed_params() {
    for (name, req) in requests() {
        let Some(method) = req.get("method").and_then(Value::as_str) else {
            continue;
        };
        let params = req.get("params").cloned();
        if name == "err_bdev_get_bdevs_unknown_param" || name == "err_bdev_get_bdevs_wrong_type" {
            let e = typed::<BdevGetBdevsParams>(params).unwrap_err();
            assert_eq!(e.code, crate::wire::codes::INVALID_PARAMS);
            assert!(e.message.contains("nam"), "{name}: {}", e.message);
            continue;
        }
        if name == "err_unknown_method" {
            continue;
        }
        check_params(method, params);
    }
}

#[test]
fn every_sample_file_is_covered() {
    let reqs = requests();
    for entry in std::fs::read_dir(samples_dir()).unwrap() {
        let file = entry.unwrap().file_name().into_string().unwrap();
        let stem = file.trim_end_matches(".json");
        assert!(
            stem == "_requests" || reqs.contains_key(stem),
            "{file} has no request"
        );
    }
}

#[test]
fn save_config_round_trips() {
    let (_, v) = read_json("save_config.json");
    let cfg: Config = serde_json::from_value(v.clone()).unwrap();
    assert_eq!(serde_json::to_value(&cfg).unwrap(), v);
    let bdev = cfg
        .subsystems
        .iter()
        .find(|s| s.subsystem == "bdev")
        .unwrap();
    let aio = bdev
        .config
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.method == "bdev_aio_create")
        .unwrap();
    // A saved bdev_aio_create call must be accepted as typed params by our server.
    let p = typed::<BdevAioCreateParams>(aio.params.clone()).unwrap();
    assert_eq!(p.block_size, Some(512));
    let vhost = cfg
        .subsystems
        .iter()
        .find(|s| s.subsystem == "vhost_blk")
        .unwrap();
    for e in vhost.config.as_ref().unwrap() {
        typed::<VhostCreateBlkControllerParams>(e.params.clone()).unwrap();
    }
    assert!(cfg.subsystems.iter().any(|s| s.config.is_none()));
}

#[test]
fn typed_fields_match_the_samples() {
    let (_, v) = read_json("bdev_get_bdevs_snap0.json");
    let bdevs: Vec<BdevInfo> = serde_json::from_value(v["result"].clone()).unwrap();
    let lvol = bdevs[0].driver_specific.lvol.as_ref().unwrap();
    assert!(lvol.snapshot);
    assert_eq!(
        lvol.clones.as_deref(),
        Some(&["lvol0".to_owned(), "clone0".to_owned()][..])
    );
    assert_eq!(bdevs[0].aliases, vec!["lvs0/snap0"]);
    assert!(bdevs[0].extra.is_empty());

    let (_, v) = read_json("after_aio_delete_vhost_get_controllers.json");
    let ctrls: Vec<VhostController> = serde_json::from_value(v["result"].clone()).unwrap();
    let blk = ctrls[0].backend_specific.block.as_ref().unwrap();
    assert_eq!(blk.bdev, None);
    assert_eq!(blk.transport, "vhost_user_blk");

    let (_, v) = read_json("bdev_lvol_get_lvstores.json");
    let lvs: Vec<LvstoreInfo> = serde_json::from_value(v["result"].clone()).unwrap();
    assert_eq!(lvs[0].cluster_size, 4_194_304);
    assert_eq!(lvs[0].block_size, 512);
    assert_eq!(lvs[0].total_data_clusters, 63);
    assert_eq!(lvs[0].free_clusters, 63);
}

#[test]
fn method_names_are_unique_and_include_every_sample_method() {
    let mut names: Vec<_> = METHOD_NAMES.to_vec();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), METHOD_NAMES.len());
    let (_, v) = read_json("rpc_get_methods.json");
    let spdk: Vec<String> = serde_json::from_value(v["result"].clone()).unwrap();
    for n in METHOD_NAMES {
        assert!(
            spdk.iter().any(|s| s == n),
            "{n} is not an SPDK v26.09 method"
        );
    }
}

#[test]
fn optional_params_are_omitted() {
    let p = BdevLvolCreateParams {
        lvol_name: "lvol0".into(),
        size_in_mib: 64,
        thin_provision: Some(false),
        clear_method: None,
        uuid: None,
        lvs_name: Some("lvs0".into()),
    };
    let v = serde_json::to_value(&p).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"lvol_name":"lvol0","size_in_mib":64,"thin_provision":false,"lvs_name":"lvs0"})
    );
    let c = serde_json::to_value(LvolClearMethod::WriteZeroes).unwrap();
    assert_eq!(c, "write_zeroes");
}
