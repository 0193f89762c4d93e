//! `scripts/setup-kata.sh` on sample Kata configurations: the dry run changes nothing, the real
//! run sets every key once (replacing commented and conflicting lines), and a second run is a
//! no-op; for runtime-rs only what Dragonball needs.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::process::Command;

use katablk_e2e::repo_root;

const SAMPLE: &str = "\
# sample
[hypervisor.qemu]
path = \"/usr/bin/qemu-system-x86_64\"
# enable_hugepages = true
enable_hugepages = false
#enable_vhost_user_store = true
# vhost_user_store_path = \"/var/run/kata-containers/vhost-user\"

[runtime]
enable_debug = false
";

fn run(args: &[&str]) -> String {
    run2(args).0
}

/// stdout and stderr of a successful run.
fn run2(args: &[&str]) -> (String, String) {
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/setup-kata.sh"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// The active (uncommented) values of key `k` in a TOML text.
fn active(text: &str, k: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.split('=').next().unwrap().trim() == k)
        .map(|l| l.split_once('=').unwrap().1.trim().to_string())
        .collect()
}

#[test]
fn setup_kata_sets_each_key_once_and_is_idempotent() {
    let dir = std::env::temp_dir().join(format!("katablk-setup-kata-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("configuration.toml");
    fs::write(&cfg, SAMPLE).unwrap();
    let cfg_s = cfg.to_str().unwrap();

    let diff = run(&["--dry-run", "--config", cfg_s]);
    assert!(diff.contains("+enable_vhost_user_store = true"), "{diff}");
    assert_eq!(
        fs::read_to_string(&cfg).unwrap(),
        SAMPLE,
        "dry run changed the file"
    );

    run(&["--config", cfg_s, "--store", "/run/vu"]);
    let got = fs::read_to_string(&cfg).unwrap();
    let active = |k: &str| active(&got, k);
    assert_eq!(active("enable_vhost_user_store"), ["true"], "{got}");
    assert_eq!(active("vhost_user_store_path"), ["\"/run/vu\""], "{got}");
    assert_eq!(active("enable_hugepages"), ["true"], "{got}");
    assert_eq!(active("disable_block_device_use"), ["false"], "{got}");
    assert_eq!(active("vhost_user_reconnect_timeout_sec").len(), 1, "{got}");
    assert!(got.contains("[runtime]\nenable_debug = false"), "{got}");

    let again = run(&["--config", cfg_s, "--store", "/run/vu"]);
    assert!(again.contains("already configured"), "{again}");
    assert_eq!(fs::read_to_string(&cfg).unwrap(), got);
    fs::remove_dir_all(&dir).unwrap();
}

const DRAGONBALL: &str = "\
[hypervisor.dragonball]
path = \"/opt/kata/bin/dragonball\"
enable_hugepages = false
";

#[test]
fn setup_kata_for_runtime_rs_changes_only_what_dragonball_needs() {
    let dir = std::env::temp_dir().join(format!("katablk-setup-kata-rs-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("configuration.toml");
    fs::write(&cfg, DRAGONBALL).unwrap();
    let cfg_s = cfg.to_str().unwrap();
    // katablk-target: Dragonball's shmem RAM is shared already, spdkvol needs no store.
    let (out, _) = run2(&["--runtime", "rs", "--config", cfg_s]);
    assert!(out.contains("already configured"), "{out}");
    assert_eq!(fs::read_to_string(&cfg).unwrap(), DRAGONBALL);
    // SPDK's vhost as the target: hugepage-backed guest RAM.
    run(&["--runtime", "rs", "--hugepages", "--config", cfg_s]);
    let got = fs::read_to_string(&cfg).unwrap();
    assert_eq!(active(&got, "enable_hugepages"), ["true"], "{got}");
    assert!(active(&got, "enable_vhost_user_store").is_empty(), "{got}");
    // A runtime-rs config without Dragonball is reported (no other VMM attaches spdkvol).
    fs::write(&cfg, SAMPLE).unwrap();
    let (_, err) = run2(&["--runtime", "rs", "--dry-run", "--config", cfg_s]);
    assert!(err.contains("no [hypervisor.dragonball]"), "{err}");
    // And the Go runtime without QEMU.
    fs::write(&cfg, DRAGONBALL).unwrap();
    let (_, err) = run2(&["--dry-run", "--config", cfg_s]);
    assert!(err.contains("no [hypervisor.qemu]"), "{err}");
    fs::remove_dir_all(&dir).unwrap();
}
