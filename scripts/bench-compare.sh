#!/usr/bin/env bash
# Side-by-side benchmark of katablk-vhost, qemu-storage-daemon (QSD) and katablk-target over
# vhost-user-blk (the target and its lvol cases: see scripts/bench-target.sh).
#
# For every case (backing store) and workload, runs the servers ALTERNATELY
# (katablk, qsd, katablk, qsd, ...) for ROUNDS rounds, each run on a freshly started
# server, and measures it with katablk-bench. Writes every raw JSON result to
# OUT/raw/, then OUT/summary.json, OUT/summary.md (medians, katablk/qsd ratios) and PNG
# charts, and packs raw/ and logs/ into OUT/raw.tar.gz (scripts/bench-pack.sh; PACK=0 keeps
# them). See benches/README.md. Every setting below can be overridden from the environment.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}

KATABLK_VHOST=${KATABLK_VHOST:-$ROOT/target/release/katablk-vhost} # server under test
QSD=${QSD:-qemu-storage-daemon}                  # the reference server
KATABLK_TARGET=${KATABLK_TARGET:-$ROOT/target/release/katablk-target} # the embedded target
KATABLK_SPDK=${KATABLK_SPDK:-$ROOT/target/spdk/release/katablk-spdk} # SPDK bdevs + katablk vhost (server kspdk)
KATABLK_TARGET_B=${KATABLK_TARGET_B:-}           # another build of katablk-target (server target-b: A/B of a change)
KATABLK_SPDK_B=${KATABLK_SPDK_B:-}               # another build of katablk-spdk (server kspdk-b)
SPDK_VHOST=${SPDK_VHOST:-}                       # SPDK's vhost app (server spdk), e.g. <spdk>/build/bin/vhost
CH_VUB=${CH_VUB:-}                               # cloud-hypervisor's vhost_user_block (server chvub)
CH_EXTRA=${CH_EXTRA:-poll_queue=true}            # extra --block-backend options of chvub
SPDK_MEM_MIB=${SPDK_MEM_MIB:-2048}               # -s of SPDK's vhost / katablk-spdk (hugepages)
SPDK_CPUMASK=${SPDK_CPUMASK:-0x1}                # reactor mask of SPDK's vhost / katablk-spdk
BENCH_BIN_DIR=${BENCH_BIN_DIR:-$CARGO_TARGET_DIR/release}
BUILD=${BUILD:-1}                                # 1: cargo build --release -p katablk-bench first
NAME=${NAME:-$(date -u +%Y%m%d-%H%M%S)}
OUT=${OUT:-$ROOT/benches/results/$NAME}
RUNTIME=${RUNTIME:-5}                            # measured seconds per run
RAMP=${RAMP:-1}                                  # warm-up seconds per run (not measured)
ROUNDS=${ROUNDS:-3}
INTERLEAVE=${INTERLEAVE:-0}                      # 1: per workload and round, every case in turn
                                                 # (order reversed every other round)
IDLE_SECS=${IDLE_SECS:-3}                        # idle-CPU measurement per case and server (0: skip)
CASES=${CASES:-"file ram"}                       # any of: file ram tmpfs null aio-file lvol-file
                                                 # malloc lvol-ram thin-first-write
WORKLOADS=${WORKLOADS:-"randread-4k-qd1 randread-4k-qd32 randwrite-4k-qd32 read-128k-qd8 randread-4k-qd32-2q"}
SERVERS=${SERVERS:-"katablk qsd"}                # run order within a round (katablk qsd target); qsd2, qsd3...
                                                 # are extra QSD instances (A/A noise check)
CANDIDATE=${CANDIDATE:-katablk}                  # ratios are CANDIDATE / BASELINE
BASELINE=${BASELINE:-qsd}
EXTRA_BASELINES=${EXTRA_BASELINES:-}             # more summaries, every server over each of these
                                                 # (summary-vs-NAME.md), e.g. chvub
SERVER_CPUS=${SERVER_CPUS:-}                     # pin the server with taskset -c (e.g. 0)
CLIENT_CPUS=${CLIENT_CPUS:-}                     # pin katablk-bench with taskset -c (e.g. 1)
IMG_MIB=${IMG_MIB:-1024}
IMG_DIR=${IMG_DIR:-}                             # directory of FILE_IMG, LVOL_IMG and THIN_IMG
                                                 # (default /var/tmp); e.g. /dev/shm/katablk-bench
                                                 # keeps the file and lvol-on-file images in
                                                 # memory (tmpfs: no page-cache eviction)
FILE_IMG=${FILE_IMG:-${IMG_DIR:-/var/tmp}/katablk-bench.img} # "file" case, prefilled with random data
TMPFS_IMG=${TMPFS_IMG:-/dev/shm/katablk-bench.img} # "ram" (qsd side) and "tmpfs" cases
REFILL=${REFILL:-0}                              # 1: rewrite the images even if present
DIRECT=${DIRECT:-0}                              # 1: O_DIRECT in the file case (both servers)
FILE_CACHE=${FILE_CACHE:-warm}                   # file case, buffered: warm (the image read into an
                                                 # empty page cache before each run) | cold (the cache
                                                 # dropped: its pages come from the server's own I/O)
