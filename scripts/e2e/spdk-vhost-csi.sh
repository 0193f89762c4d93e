#!/usr/bin/env bash
# The katablk-csi node flow against SPDK's own vhost app (instead of katablk-target), with
# checks at every step, as kubelet and the external provisioner would drive it:
#
#   SPDK's vhost -S <store>/block/sockets -r <rpc> -m 0x1 -s 512
#   katablk-csi --spdk-rpc <rpc> --node-config (a sparse pool file declared as lvstore lvs0)
#   probe (the driver creates the aio bdev and lvs0 on SPDK) -> CreateVolume (block) ->
#   NodePublishVolume (controller on SPDK, b 241:0 bind-mounted at the target path, socket in
#   the store) -> DeleteVolume refused while published -> data written and verified through the
#   published socket with libblkio (katablk-bench --align-2m; 4 KiB and 1 MiB requests) ->
#   ControllerExpand + NodeExpand -> kill -9 of SPDK and restart (the driver re-creates the aio
#   bdev and the controller on the same socket) -> NodeUnpublishVolume refused while a client is connected ->
#   NodeUnpublishVolume (mount, target file, device node, controller and socket gone, lvol kept) -> DeleteVolume (lvol gone) -> SPDK still running.
#
#   SPDK_VHOST=/path/to/spdk/build/bin/vhost scripts/e2e/spdk-vhost-csi.sh
#
# Without SPDK_VHOST (or when it does not exist, or not root) it prints "SKIP: ..." and exits 0.
# Prints a PASS/FAIL line per check and "N passed, N failed"; exits 1 if any check failed.
# Environment: KATABLK_BIN_DIR (default target/debug) or KATABLK_CSI, KATABLK_CSI_CTL,
# KATABLK_BENCH (must know --align-2m); SPDK_VHOST_ARGS (default "-m 0x1 -s 512");
# KEEP=1 keeps the scratch directory (logs: vhost.log, csi.log).
# Snapshots, clones and filesystem volumes on SPDK's vhost: csi/tests/spdk_vhost.rs.
#
# Why --align-2m: SPDK's vhost registers each client memory region in 2 MiB units rounded out
# from its own mapping of it, touching every unit; a region of normal pages can make it touch
# unmapped memory and die (seen: SIGSEGV in vtophys_get_paddr_pagemap with a 2 MiB libblkio
# buffer). 2 MiB hugepage buffers at 2 MiB-aligned addresses (katablk_bdev::shm) avoid that;
# katablk-csi's own client (formatting) uses them too.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
repo=$PWD

if [ -z "${SPDK_VHOST:-}" ]; then
    echo "SKIP: SPDK_VHOST is not set (path of SPDK's build/bin/vhost)"
    exit 0
fi
if [ ! -x "$SPDK_VHOST" ]; then
    echo "SKIP: SPDK_VHOST=$SPDK_VHOST is not an executable file"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "SKIP: needs root (mknod, bind mounts, hugepages)"
    exit 0
fi

bindir=${KATABLK_BIN_DIR:-$repo/target/debug}
csi_bin=${KATABLK_CSI:-$bindir/katablk-csi}
ctl_bin=${KATABLK_CSI_CTL:-$bindir/katablk-csi-ctl}
bench_bin=${KATABLK_BENCH:-$bindir/katablk-bench}
for b in "$csi_bin" "$ctl_bin" "$bench_bin"; do
    [ -x "$b" ] || { echo "FAIL: $b not found (cargo build -p katablk-csi -p katablk-bench, or set KATABLK_BIN_DIR)"; exit 1; }
done
"$bench_bin" --help | grep -q -- --align-2m ||
    { echo "FAIL: $bench_bin has no --align-2m (rebuild katablk-bench)"; exit 1; }

# SPDK takes 512 MiB of 2 MiB hugepages, the clients a few more.
free_pages=$(awk '/HugePages_Free/ { print $2 }' /proc/meminfo)
if [ "${free_pages:-0}" -lt 300 ]; then
    scripts/setup-hugepages.sh "$(($(awk '/HugePages_Total/ { print $2 }' /proc/meminfo) + 300 - free_pages))" >/dev/null ||
        { echo "FAIL: not enough free 2 MiB hugepages ($free_pages); run scripts/setup-hugepages.sh"; exit 1; }
