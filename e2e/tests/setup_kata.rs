//! `scripts/setup-kata.sh` on a sample Kata configuration: the dry run changes nothing, the real
//! run sets every key once (replacing commented and conflicting lines), and a second run is a
//! no-op.
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
    String::from_utf8(out.stdout).unwrap()
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
    let active = |k: &str| {
        got.lines()
            .filter(|l| l.split('=').next().unwrap().trim() == k)
            .map(|l| l.split_once('=').unwrap().1.trim().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(active("enable_vhost_user_store"), ["true"], "{got}");
    assert_eq!(active("vhost_user_store_path"), ["\"/run/vu\""], "{got}");
    assert_eq!(active("enable_hugepages"), ["true"], "{got}");
    assert_eq!(active("vhost_user_reconnect_timeout_sec").len(), 1, "{got}");
    assert!(got.contains("[runtime]\nenable_debug = false"), "{got}");

    let again = run(&["--config", cfg_s, "--store", "/run/vu"]);
    assert!(again.contains("already configured"), "{again}");
    assert_eq!(fs::read_to_string(&cfg).unwrap(), got);
    fs::remove_dir_all(&dir).unwrap();
}
