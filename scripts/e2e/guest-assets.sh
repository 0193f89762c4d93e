#!/usr/bin/env bash
# Fetches and prepares everything the QEMU guest end-to-end test needs, from Debian packages only:
#
#   - QEMU (qemu-system-x86_64, TCG) and the libraries this host lacks, extracted with `dpkg -x`
#     (never installed: installing qemu-system-x86 may remove qemu-utils);
#   - the Debian 12 kernel (vmlinuz and the six virtio modules);
#   - a guest initramfs: busybox-static, the virtio modules, fio with every shared library that
#     the loader resolves for it (taken from the downloaded packages, never from the host), and the
#     /init and test scripts of scripts/e2e/guest/ plus the fio job files of benches/fio/.
#
# Usage: scripts/e2e/guest-assets.sh [--print-env]
#
# Everything is cached under $KATABLK_E2E_CACHE (default /var/cache/katablk-e2e): the .deb files,
# the extracted trees and the base initramfs are built once; the small overlay initramfs with the
# scripts is rebuilt on every call (a second cpio appended to the first; the kernel unpacks both).
# With --print-env it prints shell assignments (KATABLK_QEMU, KATABLK_QEMU_LD_LIBRARY_PATH,
# KATABLK_QEMU_MODULE_DIR, KATABLK_QEMU_BIOS_DIRS, KATABLK_KERNEL, KATABLK_INITRD) for `eval`.
#
# Package lists older than the mirror (a package's listed version is gone from it) are refreshed
# with one `apt-get update` and the download retried.
#
# Exit status: 0 ready; 1 (or any other) a failure, also when the Debian packages cannot be
# downloaded; 77 (callers skip) only for a machine that cannot reach a Debian mirror and asked
# for it with KATABLK_E2E_ALLOW_SKIP=1.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${KATABLK_E2E_CACHE:-/var/cache/katablk-e2e}
print_env=0
[ "${1:-}" = "--print-env" ] && print_env=1

log() { echo "guest-assets: $*" >&2; }
die() { log "error: $*"; exit 1; }
unavailable() {
    if [ "${KATABLK_E2E_ALLOW_SKIP:-0}" = 1 ]; then
        log "unavailable: $*"
        exit 77
    fi
    log "error: $* (a machine without a Debian mirror may skip with KATABLK_E2E_ALLOW_SKIP=1)"
    exit 1
}

# One `apt-get update` per run, the first time a lookup or download fails: the lists may be older
# than the mirror. Fails if it already ran or cannot reach the mirror.
refreshed=0
refresh_lists() {
    [ $refreshed = 0 ] || return 1
    refreshed=1
    log "refreshing the package lists (apt-get update)"
    apt-get update -qq >&2
}

# Runs "$@"; if it fails, refreshes the package lists once and runs it again.
retry_fresh() {
    "$@" && return 0
    refresh_lists || return 1
    log "retrying with fresh package lists: $*"
    "$@"
}

# QEMU, its firmware, and the libraries of its Depends that a plain Debian 12 host may lack
# (DESIGN.md section 7). Libraries the host already has are used from the host.
qemu_pkgs=(qemu-system-x86 qemu-system-data qemu-system-common seabios ipxe-qemu libcapstone4
    libfdt1 libpmem1 librdmacm1 libibverbs1 libslirp0 libvdeplug2 libndctl6 libdaxctl1 libnl-3-200
    libnl-route-3-200)
guest_pkgs=(busybox-static fio)
modules=(virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk)

mkdir -p "$cache/debs"
exec 9>"$cache/.lock"
flock 9

