//! SPDK's python JSON-RPC client, `spdk-rpc` (PyPI `spdk`; `scripts/setup-debian.sh` installs
//! it in a venv and `scripts/test.sh` exports it as `$SPDK_RPC`), found and run.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// True if `bin --help` runs and succeeds.
pub fn works(bin: &Path) -> bool {
    Command::new(bin)
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `$SPDK_RPC`, else `spdk-rpc` on `PATH`: `Ok(None)` when neither is there, `Err` (saying
/// so) when `$SPDK_RPC` is set but does not run.
pub fn installed() -> Result<Option<PathBuf>, String> {
    if let Some(p) = std::env::var_os("SPDK_RPC") {
        let p = PathBuf::from(p);
        return if works(&p) {
            Ok(Some(p))
        } else {
            Err(format!("$SPDK_RPC={} does not run", p.display()))
        };
    }
    let on_path = PathBuf::from("spdk-rpc");
    Ok(works(&on_path).then_some(on_path))
}

/// `bin -s sock ARGS`, run to completion.
pub fn run(bin: &Path, sock: &Path, args: &[&str]) -> Output {
    Command::new(bin)
        .arg("-s")
        .arg(sock)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()))
}

/// [`run`], which must succeed; its stdout, trimmed.
pub fn run_ok(bin: &Path, sock: &Path, args: &[&str]) -> String {
    let o = run(bin, sock, args);
    assert!(
        o.status.success(),
        "spdk-rpc {args:?} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}
