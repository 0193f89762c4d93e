// Shared by build.rs and the crate's unit tests (included with `#[path]`): where SPDK is and
// what to link, decided from `SPDK_DIR` or pkg-config, with no side effects.

use std::path::{Path, PathBuf};

/// The SPDK libraries katablk needs, as pkg-config package names: the application framework
/// with the bdev subsystem, every bdev module SPDK built (NVMe, AIO, malloc, null, lvol, ...),
/// the DPDK environment (and its RPCs) and the system libraries.
pub const PKG_CONFIG_PACKAGES: &[&str] = &[
    "spdk_event",
    "spdk_event_bdev",
    "spdk_bdev_modules",
    "spdk_env_dpdk",
    "spdk_env_dpdk_rpc",
    "spdk_syslibs",
];

/// Libraries whose constructors register modules (bdev modules, subsystems, RPCs, DPDK
/// drivers): they must be linked whole, or the linker drops them.
pub const WHOLE_ARCHIVE_PREFIXES: &[&str] = &["spdk_", "rte_"];

/// A located SPDK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpdkInstall {
    /// Directories with SPDK (and DPDK) headers.
    pub include_dirs: Vec<PathBuf>,
    /// Directories to search for libraries.
    pub lib_dirs: Vec<PathBuf>,
    /// Libraries to link, in order.
    pub libs: Vec<String>,
}

/// Why SPDK was not found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocateError {
    /// `SPDK_DIR` is set but holds no SPDK headers.
    BadSpdkDir(PathBuf),
    /// Neither `SPDK_DIR` nor pkg-config found SPDK.
    NotFound(String),
}

impl std::fmt::Display for LocateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LocateError::BadSpdkDir(d) => write!(
                f,
                "SPDK_DIR={} has no include/spdk/bdev.h: point SPDK_DIR at an SPDK build tree or install prefix",
                d.display()
            ),
            LocateError::NotFound(why) => write!(
                f,
                "SPDK not found ({why}): set SPDK_DIR to an SPDK build tree or install prefix, or make its pkg-config files (spdk_bdev.pc, ...) visible through PKG_CONFIG_PATH"
            ),
        }
    }
}

/// The pkg-config directories of an SPDK tree or prefix: `build/lib/pkgconfig` (a build tree,
/// with DPDK's in `dpdk/build/lib/pkgconfig`) or `lib/pkgconfig` (an install prefix).
pub fn pkg_config_dirs(dir: &Path) -> Result<Vec<PathBuf>, LocateError> {
    if !dir.join("include/spdk/bdev.h").is_file() {
        return Err(LocateError::BadSpdkDir(dir.to_path_buf()));
    }
    let dirs: Vec<PathBuf> = [
        "build/lib/pkgconfig",
        "dpdk/build/lib/pkgconfig",
        "lib/pkgconfig",
        "lib64/pkgconfig",
    ]
    .iter()
    .map(|d| dir.join(d))
    .filter(|d| d.is_dir())
    .collect();
    if dirs.is_empty() {
        return Err(LocateError::NotFound(format!(
            "no pkgconfig directory (build/lib/pkgconfig or lib/pkgconfig) under {}: build SPDK first",
            dir.display()
        )));
    }
    Ok(dirs)
}

/// `PKG_CONFIG_PATH` with `dirs` in front of `current`.
pub fn join_pkg_config_path(dirs: &[PathBuf], current: Option<&str>) -> String {
    let mut parts: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    if let Some(c) = current.filter(|c| !c.is_empty()) {
        parts.push(c.to_string());
    }
    parts.join(":")
}

/// Library names (`spdk_bdev` for `libspdk_bdev.a`) in a directory listing.
pub fn lib_names(files: &[String]) -> Vec<String> {
    let mut v: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let stem = f.strip_prefix("lib")?;
            let name = stem
                .strip_suffix(".a")
                .or_else(|| stem.strip_suffix(".so"))?;
            (name.starts_with("spdk_") || name.starts_with("rte_")).then(|| name.to_string())
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

/// True if `lib` must be linked whole.
pub fn whole_archive(lib: &str) -> bool {
    WHOLE_ARCHIVE_PREFIXES.iter().any(|p| lib.starts_with(p))
}
