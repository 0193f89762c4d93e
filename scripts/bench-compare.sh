#!/usr/bin/env bash
# Side-by-side benchmark of katablk-vhost and qemu-storage-daemon (QSD) over vhost-user-blk.
#
# For every case (backing store) and workload, runs the servers ALTERNATELY
# (katablk, qsd, katablk, qsd, ...) for ROUNDS rounds, each run on a freshly started
# server, and measures it with katablk-bench. Writes every raw JSON result to
# OUT/raw/, then OUT/summary.json, OUT/summary.md (medians, katablk/qsd ratios) and PNG
# charts. See benches/README.md. Every setting below can be overridden from the environment.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}

KATABLK_VHOST=${KATABLK_VHOST:-$ROOT/build/release/katablk-vhost} # server under test
QSD=${QSD:-qemu-storage-daemon}                  # the reference server
BENCH_BIN_DIR=${BENCH_BIN_DIR:-$CARGO_TARGET_DIR/release}
BUILD=${BUILD:-1}                                # 1: cargo build --release -p katablk-bench first
NAME=${NAME:-$(date -u +%Y%m%d-%H%M%S)}
OUT=${OUT:-$ROOT/benches/results/$NAME}
RUNTIME=${RUNTIME:-5}                            # measured seconds per run
RAMP=${RAMP:-1}                                  # warm-up seconds per run (not measured)
ROUNDS=${ROUNDS:-3}
IDLE_SECS=${IDLE_SECS:-3}                        # idle-CPU measurement per case and server (0: skip)
CASES=${CASES:-"file ram"}                       # any of: file ram tmpfs null
WORKLOADS=${WORKLOADS:-"randread-4k-qd1 randread-4k-qd32 randwrite-4k-qd32 read-128k-qd8 randread-4k-qd32-2q"}
SERVERS=${SERVERS:-"katablk qsd"}                # run order within a round; qsd2, qsd3...
                                                 # are extra QSD instances (A/A noise check)
CANDIDATE=${CANDIDATE:-katablk}                  # ratios are CANDIDATE / BASELINE
BASELINE=${BASELINE:-qsd}
SERVER_CPUS=${SERVER_CPUS:-}                     # pin the server with taskset -c (e.g. 0)
CLIENT_CPUS=${CLIENT_CPUS:-}                     # pin katablk-bench with taskset -c (e.g. 1)
IMG_MIB=${IMG_MIB:-1024}
FILE_IMG=${FILE_IMG:-/var/tmp/katablk-bench.img} # "file" case, prefilled with random data
TMPFS_IMG=${TMPFS_IMG:-/dev/shm/katablk-bench.img} # "ram" (qsd side) and "tmpfs" cases
REFILL=${REFILL:-0}                              # 1: rewrite the images even if present
DIRECT=${DIRECT:-0}                              # 1: O_DIRECT in the file case (both servers)
NUM_QUEUES=${NUM_QUEUES:-2}                      # queues every server exports
POLL=${POLL:-event}                              # client completion wait: event | busy
KATABLK_EXTRA=${KATABLK_EXTRA:-}                 # extra katablk-vhost arguments, e.g. "--poll-us 50"
QSD_EXTRA=${QSD_EXTRA:-}                         # extra qemu-storage-daemon arguments
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
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- tools -------------------------------------------------------------------------------
if [ "$BUILD" = 1 ]; then
    log "building katablk-bench (release) into $CARGO_TARGET_DIR"
    (cd "$ROOT" && cargo build --release -q -p katablk-bench)
fi
BENCH=$BENCH_BIN_DIR/katablk-bench
run_bench() { # the client, pinned if CLIENT_CPUS is set
    if [ -n "$CLIENT_CPUS" ]; then
        taskset -c "$CLIENT_CPUS" "$BENCH" "$@"
    else
        "$BENCH" "$@"
    fi
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
    qsd*)
        if command -v "$QSD" >/dev/null 2>&1; then
            active+=("$s")
        else
            log "SKIPPING qsd: $QSD not found (apt-get install qemu-utils)"
            NOTES+=("qsd side skipped: $QSD not found")
        fi
        ;;
    *) die "unknown server '$s' in SERVERS (use katablk, qsd, qsd2, ...)" ;;
    esac
done
[ ${#active[@]} -gt 0 ] || die "no server to benchmark"

# --- backing stores ----------------------------------------------------------------------
prefill() { # PATH: a random-filled image of IMG_MIB MiB, so reads hit real data
    local path=$1
    if [ "$REFILL" = 1 ] || [ ! -f "$path" ] || [ "$(stat -c %s "$path")" -ne $((IMG_MIB << 20)) ]; then
        log "prefilling $path ($IMG_MIB MiB of random data)"
        mkdir -p "$(dirname "$path")"
        dd if=/dev/urandom of="$path" bs=1M count="$IMG_MIB" conv=fsync status=none
    fi
}
for c in $CASES; do
    case $c in
    file)
        prefill "$FILE_IMG"
        # Buffered runs measure the servers, not the disk: start with the image in the page
        # cache (an image left from an earlier run may have been evicted).
        [ "$DIRECT" = 1 ] || cat "$FILE_IMG" >/dev/null
        ;;
    ram | tmpfs) prefill "$TMPFS_IMG" ;;
    null) ;;
    *) die "unknown case '$c' in CASES (use file, ram, tmpfs, null)" ;;
    esac
