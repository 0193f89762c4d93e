#!/usr/bin/env bash
# katablk quickstart: the node stack on the embedded target with a file-backed lvstore.
#
#   scripts/quickstart.sh            build; start katablk-target and katablk-csi; declare the
#                                    node's lvstore on a disk image (aio bdev + lvstore over SPDK
#                                    JSON-RPC, idempotently); provision a volume and publish it
#                                    through CSI gRPC as kubelet would (a vhost-user-blk
#                                    controller, a Kata device node b 241:N bind-mounted at the
#                                    target path); check it with a vhost-user client; keep
#                                    serving (Ctrl-C)
#   scripts/quickstart.sh --check    same, then unpublish and stop
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
store="$dir/vhost-user"          # Kata's vhost_user_store_path
kubelet="$dir/kubelet"
mkdir -p "$store/block/sockets" "$store/block/devices" "$kubelet"
cargo build --release -p katablk-target -p katablk-csi -p katablk-bench
bin=target/release
img="$dir/disk.img"
[ -f "$img" ] || truncate -s "${size}M" "$img"
sock="$dir/spdk.sock"
csi="$dir/csi.sock"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
wait_sock() { for _ in $(seq 100); do [ -S "$1" ] && return 0; sleep 0.1; done; echo "$1 did not appear; see $dir/*.log" >&2; exit 1; }

"$bin/katablk-target" -S "$store/block/sockets" -r "$sock" --state-dir "$dir/state" 2>>"$dir/target.log" &
pids+=($!)
wait_sock "$sock"
rpc() { "$rpc_bin" -s "$sock" "$@"; }
# The node's declared storage: a restart finds both again (state dir + lvstore examine).
rpc bdev_get_bdevs -b aio0 >/dev/null 2>&1 || rpc bdev_aio_create "$img" aio0
rpc bdev_lvol_get_lvstores -l lvs0 >/dev/null 2>&1 || rpc bdev_lvol_create_lvstore aio0 lvs0

"$bin/katablk-csi" --endpoint "unix://$csi" --spdk-rpc "$sock" --vhost-user-store "$store" \
    --lvs lvs0 --kubelet-dir "$kubelet" --direct-volumes-dir "$dir/direct-volumes" \
    --state-dir "$dir/csi-state" --node-id "$(hostname)" 2>>"$dir/csi.log" &
pids+=($!)
wait_sock "$csi"
ctl() { "$bin/katablk-csi-ctl" --endpoint "unix://$csi" "$@"; }
ctl probe
# CreateVolume (idempotent by name) and NodePublishVolume, as the provisioner and kubelet do.
read -r vol cap _ < <(ctl create pvc-quickstart 256 -p thinProvision=true)
echo "volume $vol ($cap bytes)"
target="$kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-quickstart/dev"
mkdir -p "$(dirname "$target")"
ctl publish "$vol" "$target"
major=$((16#$(stat -c %t "$target")))
minor=$((16#$(stat -c %T "$target")))
[ "$major" = 241 ] || { echo "target is not a vhost-user-blk device node (major $major)" >&2; exit 1; }
ctrlr_sock=$(rpc vhost_get_controllers | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["socket"])')
echo "published: $target is b $major:$minor; Kata hands $ctrlr_sock to the VMM"
echo "attach QEMU with: -chardev socket,id=c0,path=$ctrlr_sock -device vhost-user-blk-pci,chardev=c0"
"$bin/katablk-bench" --socket "$ctrlr_sock" --rw randwrite --bs 4k --iodepth 8 \
    --runtime 2 --verify --no-progress
"$bin/katablk-bench" --socket "$ctrlr_sock" --rw randread --bs 4k --iodepth 32 \
    --runtime 3 --no-progress
if [ "${1:-}" = "--check" ]; then
    ctl unpublish "$vol" "$target"
    ctl list
    exit 0
fi
echo "serving until Ctrl-C (JSON-RPC at $sock, CSI at $csi)"
wait "${pids[0]}"
