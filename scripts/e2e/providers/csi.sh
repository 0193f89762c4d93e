# shellcheck shell=bash disable=SC2034  # sourced by guest-e2e.sh, which reads the DISK_* variables
# Disk provider for guest-e2e.sh: the node stack. katablk-target serves an lvstore on a sparse
# pool file (declared to katablk-csi with --node-config, so the driver creates the aio bdev and
# the lvstore over SPDK JSON-RPC); the volume is provisioned and published through CSI gRPC with
# katablk-csi-ctl, exactly as the external provisioner and kubelet would (CreateVolume,
# NodePublishVolume with volumeMode Block), and the guest is attached to the socket behind the
# published Kata device node: <store>/block/sockets/<name of the device node>.
#
#   provider_restart   kill -9 of katablk-target, then the same command again: --state-dir
#                      brings back the aio bdev, the lvstore and the controller on the same socket
#   provider_grow      ControllerExpandVolume + NodeExpandVolume (katablk-csi-ctl expand): the
#                      driver resizes the lvol and the target sends CONFIG_CHANGE_MSG to QEMU
#   provider_stop      NodeUnpublishVolume and DeleteVolume, each checked (device node, bind
#                      mount, controller and lvol gone), then both daemons stopped
#
# The target (KATABLK_E2E_CSI_TARGET):
#   katablk (default)  katablk-target with --state-dir
#   spdk               an SPDK JSON-RPC vhost target with SPDK vhost's command line and no state
#                      across restarts: KATABLK_E2E_SPDK_BIN = SPDK's build/bin/vhost (guest RAM
#                      on hugepages: KATABLK_E2E_MEMFD_OPTS=",hugetlb=on") or katablk-spdk;
#                      KATABLK_E2E_SPDK_ARGS (default "-m 0x1 -s 512"). After its kill -9 the
#                      driver's node config and reconciliation (every second here) bring back the
#                      aio bdev (the lvstore and lvol by examine), the controller and its socket.
# The contract of the provider functions is in providers/vhost.sh. Binaries: KATABLK_TARGET,
# KATABLK_CSI, KATABLK_CSI_CTL (guest-e2e.sh finds them in the build directory). The lvol has no
# flat backing file, so DISK_BACKING is "" (the host-side checksum comparison is skipped; the
# guest verifies its data itself, before and after the restart).

CSI_POOL_MIB=${KATABLK_E2E_POOL_MIB:-2048}
CSI_RECONCILE_S=10

csi_ctl() { "$KATABLK_CSI_CTL" --endpoint "unix://$CSI_SOCK" "$@"; }

CSI_TARGET_KIND=${KATABLK_E2E_CSI_TARGET:-katablk}

csi_target_spawn() {
    rm -f "$CSI_RPC"
    if [ "$CSI_TARGET_KIND" = spdk ]; then
        [ -x "${KATABLK_E2E_SPDK_BIN:-}" ] || {
            echo "KATABLK_E2E_CSI_TARGET=spdk needs KATABLK_E2E_SPDK_BIN (SPDK's vhost or katablk-spdk)" >&2
            return 1
        }
        # shellcheck disable=SC2086
        "$KATABLK_E2E_SPDK_BIN" -S "$CSI_STORE/block/sockets" -r "$CSI_RPC" \
            ${KATABLK_E2E_SPDK_ARGS:--m 0x1 -s 512} >>"$E2E_LOG_DIR/server-target.log" 2>&1 &
    else
        "$KATABLK_TARGET" -S "$CSI_STORE/block/sockets" -r "$CSI_RPC" --state-dir "$CSI_DIR/target-state" \
            >>"$E2E_LOG_DIR/server-target.log" 2>&1 &
    fi
    CSI_TARGET_PID=$!
    provider_wait_sock "$CSI_RPC" "$CSI_TARGET_PID" "$E2E_LOG_DIR/server-target.log" 200
}

# Starts katablk-target and katablk-csi once per guest-e2e run (every disk comes from one pool).
csi_stack_up() {
    [ -n "${CSI_PID:-}" ] && kill -0 "$CSI_PID" 2>/dev/null && return 0
    CSI_DIR=$E2E_RUN_DIR/node
    CSI_STORE=$CSI_DIR/vhost-user # Kata's vhost_user_store_path
    CSI_KUBELET=$CSI_DIR/kubelet
    CSI_RPC=$CSI_DIR/spdk.sock
    CSI_SOCK=$CSI_DIR/csi.sock
    mkdir -p "$CSI_STORE/block/sockets" "$CSI_STORE/block/devices" "$CSI_KUBELET"
    truncate -s "${CSI_POOL_MIB}M" "$CSI_DIR/pool.img"
    printf 'devices:\n  - path: %s\n    lvs: lvs0\n' "$CSI_DIR/pool.img" >"$CSI_DIR/node.yaml"
    csi_target_spawn || return 1
    "$KATABLK_CSI" --endpoint "unix://$CSI_SOCK" --spdk-rpc "$CSI_RPC" --vhost-user-store "$CSI_STORE" \
        --lvs lvs0 --node-config "$CSI_DIR/node.yaml" --kubelet-dir "$CSI_KUBELET" \
        --direct-volumes-dir "$CSI_DIR/direct-volumes" --state-dir "$CSI_DIR/csi-state" \
        --node-id e2e-node --reconcile-interval "$CSI_RECONCILE_S" >>"$E2E_LOG_DIR/server-csi.log" 2>&1 &
    CSI_PID=$!
    provider_wait_sock "$CSI_SOCK" "$CSI_PID" "$E2E_LOG_DIR/server-csi.log" 200 || return 1
    csi_ctl probe >&2
}

