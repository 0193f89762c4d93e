#!/usr/bin/env bash
# Rate limits (bdev_set_qos_limit, katablk's QoS groups) measured on the vhost-user path with the
# libblkio client: katablk-target, and SPDK's vhost app with the same limits where SPDK_VHOST
# is set. One results directory; katablk-bench-qos writes its summary and plots. See
# benches/README.md.
#
#   scripts/bench-qos.sh                                   # katablk-target only, ~4 min
#   SPDK_VHOST=<spdk>/build/bin/vhost scripts/bench-qos.sh # both servers, ~7 min
#
# Scenarios, each on RAM bdevs (bdev_malloc_create) with a fresh server:
#   hold-4k     4k randread QD32 for HOLD_SECS with rw_ios_per_sec=HOLD_IOPS (and the same run
#               unlimited first, to show what the client can push)
#   hold-128k   128k read QD8 with rw_mbytes_per_sec=HOLD_MBPS (and unlimited first)
#   change      4k randread QD32; the limit set to CHANGE_IOPS (three values) at 0 s, CHANGE_AT s
#               and 2*CHANGE_AT s while the client runs
#   neighbour   two volumes: the second at QD1 alone, then beside the first at QD32 unlimited,
#               then beside it limited to NEIGH_IOPS, NEIGH_ROUNDS times; medians compared
#   group       (katablk-target only) three volumes in one katablk_set_qos_group of GROUP_IOPS:
#               all three busy, then one alone
#   idle        IDLE_CTRLS controllers on limited bdevs, one idle client: server CPU
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
BENCH_BIN_DIR=${BENCH_BIN_DIR:-$CARGO_TARGET_DIR/release}
KATABLK_TARGET=${KATABLK_TARGET:-$BENCH_BIN_DIR/katablk-target}
SPDK_VHOST=${SPDK_VHOST:-}              # SPDK's vhost app (server spdk)
SPDK_MEM_MIB=${SPDK_MEM_MIB:-1536}
SERVER_CPUS=${SERVER_CPUS:-0}           # one core for the server (target: -m, SPDK: reactor mask)
CLIENT_CPUS=${CLIENT_CPUS:-1}           # katablk-bench clients
BUILD=${BUILD:-1}
NAME=${NAME:-qos-$(date -u +%Y%m%d-%H%M%S)}
OUT=${OUT:-$ROOT/benches/results/$NAME}
HOLD_SECS=${HOLD_SECS:-10}
FREE_SECS=${FREE_SECS:-4}
HOLD_IOPS=${HOLD_IOPS:-20000}
HOLD_MBPS=${HOLD_MBPS:-200}
CHANGE_IOPS=${CHANGE_IOPS:-"20000 5000 40000"}
CHANGE_AT=${CHANGE_AT:-4}
NEIGH_IOPS=${NEIGH_IOPS:-10000}
NEIGH_ROUNDS=${NEIGH_ROUNDS:-3}
GROUP_IOPS=${GROUP_IOPS:-30000}
IDLE_CTRLS=${IDLE_CTRLS:-100}
IDLE_SECS=${IDLE_SECS:-10}
INTERVAL=${INTERVAL:-100ms}
SCENARIOS=${SCENARIOS:-"hold-4k hold-128k change neighbour group idle"}
DEV_MIB=${DEV_MIB:-1024}

log() { echo "[bench-qos] $*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}
if [ "$BUILD" = 1 ]; then
    (cd "$ROOT" && cargo build --release -q -p katablk-bench -p katablk-target)
fi
BENCH=$BENCH_BIN_DIR/katablk-bench
TBENCH=$BENCH_BIN_DIR/katablk-target-bench
for b in "$BENCH" "$TBENCH" "$BENCH_BIN_DIR/katablk-bench-qos" "$KATABLK_TARGET"; do
    [ -x "$b" ] || die "$b is missing (cargo build --release -p katablk-bench -p katablk-target)"
done
SERVERS=target
if [ -n "$SPDK_VHOST" ]; then
    [ -x "$SPDK_VHOST" ] || die "SPDK_VHOST=$SPDK_VHOST is not executable"
    SERVERS="target spdk"
else
    log "SPDK_VHOST not set: katablk-target only"
fi
# SPDK's DPDK environment takes its -s memory from 2 MiB hugepages on a hugetlbfs mount.
if [ -n "$SPDK_VHOST" ]; then
    "$ROOT/scripts/setup-hugepages.sh" $(((SPDK_MEM_MIB + 512) / 2)) >&2
fi

mkdir -p "$OUT/raw" "$OUT/logs"
WORK=$(mktemp -d /tmp/katablk-bench-qos.XXXXXX)
SERVER_PID=
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    kill "$SERVER_PID" 2>/dev/null || true
    local i
    for i in $(seq 1 100); do
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.1
    done
    kill -9 "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
}
trap 'stop_server; rm -rf "$WORK"' EXIT