NUM_QUEUES=${NUM_QUEUES:-2}                      # queues every server exports
POLL=${POLL:-event}                              # client completion wait: event | busy
WAKEUP_SECS=${WAKEUP_SECS:-3}                    # katablk-bench-wakeup floor per wait mode (0: none)
KATABLK_EXTRA=${KATABLK_EXTRA:-}                 # extra katablk-vhost arguments, e.g. "--poll-us 50"
QSD_EXTRA=${QSD_EXTRA:-}                         # extra qemu-storage-daemon arguments
TARGET_EXTRA=${TARGET_EXTRA:-}                   # extra katablk-target arguments, e.g. "--poll-us 0"
TARGET_CPUMASK=${TARGET_CPUMASK:-}               # controller cpumask (default: the target's, 0x1)
LVOL_IMG=${LVOL_IMG:-${IMG_DIR:-/var/tmp}/katablk-bench-lvol.img} # lvol-file: lvstore on a copy of FILE_IMG
LVS_SLACK_MIB=${LVS_SLACK_MIB:-16}               # extra MiB of lvstore devices (metadata), so the
                                                 # thick lvol is IMG_MIB like the raw device
THIN_IMG=${THIN_IMG:-${IMG_DIR:-/var/tmp}/katablk-bench-thin.img} # thin-first-write: fresh sparse file per run
THIN_MIB=${THIN_MIB:-$IMG_MIB}                   # thin lvol size
THIN_CLUSTER=${THIN_CLUSTER:-}                   # thin lvstore cluster_sz in bytes (default 4 MiB)
THIN_WORKLOADS=${THIN_WORKLOADS:-randwrite-4k-qd32} # workloads of thin-first-write (run with RAMP 0)
PREFILL_SECS=${PREFILL_SECS:-5}                  # malloc/lvol-ram: sequential write pass before each run
SOCK_DIR=${SOCK_DIR:-$(mktemp -d /tmp/katablk-bench.XXXXXX)}

log() { printf '[bench-compare %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=""
    fi
    rm -rf "$SOCK_DIR"
    case " $CASES " in *" thin-first-write "*) rm -f "$THIN_IMG" ;; esac
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- tools -------------------------------------------------------------------------------
if [ "$BUILD" = 1 ]; then
    log "building katablk-bench (release) into $CARGO_TARGET_DIR"
    (cd "$ROOT" && cargo build --release -q -p katablk-bench)
    case " $SERVERS " in
    *" target "*) (cd "$ROOT" && cargo build --release -q -p katablk-target) ;;
    esac
fi
BENCH=$BENCH_BIN_DIR/katablk-bench
TBENCH=$BENCH_BIN_DIR/katablk-target-bench
# ALIGN_2M=1: the client's buffers at 2 MiB-aligned addresses (SPDK's vhost needs it); by
# default on whenever SPDK's vhost is among the servers, for every server of the run alike.
case " $SERVERS " in *" spdk "*) ALIGN_2M=${ALIGN_2M:-1} ;; *) ALIGN_2M=${ALIGN_2M:-0} ;; esac
run_bench() { # the client, pinned if CLIENT_CPUS is set
    local -a extra=()
    [ "$ALIGN_2M" = 1 ] && extra=(--align-2m)
    if [ -n "$CLIENT_CPUS" ]; then
        taskset -c "$CLIENT_CPUS" "$BENCH" "$@" "${extra[@]}"
    else
        "$BENCH" "$@" "${extra[@]}"
    fi
}
trpc() { # SOCK METHOD [JSON]: one JSON-RPC call to katablk-target, result on stdout
    "$TBENCH" rpc -s "$@"
}
wait_path() { # PATH PID LOG: wait up to 10 s for socket PATH while PID lives
    local i
    for i in $(seq 1 200); do
        [ -S "$1" ] && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.05
    done
    return 1
}
for b in katablk-bench katablk-bench-summary katablk-bench-plot; do
    [ -x "$BENCH_BIN_DIR/$b" ] || die "$BENCH_BIN_DIR/$b is missing (cargo build --release -p katablk-bench)"
done

