#!/usr/bin/env bash
# katablk quickstart: the node stack on the embedded target with a file-backed lvstore.
#
#   scripts/quickstart.sh            build; start katablk-target; provision (idempotently) an
#                                    aio bdev on a disk image, an lvstore, a thin lvol and a
#                                    vhost-user-blk controller over SPDK JSON-RPC; check the
#                                    controller with a vhost-user client; keep serving (Ctrl-C)
#   scripts/quickstart.sh --check    same, then stop
#
# Environment: KATABLK_DIR (default /var/tmp/katablk), KATABLK_SIZE_MIB (default 1024),
# SPDK_RPC (default: the venv made by scripts/setup-debian.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${KATABLK_DIR:-/var/tmp/katablk}
size=${KATABLK_SIZE_MIB:-1024}
rpc_bin=${SPDK_RPC:-/opt/katablk/spdk-venv/bin/spdk-rpc}
[ -x "$rpc_bin" ] || rpc_bin=$(command -v spdk-rpc || true)
[ -n "$rpc_bin" ] || { echo "spdk-rpc not found: run scripts/setup-debian.sh" >&2; exit 1; }
mkdir -p "$dir/sockets"
cargo build --release -p katablk-target -p katablk-vhost -p katablk-bench
img="$dir/disk.img"
[ -f "$img" ] || truncate -s "${size}M" "$img"
sock="$dir/spdk.sock"
build/release/katablk-target -S "$dir/sockets" -r "$sock" --state-dir "$dir/state" \
    2>>"$dir/target.log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { echo "katablk-target did not start; see $dir/target.log" >&2; exit 1; }
rpc() { "$rpc_bin" -s "$sock" "$@"; }
# Idempotent provisioning: a restart finds everything restored from $dir/state.
rpc bdev_get_bdevs -b aio0 >/dev/null 2>&1 || rpc bdev_aio_create "$img" aio0
rpc bdev_lvol_get_lvstores -l lvs0 >/dev/null 2>&1 || rpc bdev_lvol_create_lvstore aio0 lvs0
rpc bdev_get_bdevs -b lvs0/vol0 >/dev/null 2>&1 || rpc bdev_lvol_create vol0 256 -l lvs0 -t
rpc vhost_get_controllers -n vhostblk0 >/dev/null 2>&1 ||
    rpc vhost_create_blk_controller --cpumask 0x1 vhostblk0 lvs0/vol0
ctrl="$dir/sockets/vhostblk0"
echo "lvol lvs0/vol0 on $img served at $ctrl"
echo "attach QEMU with: -chardev socket,id=c0,path=$ctrl -device vhost-user-blk-pci,chardev=c0"
build/release/katablk-bench --socket "$ctrl" --rw randwrite --bs 4k --iodepth 8 \
    --runtime 2 --verify --no-progress
build/release/katablk-bench --socket "$ctrl" --rw randread --bs 4k --iodepth 32 \
    --runtime 3 --no-progress
rpc bdev_lvol_get_lvols
if [ "${1:-}" = "--check" ]; then
    exit 0
fi
echo "serving until Ctrl-C (JSON-RPC at $sock)"
wait $pid
