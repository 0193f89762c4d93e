//! Without the `spdk` feature the crate is empty and this script does nothing. With it, SPDK is
//! located through `SPDK_DIR` (its pkg-config files) or pkg-config on `PKG_CONFIG_PATH`
//! (failing with a message naming `SPDK_DIR` otherwise), bindings are generated with bindgen
//! from `wrapper.h` under an allowlist into `OUT_DIR`, and the SPDK/DPDK libraries are linked
//! statically and whole-archive (their constructors register bdev modules, subsystems, RPC
//! methods and DPDK drivers).

#[cfg(feature = "spdk")]
#[path = "build_support/locate.rs"]
#[allow(dead_code)]
mod locate;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build_support/locate.rs");
    println!("cargo:rerun-if-env-changed=SPDK_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    #[cfg(feature = "spdk")]
    with_spdk();
}

#[cfg(feature = "spdk")]
fn with_spdk() {
    use std::path::PathBuf;
    let install = locate_spdk().unwrap_or_else(|e| panic!("spdk-sys with the `spdk` feature: {e}"));
    for d in &install.lib_dirs {
        println!("cargo:rustc-link-search=native={}", d.display());
    }
    for l in &install.libs {
        if locate::whole_archive(l) {
            println!("cargo:rustc-link-lib=static:+whole-archive,-bundle={l}");
        } else {
            println!("cargo:rustc-link-lib={l}");
        }
    }
    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("^spdk_.*")
        .allowlist_type("^spdk_.*")
        .allowlist_var("^SPDK_.*")
        .opaque_type("^spdk_nvme.*")
        .opaque_type("^rte_.*")
        .opaque_type("^spdk_bdev_nvme_.*")
        .opaque_type("^spdk_bdev_ext_io_opts$")
        .derive_default(true)
        .layout_tests(false)
        .prepend_enum_name(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for d in &install.include_dirs {
        b = b.clang_arg(format!("-I{}", d.display()));
    }
    let bindings = b
        .generate()
        .unwrap_or_else(|e| panic!("bindgen over wrapper.h failed: {e}"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join("spdk.rs");
    bindings
        .write_to_file(&out)
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

#[cfg(feature = "spdk")]
fn locate_spdk() -> Result<locate::SpdkInstall, locate::LocateError> {
    if let Some(d) = std::env::var_os("SPDK_DIR") {
        let dir = std::path::PathBuf::from(d);
        let dirs = locate::pkg_config_dirs(&dir)?;
        let current = std::env::var("PKG_CONFIG_PATH").ok();
        // The pkg-config crate runs `pkg-config`, which reads this variable.
        std::env::set_var(
            "PKG_CONFIG_PATH",
            locate::join_pkg_config_path(&dirs, current.as_deref()),
        );
    }
    let mut inc = Vec::new();
    let mut dirs = Vec::new();
    let mut libs: Vec<String> = Vec::new();
    for p in locate::PKG_CONFIG_PACKAGES {
        let l = pkg_config::Config::new()
            .statik(true)
            .cargo_metadata(false)
            .probe(p)
            .map_err(|e| locate::LocateError::NotFound(format!("pkg-config {p}: {e}")))?;
        for i in l.include_paths {
            if !inc.contains(&i) {
                inc.push(i);
            }
        }
        for d in l.link_paths {
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
        for n in l.libs {
            if !libs.contains(&n) {
                libs.push(n);
            }
        }
    }
    if let Some(d) = std::env::var_os("SPDK_DIR") {
        // A build tree's headers are also under include/ (and DPDK's under dpdk/build/include).
        let dir = std::path::PathBuf::from(d);
        for i in [dir.join("include"), dir.join("dpdk/build/include")] {
            if i.is_dir() && !inc.contains(&i) {
                inc.push(i);
            }
        }
    }
    // -pthread is a flag, not a library, in spdk_syslibs.pc.
    if !libs.iter().any(|l| l == "pthread") {
        libs.push("pthread".into());
    }
    Ok(locate::SpdkInstall {
        include_dirs: inc,
        lib_dirs: dirs,
        libs,
    })
}