NOTES=()
active=()
for s in $SERVERS; do
    case $s in
    katablk)
        if [ -x "$KATABLK_VHOST" ]; then
            active+=(katablk)
        else
            log "SKIPPING katablk: katablk-vhost not found at $KATABLK_VHOST" \
                "(build it with 'cargo build --release -p katablk-vhost' or set KATABLK_VHOST=PATH)"
            NOTES+=("katablk side skipped: no katablk-vhost binary at $KATABLK_VHOST")
        fi
        ;;
    target)
        if [ -x "$KATABLK_TARGET" ] && [ -x "$TBENCH" ]; then
            active+=(target)
        else
            log "SKIPPING target: katablk-target not found at $KATABLK_TARGET (or $TBENCH missing)" \
                "(build it with 'cargo build --release -p katablk-target' or set KATABLK_TARGET=PATH)"
            NOTES+=("target side skipped: no katablk-target binary at $KATABLK_TARGET")
        fi
        ;;
    kspdk)
        if [ -x "$KATABLK_SPDK" ] && [ -x "$TBENCH" ]; then
            active+=(kspdk)
        else
            log "SKIPPING kspdk: katablk-spdk not found at $KATABLK_SPDK" \
                "(SPDK_DIR=<spdk> CARGO_TARGET_DIR=target/spdk cargo build --release -p katablk-spdk --features spdk)"
            NOTES+=("kspdk side skipped: no katablk-spdk binary at $KATABLK_SPDK")
        fi
        ;;
    target-b | kspdk-b)
        b=KATABLK_TARGET_B
        [ "$s" = kspdk-b ] && b=KATABLK_SPDK_B
        if [ -n "${!b}" ] && [ -x "${!b}" ] && [ -x "$TBENCH" ]; then
            active+=("$s")
        else
            log "SKIPPING $s: set $b to the other build's binary"
            NOTES+=("$s side skipped: $b not set")
        fi
        ;;
    spdk)
        if [ -n "$SPDK_VHOST" ] && [ -x "$SPDK_VHOST" ] && [ -x "$TBENCH" ]; then
            active+=(spdk)
        else
            log "SKIPPING spdk: set SPDK_VHOST to SPDK's vhost app"
            NOTES+=("spdk side skipped: SPDK_VHOST not set")
        fi
        ;;
    chvub)
        if [ -n "$CH_VUB" ] && [ -x "$CH_VUB" ]; then
            active+=(chvub)
        else
            log "SKIPPING chvub: set CH_VUB to cloud-hypervisor's vhost_user_block binary"
            NOTES+=("chvub side skipped: CH_VUB not set")
        fi
        ;;
    qsd*)
        if command -v "$QSD" >/dev/null 2>&1; then
            active+=("$s")
        else
            log "SKIPPING qsd: $QSD not found (apt-get install qemu-utils)"
            NOTES+=("qsd side skipped: $QSD not found")
        fi
        ;;
    *) die "unknown server '$s' in SERVERS (use katablk, qsd, target, kspdk, spdk, chvub, target-b, kspdk-b, qsd2, ...)" ;;
    esac
done
[ ${#active[@]} -gt 0 ] || die "no server to benchmark"
case $FILE_CACHE in warm | cold) ;; *) die "FILE_CACHE must be warm or cold, not '$FILE_CACHE'" ;; esac
# SPDK's DPDK environment (spdk, kspdk) takes its -s memory from 2 MiB hugepages on a hugetlbfs
# mount; a fresh machine has neither ("EAL: Cannot get hugepage information").
case " ${active[*]} " in *" spdk "* | *" kspdk "* | *" kspdk-b "*)
    "$ROOT/scripts/setup-hugepages.sh" $(((SPDK_MEM_MIB + 512) / 2)) >&2 ||
        die "hugepages for spdk/kspdk: setup-hugepages.sh failed"
    ;;
esac
if [ "$DIRECT" = 1 ] && [[ " ${active[*]} " == *" target "* ]]; then
    NOTES+=("DIRECT=1: katablk-target's aio bdevs have no O_DIRECT option over RPC; its file cases use the page cache")
fi

# --- backing stores ----------------------------------------------------------------------
if [ -n "$IMG_DIR" ]; then
    mkdir -p "$IMG_DIR"
    fstype=$(stat -f -c %T "$IMG_DIR" 2>/dev/null || echo unknown)
    NOTES+=("images in IMG_DIR=$IMG_DIR ($fstype)")
    if [ "$fstype" != tmpfs ]; then
        log "note: IMG_DIR $IMG_DIR is on $fstype, not tmpfs: the images may still be evicted"
    fi
fi
prefill() { # PATH: a random-filled image of IMG_MIB MiB, so reads hit real data
    local path=$1
    if [ "$REFILL" = 1 ] || [ ! -f "$path" ] || [ "$(stat -c %s "$path")" -ne $((IMG_MIB << 20)) ]; then
        log "prefilling $path ($IMG_MIB MiB of random data)"
        mkdir -p "$(dirname "$path")"
        dd if=/dev/urandom of="$path" bs=1M count="$IMG_MIB" conv=fsync status=none
    fi
}
# lvol-file: LVOL_IMG is a copy of the random-filled FILE_IMG plus LVS_SLACK_MIB. The lvstore
# and its thick lvol are created on it once, with clear_method none, so the lvol's clusters
# keep the random data (reads hit real data); later runs reopen it with bdev_aio_create
# (examine). A stamp file records that it is complete.
lvol_img_prepare() {
    local stamp=$LVOL_IMG.ready want="IMG_MIB=$IMG_MIB LVS_SLACK_MIB=$LVS_SLACK_MIB"
    if [ "$REFILL" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    log "preparing $LVOL_IMG: copy of $FILE_IMG, lvstore lvs_bench, thick lvol lvs_bench/thick0"
    rm -f "$stamp"
    cp --sparse=never "$FILE_IMG" "$LVOL_IMG"
    dd if=/dev/urandom of="$LVOL_IMG" bs=1M count="$LVS_SLACK_MIB" seek="$IMG_MIB" conv=notrunc,fsync status=none
    local dir rpcs logf pid
    dir=$(mktemp -d /tmp/katablk-bench-lvs.XXXXXX)
    rpcs=$dir/rpc.sock
    logf=$OUT/logs/lvol-img-prepare.target.log
    mkdir -p "$OUT/logs"
    "$KATABLK_TARGET" -S "$dir" -r "$rpcs" >"$logf" 2>&1 &
    pid=$!
    wait_path "$rpcs" "$pid" "$logf" || die "katablk-target did not start; log: $logf"
    trpc "$rpcs" bdev_aio_create "{\"filename\": \"$LVOL_IMG\", \"name\": \"aio0\"}" >/dev/null
    trpc "$rpcs" bdev_lvol_create_lvstore '{"bdev_name": "aio0", "lvs_name": "lvs_bench", "clear_method": "none"}' >/dev/null
    trpc "$rpcs" bdev_lvol_create "{\"lvol_name\": \"thick0\", \"size_in_mib\": $IMG_MIB, \"thin_provision\": false, \"lvs_name\": \"lvs_bench\"}" >/dev/null
    trpc "$rpcs" bdev_lvol_get_lvstores '{"lvs_name": "lvs_bench"}' >>"$logf"
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -rf "$dir"
    sync "$LVOL_IMG"
    echo "$want" >"$stamp"
}

for c in $CASES; do
    case $c in
    file | aio-file)
        prefill "$FILE_IMG"
        # Buffered runs measure the servers, not the disk: start with the image in the page
        # cache (an image left from an earlier run may have been evicted).
        [ "$DIRECT" = 1 ] || cat "$FILE_IMG" >/dev/null
        ;;
    lvol-file)
        prefill "$FILE_IMG"
        lvol_img_prepare
        # As for the raw file case: the lvstore image starts in the page cache.
        [ "$DIRECT" = 1 ] || cat "$LVOL_IMG" >/dev/null
        ;;
    ram | tmpfs | malloc | lvol-ram) prefill "$TMPFS_IMG" ;;
    null | thin-first-write) ;;
    *) die "unknown case '$c' in CASES (use file, ram, tmpfs, null, aio-file, lvol-file, malloc, lvol-ram, thin-first-write)" ;;
    esac
