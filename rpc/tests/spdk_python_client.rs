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
use serde_json::{json, Value};

const SPDK_PY_VERSION: &str = "26.9";

/// True if `bin --help` runs.
fn works(bin: &Path) -> bool {
    Command::new(bin)
        .arg("--help")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn find_spdk_rpc() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("SPDK_RPC") {
        let p = PathBuf::from(p);
        return if works(&p) {
            Ok(p)
        } else {
            Err(format!("$SPDK_RPC={} does not run", p.display()))
        };
    }
    if works(Path::new("spdk-rpc")) {
        return Ok(PathBuf::from("spdk-rpc"));
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
