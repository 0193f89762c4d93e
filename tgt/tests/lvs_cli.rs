//! `katablk-lvs` on the lvstore image a real SPDK wrote (lvol/tests/data): inspect, import
//! into a katablk store, export back to SPDK format, and the errors of bad input.
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::path::Path;
use std::process::Command;

fn lvs(args: &[&str]) -> (bool, serde_json::Value, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_katablk-lvs"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let v = serde_json::from_str(&out).unwrap_or(serde_json::Value::Null);
    (o.status.success(), v, err)
}

fn spdk_image(dir: &Path) -> String {
    let gz = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lvol/tests/data/spdk-lvstore.img.gz"
    ))
    .unwrap();
    let mut img = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut img)
        .unwrap();
    let p = dir.join("spdk.img");
    std::fs::write(&p, img).unwrap();
    p.to_str().unwrap().to_string()
}

fn names(v: &serde_json::Value) -> Vec<String> {
    let mut n: Vec<String> = v["lvols"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap().to_string())
        .collect();
    n.sort();
    n
}

#[test]
fn inspect_import_export() {
    let dir = tempfile::tempdir().unwrap();
    let spdk = spdk_image(dir.path());
    let (ok, v, err) = lvs(&["inspect", &spdk]);
    assert!(ok, "{err}");
    assert_eq!(v["format"], "spdk");
    assert_eq!(v["name"], "lvs_spdk");
    assert_eq!(names(&v), ["clone", "ro", "snap", "thick", "thin"]);
    let kbl = dir.path().join("kbl.img");
    let kbl = kbl.to_str().unwrap();
    let (ok, v, err) = lvs(&["import-spdk", "--from", &spdk, "--to", kbl, "--size", "64M"]);
    assert!(ok, "{err}");
    assert_eq!(v["clusters_copied"], 10);
    let (ok, v, err) = lvs(&["inspect", kbl]);
    assert!(ok, "{err}");
    assert_eq!(v["format"], "katablk");
    assert_eq!(v["uuid"], "73c39b66-3086-4cd8-bd1b-64a863bc6629");
    assert_eq!(names(&v), ["clone", "ro", "snap", "thick", "thin"]);
    let snap = v["lvols"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "snap")
        .unwrap();
    assert_eq!(snap["is_snapshot"], true);
    let back = dir.path().join("back.img");
    let back = back.to_str().unwrap();
    let (ok, _, err) = lvs(&["export-spdk", "--from", kbl, "--to", back]);
    assert!(ok, "{err}");
    let (ok, v, err) = lvs(&["inspect", back]);
    assert!(ok, "{err}");
    assert_eq!(v["format"], "spdk");
    assert_eq!(v["clean"], true);
    assert_eq!(names(&v), ["clone", "ro", "snap", "thick", "thin"]);
    let clone = v["lvols"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "clone")
        .unwrap();
    assert_eq!(clone["parent"], "snap");
}

#[test]
fn bad_input_is_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    // Importing something that is not an SPDK lvstore.
    let junk = dir.path().join("junk.img");
    std::fs::write(&junk, vec![0u8; 1 << 20]).unwrap();
    let out = dir.path().join("out.img");
    let (ok, _, err) = lvs(&[
        "import-spdk",
        "--from",
        junk.to_str().unwrap(),
        "--to",
        out.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(err.contains("not an SPDK lvstore"), "{err}");
    // A missing file, a bad size, --size on an existing destination.
    let (ok, _, err) = lvs(&["inspect", "/nonexistent/x.img"]);
    assert!(!ok && err.contains("/nonexistent/x.img"), "{err}");
    let spdk = spdk_image(dir.path());
    let (ok, _, err) = lvs(&["import-spdk", "--from", &spdk, "--to", "x", "--size", "12Q"]);
    assert!(!ok && err.contains("bad size"), "{err}");
    let (ok, _, err) = lvs(&[
        "import-spdk",
        "--from",
        &spdk,
        "--to",
        junk.to_str().unwrap(),
        "--size",
        "1G",
    ]);
    assert!(!ok && err.contains("--size is only for new files"), "{err}");
    // Too small a destination.
    let small = dir.path().join("small.img");
    let (ok, _, err) = lvs(&[
        "import-spdk",
        "--from",
        &spdk,
        "--to",
        small.to_str().unwrap(),
        "--size",
        "8M",
    ]);
    assert!(!ok && err.contains("no space"), "{err}");
}
