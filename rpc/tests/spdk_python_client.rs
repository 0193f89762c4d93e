//! Wire compatibility with SPDK's own python client (`pip install spdk` → `spdk-rpc`).
//!
//! The client is found as `$SPDK_RPC`, else `spdk-rpc` on `PATH`, else in a venv under the
//! cargo target dir, which is created with `python3 -m venv` + `pip install spdk==26.9` on
//! first use. If none of that works (no python3, no network), each test prints why and
//! passes without checking anything.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use common::TestServer;
use katablk_test_support::spdk_rpc::{installed, works};
use serde_json::{json, Value};

const SPDK_PY_VERSION: &str = "26.9";

fn find_spdk_rpc() -> Result<PathBuf, String> {
    if let Some(p) = installed()? {
        return Ok(p);
    }
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("spdk-py-venv");
    let bin = venv.join("bin/spdk-rpc");
    if works(&bin) {
        return Ok(bin);
    }
    let run = |cmd: &mut Command| -> Result<(), String> {
        let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{cmd:?} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    };
    run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    run(Command::new(venv.join("bin/pip")).args([
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--timeout",
        "30",
        &format!("spdk=={SPDK_PY_VERSION}"),
    ]))?;
    if works(&bin) {
        Ok(bin)
    } else {
        Err(format!(
            "pip installed spdk but {} does not run",
            bin.display()
        ))
    }
}

/// The `spdk-rpc` command, or `None` (with the reason printed) to skip.
fn spdk_rpc() -> Option<&'static Path> {
    static FOUND: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match FOUND.get_or_init(find_spdk_rpc) {
        Ok(p) => Some(p.as_path()),
        Err(why) => {
            println!("SKIPPED: SPDK's python client is not available: {why}");
            None
        }
    }
}

