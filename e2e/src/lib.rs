//! Runs the repository's shell-level end-to-end checks from `cargo nextest`: the QEMU guest test
//! (`scripts/e2e/guest-e2e.sh`) and the Kubernetes manifest validation
//! (`scripts/validate-manifests.sh`). The scripts do the work; this crate only maps their exit
//! status onto a test result: 0 passes, [`EXIT_SKIP`] skips with the reason the script printed,
//! anything else fails with the script's whole output.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Exit status with which a script says its prerequisites are missing (automake's convention).
pub const EXIT_SKIP: i32 = 77;

/// What a script run came to, when it did not fail.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    /// The script could not run here; the reason is its last `unavailable:` or `skip:` line.
    Skipped(String),
}

/// The workspace root (this crate's parent directory). Cargo and nextest set
/// `CARGO_MANIFEST_DIR` when they run a test; the path compiled in is the fallback (it goes stale
/// when a build directory is shared between checkouts).
pub fn repo_root() -> PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Runs `bash SCRIPT ARGS` from the repository root with extra environment variables, echoes its
/// output (nextest shows it for failures and where configured), and returns the outcome.
///
/// # Panics
/// When the script cannot be started, or exits with anything but 0 or [`EXIT_SKIP`].
pub fn run_script(script: &str, args: &[&str], env: &[(&str, &Path)]) -> Outcome {
    let root = repo_root();
    let mut cmd = Command::new("bash");
    cmd.arg(root.join(script)).args(args).current_dir(&root);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) => panic!("cannot run {script}: {e}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    eprint!("{stderr}");
    match out.status.code() {
        Some(0) => Outcome::Passed,
        Some(EXIT_SKIP) => Outcome::Skipped(skip_reason(&stderr)),
        _ => panic!("{script} failed ({}); its output is above", out.status),
    }
}

/// The last line of `text` saying why a script skipped (`...unavailable: why` or `...skip: why`),
/// or a generic reason.
pub fn skip_reason(text: &str) -> String {
    text.lines()
        .rev()
        .find_map(|l| {
            ["unavailable: ", "skip: "]
                .iter()
                .find_map(|m| l.find(m).map(|i| l[i + m.len()..].trim().to_string()))
        })
        .unwrap_or_else(|| "the script reported its prerequisites missing".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_reason_takes_the_last_marked_line() {
        let err =
            "guest-assets: downloading x\nguest-assets: unavailable: apt-get download failed\n";
        assert_eq!(skip_reason(err), "apt-get download failed");
        assert_eq!(skip_reason("a\nvalidate: skip: no tool\nb\n"), "no tool");
        assert!(skip_reason("nothing").contains("prerequisites"));
    }

    #[test]
    fn repo_root_holds_the_scripts() {
        assert!(repo_root().join("scripts/e2e/guest-e2e.sh").is_file());
    }
}
