//! The QEMU guest end-to-end test (`scripts/e2e/guest-e2e.sh`): one guest per queue count, each
//! checking identity, data, fio and reconnection across a `kill -9` of the server. Skips (and says
//! why) where the Debian packages for QEMU and the guest cannot be downloaded; fails if they can
//! and anything in the guest fails. `.config/nextest.toml` runs it alone, with a long timeout.

use katablk_e2e::{run_script, sibling_binary, Outcome};

#[test]
fn guest_e2e_under_qemu_tcg() {
    // The katablk-vhost of this build (cargo builds it for vhost's own integration tests).
    let vhost = sibling_binary("katablk-vhost");
    let env: Vec<(&str, &std::path::Path)> = vhost
        .as_deref()
        .map(|p| ("KATABLK_VHOST", p))
        .into_iter()
        .collect();
    match run_script("scripts/e2e/guest-e2e.sh", &[], &env) {
        Outcome::Passed => {}
        Outcome::Skipped(why) => eprintln!("SKIPPED guest e2e: {why}"),
    }
}