done

# --- servers -----------------------------------------------------------------------------
# start_server SERVER CASE SOCK LOG: starts it in the background, sets SERVER_PID, waits for
# the socket.
start_server() {
    local server=$1 case=$2 sock=$3 logf=$4
    rm -f "$sock"
    local -a cmd
    case $server in target | kspdk | spdk | target-b | kspdk-b)
        start_target "$case" "$sock" "$logf" "$server"
        return
        ;;
    esac
    if [ "$server" = katablk ]; then
        cmd=("$KATABLK_VHOST" --socket "$sock" --num-queues "$NUM_QUEUES")
        case $case in
        file | aio-file | lvol-file)
            cmd+=(--file "$FILE_IMG")
            [ "$DIRECT" = 1 ] && cmd+=(--direct)
            ;;
        ram | malloc | lvol-ram) cmd+=(--malloc "$IMG_MIB") ;;
        tmpfs) cmd+=(--file "$TMPFS_IMG") ;;
        null) cmd+=(--null "$IMG_MIB") ;;
        esac
        # shellcheck disable=SC2206
        cmd+=($KATABLK_EXTRA)
    elif [ "$server" = chvub ]; then
        # One file backend; RAM cases use the tmpfs file, as for qsd. Its queues are served by
        # one thread each (poll_queue=true: busy-polls after each request, as CH ships it).
        local img=$TMPFS_IMG direct=false
        case $case in
        file | aio-file | lvol-file)
            img=$FILE_IMG
            [ "$DIRECT" = 1 ] && direct=true
            ;;
        esac
        cmd=("$CH_VUB" --block-backend "path=$img,socket=$sock,num_queues=$NUM_QUEUES,direct=$direct${CH_EXTRA:+,$CH_EXTRA}")
    else
        local blockdev
        case $case in
        file | aio-file | lvol-file)
            if [ "$DIRECT" = 1 ]; then
                blockdev="driver=file,node-name=f0,filename=$FILE_IMG,cache.direct=on,aio=threads"
            else
                blockdev="driver=file,node-name=f0,filename=$FILE_IMG,cache.direct=off,aio=threads"
            fi
            ;;
        ram | tmpfs | malloc | lvol-ram) blockdev="driver=file,node-name=f0,filename=$TMPFS_IMG,cache.direct=off,aio=threads" ;;
        null) blockdev="driver=null-co,node-name=f0,size=$((IMG_MIB << 20)),read-zeroes=off" ;;
        esac
        cmd=("$QSD" --blockdev "$blockdev"
            --export "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path=$sock,writable=on,num-queues=$NUM_QUEUES")
        # shellcheck disable=SC2206
        cmd+=($QSD_EXTRA)
    fi
    if [ -n "$SERVER_CPUS" ]; then cmd=(taskset -c "$SERVER_CPUS" "${cmd[@]}"); fi
    echo "+ ${cmd[*]}" >"$logf"
    "${cmd[@]}" >>"$logf" 2>&1 &
    SERVER_PID=$!
    local i
    for i in $(seq 1 200); do
        if [ -S "$sock" ]; then
            sleep 0.1
            return 0
        fi
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            wait "$SERVER_PID" 2>/dev/null || true
            SERVER_PID=""
            die "$server exited before creating $sock; log: $logf: $(tail -3 "$logf")"
        fi
        sleep 0.05
    done
    die "$server did not create $sock within 10 s; log: $logf"
}