provider_start() {
    local name=$1 size=$2 out i
    [ "$CSI_TARGET_KIND" = spdk ] && CSI_RECONCILE_S=1
    csi_stack_up || return 1
    # The driver applies the node config at start; CreateVolume waits for nothing, so retry
    # while the lvstore is being created.
    CSI_VOL=
    for i in $(seq 50); do
        if out=$(csi_ctl create "pvc-$name" "$size" 2>&1); then
            read -r CSI_VOL _ <<<"$out"
            break
        fi
        sleep 0.1
    done
    [ -n "$CSI_VOL" ] || { echo "CreateVolume failed: $out" >&2; return 1; }
    CSI_TARGET_PATH=$CSI_KUBELET/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-$name/dev
    mkdir -p "$(dirname "$CSI_TARGET_PATH")"
    csi_ctl publish "$CSI_VOL" "$CSI_TARGET_PATH" >&2 || return 1
    # The device node the target path is bound to names the controller and its socket.
    local rdev dev
    rdev=$(stat -c '%t:%T' "$CSI_TARGET_PATH")
    [ "$((16#${rdev%%:*}))" = 241 ] || { echo "$CSI_TARGET_PATH is not b 241:* ($rdev)" >&2; return 1; }
    CSI_CTRLR=
    for dev in "$CSI_STORE"/block/devices/*; do
        [ "$(stat -c '%t:%T' "$dev")" = "$rdev" ] && CSI_CTRLR=$(basename "$dev")
    done
    [ -n "$CSI_CTRLR" ] || { echo "no device node under $CSI_STORE/block/devices matches $rdev" >&2; return 1; }
    DISK_SOCK=$CSI_STORE/block/sockets/$CSI_CTRLR
    [ -S "$DISK_SOCK" ] || { echo "published, but $DISK_SOCK is not a socket" >&2; return 1; }
    DISK_BACKING=""
    # katablk's controllers report the controller name (20 bytes at most) as the serial; SPDK's
    # vhost reports its bdev's name (the lvol's UUID).
    DISK_SERIAL=${CSI_CTRLR:0:20}
    if [ "$CSI_TARGET_KIND" = spdk ] && [ "$(basename "$KATABLK_E2E_SPDK_BIN")" != katablk-spdk ]; then
        local bdev
        bdev=$("${SPDK_RPC:-/opt/katablk/spdk-venv/bin/spdk-rpc}" -s "$CSI_RPC" vhost_get_controllers -n "$CSI_CTRLR" |
            python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["backend_specific"]["block"]["bdev"])')
        DISK_SERIAL=${bdev:0:20}
    fi
    echo "CSI: volume $CSI_VOL published at $CSI_TARGET_PATH (b 241:$((16#${rdev#*:}))) -> $DISK_SOCK" >&2
}

provider_restart() {
    kill -9 "$CSI_TARGET_PID"
    wait "$CSI_TARGET_PID" 2>/dev/null || true
    echo "--- restarted after kill -9 ---" >>"$E2E_LOG_DIR/server-target.log"
    sleep "${KATABLK_E2E_OUTAGE_S:-1}"
    csi_target_spawn || return 1
    # katablk-target restores the controller from its state; with an SPDK target the driver's
    # reconciliation re-creates it within a few reconcile intervals.
    local i tries=100
    [ "$CSI_TARGET_KIND" = spdk ] && tries=$((CSI_RECONCILE_S * 200 + 200))
    for i in $(seq "$tries"); do
        [ -S "$DISK_SOCK" ] && return 0
        sleep 0.05
    done
    echo "the restarted target did not bring back $DISK_SOCK" >&2
    return 1
}

provider_can_grow() { return 0; }

provider_grow() {
    csi_ctl expand "$CSI_VOL" "$1" --target "$CSI_TARGET_PATH" >&2
}

# Prints @@KATABLK lines: guest-e2e.sh appends them to the run's console log.
provider_stop() {
    [ -n "${CSI_VOL:-}" ] || return 0
    local dev=$CSI_STORE/block/devices/$CSI_CTRLR
    if csi_ctl unpublish "$CSI_VOL" "$CSI_TARGET_PATH" >&2 && [ ! -e "$CSI_TARGET_PATH" ] &&
        [ ! -e "$dev" ] && [ ! -e "$DISK_SOCK" ] && ! grep -q " $CSI_TARGET_PATH " /proc/self/mountinfo; then
        echo "@@KATABLK PASS csi-unpublish target path, bind mount, device node and socket gone"
    else
        echo "@@KATABLK FAIL csi-unpublish something is left: $(ls -d "$CSI_TARGET_PATH" "$dev" "$DISK_SOCK" 2>/dev/null | tr '\n' ' ')"
    fi
    if csi_ctl delete "$CSI_VOL" >&2 && ! csi_ctl list | grep -q "^$CSI_VOL "; then
        echo "@@KATABLK PASS csi-delete volume $CSI_VOL deleted"
    else
        echo "@@KATABLK FAIL csi-delete volume $CSI_VOL still listed"
    fi
    CSI_VOL=
}

# Called once at the end of the run (the EXIT trap): both daemons stopped, leftover mounts undone.
provider_shutdown() {
    provider_term "${CSI_PID:-}"
    provider_term "${CSI_TARGET_PID:-}"
    CSI_PID='' CSI_TARGET_PID=
    # Bind mounts left by a failed run would keep the scratch directory busy.
    local m
    for m in $(awk -v d="$E2E_RUN_DIR/" 'index($5, d) == 1 { print $5 }' /proc/self/mountinfo | sort -r); do
        umount "$m" 2>/dev/null || true
    done
    return 0
}
