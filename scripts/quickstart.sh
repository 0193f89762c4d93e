#!/usr/bin/env bash
# katablk quickstart: build, then serve a file-backed disk over vhost-user-blk.
#
#   scripts/quickstart.sh            build, create the disk image, serve until Ctrl-C
#   scripts/quickstart.sh --check    same, but write/read-verify it with a vhost-user client
#                                    (katablk-bench --verify) and exit
#
# Environment: KATABLK_DIR (default /var/tmp/katablk), KATABLK_SIZE_MIB (default 1024).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${KATABLK_DIR:-/var/tmp/katablk}
size=${KATABLK_SIZE_MIB:-1024}
mkdir -p "$dir"
cargo build --release -p katablk-vhost -p katablk-bench
img="$dir/disk.img"
[ -f "$img" ] || truncate -s "${size}M" "$img"
sock="$dir/vhost.sock"
build/release/katablk-vhost --socket "$sock" --file "$img" --num-queues 2 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { echo "katablk-vhost did not start" >&2; exit 1; }
echo "serving $img on $sock"
echo "attach QEMU with: -chardev socket,id=c0,path=$sock -device vhost-user-blk-pci,chardev=c0,num-queues=2"
if [ "${1:-}" = "--check" ]; then
    build/release/katablk-bench --socket "$sock" --rw randwrite --bs 4k --iodepth 8 \
        --runtime 2 --verify --no-progress
    build/release/katablk-bench --socket "$sock" --rw randread --bs 4k --iodepth 32 \
        --runtime 3 --no-progress
    exit 0
fi
wait $pid