# start_target CASE SOCK LOG: a fresh katablk-target with its RPC socket in SOCK_DIR,
# provisioned for CASE over JSON-RPC; its controller is named after SOCK's file name, so
# the controller socket is SOCK. Sets SERVER_PID.
TARGET_RPC=$SOCK_DIR/rpc.sock
start_target() {
    local case=$1 sock=$2 logf=$3 server=${4:-target} mib_blocks=$((IMG_MIB * 2048)) lvs_blocks=$(((IMG_MIB + LVS_SLACK_MIB) * 2048))
    rm -f "$TARGET_RPC"
    local -a cmd
    case $server in
    target | target-b)
        local bin=$KATABLK_TARGET
        [ "$server" = target-b ] && bin=$KATABLK_TARGET_B
        cmd=("$bin" -S "$(dirname "$sock")" -r "$TARGET_RPC" --max-queues "$NUM_QUEUES")
        # shellcheck disable=SC2206
        cmd+=($TARGET_EXTRA)
        ;;
    kspdk | kspdk-b)
        local bin=$KATABLK_SPDK
        [ "$server" = kspdk-b ] && bin=$KATABLK_SPDK_B
        cmd=("$bin" -S "$(dirname "$sock")" -r "$TARGET_RPC" -m "$SPDK_CPUMASK" -s "$SPDK_MEM_MIB" --max-queues "$NUM_QUEUES")
        ;;
    spdk) cmd=("$SPDK_VHOST" -S "$(dirname "$sock")" -r "$TARGET_RPC" -m "$SPDK_CPUMASK" -s "$SPDK_MEM_MIB") ;;
    esac
    if [ -n "$SERVER_CPUS" ]; then cmd=(taskset -c "$SERVER_CPUS" "${cmd[@]}"); fi
    echo "+ ${cmd[*]}" >"$logf"
    "${cmd[@]}" >>"$logf" 2>&1 &
    SERVER_PID=$!
    if ! wait_path "$TARGET_RPC" "$SERVER_PID" "$logf"; then
        stop_server
        die "$server did not serve $TARGET_RPC; log: $logf: $(tail -3 "$logf")"
    fi
    local dev r=(trpc "$TARGET_RPC")
    {
        case $case in
        file | aio-file)
            "${r[@]}" bdev_aio_create "{\"filename\": \"$FILE_IMG\", \"name\": \"aio0\", \"block_size\": 512}"
            dev=aio0
            ;;
        tmpfs)
            "${r[@]}" bdev_aio_create "{\"filename\": \"$TMPFS_IMG\", \"name\": \"aio0\", \"block_size\": 512}"
            dev=aio0
            ;;
        ram | malloc)
            "${r[@]}" bdev_malloc_create "{\"name\": \"mal0\", \"num_blocks\": $mib_blocks, \"block_size\": 512}"
            dev=mal0
            ;;
        null)
            "${r[@]}" bdev_null_create "{\"name\": \"null0\", \"num_blocks\": $mib_blocks, \"block_size\": 512}"
            dev=null0
            ;;
        lvol-file) # prepared once by lvol_img_prepare; examine brings the lvol back
            "${r[@]}" bdev_aio_create "{\"filename\": \"$LVOL_IMG\", \"name\": \"aio0\"}"
            "${r[@]}" bdev_get_bdevs '{"name": "lvs_bench/thick0"}' >/dev/null
            dev=lvs_bench/thick0
            ;;
        lvol-ram)
            "${r[@]}" bdev_malloc_create "{\"name\": \"mal0\", \"num_blocks\": $lvs_blocks, \"block_size\": 512}"
            "${r[@]}" bdev_lvol_create_lvstore '{"bdev_name": "mal0", "lvs_name": "lvs_ram", "clear_method": "none"}'
            "${r[@]}" bdev_lvol_create "{\"lvol_name\": \"thick0\", \"size_in_mib\": $IMG_MIB, \"thin_provision\": false, \"lvs_name\": \"lvs_ram\"}"
            dev=lvs_ram/thick0
            ;;
        thin-first-write) # a new sparse file, lvstore and thin lvol every run: every cluster is new
            rm -f "$THIN_IMG"
            truncate -s "$(((THIN_MIB + LVS_SLACK_MIB) << 20))" "$THIN_IMG"
            "${r[@]}" bdev_aio_create "{\"filename\": \"$THIN_IMG\", \"name\": \"aio0\"}"
            if [ -n "$THIN_CLUSTER" ]; then
                "${r[@]}" bdev_lvol_create_lvstore "{\"bdev_name\": \"aio0\", \"lvs_name\": \"lvs_thin\", \"clear_method\": \"none\", \"cluster_sz\": $THIN_CLUSTER}"
            else
                "${r[@]}" bdev_lvol_create_lvstore '{"bdev_name": "aio0", "lvs_name": "lvs_thin", "clear_method": "none"}'
            fi
            "${r[@]}" bdev_lvol_create "{\"lvol_name\": \"thin0\", \"size_in_mib\": $THIN_MIB, \"thin_provision\": true, \"lvs_name\": \"lvs_thin\"}"
            dev=lvs_thin/thin0
            ;;
        esac
        if [ -n "$TARGET_CPUMASK" ]; then
            "${r[@]}" vhost_create_blk_controller "{\"ctrlr\": \"$(basename "$sock")\", \"dev_name\": \"$dev\", \"cpumask\": \"$TARGET_CPUMASK\"}"
        else
            "${r[@]}" vhost_create_blk_controller "{\"ctrlr\": \"$(basename "$sock")\", \"dev_name\": \"$dev\"}"
        fi
    } >>"$logf.rpc" 2>&1 || {
        stop_server
        die "provisioning $server for $case failed: $(tail -3 "$logf.rpc")" \
            "$([ "$case" = lvol-file ] && echo "(REFILL=1 recreates $LVOL_IMG)")"
    }
    if ! wait_path "$sock" "$SERVER_PID" "$logf"; then
        stop_server
        die "$server did not create $sock; log: $logf"
    fi
    sleep 0.1
}

