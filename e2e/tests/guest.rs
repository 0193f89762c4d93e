//! The QEMU guest end-to-end test (`scripts/e2e/guest-e2e.sh`): one guest per queue count, each
//! checking identity, data, fio, reconnection across a `kill -9` of the server and growth of the
//! disk. Two providers: the node stack (katablk-target + katablk-csi, the volume created and
//! published through CSI gRPC) and a standalone katablk-vhost (whose backing file the host checks
//! against the guest's checksums). Fails when the Debian packages for QEMU and the guest cannot be
//! downloaded (stale package lists are refreshed first), or when anything in the guest fails. It
//! skips, saying why, only on a machine without a Debian mirror that asked for it with
//! `KATABLK_E2E_ALLOW_SKIP=1`, and never in CI (`CI` set).
//! `.config/nextest.toml` runs it alone, with a long timeout.

use katablk_e2e::{run_script, Outcome};

/// The binaries of this build (cargo builds them for the crates' own integration tests), so the
/// script does not build release ones.
fn binaries(names: &[(&'static str, &str)]) -> Vec<(&'static str, std::path::PathBuf)> {
    names
        .iter()
        .filter_map(|(var, bin)| katablk_test_support::bin::find(bin, None).map(|p| (*var, p)))
        .collect()
}

fn run(provider: &'static str, args: &[&str], bins: &[(&'static str, &str)]) {
    let owned = binaries(bins);
    let mut env: Vec<(&str, &std::path::Path)> =
        owned.iter().map(|(k, p)| (*k, p.as_path())).collect();
    let p = std::path::Path::new(provider);
    env.push(("KATABLK_E2E_PROVIDER", p));
    match run_script("scripts/e2e/guest-e2e.sh", args, &env) {
        Outcome::Passed => {}
        Outcome::Skipped(why) if std::env::var_os("CI").is_some() => {
            panic!("guest e2e ({provider}) cannot be skipped in CI: {why}")
        }
        Outcome::Skipped(why) => eprintln!("SKIPPED guest e2e ({provider}): {why}"),
    }
}

#[test]
fn guest_e2e_under_qemu_tcg() {
    // The node stack, as the flow: CSI provision + publish, restart, expand, unpublish.
    run(
        "csi",
        &["--out", "target/e2e/csi"],
        &[
            ("KATABLK_TARGET", "katablk-target"),
            ("KATABLK_CSI", "katablk-csi"),
            ("KATABLK_CSI_CTL", "katablk-csi-ctl"),
        ],
    );
    // A standalone katablk-vhost on a flat file: the host compares the guest's checksums.
    run(
        "vhost",
        &["--out", "target/e2e/vhost", "--fio", "randread-4k-qd32"],
        &[("KATABLK_VHOST", "katablk-vhost")],
    );
}