apt_download() { # PKG... into $cache/debs, skipping those already there
    local want=() p
    for p in "$@"; do
        compgen -G "$cache/debs/${p}_*.deb" >/dev/null || want+=("$p")
    done
    [ ${#want[@]} -eq 0 ] && return 0
    log "downloading ${want[*]}"
    (cd "$cache/debs" && apt-get -q -o APT::Sandbox::User=root download "${want[@]}") >&2
}

deb_of() { # PKG -> path of its cached .deb
    local f
    f=$(compgen -G "$cache/debs/${1}_*.deb" | head -n 1) || true
    [ -n "$f" ] || die "no cached .deb for $1"
    echo "$f"
}

# Library packages (lib*, zlib1g) in the Depends closure of the given packages, first alternative
# only; one apt-cache call per level of the graph.
lib_closure() {
    declare -A seen=()
    local level=("$@") next p
    while [ ${#level[@]} -gt 0 ]; do
        for p in "${level[@]}"; do seen[$p]=1; echo "$p"; done
        mapfile -t next < <(apt-cache depends --no-recommends --no-suggests --no-conflicts \
            --no-breaks --no-replaces --no-enhances "${level[@]}" 2>/dev/null |
            awk '/^ *(\|)?(Pre)?Depends: [^<]/ && !alt { print $2 } { alt = ($1 ~ /^\|/) }' |
            grep -E '^(lib|zlib1g$)' | sort -u)
        level=()
        for p in "${next[@]}"; do [ -n "${seen[$p]:-}" ] || level+=("$p"); done
    done
}

# ---------------------------------------------------------------------------------------------
# 0. Package lists: apt-get download needs them. A host that never ran apt-get update gets one.
kernel_pkg=${KATABLK_E2E_KERNEL_PKG:-}
resolve_kernel() {
    apt-cache depends linux-image-amd64 2>/dev/null |
        awk '/Depends: linux-image-6\.1\.0-[0-9]+-amd64$/ { print $2; exit }'
}
if [ -z "$kernel_pkg" ]; then
    kernel_pkg=$(compgen -G "$cache/debs/linux-image-6.1.0-*-amd64_*.deb" | head -n 1 || true)
    kernel_pkg=${kernel_pkg:+$(basename "$kernel_pkg" | cut -d_ -f1)}
fi
if [ -z "$kernel_pkg" ]; then
    kernel_pkg=$(resolve_kernel)
    if [ -z "$kernel_pkg" ]; then
        log "no linux-image-amd64 in the package lists"
        refresh_lists || unavailable "apt-get update failed (no Debian mirror reachable?)"
        kernel_pkg=$(resolve_kernel)
    fi
    [ -n "$kernel_pkg" ] || unavailable "no linux-image-6.1.0-*-amd64 package known to apt"
fi
kver=${kernel_pkg#linux-image-}

# ---------------------------------------------------------------------------------------------
# 1. QEMU on the host side.
qroot=$cache/qemu
if [ ! -x "$qroot/usr/bin/qemu-system-x86_64" ]; then
    retry_fresh apt_download "${qemu_pkgs[@]}" || unavailable "apt-get download of QEMU failed"
    rm -rf "$qroot.tmp"
    mkdir -p "$qroot.tmp"
    for p in "${qemu_pkgs[@]}"; do dpkg -x "$(deb_of "$p")" "$qroot.tmp"; done
    rm -rf "$qroot"
    mv "$qroot.tmp" "$qroot"
fi
qlibs="$qroot/usr/lib/x86_64-linux-gnu:$qroot/lib/x86_64-linux-gnu"
missing=$(LD_LIBRARY_PATH=$qlibs ldd "$qroot/usr/bin/qemu-system-x86_64" | awk '/not found/ { print $1 }')
[ -z "$missing" ] || die "qemu-system-x86_64 needs libraries neither this host nor the extracted" \
    "packages have: $missing (add their packages to qemu_pkgs)"

# ---------------------------------------------------------------------------------------------
# 2. Kernel and modules (only those files are taken out of the 70 MB package).
kdir=$cache/kernel-$kver
if [ ! -s "$kdir/vmlinuz" ]; then
    # After a refresh the kernel is looked up again (unless pinned): stale lists may name an ABI
    # version the mirror no longer has.
    kernel_fetch() {
        if [ $refreshed = 1 ] && [ -z "${KATABLK_E2E_KERNEL_PKG:-}" ]; then
            kernel_pkg=$(resolve_kernel)
            [ -n "$kernel_pkg" ] || return 1
        fi
        apt_download "$kernel_pkg"
    }
    retry_fresh kernel_fetch || unavailable "apt-get download of $kernel_pkg failed"
    kver=${kernel_pkg#linux-image-}
    kdir=$cache/kernel-$kver
    rm -rf "$kdir.tmp"
    mkdir -p "$kdir.tmp/x"
    patterns=("./boot/vmlinuz-*")
    for m in "${modules[@]}"; do patterns+=("*/$m.ko"); done
    dpkg-deb --fsys-tarfile "$(deb_of "$kernel_pkg")" |
        tar -x -C "$kdir.tmp/x" --wildcards "${patterns[@]}"
    mv "$kdir.tmp"/x/boot/vmlinuz-* "$kdir.tmp/vmlinuz"
    mkdir -p "$kdir.tmp/modules"
    for m in "${modules[@]}"; do
        f=$(find "$kdir.tmp/x/lib/modules" -name "$m.ko" | head -n 1)
        [ -n "$f" ] || die "module $m.ko not in $kernel_pkg"
        mv "$f" "$kdir.tmp/modules/"
    done
    rm -rf "$kdir.tmp/x" "$kdir"
    mv "$kdir.tmp" "$kdir"
fi

# ---------------------------------------------------------------------------------------------
# 3. Guest userland: busybox, fio and the closure of fio's library packages (glibc included, so
#    the guest's loader and libc come from the same package as everything else).
groot=$cache/guest-root
if [ ! -x "$groot/usr/bin/fio" ]; then
    # The closure is computed again after a refresh: fresh lists may name other libraries.
    guest_download() {
        mapfile -t gpkgs < <(lib_closure "${guest_pkgs[@]}")
        [ ${#gpkgs[@]} -gt 2 ] || { log "apt-cache knows no dependencies of fio"; return 1; }
        apt_download "${gpkgs[@]}"
    }
    retry_fresh guest_download || unavailable "apt-get download of fio and its libraries failed"
    rm -rf "$groot.tmp"
    mkdir -p "$groot.tmp"
    for p in "${gpkgs[@]}"; do dpkg -x "$(deb_of "$p")" "$groot.tmp"; done
    rm -rf "$groot"
    mv "$groot.tmp" "$groot"
fi

base=$cache/initrd-base-$kver.cpio.gz
if [ ! -s "$base" ]; then
    log "building the base initramfs"
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,lib/modules,lib/x86_64-linux-gnu,lib64,proc,sys,dev,tmp,mnt}
    cp "$groot/bin/busybox" "$stage/bin/busybox"
    cp "$kdir"/modules/*.ko "$stage/lib/modules/"
    cp "$groot/usr/bin/fio" "$stage/usr/bin/fio"
    # Every library the guest's own loader resolves for fio, from the extracted packages only.
    ldso=$groot/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
    [ -x "$ldso" ] || die "no ld-linux-x86-64.so.2 in the extracted libc6"
    libpath=$(find "$groot" -name '*.so*' -type f -printf '%h\n' | sort -u | paste -sd:)
    "$ldso" --library-path "$libpath" --list "$groot/usr/bin/fio" >"$stage/ldd.txt" ||
        die "the loader cannot resolve fio's libraries: $(cat "$stage/ldd.txt")"
    while read -r name arrow path _; do
        case "$arrow" in
        "=>")
            case "$name" in /*) continue ;; esac # the loader itself, copied below
            [ "$path" != "not" ] || die "fio needs $name, which no downloaded package has"
            case "$path" in "$groot"/*) ;; *) die "fio's $name resolved outside the packages: $path" ;; esac
            cp -L "$path" "$stage/lib/x86_64-linux-gnu/$name"
            ;;
        esac
    done <"$stage/ldd.txt"
    cp -L "$ldso" "$stage/lib64/ld-linux-x86-64.so.2"
    ln -s /lib64/ld-linux-x86-64.so.2 "$stage/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    rm "$stage/ldd.txt"
    (cd "$stage" && find . | "$groot/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1) >"$base.tmp"
    mv "$base.tmp" "$base"
    rm -rf "$stage"
    trap - EXIT
fi

# ---------------------------------------------------------------------------------------------
# 4. Overlay: /init, the guest test scripts and the fio job files (cheap, rebuilt every time).
over=$(mktemp -d)
trap 'rm -rf "$over"' EXIT
mkdir -p "$over/e2e" "$over/fio"
install -m 0755 "$here/guest/init" "$over/init"
install -m 0755 "$here"/guest/*.sh "$over/e2e/"
install -m 0644 "$repo"/benches/fio/*.fio "$over/fio/"
initrd=$cache/initrd.gz
(cd "$over" && find . | "$groot/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1) >"$cache/overlay.cpio.gz"
cat "$base" "$cache/overlay.cpio.gz" >"$initrd.tmp"
mv "$initrd.tmp" "$initrd"

if [ $print_env = 1 ]; then
    printf 'KATABLK_QEMU=%q\n' "$qroot/usr/bin/qemu-system-x86_64"
    printf 'KATABLK_QEMU_LD_LIBRARY_PATH=%q\n' "$qlibs"
    printf 'KATABLK_QEMU_MODULE_DIR=%q\n' "$qroot/usr/lib/x86_64-linux-gnu/qemu"
    printf 'KATABLK_QEMU_BIOS_DIRS=%q\n' "$qroot/usr/share/qemu:$qroot/usr/share/seabios"
    printf 'KATABLK_KERNEL=%q\n' "$kdir/vmlinuz"
    printf 'KATABLK_INITRD=%q\n' "$initrd"
    printf 'KATABLK_KERNEL_VERSION=%q\n' "$kver"
fi
log "ready: kernel $kver, initramfs $initrd"