# server_has SERVER CASE: whether SERVER has a backend for CASE (only the target has lvols).
server_has() {
    case $2 in
    thin-first-write) case $1 in target | target-b) return 0 ;; *) return 1 ;; esac ;;
    lvol-file) case $1 in kspdk | kspdk-b | spdk) return 1 ;; *) return 0 ;; esac ;; # SPDK cannot open katablk's lvstore image
    null) [ "$1" != chvub ] ;; # no null backend in vhost_user_block
    *) return 0 ;;
    esac
}

# prefill_run SERVER CASE WORKLOAD TAG: RAM backends start empty (untouched memory reads as
# zeroes without touching real pages, and every first write to a page takes a page fault), so
# before any workload on malloc/lvol-ram write the device sequentially for PREFILL_SECS (its
# report goes to logs/, not raw/): the run then measures the device, not the kernel's
# first-touch path.
prefill_run() {
    local server=$1 case=$2 wl=$3 tag=$4
    case $case in malloc | lvol-ram) ;; *) return 0 ;; esac
    case $server in katablk | target | kspdk | spdk | target-b | kspdk-b) ;; *) return 0 ;; esac
    [ "$PREFILL_SECS" != 0 ] || return 0
    run_bench --socket "$sock" --rw write --bs 1M --iodepth 8 --runtime "$PREFILL_SECS" --ramp 0 \
        --poll "$POLL" --no-progress --json "$OUT/logs/$tag.prefill.json" \
        >"$OUT/logs/$tag.prefill.txt" 2>&1 || {
        log "prefill write pass failed: $(tail -3 "$OUT/logs/$tag.prefill.txt")"
        return 1
    }
    local written
    written=$(awk '/"bytes":/ { gsub(/[^0-9]/, "", $2); if ($2 + 0 > m) m = $2 + 0 } END { printf "%d\n", m }' "$OUT/logs/$tag.prefill.json")
    if [ "$written" -lt $((IMG_MIB << 20)) ]; then
        log "warning: $tag prefill wrote only $((written >> 20)) of $IMG_MIB MiB (raise PREFILL_SECS)"
    fi
}

stop_server() { # SIGTERM, then SIGKILL after 10 s (SPDK's vhost can hang in shutdown
    # waiting for a session that the client already closed)
    if [ -n "$SERVER_PID" ]; then
        kill "$SERVER_PID" 2>/dev/null || true
        local i
        for i in $(seq 1 100); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$SERVER_PID" 2>/dev/null; then
            log "server $SERVER_PID did not exit 10 s after SIGTERM: SIGKILL"
            kill -9 "$SERVER_PID" 2>/dev/null || true
        fi
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=""
    fi
}

# workload_args NAME: katablk-bench arguments of a workload named RW-BS-qdN[-Jq],
# e.g. randread-4k-qd32, read-128k-qd8, randread-4k-qd32-2q (2 queues, one job each).
workload_args() {
    local re='^(randread|randwrite|read|write|randrw)-([0-9]+[kKmM]?)-qd([0-9]+)(-([0-9]+)q)?$'
    [[ $1 =~ $re ]] || die "bad workload name '$1' (expected RW-BS-qdN[-Jq], e.g. randread-4k-qd32-2q)"
    echo "--rw ${BASH_REMATCH[1]} --bs ${BASH_REMATCH[2]} --iodepth ${BASH_REMATCH[3]} --numjobs ${BASH_REMATCH[5]:-1}"
}
for w in $WORKLOADS; do workload_args "$w" >/dev/null; done

