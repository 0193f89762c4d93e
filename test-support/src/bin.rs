//! Where a workspace binary (`katablk-vhost`, `katablk-target`, `katablk-csi`, ...) was built.
//!
//! Cargo tells an integration test where its own crate's binaries are (`CARGO_BIN_EXE_<name>`,
//! at compile time: [`bin_path!`](crate::bin_path) passes it in), but not where another crate's
//! are; those are found next to the running test binary, under `$CARGO_TARGET_DIR` or under
//! the workspace's `target/`, in that order, after an explicit `$KATABLK_<NAME>_BIN`.

use std::path::{Path, PathBuf};

/// The variable that names binary `name` explicitly: `katablk-target` → `KATABLK_TARGET_BIN`.
pub fn override_var(name: &str) -> String {
    format!("{}_BIN", name.to_ascii_uppercase().replace('-', "_"))
}

/// Every place binary `name` may be, most specific first: `$KATABLK_<NAME>_BIN`, `compiled`
/// (the test crate's `CARGO_BIN_EXE_<name>`), nextest's `NEXTEST_BIN_EXE_<name>`, next to the
/// running test (`<target-dir>/debug/deps/<test>` → `<target-dir>/debug/<name>`),
/// `$CARGO_TARGET_DIR/debug/<name>` and the workspace's `target/debug/<name>`.
pub fn candidates(name: &str, compiled: Option<&str>) -> Vec<PathBuf> {
    let mut c = Vec::new();
    if let Some(p) = std::env::var_os(override_var(name)) {
        c.push(PathBuf::from(p));
    }
    if let Some(p) = compiled {
        c.push(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os(format!("NEXTEST_BIN_EXE_{name}")) {
        c.push(PathBuf::from(p));
    }
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().and_then(Path::parent).map(Path::to_path_buf))
    {
        c.push(dir.join(name));
    }
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        c.push(Path::new(&t).join("debug").join(name));
    }
    c.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/debug")
            .join(name),
    );
    c
}

/// Binary `name` if it was built (see [`candidates`]).
pub fn find(name: &str, compiled: Option<&str>) -> Option<PathBuf> {
    candidates(name, compiled).into_iter().find(|p| p.is_file())
}

/// Binary `name`; panics, saying where it looked and what to do, when it was not built.
pub fn path(name: &str, compiled: Option<&str>) -> PathBuf {
    let cands = candidates(name, compiled);
    match cands.iter().find(|p| p.is_file()) {
        Some(p) => p.clone(),
        None => panic!(
            "{name} binary not found (tried {cands:?}); run `cargo build --workspace` (or \
             build the crate with that binary) first, or set {}",
            override_var(name)
        ),
    }
}

/// The path of workspace binary `$name` (a string literal), with the calling crate's
/// `CARGO_BIN_EXE_<name>` when the binary is its own; panics when it was not built.
///
/// ```no_run
/// let vhost = katablk_test_support::bin_path!("katablk-vhost");
/// ```
#[macro_export]
macro_rules! bin_path {
    ($name:literal) => {
        $crate::bin::path($name, option_env!(concat!("CARGO_BIN_EXE_", $name)))
    };
}