RPC=$WORK/rpc.sock
rpc() { "$TBENCH" rpc -s "$RPC" "$@"; }
now() { date +%s.%N; }

start_server() { # SERVER SCENARIO
    local server=$1 scen=$2 logf cmd i
    stop_server
    rm -rf "$WORK/s" && mkdir -p "$WORK/s"
    rm -f "$RPC" # SPDK refuses a socket path that exists
    logf=$OUT/logs/$server-$scen.log
    case $server in
    target) cmd=("$KATABLK_TARGET" -S "$WORK/s" -r "$RPC" -m "[$SERVER_CPUS]") ;;
    spdk) cmd=("$SPDK_VHOST" -S "$WORK/s" -r "$RPC" -m "[$SERVER_CPUS]" -s "$SPDK_MEM_MIB") ;;
    esac
    echo "+ ${cmd[*]}" >"$logf"
    taskset -c "$SERVER_CPUS" "${cmd[@]}" >>"$logf" 2>&1 &
    SERVER_PID=$!
    for i in $(seq 1 300); do
        [ -S "$RPC" ] && rpc rpc_get_methods >/dev/null 2>&1 && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.05
    done
    die "$server did not start; log: $logf: $(tail -3 "$logf")"
}

volume() { # NAME: a RAM bdev of DEV_MIB and a controller vc-NAME on it, filled once
    rpc bdev_malloc_create "{\"name\": \"$1\", \"num_blocks\": $((DEV_MIB * 2048)), \"block_size\": 512}" >/dev/null
    rpc vhost_create_blk_controller "{\"ctrlr\": \"vc-$1\", \"dev_name\": \"$1\"}" >/dev/null
}
limit() { # BDEV JSON-FIELDS: bdev_set_qos_limit, the time it returned in the events file
    rpc bdev_set_qos_limit "{\"name\": \"$1\", $2}" >/dev/null
    echo "$(now) $1 $2" >>"$EVENTS"
}

client() { # JSON-NAME BDEV SECONDS RW BS QD [katablk-bench args]: one client run
    local name=$1 dev=$2 secs=$3 rw=$4 bs=$5 qd=$6
    shift 6
    taskset -c "$CLIENT_CPUS" "$BENCH" --socket "$WORK/s/vc-$dev" --rw "$rw" --bs "$bs" \
        --iodepth "$qd" --runtime "$secs" --ramp 1 --align-2m --interval "$INTERVAL" \
        --server-pid "$SERVER_PID" --json "$OUT/raw/$SERVER-$SCEN-$name.json" --no-progress -q \
        --meta "server=$SERVER" --meta "scenario=$SCEN" --meta "run=$name" --meta "volume=$dev" "$@" \
        >>"$OUT/logs/$SERVER-$SCEN.clients.log" 2>&1
}

run_hold() { # 4k|128k
    local size=$1
    start_server "$SERVER" "$SCEN"
    volume m0
    client prefill m0 2 write 128k 8
    if [ "$size" = 4k ]; then
        client free m0 "$FREE_SECS" randread 4k 32
        limit m0 "\"rw_ios_per_sec\": $HOLD_IOPS"
        client limited m0 "$HOLD_SECS" randread 4k 32
    else
        client free m0 "$FREE_SECS" read 128k 8
        limit m0 "\"rw_mbytes_per_sec\": $HOLD_MBPS"
        client limited m0 "$HOLD_SECS" read 128k 8
    fi
}

run_change() {
    local first rest v t=0 secs
    read -r first rest <<<"$CHANGE_IOPS"
    start_server "$SERVER" "$SCEN"
    volume m0
    client prefill m0 2 write 128k 8
    limit m0 "\"rw_ios_per_sec\": $first"
    secs=$((CHANGE_AT * (1 + $(wc -w <<<"$rest"))))
    client limited m0 "$secs" randread 4k 32 &
    local cpid=$!
    sleep 1 # the client's ramp
    for v in $rest; do
        t=$((t + CHANGE_AT))
        sleep "$CHANGE_AT"
        limit m0 "\"rw_ios_per_sec\": $v"
    done
    wait "$cpid"
}

run_neighbour() {
    start_server "$SERVER" "$SCEN"
    volume m0
    volume m1
    client prefill-m0 m0 2 write 128k 8
    client prefill-m1 m1 2 write 128k 8
    # The neighbour m1 runs latency-bound (QD1) beside m0 pushing QD32: alone, with m0
    # unlimited, with m0 limited.
    client alone-m1 m1 "$HOLD_SECS" randread 4k 1
    # NEIGH_ROUNDS rounds of both phases, alternating (the verdict takes medians).
    local phase r lim
    for r in $(seq 1 "$NEIGH_ROUNDS"); do
        for phase in free limited; do
            lim=0
            [ "$phase" = limited ] && lim=$NEIGH_IOPS
            # (a fresh bdev has no limit: nothing to lift before the first round)
            [ "$r$phase" = 1free ] || limit m0 "\"rw_ios_per_sec\": $lim"
            client "$phase-m0-r$r" m0 "$HOLD_SECS" randread 4k 32 &
            local a=$!
            client "$phase-m1-r$r" m1 "$HOLD_SECS" randread 4k 1 &
            local b=$!
            wait "$a" "$b"
        done
    done
}