# brief TEXT_REPORT: "IOPS=..., p50=..., p99=..., server NN% CPU" from the total section.
brief() {
    awk '
        /^total:/ { t = 1; next }
        t && !iops && match($0, /IOPS=[^,]*/) { iops = substr($0, RSTART, RLENGTH) }
        t && !p50 && match($0, /p50=[^,]*/) { p50 = substr($0, RSTART, RLENGTH) }
        t && !p99 && match($0, /p99=[^,]*/) { p99 = substr($0, RSTART, RLENGTH) }
        /^cpu:/ && match($0, /server pid [0-9]+ .*\(([0-9.]+)%/) {
            s = substr($0, RSTART); sub(/.*\(/, "", s); sub(/ of one core\).*/, "", s); cpu = s
        }
        END { printf "%s, %s us, %s us, server CPU %s\n", iops, p50, p99, cpu }
    ' "$1"
}

# --- run ---------------------------------------------------------------------------------
mkdir -p "$OUT/raw" "$OUT/logs"
{
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(uname -srm), $(nproc) CPUs, $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)"
    echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "qsd: $("$QSD" --version 2>/dev/null | head -1 || echo absent)"
    echo "katablk-target: $KATABLK_TARGET ($([ -x "$KATABLK_TARGET" ] && echo present || echo absent))"
    echo "katablk-vhost: $KATABLK_VHOST ($([ -x "$KATABLK_VHOST" ] && echo present || echo absent))"
    echo "chvub: ${CH_VUB:-unset}"
    echo "spdk: ${SPDK_VHOST:-unset}"
    echo "servers: ${active[*]}"
    for v in SERVERS CANDIDATE BASELINE SERVER_CPUS CLIENT_CPUS CASES WORKLOADS ROUNDS INTERLEAVE RUNTIME RAMP IDLE_SECS IMG_MIB IMG_DIR FILE_IMG TMPFS_IMG DIRECT FILE_CACHE NUM_QUEUES POLL WAKEUP_SECS KATABLK_EXTRA QSD_EXTRA KATABLK_TARGET TARGET_EXTRA TARGET_CPUMASK LVOL_IMG LVS_SLACK_MIB THIN_IMG THIN_MIB THIN_CLUSTER THIN_WORKLOADS PREFILL_SECS CH_EXTRA EXTRA_BASELINES; do
        echo "$v=${!v}"
    done
} >"$OUT/env.txt"

# The QD1 floor of this machine: a polling "server" on the first server CPU signalling an
# eventfd to a "driver" on the first client CPU (katablk-bench-wakeup), as the bench client
# waits in event mode, and with a busy-polling driver. No server's QD1 latency can be below it.
if [ "$WAKEUP_SECS" != 0 ] && [ -x "$BENCH_BIN_DIR/katablk-bench-wakeup" ]; then
    wcpu_s=${SERVER_CPUS:-0} wcpu_c=${CLIENT_CPUS:-1}
    wcpu_s=${wcpu_s%%[,-]*} wcpu_c=${wcpu_c%%[,-]*}
    for w in poll spin; do
        "$BENCH_BIN_DIR/katablk-bench-wakeup" --server-cpu "$wcpu_s" --client-cpu "$wcpu_c" \
            --wait "$w" --secs "$WAKEUP_SECS" --json "$OUT/wakeup-$w.json" >"$OUT/logs/wakeup-$w.txt" 2>&1 ||
            die "katablk-bench-wakeup failed: $(tail -3 "$OUT/logs/wakeup-$w.txt")"
        p50=$(awk '/round trip +p50/ {print $4; exit}' "$OUT/logs/wakeup-$w.txt")
        log "QD1 floor, $w wait (CPU $wcpu_s -> $wcpu_c): round trip p50 $p50 us"
        NOTES+=("QD1 floor (katablk-bench-wakeup --wait $w, CPU $wcpu_s -> $wcpu_c): round trip p50 $p50 us")
    done
fi

