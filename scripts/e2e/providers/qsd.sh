# shellcheck shell=bash disable=SC2034  # sourced by guest-e2e.sh, which reads the DISK_* variables
# Disk provider for guest-e2e.sh: qemu-storage-daemon serving a sparse file, the peer that
# katablk's guest fio numbers are compared with (scripts/e2e/guest-fio-compare.sh). It is a
# reference, not a subject: it is not restarted under the guest (qsd has no INFLIGHT_SHMFD, so a
# kill -9 loses in-flight requests) and cannot grow the disk; both steps report SKIP.
# Contract: providers/vhost.sh. Binary: QSD (default qemu-storage-daemon).

QSD_BIN=${QSD:-qemu-storage-daemon}

provider_start() {
    QSD_NAME=$1
    DISK_BACKING=$E2E_RUN_DIR/$1.img
    DISK_SOCK=$E2E_RUN_DIR/$1.sock
    rm -f "$DISK_BACKING" "$DISK_SOCK"
    truncate -s "${2}M" "$DISK_BACKING"
    DISK_SERIAL="" # qsd reports no serial of ours: not checked
    "$QSD_BIN" --blockdev "driver=file,node-name=f0,filename=$DISK_BACKING,cache.direct=off,aio=threads" \
        --export "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path=$DISK_SOCK,writable=on,num-queues=$3" \
        >>"$E2E_LOG_DIR/server-$QSD_NAME.log" 2>&1 &
    QSD_PID=$!
    provider_wait_sock "$DISK_SOCK" "$QSD_PID" "$E2E_LOG_DIR/server-$QSD_NAME.log"
}

# Not restarted (see above): the guest's loop goes on against the same server.
provider_restart() { echo "qsd provider: the server is not restarted (reference only)" >&2; }

provider_can_grow() {
    echo "skipped: qemu-storage-daemon is the reference server (no resize)"
    return 1
}

provider_grow() { return 1; }

provider_stop() {
    provider_term "${QSD_PID:-}"
    QSD_PID=
    rm -f "$DISK_SOCK"
}