done

# --- servers -----------------------------------------------------------------------------
# start_server SERVER CASE SOCK LOG: starts it in the background, sets SERVER_PID, waits for
# the socket.
start_server() {
    local server=$1 case=$2 sock=$3 logf=$4
    rm -f "$sock"
    local -a cmd
    if [ "$server" = katablk ]; then
        cmd=("$KATABLK_VHOST" --socket "$sock" --num-queues "$NUM_QUEUES")
        case $case in
        file)
            cmd+=(--file "$FILE_IMG")
            [ "$DIRECT" = 1 ] && cmd+=(--direct)
            ;;
        ram) cmd+=(--malloc "$IMG_MIB") ;;
        tmpfs) cmd+=(--file "$TMPFS_IMG") ;;
        null) cmd+=(--null "$IMG_MIB") ;;
        esac
        # shellcheck disable=SC2206
        cmd+=($KATABLK_EXTRA)
    else
        local blockdev
        case $case in
        file)
            if [ "$DIRECT" = 1 ]; then
                blockdev="driver=file,node-name=f0,filename=$FILE_IMG,cache.direct=on,aio=threads"
            else
                blockdev="driver=file,node-name=f0,filename=$FILE_IMG,cache.direct=off,aio=threads"
            fi
            ;;
        ram | tmpfs) blockdev="driver=file,node-name=f0,filename=$TMPFS_IMG,cache.direct=off,aio=threads" ;;
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

stop_server() {
    if [ -n "$SERVER_PID" ]; then
        kill "$SERVER_PID" 2>/dev/null || true
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
    echo "katablk-vhost: $KATABLK_VHOST ($([ -x "$KATABLK_VHOST" ] && echo present || echo absent))"
    echo "servers: ${active[*]}"
    for v in SERVERS CANDIDATE BASELINE SERVER_CPUS CLIENT_CPUS CASES WORKLOADS ROUNDS RUNTIME RAMP IDLE_SECS IMG_MIB FILE_IMG TMPFS_IMG DIRECT NUM_QUEUES POLL KATABLK_EXTRA QSD_EXTRA; do
        echo "$v=${!v}"
    done
} >"$OUT/env.txt"

ncases=$(wc -w <<<"$CASES")
nwl=$(wc -w <<<"$WORKLOADS")
estimate=$(((ncases * nwl * ROUNDS * (RUNTIME + RAMP + 1) + ncases * (IDLE_SECS + 1)) * ${#active[@]}))
log "servers: ${active[*]}; cases: $CASES; $nwl workloads x $ROUNDS rounds; about $((estimate / 60 + 1)) min"
log "results: $OUT"

seq_no=0
sock=$SOCK_DIR/vhost.sock
for case in $CASES; do
    if [ "$IDLE_SECS" != 0 ]; then
        for server in "${active[@]}"; do
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
    fi
    for wl in $WORKLOADS; do
        read -r -a wargs <<<"$(workload_args "$wl")"
        for round in $(seq 1 "$ROUNDS"); do
            for server in "${active[@]}"; do
                seq_no=$((seq_no + 1))
                tag=$(printf '%03d-%s-%s-%s-r%d' "$seq_no" "$case" "$wl" "$server" "$round")
                start_server "$server" "$case" "$sock" "$OUT/logs/$tag.server.log"
                if ! run_bench --socket "$sock" "${wargs[@]}" --runtime "$RUNTIME" --ramp "$RAMP" \
                    --poll "$POLL" --server-pid "$SERVER_PID" --no-progress \
                    --json "$OUT/raw/$tag.json" --label "$server $case $wl r$round" \
                    --meta case="$case" --meta workload="$wl" --meta server="$server" \
                    --meta round="$round" >"$OUT/logs/$tag.txt" 2>&1; then
                    log "FAILED: $tag: $(tail -3 "$OUT/logs/$tag.txt")"
                    log "server log: $(tail -3 "$OUT/logs/$tag.server.log")"
                    stop_server
                    continue
                fi
                stop_server
                log "$case $wl $server r$round: $(brief "$OUT/logs/$tag.txt")"
            done
        done
    done
done

note_args=()
for n in "${NOTES[@]+"${NOTES[@]}"}"; do note_args+=(--note "$n"); done
"$BENCH_BIN_DIR/katablk-bench-summary" "$OUT" --baseline "$BASELINE" --candidate "$CANDIDATE" "${note_args[@]+"${note_args[@]}"}"
"$BENCH_BIN_DIR/katablk-bench-plot" "$OUT/summary.json" --out "$OUT"
log "done: $OUT/summary.md"
cat "$OUT/summary.md"