ncases=$(wc -w <<<"$CASES")
nwl=$(wc -w <<<"$WORKLOADS")
estimate=$(((ncases * nwl * ROUNDS * (RUNTIME + RAMP + 1) + ncases * (IDLE_SECS + 1)) * ${#active[@]}))
log "servers: ${active[*]}; cases: $CASES; $nwl workloads x $ROUNDS rounds; about $((estimate / 60 + 1)) min"
log "results: $OUT"

seq_no=0
sock=$SOCK_DIR/vhost.sock

# measure_idle CASE: the idle-CPU runs of every server that has CASE.
measure_idle() {
    local case=$1 server tag
    [ "$IDLE_SECS" != 0 ] && [ "$case" != thin-first-write ] || return 0
    for server in "${active[@]}"; do
        server_has "$server" "$case" || continue
        seq_no=$((seq_no + 1))
        tag=$(printf '%03d-%s-idle-%s' "$seq_no" "$case" "$server")
        start_server "$server" "$case" "$sock" "$OUT/logs/$tag.server.log"
        run_bench --socket "$sock" --idle-cpu "$IDLE_SECS" --server-pid "$SERVER_PID" \
            --numjobs 1 --no-progress --json "$OUT/raw/$tag.json" --label "$server $case idle" \
            --meta case="$case" --meta server="$server" --meta workload=idle \
            >"$OUT/logs/$tag.txt" 2>&1 || die "idle run failed: $(tail -3 "$OUT/logs/$tag.txt")"
        stop_server
        log "$case idle $server: $(grep -o 'server pid.*' "$OUT/logs/$tag.txt")"
    done
}

# measure CASE WORKLOAD ROUND: one run of WORKLOAD on CASE per server, each on a fresh server.
measure() {
    local case=$1 wl=$2 round=$3 server tag case_ramp=$RAMP alloc
    local -a wargs
    [ "$case" = thin-first-write ] && case_ramp=0 # from the first write: every cluster is new
    read -r -a wargs <<<"$(workload_args "$wl")"
    for server in "${active[@]}"; do
        server_has "$server" "$case" || continue
        seq_no=$((seq_no + 1))
        tag=$(printf '%03d-%s-%s-%s-r%d' "$seq_no" "$case" "$wl" "$server" "$round")
        if [ "$case" = file ] && [ "$DIRECT" != 1 ]; then
            # Every server starts alike: the writes of the previous run written back (pages
            # under writeback make buffered writes wait) and the whole image in the page cache
            # again (O_DIRECT writes of SPDK's AIO bdev drop the pages they write).
            # The cache is dropped first either way: what the page cache holds of the image,
            # and in folios of which size, then depends on this run only (a read ahead fills
            # large folios, in which ext4 walks every block of the folio for each 4 KiB
            # buffered write; pages a server read or wrote one at a time stay small).
            sync "$FILE_IMG"
            { echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null || log "cannot drop the page cache (not root?)"
            [ "$FILE_CACHE" = cold ] || cat "$FILE_IMG" >/dev/null
        fi
        # A run whose client the server dropped (SPDK's vhost now and then closes the
        # connection while mapping a memory region) is tried once more on a fresh server.
        local attempt ok=0
        for attempt in 1 2; do
            start_server "$server" "$case" "$sock" "$OUT/logs/$tag.server.log"
            if prefill_run "$server" "$case" "$wl" "$tag" &&
                run_bench --socket "$sock" "${wargs[@]}" --runtime "$RUNTIME" --ramp "$case_ramp" \
                    --poll "$POLL" --server-pid "$SERVER_PID" --no-progress \
                    --json "$OUT/raw/$tag.json" --label "$server $case $wl r$round" \
                    --meta case="$case" --meta workload="$wl" --meta server="$server" \
                    --meta round="$round" >"$OUT/logs/$tag.txt" 2>&1; then
                ok=1
                break
            fi
            log "FAILED: $tag (attempt $attempt): $(tail -3 "$OUT/logs/$tag.txt" 2>/dev/null)"
            log "server log: $(tail -3 "$OUT/logs/$tag.server.log")"
            cp "$OUT/logs/$tag.server.log" "$OUT/logs/$tag.server.log.attempt$attempt" 2>/dev/null || true
            stop_server
            rm -f "$OUT/raw/$tag.json"
        done
        if [ "$ok" != 1 ]; then
            NOTES+=("$tag failed twice and is missing")
            continue
        fi
        if [ "$case" = thin-first-write ]; then
            # record how many clusters the run allocated (the summary divides by writes)
            alloc=$(trpc "$TARGET_RPC" bdev_lvol_get_lvols '{"lvs_name": "lvs_thin"}' |
                awk '/"num_allocated_clusters"/ { gsub(/[^0-9]/, "", $2); print $2 + 0; exit }')
            python3 - "$OUT/raw/$tag.json" "${alloc:-0}" <<'PY'
import json, sys
p, n = sys.argv[1], sys.argv[2]
r = json.load(open(p))
r["params"]["meta"]["allocated_clusters"] = n
json.dump(r, open(p, "w"), indent=2)
PY
        fi
        stop_server
        log "$case $wl $server r$round: $(brief "$OUT/logs/$tag.txt")"
    done
}

if [ "$INTERLEAVE" = 1 ]; then
    # Workload by workload and round by round, every case once per round, the case order
    # reversed in every other round (A B, B A, ...): each round's cases ran minutes apart at
    # most, so the summary's paired ratios (per round) cancel slow drifts of the machine.
    main_cases=() last_cases=()
    for case in $CASES; do
        measure_idle "$case"
        if [ "$case" = thin-first-write ]; then last_cases+=("$case"); else main_cases+=("$case"); fi
    done
    for wl in $WORKLOADS; do
        for round in $(seq 1 "$ROUNDS"); do
            order=("${main_cases[@]}")
            if [ $((round % 2)) = 0 ]; then
                order=()
                for ((i = ${#main_cases[@]} - 1; i >= 0; i--)); do order+=("${main_cases[i]}"); done
            fi
            for case in "${order[@]}"; do measure "$case" "$wl" "$round"; done
        done
    done
    for case in "${last_cases[@]+"${last_cases[@]}"}"; do
        for wl in $THIN_WORKLOADS; do
            for round in $(seq 1 "$ROUNDS"); do measure "$case" "$wl" "$round"; done
        done
    done
else
    for case in $CASES; do
        measure_idle "$case"
        case_wls=$WORKLOADS
        [ "$case" = thin-first-write ] && case_wls=$THIN_WORKLOADS
        for wl in $case_wls; do
            for round in $(seq 1 "$ROUNDS"); do measure "$case" "$wl" "$round"; done
        done
    done
fi

note_args=()
for n in "${NOTES[@]+"${NOTES[@]}"}"; do note_args+=(--note "$n"); done
"$BENCH_BIN_DIR/katablk-bench-summary" "$OUT" --baseline "$BASELINE" --candidate "$CANDIDATE" "${note_args[@]+"${note_args[@]}"}"
for b in $EXTRA_BASELINES; do
    "$BENCH_BIN_DIR/katablk-bench-summary" "$OUT" --baseline "$b" --candidate "$CANDIDATE" \
        --output "summary-vs-$b" "${note_args[@]+"${note_args[@]}"}"
done
"$BENCH_BIN_DIR/katablk-bench-plot" "$OUT/summary.json" --out "$OUT"
# Raw data into one archive for committing (PACK=0 keeps raw/ and logs/ as directories).
[ "${PACK:-1}" = 0 ] || "$ROOT/scripts/bench-pack.sh" "$OUT"
log "done: $OUT/summary.md"
cat "$OUT/summary.md"
