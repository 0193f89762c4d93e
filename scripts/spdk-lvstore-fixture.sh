#!/usr/bin/env bash
# Builds the SPDK lvstore image that katablk-lvol's import tests read
# (lvol/tests/data/spdk-lvstore.img.gz, with what SPDK reported about it in
# spdk-lvstore.json), using a real SPDK: its vhost app + rpc.py to make the store and the
# volumes, spdk_dd to write data into them. Needs an SPDK build (SPDK_DIR); runs without
# hugepages.
#
#   SPDK_DIR=/opt/spdk-src/spdk scripts/spdk-lvstore-fixture.sh [OUT_DIR]
#
# Content (1 MiB clusters on a 64 MiB file, block size 512), data in the patterns of
# lvol/tests/spdk_import.rs (pattern(tag, offset): 4 KiB blocks of text naming both):
#   thick  4 MiB thick       A over its first 2 MiB
#   thin   8 MiB thin        B at 0 (1 MiB) and at 5 MiB + 256 KiB (512 KiB); then snapshot
#                            "snap" of it, then C at 0 (64 KiB) of thin
#   clone  clone of snap     D at 7 MiB (1 MiB)
#   ro     2 MiB thick       E over all of it, then set read-only
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SPDK_DIR=${SPDK_DIR:?set SPDK_DIR to an SPDK build (with build/bin/vhost and spdk_dd)}
OUT=${1:-$ROOT/lvol/tests/data}
WORK=$(mktemp -d /tmp/katablk-spdk-fixture.XXXXXX)
IMG=$WORK/spdk-lvstore.img
SOCK=$WORK/spdk.sock
TGT_PID=
cleanup() {
    [ -z "$TGT_PID" ] || kill -9 "$TGT_PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

rpc() { PYTHONPATH=$SPDK_DIR/python python3 "$SPDK_DIR/scripts/rpc.py" -s "$SOCK" "$@"; }

tgt_start() {
    "$SPDK_DIR/build/bin/vhost" --no-huge -s 512 -S "$WORK" -r "$SOCK" -m 0x1 >"$WORK/tgt.log" 2>&1 &
    TGT_PID=$!
    for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
    rpc framework_wait_init
    rpc bdev_aio_create "$IMG" aio0 512 >/dev/null
    rpc bdev_wait_for_examine
}

tgt_stop() {
    kill -INT "$TGT_PID"
    wait "$TGT_PID" || true
    TGT_PID=
}

# pattern TAG OFFSET LEN: the bytes the tests expect (one text line per 4 KiB block,
# repeated to fill it).
pattern() {
    python3 - "$1" "$2" "$3" <<'PY'
import sys
tag, off, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = bytearray()
for b in range(off, off + n, 4096):
    line = f"katablk spdk fixture {tag} block {b // 4096}\n".encode()
    out += (line * (4096 // len(line) + 1))[:4096]
sys.stdout.buffer.write(out)
PY
}

# dd_write BDEV TAG OFFSET LEN: writes pattern TAG at OFFSET of BDEV with spdk_dd.
dd_write() {
    pattern "$2" "$3" "$4" >"$WORK/data"
    cat >"$WORK/dd.json" <<EOF
{"subsystems": [{"subsystem": "bdev", "config": [
  {"method": "bdev_aio_create", "params": {"name": "aio0", "filename": "$IMG", "block_size": 512}},
  {"method": "bdev_wait_for_examine"}]}]}
EOF
    "$SPDK_DIR/build/bin/spdk_dd" --no-huge -s 512 --json "$WORK/dd.json" --if "$WORK/data" \
        --ob "$1" --bs 4096 --seek $(($3 / 4096)) >"$WORK/dd.log" 2>&1 ||
        { cat "$WORK/dd.log"; exit 1; }
}

truncate -s 64M "$IMG"
tgt_start
rpc bdev_lvol_create_lvstore aio0 lvs_spdk -c 1048576 >/dev/null
rpc bdev_lvol_create -l lvs_spdk thick 4 >/dev/null
rpc bdev_lvol_create -l lvs_spdk -t thin 8 >/dev/null
rpc bdev_lvol_create -l lvs_spdk ro 2 >/dev/null
tgt_stop

dd_write lvs_spdk/thick A 0 $((2 << 20))
dd_write lvs_spdk/thin B 0 $((1 << 20))
dd_write lvs_spdk/thin B $(((5 << 20) + (256 << 10))) $((512 << 10))
dd_write lvs_spdk/ro E 0 $((2 << 20))

tgt_start
rpc bdev_lvol_snapshot lvs_spdk/thin snap >/dev/null
rpc bdev_lvol_clone lvs_spdk/snap clone >/dev/null
rpc bdev_lvol_set_read_only lvs_spdk/ro >/dev/null
tgt_stop

dd_write lvs_spdk/thin C 0 $((64 << 10))
dd_write lvs_spdk/clone D $((7 << 20)) $((1 << 20))

tgt_start
{
    echo '{"lvstores":'
    rpc bdev_lvol_get_lvstores
    echo ', "lvols":'
    rpc bdev_lvol_get_lvols
    echo '}'
} >"$WORK/spdk-lvstore.json"
tgt_stop

mkdir -p "$OUT"
python3 -m json.tool "$WORK/spdk-lvstore.json" >"$OUT/spdk-lvstore.json"
gzip -9 -n -c "$IMG" >"$OUT/spdk-lvstore.img.gz"
echo "wrote $OUT/spdk-lvstore.img.gz ($(stat -c %s "$OUT/spdk-lvstore.img.gz") bytes) and $OUT/spdk-lvstore.json"
