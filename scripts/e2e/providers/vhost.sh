# shellcheck shell=bash disable=SC2034  # sourced by guest-e2e.sh, which reads the DISK_* variables
# Disk provider for guest-e2e.sh: a standalone katablk-vhost serving a sparse file.
#
# Every provider (scripts/e2e/providers/<name>.sh, chosen with KATABLK_E2E_PROVIDER) defines:
#   provider_start NAME SIZE_MIB QUEUES SERIAL   create and export a disk; set DISK_SOCK (the
#                                                vhost-user socket) and DISK_BACKING (a file whose
#                                                bytes are the disk's, or "" if there is none)
#   provider_restart                             kill -9 the server and start it again on the same
#                                                socket, returning once it accepts connections
#   provider_can_grow                            succeed if provider_grow works; else print why not
#   provider_grow NEW_MIB                        grow the disk and notify the guest (CONFIG_CHANGE_MSG)
#   provider_stop                                stop the server, remove what start created
#   provider_shutdown (optional)                 once at the end of the run; common.sh has the
#                                                no-op default and the shared helpers
# State lives in the shell variables of the sourcing script; scratch files go under $E2E_RUN_DIR
# (short: socket paths), logs under $E2E_LOG_DIR (kept after the run).

VHOST_BIN=${KATABLK_VHOST:-}

provider_vhost_spawn() {
    "$VHOST_BIN" --socket "$DISK_SOCK" --file "$DISK_BACKING" --num-queues "$VHOST_QUEUES" \
        --serial "$VHOST_SERIAL" >>"$E2E_LOG_DIR/server-$VHOST_NAME.log" 2>&1 &
    VHOST_PID=$!
    provider_wait_sock "$DISK_SOCK" "$VHOST_PID" "$E2E_LOG_DIR/server-$VHOST_NAME.log"
}

provider_start() {
    VHOST_NAME=$1 VHOST_QUEUES=$3 VHOST_SERIAL=$4
    DISK_BACKING=$E2E_RUN_DIR/$1.img
    DISK_SOCK=$E2E_RUN_DIR/$1.sock
    rm -f "$DISK_BACKING" "$DISK_SOCK"
    truncate -s "${2}M" "$DISK_BACKING"
    provider_vhost_spawn
}

provider_restart() {
    # The stale socket left by kill -9 is removed by the new instance itself.
    kill -9 "$VHOST_PID"
    wait "$VHOST_PID" 2>/dev/null || true
    echo "--- restarted after kill -9 ---" >>"$E2E_LOG_DIR/server-$VHOST_NAME.log"
    sleep "${KATABLK_E2E_OUTAGE_S:-1}"
    provider_vhost_spawn
}

provider_can_grow() {
    echo "skipped: needs katablk-target (katablk-vhost has no resize RPC)"
    return 1
}

provider_grow() { return 1; }

provider_stop() {
    provider_term "${VHOST_PID:-}"
    VHOST_PID=
    rm -f "$DISK_SOCK"
}
