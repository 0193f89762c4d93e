#!/usr/bin/env bash
# katablk-target benchmarks: the data path (scripts/bench-compare.sh with the target next to
# katablk-vhost and qemu-storage-daemon, raw bdevs and lvols) and the control plane and idle
# cost (katablk-target-bench). One results directory; see benches/README.md.
#
#   scripts/bench-target.sh                       # full run, ~45 min on 2 cores
#   ROUNDS=1 RUNTIME=2 TB_ITERATIONS=10 scripts/bench-target.sh   # quick trial
#   IMG_DIR=/dev/shm/katablk-bench SERVERS=target CASES="aio-file lvol-file" TB=0 \
#       scripts/bench-target.sh   # raw file vs lvol on file, both images on tmpfs
#
# Everything bench-compare.sh reads from the environment applies; the defaults differ:
# SERVERS="target katablk qsd", CASES="aio-file lvol-file malloc lvol-ram thin-first-write",
# CANDIDATE=target. TB_* settings go to katablk-target-bench (TB=0 skips it).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
export SERVERS=${SERVERS:-"target katablk qsd"}
export CASES=${CASES:-"aio-file lvol-file malloc lvol-ram thin-first-write"}
export CANDIDATE=${CANDIDATE:-target}
export NAME=${NAME:-target-$(date -u +%Y%m%d-%H%M%S)}
export OUT=${OUT:-$ROOT/benches/results/$NAME}
BENCH_BIN_DIR=${BENCH_BIN_DIR:-$CARGO_TARGET_DIR/release}
KATABLK_TARGET=${KATABLK_TARGET:-$ROOT/target/release/katablk-target}
TB=${TB:-1}
TB_ITERATIONS=${TB_ITERATIONS:-50}     # create/delete cycles of the RPC latency test
TB_CONTROLLERS=${TB_CONTROLLERS:-100}  # idle controllers
TB_CLIENTS=${TB_CLIENTS:-100}          # idle clients connected (falls back to TB_CLIENTS_FALLBACK)
TB_CLIENTS_FALLBACK=${TB_CLIENTS_FALLBACK:-20}
TB_IDLE_SECS=${TB_IDLE_SECS:-10}       # each idle CPU window
TB_BACKING=${TB_BACKING:-lvol}         # lvol (thin lvols) or null
TB_ARGS=${TB_ARGS:-}                   # extra katablk-target arguments

if [ "${BUILD:-1}" = 1 ]; then
    (cd "$ROOT" && cargo build --release -q -p katablk-bench -p katablk-target -p katablk-vhost)
fi
export BUILD=0
pack=${PACK:-1}
PACK=0 "$ROOT/scripts/bench-compare.sh"

if [ "$TB" = 1 ]; then
    echo "[bench-target] katablk-target-bench: RPC latency and idle cost" >&2
    cmd=("$BENCH_BIN_DIR/katablk-target-bench" run --target "$KATABLK_TARGET"
        --iterations "$TB_ITERATIONS" --controllers "$TB_CONTROLLERS" --backing "$TB_BACKING"
        --clients "$TB_CLIENTS" --clients-fallback "$TB_CLIENTS_FALLBACK"
        --idle-secs "$TB_IDLE_SECS" --target-args "$TB_ARGS"
        --json "$OUT/target-bench.json" --md "$OUT/target-bench.md")
    mkdir -p "$OUT/logs"
    echo "+ ${cmd[*]}" >"$OUT/logs/target-bench.txt"
    "${cmd[@]}" >>"$OUT/logs/target-bench.txt" 2>&1 || {
        echo "[bench-target] katablk-target-bench failed: $(tail -3 "$OUT/logs/target-bench.txt")" >&2
        exit 1
    }
    { echo; cat "$OUT/target-bench.md"; } >>"$OUT/summary.md"
    cat "$OUT/target-bench.md"
fi
[ "$pack" = 0 ] || "$ROOT/scripts/bench-pack.sh" "$OUT"
echo "[bench-target] done: $OUT/summary.md" >&2
