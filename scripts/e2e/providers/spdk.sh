# shellcheck shell=bash disable=SC2034  # sourced by guest-e2e.sh, which reads the DISK_* variables
# Disk provider for guest-e2e.sh: an SPDK JSON-RPC vhost target started with SPDK vhost's command
# line (-S, -r, -m, -s): katablk-spdk (SPDK's bdev layer with katablk's vhost-user-blk data plane,
# built with `--features spdk`) or SPDK's own vhost app. The disk is an SPDK AIO bdev on a sparse
# file, exported with vhost_create_blk_controller over SPDK's `spdk-rpc`.
#   KATABLK_E2E_SPDK_BIN   the binary (katablk-spdk, or SPDK's build/bin/vhost)
#   KATABLK_E2E_SPDK_ARGS  extra arguments (default "-m 0x1 -s 512"; e.g. add --no-huge for
#                          katablk-spdk on a machine without hugepages)
# SPDK's vhost needs hugepage-backed guest RAM: set KATABLK_E2E_MEMFD_OPTS=",hugetlb=on".
# A restart (kill -9) re-creates the bdev and the controller, as katablk-csi's reconciliation
# does after a target restart; grow = a longer file + bdev_aio_rescan (SPDK's resize event).
# See providers/vhost.sh for the interface.

SPDK_BIN=${KATABLK_E2E_SPDK_BIN:-}
SPDK_ARGS=${KATABLK_E2E_SPDK_ARGS:--m 0x1 -s 512}
SPDK_RPC_BIN=${SPDK_RPC:-/opt/katablk/spdk-venv/bin/spdk-rpc}

provider_spdk_rpc() {
    "$SPDK_RPC_BIN" -s "$SPDK_SOCK" "$@" >>"$E2E_LOG_DIR/server-$SPDK_NAME.rpc.log" 2>&1
}

provider_spdk_spawn() {
    rm -f "$SPDK_SOCK"
    # shellcheck disable=SC2086
    "$SPDK_BIN" -S "$E2E_RUN_DIR" -r "$SPDK_SOCK" $SPDK_ARGS \
        >>"$E2E_LOG_DIR/server-$SPDK_NAME.log" 2>&1 &
    SPDK_PID=$!
    provider_wait_sock "$SPDK_SOCK" "$SPDK_PID" "$E2E_LOG_DIR/server-$SPDK_NAME.log" 600 || return 1
    provider_spdk_rpc bdev_aio_create "$DISK_BACKING" aio0 512 &&
        provider_spdk_rpc vhost_create_blk_controller "$SPDK_NAME" aio0 || {
        echo "provisioning failed; rpc log:" >&2
        tail -n 20 "$E2E_LOG_DIR/server-$SPDK_NAME.rpc.log" >&2
        return 1
    }
    provider_wait_sock "$DISK_SOCK" "$SPDK_PID" "$E2E_LOG_DIR/server-$SPDK_NAME.log"
}

provider_start() {
    [ -n "$SPDK_BIN" ] && [ -x "$SPDK_BIN" ] || {
        echo "KATABLK_E2E_SPDK_BIN must name katablk-spdk or SPDK's vhost" >&2
        return 1
    }
    SPDK_NAME=$1
    DISK_BACKING=$E2E_RUN_DIR/$1.img
    DISK_SOCK=$E2E_RUN_DIR/$1
    SPDK_SOCK=$E2E_RUN_DIR/spdk.sock
    rm -f "$DISK_BACKING" "$DISK_SOCK"
    truncate -s "${2}M" "$DISK_BACKING"
    # GET_ID: katablk-spdk answers the controller name; SPDK's vhost the bdev name padded with
    # spaces (not checked), and it offers no discard for an AIO bdev on a regular file.
    if [ "$(basename "$SPDK_BIN")" = katablk-spdk ]; then
        DISK_SERIAL=${1:0:20}
    else
        DISK_SERIAL="" DISK_DISCARD=0
    fi
    provider_spdk_spawn
}

provider_restart() {
    kill -9 "$SPDK_PID"
    wait "$SPDK_PID" 2>/dev/null || true
    rm -f "$DISK_SOCK"
    echo "--- restarted after kill -9 ---" >>"$E2E_LOG_DIR/server-$SPDK_NAME.log"
    sleep "${KATABLK_E2E_OUTAGE_S:-1}"
    provider_spdk_spawn
}

provider_can_grow() { return 0; }

provider_grow() {
    truncate -s "${1}M" "$DISK_BACKING"
    provider_spdk_rpc bdev_aio_rescan aio0
}

provider_stop() {
    if [ -n "${SPDK_PID:-}" ] && kill -0 "$SPDK_PID" 2>/dev/null; then
        provider_spdk_rpc vhost_delete_controller "$SPDK_NAME" || true
    fi
    provider_term "${SPDK_PID:-}"
    SPDK_PID=
    rm -f "$DISK_SOCK" "$SPDK_SOCK"
}
