//! Without the `spdk` feature the crate is empty and this script does nothing. With it, SPDK is
//! located through `SPDK_DIR` or pkg-config (failing with a message naming `SPDK_DIR`
//! otherwise), bindings are generated with bindgen from `wrapper.h` under an allowlist into
//! `OUT_DIR`, and the SPDK/DPDK libraries are linked (whole-archive where their constructors
//! must survive).

#[cfg(feature = "spdk")]
#[path = "build_support/locate.rs"]
#[allow(dead_code)]
mod locate;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=SPDK_DIR");
    #[cfg(feature = "spdk")]
    with_spdk();
}

#[cfg(feature = "spdk")]
fn with_spdk() {
    use std::path::PathBuf;
    let install = match std::env::var_os("SPDK_DIR") {
        Some(d) => locate::from_spdk_dir(std::path::Path::new(&d), |dir| {
            let files: Vec<String> = std::fs::read_dir(dir)
                .map(|it| {
                    it.filter_map(|e| e.ok())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            locate::lib_names(&files)
        }),
        None => {
            let mut inc = Vec::new();
            let mut dirs = Vec::new();
            let mut libs = Vec::new();
            let mut err = None;
            for p in locate::PKG_CONFIG_PACKAGES {
                match pkg_config::Config::new()
                    .statik(true)
                    .cargo_metadata(false)
                    .probe(p)
                {
                    Ok(l) => {
                        inc.extend(l.include_paths);
                        dirs.extend(l.link_paths);
                        for n in l.libs {
                            if !libs.contains(&n) {
                                libs.push(n);
                            }
                        }
                    }
                    Err(e) => {
                        err = Some(format!("pkg-config {p}: {e}"));
                        break;
                    }
                }
            }
            match err {
                Some(e) => Err(locate::LocateError::NotFound(e)),
                None => Ok(locate::SpdkInstall {
                    include_dirs: inc,
                    lib_dirs: dirs,
                    libs,
                }),
            }
        }
    };
    let install = match install {
        Ok(i) => i,
        Err(e) => panic!("spdk-sys with the `spdk` feature: {e}"),
    };
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
    for sys in [
        "numa", "uuid", "ssl", "crypto", "aio", "rt", "pthread", "dl", "m",
    ] {
        println!("cargo:rustc-link-lib={sys}");
    }
    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("^spdk_.*")
        .allowlist_type("^spdk_.*")
        .allowlist_var("^SPDK_.*")
        .allowlist_type("^rte_mempool$")
        .opaque_type("^spdk_nvme.*")
        .derive_default(true)
        .layout_tests(false)
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