async fn rpc(bin: &Path, sock: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(bin);
    cmd.arg("-s").arg(sock).arg("-t").arg("10").args(args);
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

async fn rpc_ok(bin: &Path, sock: &Path, args: &[&str]) -> String {
    let out = rpc(bin, sock, args).await;
    assert!(
        out.status.success(),
        "spdk-rpc {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

async fn rpc_json(bin: &Path, sock: &Path, args: &[&str]) -> Value {
    let s = rpc_ok(bin, sock, args).await;
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("spdk-rpc {args:?}: {e}: {s}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spdk_rpc_reads() {
    let Some(bin) = spdk_rpc() else { return };
    let srv = TestServer::start();
    let sock = srv.path();
    let v = rpc_json(bin, sock, &["spdk_get_version"]).await;
    assert_eq!(
        v,
        json!({"version":"SPDK v26.09-pre","fields":{"major":26,"minor":9,"patch":0,"suffix":"-pre"}})
    );
    let methods = rpc_json(bin, sock, &["rpc_get_methods"]).await;
    assert!(methods
        .as_array()
        .unwrap()
        .contains(&json!("bdev_get_bdevs")));
    let bdevs = rpc_json(bin, sock, &["bdev_get_bdevs", "-b", "Malloc0"]).await;
    assert_eq!(bdevs[0]["name"], "Malloc0");
    assert_eq!(bdevs[0]["supported_io_types"]["read"], false);
    let lvs = rpc_json(bin, sock, &["bdev_lvol_get_lvstores", "-l", "lvs0"]).await;
    assert_eq!(lvs[0]["cluster_size"], 4194304);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spdk_rpc_mutations_and_errors() {
    let Some(bin) = spdk_rpc() else { return };
    let srv = TestServer::start();
    let sock = srv.path();
    let uuid = rpc_ok(
        bin,
        sock,
        &["bdev_lvol_create", "-l", "lvs0", "lvol0", "64"],
    )
    .await;
    assert_eq!(uuid.trim(), "b2d02484-1cab-4fc6-a85b-181920650a35");
    let out = rpc(
        bin,
        sock,
        &["bdev_lvol_create", "-l", "lvs0", "lvol0", "64"],
    )
    .await;
    assert!(!out.status.success());
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("-17") && text.contains("File exists"),
        "{text}"
    );
    let out = rpc(bin, sock, &["bdev_get_bdevs", "-b", "nosuch"]).await;
    assert!(!out.status.success());
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("-19") && text.contains("No such device"),
        "{text}"
    );
    let ok = rpc_ok(
        bin,
        sock,
        &[
            "vhost_create_blk_controller",
            "vhostblk0",
            "lvs0/lvol0",
            "--cpumask",
            "0x1",
        ],
    )
    .await;
    assert_eq!(ok.trim(), "");
    let out = rpc(
        bin,
        sock,
        &["vhost_create_blk_controller", "vhostmissing", "nosuch"],
    )
    .await;
    assert!(!out.status.success());
    rpc_ok(bin, sock, &["spdk_kill_instance", "SIGTERM"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spdk_rpc_save_and_load_config() {
    let Some(bin) = spdk_rpc() else { return };
    let srv = TestServer::start();
    let sock = srv.path();
    let cfg = rpc_json(bin, sock, &["save_config"]).await;
    assert_eq!(cfg["subsystems"][0]["subsystem"], "bdev");
    assert_eq!(
        cfg["subsystems"][0]["config"][0]["method"],
        "bdev_malloc_create"
    );
    let file = srv.dir.path().join("config.json");
    std::fs::write(&file, serde_json::to_vec(&cfg).unwrap()).unwrap();
    rpc_ok(bin, sock, &["load_config", "-j", file.to_str().unwrap()]).await;
}

/// Every CLI form of every typed method, with all its options, as SPDK's client sends it:
/// our `deny_unknown_fields` params must accept every member it sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spdk_rpc_param_names_accepted() {
    use katablk_rpc::methods::*;
    use katablk_rpc::server::{Router, RpcServer, ServerConfig};
    use katablk_rpc::wire::typed;
    use std::sync::{Arc, Mutex};

    let Some(bin) = spdk_rpc() else { return };
    type Seen = Arc<Mutex<Vec<(String, Option<Value>)>>>;
    let seen: Seen = Arc::default();

    fn accept<M: Method>(r: Router, result: Value, seen: &Seen) -> Router {
        let seen = Arc::clone(seen);
        r.route(M::NAME, move |params: Option<Value>| {
            let result = result.clone();
            seen.lock()
                .unwrap()
                .push((M::NAME.to_owned(), params.clone()));
            async move {
                let _: M::Params = typed(params)?;
                Ok(result)
            }
        })
    }
    let t = json!(true);
    let s = json!("name");
    let r = Router::new();
    let r = accept::<SpdkGetVersion>(r, serde_json::to_value(common::version()).unwrap(), &seen);
    let r = accept::<RpcGetMethods>(r, json!(["spdk_get_version"]), &seen);
    let r = accept::<FrameworkWaitInit>(r, t.clone(), &seen);
    let r = accept::<FrameworkGetSubsystems>(r, json!([]), &seen);
    let r = accept::<FrameworkGetConfig>(r, json!([]), &seen);
    let r = accept::<SpdkKillInstance>(r, t.clone(), &seen);
    let r = accept::<BdevGetBdevs>(r, json!([]), &seen);
    let r = accept::<BdevGetIostat>(r, json!({"tick_rate": 1, "ticks": 1, "bdevs": []}), &seen);
    let r = accept::<BdevWaitForExamine>(r, t.clone(), &seen);
    let r = accept::<BdevAioCreate>(r, s.clone(), &seen);
    let r = accept::<BdevAioDelete>(r, t.clone(), &seen);
    let r = accept::<BdevMallocCreate>(r, s.clone(), &seen);
    let r = accept::<BdevMallocDelete>(r, t.clone(), &seen);
    let r = accept::<BdevNullCreate>(r, s.clone(), &seen);
    let r = accept::<BdevNullDelete>(r, t.clone(), &seen);
    let r = accept::<BdevLvolCreateLvstore>(r, s.clone(), &seen);
    let r = accept::<BdevLvolGetLvstores>(r, json!([]), &seen);
    let r = accept::<BdevLvolDeleteLvstore>(r, t.clone(), &seen);
    let r = accept::<BdevLvolRenameLvstore>(r, t.clone(), &seen);
    let r = accept::<BdevLvolGrowLvstore>(r, t.clone(), &seen);
    let r = accept::<BdevLvolCreate>(r, s.clone(), &seen);
    let r = accept::<BdevLvolGetLvols>(r, json!([]), &seen);
    let r = accept::<BdevLvolDelete>(r, t.clone(), &seen);
    let r = accept::<BdevLvolResize>(r, t.clone(), &seen);
    let r = accept::<BdevLvolRename>(r, t.clone(), &seen);
    let r = accept::<BdevLvolSnapshot>(r, s.clone(), &seen);
    let r = accept::<BdevLvolClone>(r, s.clone(), &seen);
    let r = accept::<BdevLvolInflate>(r, t.clone(), &seen);
    let r = accept::<BdevLvolDecoupleParent>(r, t.clone(), &seen);
    let r = accept::<BdevLvolSetReadOnly>(r, t.clone(), &seen);
    let r = accept::<VhostCreateBlkController>(r, t.clone(), &seen);
    let r = accept::<VhostDeleteController>(r, t.clone(), &seen);
    let r = accept::<VhostGetControllers>(r, json!([]), &seen);
    let r = accept::<VhostControllerSetCoalescing>(r, t.clone(), &seen);

    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("spdk.sock");
    let server = RpcServer::bind(ServerConfig::new(&sock)).unwrap();
    tokio::spawn(server.serve(Arc::new(r)));

    let uuid = "1805619a-ba2e-4045-a21e-46aa9deccde4";
    let commands = [
        "spdk_get_version".to_owned(),
        "rpc_get_methods -c -i".into(),
        "framework_wait_init".into(),
        "framework_get_subsystems".into(),
        "framework_get_config bdev --with-batches".into(),
        "bdev_get_bdevs -b Malloc0 -t 10".into(),
        "bdev_get_iostat -c --reset-mode all --names Malloc0,Null0".into(),
        "bdev_wait_for_examine".into(),
        format!("bdev_aio_create /tmp/x.img aio0 512 -r --fallocate -u {uuid} --no-wait"),
        "bdev_aio_create /tmp/x.img aio1".into(),
        "bdev_aio_delete aio0".into(),
        format!("bdev_malloc_create -b Malloc0 -u {uuid} -p 4096 -o 8 -m 8 -i -t 1 -d -f 0 -n -1 64 512"),
        "bdev_malloc_delete Malloc0".into(),
        format!("bdev_null_create Null0 64 512 -u {uuid} -p 4096 -m 8 -t 1 -d -f 0 -a 1 -g 1 -s 1 -c 1 -r 1"),
        "bdev_null_delete Null0".into(),
        "bdev_lvol_create_lvstore aio0 lvs0 -c 4194304 --clear-method unmap -m 10 -s 4096".into(),
        format!("bdev_lvol_get_lvstores -u {uuid}"),
        "bdev_lvol_get_lvstores -l lvs0".into(),
        "bdev_lvol_delete_lvstore -l lvs0".into(),
        format!("bdev_lvol_delete_lvstore -u {uuid}"),
        "bdev_lvol_rename_lvstore lvs0 lvs1".into(),
        "bdev_lvol_grow_lvstore -l lvs0".into(),
        "bdev_lvol_create -l lvs0 -t -c write_zeroes lvol0 64".into(),
        format!("bdev_lvol_create -u {uuid} lvol1 4"),
        "bdev_lvol_get_lvols -l lvs0".into(),
        format!("bdev_lvol_get_lvols -u {uuid}"),
        "bdev_lvol_delete lvs0/lvol0".into(),
        "bdev_lvol_resize lvs0/lvol0 128".into(),
        "bdev_lvol_rename lvs0/lvol0 lvol9".into(),
        "bdev_lvol_snapshot lvs0/lvol0 snap0".into(),
        "bdev_lvol_clone lvs0/snap0 clone0".into(),
        "bdev_lvol_inflate lvs0/clone0".into(),
        "bdev_lvol_decouple_parent lvs0/clone0".into(),
        "bdev_lvol_set_read_only lvs0/clone0".into(),
        "vhost_create_blk_controller c0 lvs0/lvol0 --cpumask 0x1 --transport vhost_user_blk -r -p".into(),
        "vhost_create_blk_controller c1 Malloc0".into(),
        "vhost_get_controllers -n c0".into(),
        "vhost_get_controllers".into(),
        "vhost_controller_set_coalescing c0 10 1000".into(),
        "vhost_delete_controller c0".into(),
        "spdk_kill_instance SIGTERM".into(),
    ];
    // One python process: `--server` runs one command per stdin line.
    let input: String = commands
        .iter()
        .map(|c| format!("-s {} -t 10 {c}\n", sock.display()))
        .collect();
    let bin = bin.to_owned();
    let out = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut child = Command::new(bin)
            .arg("--server")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let statuses: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("**STATUS="))
        .collect();
    assert_eq!(
        statuses.len(),
        commands.len(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut chunks = stdout.split("**STATUS=").collect::<Vec<_>>();
    chunks.pop();
    for (i, st) in statuses.iter().enumerate() {
        assert_eq!(
            *st,
            "**STATUS=0",
            "`{}` failed:\n{}",
            commands[i],
            chunks.get(i).unwrap_or(&"")
        );
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), commands.len());
    // Spot-check that the options really reached us under SPDK's names.
    let malloc = &seen
        .iter()
        .find(|(m, _)| m == "bdev_malloc_create")
        .unwrap()
        .1;
    assert_eq!(malloc.as_ref().unwrap()["md_interleave"], true);
    assert_eq!(malloc.as_ref().unwrap()["numa_id"], -1);
    let vhost = &seen
        .iter()
        .find(|(m, _)| m == "vhost_create_blk_controller")
        .unwrap()
        .1;
    assert_eq!(vhost.as_ref().unwrap()["packed_ring"], true);
}
