// Shared by build.rs and the crate's unit tests (included with `#[path]`): where SPDK is and
// what to link, decided from `SPDK_DIR` or pkg-config, with no side effects.

use std::path::{Path, PathBuf};

/// The SPDK libraries katablk needs, as pkg-config package names.
pub const PKG_CONFIG_PACKAGES: &[&str] = &[
    "spdk_event",
    "spdk_bdev",
    "spdk_vhost",
    "spdk_event_bdev",
    "spdk_bdev_malloc",
    "spdk_bdev_aio",
    "spdk_bdev_lvol",
    "spdk_env_dpdk",
    "spdk_syslibs",
];

/// Libraries whose constructors register modules (bdev modules, subsystems, RPCs): they must be
/// linked whole, or the linker drops them.
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

/// An SPDK tree or prefix: headers in `include/`, libraries in `build/lib` (a build tree) or
/// `lib` (an install prefix), DPDK's in `dpdk/build/{include,lib}` (a build tree).
pub fn from_spdk_dir(
    dir: &Path,
    libs_present: impl Fn(&Path) -> Vec<String>,
) -> Result<SpdkInstall, LocateError> {
    if !dir.join("include/spdk/bdev.h").is_file() {
        return Err(LocateError::BadSpdkDir(dir.to_path_buf()));
    }
    let mut include_dirs = vec![dir.join("include")];
    let mut lib_dirs = Vec::new();
    for l in [
        "build/lib",
        "lib",
        "dpdk/build/lib",
        "isa-l/.libs",
        "isa-l-crypto/.libs",
    ] {
        let p = dir.join(l);
        if p.is_dir() {
            lib_dirs.push(p);
        }
    }
    let dpdk_inc = dir.join("dpdk/build/include");
    if dpdk_inc.is_dir() {
        include_dirs.push(dpdk_inc);
    }
    let mut libs = Vec::new();
    for d in &lib_dirs {
        for l in libs_present(d) {
            if !libs.contains(&l) {
                libs.push(l);
            }
        }
    }
    if libs.is_empty() {
        return Err(LocateError::NotFound(format!(
            "no libspdk_*/librte_* libraries under {}",
            dir.display()
        )));
    }
    Ok(SpdkInstall {
        include_dirs,
        lib_dirs,
        libs,
    })
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