run_group() {
    start_server "$SERVER" "$SCEN"
    local v members=()
    for v in m0 m1 m2; do
        volume "$v"
        client "prefill-$v" "$v" 2 write 128k 8
        members+=("\"$v\"")
    done
    rpc katablk_set_qos_group "{\"name\": \"pod\", \"rw_ios_per_sec\": $GROUP_IOPS, \"bdevs\": [$(
        IFS=,
        echo "${members[*]}"
    )]}" >/dev/null
    echo "$(now) group pod rw_ios_per_sec=$GROUP_IOPS m0 m1 m2" >>"$EVENTS"
    local pids=()
    for v in m0 m1 m2; do
        client "all-$v" "$v" "$HOLD_SECS" randread 4k 32 &
        pids+=($!)
    done
    wait "${pids[@]}"
    client alone-m0 m0 "$HOLD_SECS" randread 4k 32
}

run_idle() {
    start_server "$SERVER" "$SCEN"
    local i
    for i in $(seq 0 $((IDLE_CTRLS - 1))); do
        rpc bdev_malloc_create "{\"name\": \"i$i\", \"num_blocks\": 2048, \"block_size\": 512}" >/dev/null
        rpc bdev_set_qos_limit "{\"name\": \"i$i\", \"rw_ios_per_sec\": 1000, \"rw_mbytes_per_sec\": 10}" >/dev/null
        rpc vhost_create_blk_controller "{\"ctrlr\": \"vc-i$i\", \"dev_name\": \"i$i\"}" >/dev/null
    done
    echo "$(now) $IDLE_CTRLS limited controllers" >>"$EVENTS"
    sleep 1
    taskset -c "$CLIENT_CPUS" "$BENCH" --socket "$WORK/s/vc-i0" --idle-cpu "$IDLE_SECS" \
        --server-pid "$SERVER_PID" --align-2m --json "$OUT/raw/$SERVER-$SCEN-idle.json" --no-progress -q \
        --meta "server=$SERVER" --meta "scenario=$SCEN" --meta "run=idle" --meta "controllers=$IDLE_CTRLS" \
        >>"$OUT/logs/$SERVER-$SCEN.clients.log" 2>&1
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "kernel: $(uname -r)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') x $(nproc)"
    echo "memory: $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)"
    echo "katablk: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    [ -z "$SPDK_VHOST" ] || echo "spdk: $SPDK_VHOST ($(git -C "$(dirname "$SPDK_VHOST")/../.." describe --tags --always 2>/dev/null || echo unknown))"
    echo "server cpus: $SERVER_CPUS; client cpus: $CLIENT_CPUS; interval: $INTERVAL"
    echo "settings: HOLD_SECS=$HOLD_SECS HOLD_IOPS=$HOLD_IOPS HOLD_MBPS=$HOLD_MBPS CHANGE_IOPS='$CHANGE_IOPS'" \
        "CHANGE_AT=$CHANGE_AT NEIGH_IOPS=$NEIGH_IOPS NEIGH_ROUNDS=$NEIGH_ROUNDS GROUP_IOPS=$GROUP_IOPS IDLE_CTRLS=$IDLE_CTRLS DEV_MIB=$DEV_MIB"
} >"$OUT/env.txt"

for SERVER in $SERVERS; do
    for SCEN in $SCENARIOS; do
        if [ "$SCEN" = group ] && [ "$SERVER" = spdk ]; then
            log "spdk: no QoS groups in SPDK (spdk#3605), group skipped"
            continue
        fi
        EVENTS=$OUT/raw/$SERVER-$SCEN.events
        : >"$EVENTS"
        log "$SERVER: $SCEN"
        case $SCEN in
        hold-4k) run_hold 4k ;;
        hold-128k) run_hold 128k ;;
        change) run_change ;;
        neighbour) run_neighbour ;;
        group) run_group ;;
        idle) run_idle ;;
        *) die "unknown scenario $SCEN" ;;
        esac
        stop_server
    done
done

"$BENCH_BIN_DIR/katablk-bench-qos" "$OUT" \
    --hold-iops "$HOLD_IOPS" --hold-mbps "$HOLD_MBPS" --change-iops "$CHANGE_IOPS" \
    --neigh-iops "$NEIGH_IOPS" --group-iops "$GROUP_IOPS"
[ "${PACK:-1}" = 0 ] || "$ROOT/scripts/bench-pack.sh" "$OUT"
log "done: $OUT/summary.md"