fi

dir=$(mktemp -d /tmp/katablk-spdk-csi.XXXXXX)
store=$dir/vhost-user
kubelet=$dir/kubelet
rpc_sock=$dir/spdk.sock
csi_sock=$dir/csi.sock
mkdir -p "$store/block/sockets" "$store/block/devices" "$kubelet"
truncate -s 1G "$dir/pool.img"
printf 'devices:\n  - path: %s\n    lvs: lvs0\n' "$dir/pool.img" >"$dir/node.yaml"

vhost_pid='' csi_pid=''
cleanup() {
    [ -n "$csi_pid" ] && kill "$csi_pid" 2>/dev/null && wait "$csi_pid" 2>/dev/null
    [ -n "$vhost_pid" ] && kill "$vhost_pid" 2>/dev/null && wait "$vhost_pid" 2>/dev/null
    local m
    for m in $(awk -v d="$dir/" 'index($5, d) == 1 { print $5 }' /proc/self/mountinfo | sort -r); do
        umount "$m" 2>/dev/null || true
    done
    if [ "${KEEP:-0}" = 1 ]; then echo "kept $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT

passed=0 failed=0
pass() { echo "PASS $*"; passed=$((passed + 1)); }
fail() { echo "FAIL $*"; failed=$((failed + 1)); }
check() { # check "what" command...
    local what=$1
    shift
    if "$@"; then pass "$what"; else fail "$what"; fi
}
finish() {
    echo "spdk-vhost-csi: $passed passed, $failed failed"
    [ "$failed" = 0 ] || echo "logs: $dir/vhost.log $dir/csi.log (KEEP=1 keeps them)"
    [ "$failed" = 0 ]
    exit
}

# JSON-RPC 2.0 to SPDK over its unix socket: rpc METHOD [JSON params] -> result JSON (rc 1 on error).
rpc() {
    python3 - "$rpc_sock" "$1" "${2:-}" <<'EOF'
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
req = {"jsonrpc": "2.0", "id": 1, "method": sys.argv[2]}
if sys.argv[3]:
    req["params"] = json.loads(sys.argv[3])
s.sendall(json.dumps(req).encode())
buf, dec = b"", json.JSONDecoder()
while True:
    chunk = s.recv(65536)
    if not chunk:
        sys.exit("connection closed")
    buf += chunk
    try:
        resp, _ = dec.raw_decode(buf.decode())
        break
    except ValueError:
        continue
if "error" in resp:
    print(json.dumps(resp["error"]))
    sys.exit(1)
print(json.dumps(resp["result"]))
EOF
}
# A Python expression on the JSON in stdin (r), printed: js 'r[0]["name"]' <<<json
js() { python3 -c "import json,sys; r=json.load(sys.stdin); print($1)"; }
ctl() { timeout 60 "$ctl_bin" --endpoint "unix://$csi_sock" "$@"; }
alive() { kill -0 "$vhost_pid" 2>/dev/null; }
wait_sock() {
    local _
    for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.1; done
    return 1
}

echo "SPDK vhost: $SPDK_VHOST; katablk: $csi_bin; scratch: $dir"
start_vhost() {
    rm -f "$rpc_sock"
    # shellcheck disable=SC2086
    "$SPDK_VHOST" -S "$store/block/sockets" -r "$rpc_sock" ${SPDK_VHOST_ARGS:--m 0x1 -s 512} \
        >>"$dir/vhost.log" 2>&1 &
    vhost_pid=$!
}
start_vhost
check "SPDK vhost serves JSON-RPC at $rpc_sock" wait_sock "$rpc_sock"
version=$(rpc spdk_get_version | js 'r["version"]') || version=''
check "spdk_get_version: $version" grep -q '^SPDK' <<<"$version"
[ "$failed" = 0 ] || finish

RUST_LOG=${RUST_LOG:-info} "$csi_bin" --endpoint "unix://$csi_sock" --spdk-rpc "$rpc_sock" \
    --vhost-user-store "$store" --lvs lvs0 --node-config "$dir/node.yaml" \
    --kubelet-dir "$kubelet" --direct-volumes-dir "$dir/direct-volumes" \
    --state-dir "$dir/csi-state" --node-id spdk-node --reconcile-interval 1 >"$dir/csi.log" 2>&1 &
csi_pid=$!
check "katablk-csi listening" wait_sock "$csi_sock"

# The driver applies the node config at start: aio bdev (block_size 512 on a file) + lvs0.
ready=''
for _ in $(seq 100); do
    ready=$(ctl probe 2>/dev/null) && grep -q 'ready=Some(true)' <<<"$ready" && break
    sleep 0.2
done
check "Probe ready ($ready)" grep -q 'ready=Some(true)' <<<"$ready"
lvs=$(rpc bdev_lvol_get_lvstores '{"lvs_name":"lvs0"}') || lvs='[]'
check "lvs0 created on SPDK on the declared file" \
    test "$(js 'r[0]["base_bdev"], r[0]["cluster_size"]' <<<"$lvs" 2>/dev/null)" = "lvs0-aio 4194304"
check "aio bdev lvs0-aio has 512-byte blocks" \
    test "$(rpc bdev_get_bdevs '{"name":"lvs0-aio"}' | js 'r[0]["block_size"]')" = 512

# CreateVolume (block, thin), idempotent by name.
out=$(ctl create pvc-spdk 64 -p thinProvision=true 2>&1)
read -r vol cap _ <<<"$out"
check "CreateVolume: $out" test "$vol $cap" = "lvs0/pvc-spdk 67108864"
out2=$(ctl create pvc-spdk 64 -p thinProvision=true 2>&1)
check "CreateVolume again: same volume" test "$out2" = "$out"
uuid=$(rpc bdev_get_bdevs "{\"name\":\"$vol\"}" | js 'r[0]["name"]') || uuid=''
check "lvol $vol on SPDK (bdev $uuid)" test -n "$uuid"

# NodePublishVolume.
target=$kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-spdk/dev
mkdir -p "$(dirname "$target")"
check "NodePublishVolume" ctl publish "$vol" "$target"
check "NodePublishVolume again (idempotent)" ctl publish "$vol" "$target"
rdev=$(stat -c '%t:%T' "$target" 2>/dev/null || echo none)
check "target path is b 241:0 ($rdev)" test "$(stat -c %F "$target" 2>/dev/null):$rdev" = "block special file:f1:0"
check "target path is a bind mount" grep -q " $target " /proc/self/mountinfo
ctrlr=
for d in "$store"/block/devices/*; do
    [ "$(stat -c '%t:%T' "$d")" = "$rdev" ] && ctrlr=$(basename "$d")
done
sock=$store/block/sockets/$ctrlr
check "device node $store/block/devices/$ctrlr" test -n "$ctrlr"
check "SPDK created the socket $sock" test -S "$sock"
c=$(rpc vhost_get_controllers "{\"name\":\"$ctrlr\"}" 2>&1) || c='[]'
check "SPDK controller $ctrlr on bdev $uuid, writable" \
    test "$(js 'r[0]["socket"], r[0]["backend_specific"]["block"]["bdev"], r[0]["backend_specific"]["block"]["readonly"]' <<<"$c" 2>/dev/null)" = "$sock $uuid False"
out=$(ctl delete "$vol" 2>&1)
check "DeleteVolume while published is refused (FAILED_PRECONDITION)" grep -q "published through controller" <<<"$out"

# Data through the published socket.
bench() { timeout 60 "$bench_bin" --socket "$sock" --align-2m --no-progress "$@" >"$dir/bench.out" 2>&1; }
check "4 KiB random writes verified through $sock" \
    bench --rw randwrite --bs 4k --iodepth 8 --runtime 2 --verify
grep -E 'verify:' "$dir/bench.out" | sed 's/^ */    /'
check "1 MiB writes verified (2 MiB+ buffers)" bench --rw randwrite --bs 1m --iodepth 2 --runtime 1 --verify
grep -E 'verify:' "$dir/bench.out" | sed 's/^ */    /'
check "SPDK vhost still running after the clients" alive

# ControllerExpandVolume + NodeExpandVolume, online.
check "expand to 128 MiB" ctl expand "$vol" 128 --target "$target"
size=$(rpc bdev_get_bdevs "{\"name\":\"$vol\"}" | js 'r[0]["num_blocks"] * r[0]["block_size"]') || size=0
check "lvol is 128 MiB on SPDK ($size)" test "$size" = 134217728
check "writes past the old end verified" bench --rw write --bs 64k --iodepth 4 --size 128m --runtime 1 --verify
grep -E 'verify:' "$dir/bench.out" | sed 's/^ */    /'

# SPDK dies (kill -9) and comes back with no state: the driver's node config and reconciliation
# (every second here) bring back the aio bdev, lvs0 and the lvol (examine), and the controller
# on the same socket.
kill -9 "$vhost_pid"
wait "$vhost_pid" 2>/dev/null
echo "--- killed (kill -9) and restarted ---" >>"$dir/vhost.log"
start_vhost
check "SPDK vhost restarted" wait_sock "$rpc_sock"
back=''
for _ in $(seq 100); do
    c=$(rpc vhost_get_controllers "{\"name\":\"$ctrlr\"}" 2>/dev/null) &&
        back=$(js 'r[0]["socket"], r[0]["backend_specific"]["block"]["bdev"]' <<<"$c" 2>/dev/null) &&
        [ "$back" = "$sock $uuid" ] && break
    sleep 0.1
done
check "after the restart: controller $ctrlr back on $sock, same lvol" test "$back" = "$sock $uuid"
check "data path after the restart" bench --rw randrw --bs 4k --iodepth 8 --runtime 1 --verify

# NodeUnpublishVolume while a client is connected: refused (SPDK would hold the deletion, and
# the RPC reply, until the client goes), controller and socket kept; the retry succeeds.
timeout 60 "$bench_bin" --socket "$sock" --align-2m --no-progress --rw randread --bs 4k \
    --runtime 5 >"$dir/bench-busy.out" 2>&1 &
busy=$!
sleep 1.5
t0=$SECONDS
out=$(ctl unpublish "$vol" "$target" 2>&1)
check "NodeUnpublishVolume with a connected client is refused in $((SECONDS - t0)) s" \
    grep -q "still has a connected client" <<<"$out"
check "controller and socket kept meanwhile" test -S "$sock" -a -e "$store/block/devices/$ctrlr"
wait "$busy"
busy_rc=$?
check "the connected client's reads all succeeded (rc $busy_rc)" test "$busy_rc" = 0

# NodeUnpublishVolume.
check "NodeUnpublishVolume" ctl unpublish "$vol" "$target"
check "NodeUnpublishVolume again (idempotent)" ctl unpublish "$vol" "$target"
check "target path gone" test ! -e "$target"
check "bind mount gone" bash -c "! grep -q ' $target ' /proc/self/mountinfo"
check "device node gone" test ! -e "$store/block/devices/$ctrlr"
check "socket gone" test ! -e "$sock"
check "controller gone from SPDK" test "$(rpc vhost_get_controllers)" = "[]"
check "lvol kept" rpc bdev_get_bdevs "{\"name\":\"$vol\"}" >/dev/null

# DeleteVolume.
check "DeleteVolume" ctl delete "$vol"
check "DeleteVolume again (idempotent)" ctl delete "$vol"
out=$(rpc bdev_get_bdevs "{\"name\":\"$uuid\"}" 2>&1)
check "lvol gone from SPDK ($out)" grep -q '"code": -19' <<<"$out"
check "ListVolumes empty" test -z "$(ctl list 2>&1)"
check "SPDK vhost still running" alive
finish
