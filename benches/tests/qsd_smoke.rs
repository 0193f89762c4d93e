//! End-to-end: katablk-bench against qemu-storage-daemon on a small temporary file.
//! Skipped (with a printed reason) when qemu-storage-daemon is not installed.

// Test code: panicking on unexpected errors is the point.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use katablk_test_support::Daemon;

const BENCH: &str = env!("CARGO_BIN_EXE_katablk-bench");
const SUMMARY: &str = env!("CARGO_BIN_EXE_katablk-bench-summary");
const PLOT: &str = env!("CARGO_BIN_EXE_katablk-bench-plot");

fn find_qsd() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("QSD") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("qemu-storage-daemon"))
            .find(|p| p.is_file())
    })
}

/// qemu-storage-daemon exporting `img` on `sock`; killed when the test ends, however it ends.
fn start_qsd(qsd: &Path, img: &Path, sock: &Path) -> Daemon {
    Daemon::new(qsd)
        .arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=f0,filename={},cache.direct=off,aio=threads",
            img.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path={},writable=on,num-queues=2",
            sock.display()
        ))
        .null_stdout()
        .wait_for_path(sock)
        .timeout(Duration::from_secs(10))
        .start()
}

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(BENCH)
        .args(args)
        .arg("--no-progress")
        .output()
        .expect("running katablk-bench")
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn verify_and_measure_against_qsd() {
    let Some(qsd) = find_qsd() else {
        eprintln!("SKIPPED: qemu-storage-daemon not found in PATH (apt-get install qemu-utils)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = katablk_test_support::files::image(dir.path(), "disk.img", 16 << 20);
    let sock = dir.path().join("vhost.sock");
    let server = start_qsd(&qsd, &img, &sock);
    let pid = server.pid().to_string();
    let s = sock.to_str().unwrap();
    let raw = dir.path().join("raw");
    std::fs::create_dir(&raw).unwrap();

    // 1. Write patterns and read them back for 1 s.
    let verify_json = raw.join("001-verify.json");
    let out = bench(&[
        "--socket",
        s,
        "--rw",
        "randwrite",
        "--verify",
        "--runtime",
        "1",
        "--iodepth",
        "8",
        "--json",
        verify_json.to_str().unwrap(),
        "--server-pid",
        &pid,
        "--meta",
        "case=tmp",
        "--meta",
        "server=qsd",
        "--meta",
        "workload=verify",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("all matched"), "{stdout}");
    let v = json(&verify_json);
    assert_eq!(v["kind"], "io");
    assert!(v["total"]["verified"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["device"]["capacity"], 16 << 20);
    assert!(v["server_cpu"]["percent"].as_f64().unwrap() >= 0.0);

    // 1b. Same with 16 KiB blocks split into 4 KiB segments (readv/writev path).
    let out = bench(&[
        "--socket",
        s,
        "--rw",
        "randwrite",
        "--verify",
        "--runtime",
        "0.5",
        "--iodepth",
        "4",
        "--bs",
        "16k",
        "--segment-size",
        "4k",
        "--quiet",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // 2. Two queues of random reads.
    let read_json = raw.join("002-read.json");
    let out = bench(&[
        "--socket",
        s,
        "--rw",
        "randread",
        "--queues",
        "2",
        "--runtime",
        "1",
        "--bs",
        "4k",
        "--json",
        read_json.to_str().unwrap(),
        "--server-pid",
        &pid,
        "--quiet",
        "--meta",
        "case=tmp",
        "--meta",
        "server=qsd",
        "--meta",
        "workload=rr",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = json(&read_json);
    assert_eq!(r["jobs"].as_array().unwrap().len(), 2);
    assert!(r["total"]["read"]["iops"].as_f64().unwrap() > 0.0);
    assert!(r["total"]["read"]["lat"]["p99_ns"].as_u64().unwrap() > 0);
    assert_eq!(r["total"]["write"]["ios"], 0);

    // 3. Idle CPU.
    let idle_json = raw.join("003-idle.json");
    let out = bench(&[
        "--socket",
        s,
        "--idle-cpu",
        "0.5",
        "--server-pid",
        &pid,
        "--quiet",
        "--json",
        idle_json.to_str().unwrap(),
        "--meta",
        "case=tmp",
        "--meta",
        "server=qsd",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(json(&idle_json)["kind"], "idle");
    drop(server);

    // 4. Summary and plots of those results.
    let out = Command::new(SUMMARY).arg(dir.path()).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = std::fs::read_to_string(dir.path().join("summary.md")).unwrap();
    assert!(md.contains("| tmp | rr | qsd |"), "{md}");
    let out = Command::new(PLOT)
        .arg(dir.path().join("summary.json"))
        .output()
        .unwrap();
    if out.status.success() {
        for png in ["iops.png", "latency.png", "cpu.png"] {
            let bytes = std::fs::read(dir.path().join(png)).unwrap();
            assert_eq!(&bytes[1..4], b"PNG", "{png}");
        }
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("no font found"), "{err}");
        eprintln!("plots SKIPPED: {err}");
    }
}

#[test]
fn clear_error_for_a_missing_socket() {
    let out = bench(&["--socket", "/nonexistent/katablk.sock", "--runtime", "1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does not exist"), "{err}");
    assert!(!err.contains("backtrace"), "{err}");
}

#[test]
fn clear_error_for_a_bad_block_size() {
    let out = bench(&["--socket", "/tmp/x.sock", "--bs", "1000"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("multiple of 512"));
}
