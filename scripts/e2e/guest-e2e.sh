#!/usr/bin/env bash
# End-to-end test of katablk's vhost-user-blk stack with a real guest: QEMU (TCG) boots the Debian
# kernel with the initramfs of guest-assets.sh, attached to a disk served by katablk, and the guest
# (scripts/e2e/guest/main.sh) checks size, serial, queues, discard/write-zeroes, data written and
# read back (O_DIRECT and buffered), runs the fio jobs of benches/fio/, and keeps a write/verify
# loop going while the host kills the server with SIGKILL and starts it again (QEMU reconnect=1,
# INFLIGHT_SHMFD); then the host grows the disk and the guest waits for the new size.
# All of it for num-queues=1 (one vCPU) and num-queues=2 (two vCPUs).
#
# Providers (scripts/e2e/providers/, KATABLK_E2E_PROVIDER):
#   csi (default)  the node stack: katablk-target + katablk-csi; the volume is created and
#                  published through CSI gRPC (katablk-csi-ctl), the guest attached to the socket
#                  behind the Kata device node; restart = kill -9 of katablk-target; grow =
#                  ControllerExpandVolume + NodeExpandVolume; unpublish and delete checked at the end
#   vhost          a standalone katablk-vhost on a sparse file (no grow); the host compares the
#                  guest's checksums with the file
#   spdk           katablk-spdk or SPDK's own vhost app (KATABLK_E2E_SPDK_BIN) serving an SPDK
#                  AIO bdev on a sparse file, provisioned with spdk-rpc; grow = bdev_aio_rescan
#
# Usage: scripts/e2e/guest-e2e.sh [--queues "1 2"] [--fio JOBS|none] [--fio-runtime S] [--out DIR]
# Environment:
#   KATABLK_E2E_PROVIDER  csi (default), vhost or spdk (see providers/spdk.sh)
#   KATABLK_E2E_MEMFD_OPTS  extra options of the guest RAM memfd backend (",hugetlb=on" for
#                         SPDK's vhost, which needs hugepage-backed guest RAM)
#   KATABLK_VHOST, KATABLK_TARGET, KATABLK_CSI, KATABLK_CSI_CTL   binaries (default: the build
#                         directory's release or debug ones, else a release build)
#   KATABLK_E2E_CACHE     see guest-assets.sh
# Results: DIR (default target/e2e): results.json (per run: checks, fio summary), fio-q<N>-<job>.json
# (fio's JSON), console-q<N>.log (guest serial console), qemu-q<N>.log, server-*.log.
# Exit status: 0 all passed; 77 assets unavailable (no Debian mirror); anything else failed.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
queues_list="1 2"
fio_jobs=randread-4k-qd1,randread-4k-qd32,randwrite-4k-qd1,randwrite-4k-qd32,seqread-128k-qd8
fio_runtime=5
out=$repo/target/e2e
while [ $# -gt 0 ]; do
    case "$1" in
    --queues) queues_list=$2; shift 2 ;;
    --fio) fio_jobs=$2; shift 2 ;;
    --fio-runtime) fio_runtime=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

t_start=$(date +%s)
log() { echo "guest-e2e: $*" >&2; }

# One run at a time on this machine: QEMU under TCG wants both cores, and runs share the cache.
mkdir -p "$out"
exec 7>"$out/.lock"
if ! flock -w 600 7; then log "another guest-e2e run holds $out/.lock"; exit 1; fi

# --- assets ----------------------------------------------------------------------------------
set +e
assets_env=$("$here/guest-assets.sh" --print-env)
rc=$?
set -e
[ $rc -eq 0 ] || exit $rc # 77: unavailable, the caller skips
eval "$assets_env"

# --- the server ------------------------------------------------------------------------------
provider=${KATABLK_E2E_PROVIDER:-csi}
[ "$provider" != common ] && [ -f "$here/providers/$provider.sh" ] || { log "no provider $provider"; exit 2; }
# find_bin VAR BINARY PACKAGE: $VAR if set, else the build directory's release or debug binary,
# else a release build of PACKAGE.
find_bin() {
    local var=$1 bin=$2 pkg=$3 tdir=${CARGO_TARGET_DIR:-$repo/target} p
    if [ -z "${!var:-}" ]; then
        for p in release debug; do
            [ -x "$tdir/$p/$bin" ] && { printf -v "$var" %s "$tdir/$p/$bin"; break; }
        done
    fi
    if [ -z "${!var:-}" ]; then
        log "building $bin"
        (cd "$repo" && cargo build --release -p "$pkg") >&2
        printf -v "$var" %s "$tdir/release/$bin"
    fi
    export "${var?}"
}
case $provider in
vhost) find_bin KATABLK_VHOST katablk-vhost katablk-vhost ;;
csi)
    find_bin KATABLK_TARGET katablk-target katablk-target
    find_bin KATABLK_CSI katablk-csi katablk-csi
    find_bin KATABLK_CSI_CTL katablk-csi-ctl katablk-csi
    ;;
esac
# shellcheck source=providers/common.sh
. "$here/providers/common.sh"
# shellcheck source=providers/vhost.sh
. "$here/providers/$provider.sh"

# Sockets must stay under 108 bytes: keep the run's files in a short private directory.
E2E_RUN_DIR=$(mktemp -d /tmp/katablk-e2e.XXXXXX)
# shellcheck disable=SC2034  # read by the sourced provider
E2E_LOG_DIR=$out
qemu_pid=
cleanup() {
    [ -n "$qemu_pid" ] && kill -9 "$qemu_pid" 2>/dev/null
    provider_stop >/dev/null 2>&1 || true
    provider_shutdown >/dev/null 2>&1 || true
    rm -rf "$E2E_RUN_DIR"
}
trap cleanup EXIT
rm -f "$out"/*.log "$out"/fio-*.json "$out"/results.json

size_mib=256
failures=0

# Boots one guest against DISK_SOCK and reacts to the guest's markers. $1 = queues.
boot_guest() {
    local nq=$1
    local console=$out/console-q$nq.log qlog=$out/qemu-q$nq.log
    local fifo=$E2E_RUN_DIR/console-in
    rm -f "$fifo"
    mkfifo -m 600 "$fifo"
    exec 8<>"$fifo"
    # Growing the disk is only checked where the provider can do it (katablk-target can).
    local resize=skip why
    if why=$(provider_can_grow); then resize=$((size_mib * 4096)); else log "q$nq: resize $why"; fi
    local append="console=ttyS0 quiet panic=-1 katablk.sectors=$((size_mib * 2048))"
    append+=" katablk.serial=$serial katablk.queues=$nq katablk.fio=$fio_jobs"
    append+=" katablk.fio_runtime=$fio_runtime katablk.reconnect=1 katablk.resize=$resize"
    append+=" katablk.discard=${DISK_DISCARD:-1}"
    local bios=() d
    IFS=: read -ra d <<<"$KATABLK_QEMU_BIOS_DIRS"
    for p in "${d[@]}"; do bios+=(-L "$p"); done
    LD_LIBRARY_PATH=$KATABLK_QEMU_LD_LIBRARY_PATH QEMU_MODULE_DIR=$KATABLK_QEMU_MODULE_DIR \
        "$KATABLK_QEMU" "${bios[@]}" -M q35 -accel tcg -smp "$nq" -m 512 -nic none \
        -object "memory-backend-memfd,id=mem,size=512M,share=on${KATABLK_E2E_MEMFD_OPTS:-}" -numa node,memdev=mem \
        -chardev "socket,id=c0,path=$DISK_SOCK,reconnect=1" \
        -device "vhost-user-blk-pci,chardev=c0,num-queues=$nq" \
        -kernel "$KATABLK_KERNEL" -initrd "$KATABLK_INITRD" -append "$append" \
        -display none -monitor none -chardev stdio,id=ser0,signal=off -serial chardev:ser0 \
        -no-reboot <&8 >"$console" 2>"$qlog" &
    qemu_pid=$!
    local t0 restarted=0 grown=0 deadline=$((SECONDS + ${KATABLK_E2E_BOOT_TIMEOUT:-240}))
    t0=$SECONDS
    while kill -0 "$qemu_pid" 2>/dev/null; do
        if [ $restarted = 0 ] && grep -q '^@@KATABLK RECONNECT-READY' "$console"; then
            sleep 1 # let the loop get going so requests are in flight at the kill
            log "q$nq: kill -9 of the server while the guest writes and verifies"
            provider_restart
            echo restarted >&8
            restarted=1
        fi
        if [ $grown = 0 ] && grep -q '^@@KATABLK RESIZE-READY' "$console"; then
            log "q$nq: growing the disk to $((size_mib * 2)) MiB"
            provider_grow $((size_mib * 2)) || echo "@@KATABLK FAIL grow provider_grow failed" >>"$console"
            grown=1
        fi
        if [ $SECONDS -ge $deadline ]; then
            log "q$nq: guest still running after $((SECONDS - t0)) s: killing QEMU"
            kill -9 "$qemu_pid"
            echo "@@KATABLK FAIL timeout guest killed after $((SECONDS - t0)) s" >>"$console"
        fi
        sleep 0.2
    done
    wait "$qemu_pid" || echo "@@KATABLK FAIL qemu exit status $?" >>"$console"
    qemu_pid=
    exec 8>&-
    tr -d '\r' <"$console" >"$console.tmp" && mv "$console.tmp" "$console"
    boot_seconds=$((SECONDS - t0))
}

# Compares the guest's "SUM offset length sha256" lines with the backing file.
check_sums() {
    local console=$1 off len sum got n=0 bad=0
    [ -n "$DISK_BACKING" ] || { echo "@@KATABLK SKIP host-sums provider has no flat backing file"; return; }
    while read -r _ _ off len sum; do
        got=$(dd if="$DISK_BACKING" bs=1M skip=$((off >> 20)) count=$((len >> 20)) 2>/dev/null | sha256sum | cut -d' ' -f1)
        n=$((n + 1))
        [ "$got" = "$sum" ] || bad=$((bad + 1))
    done < <(grep '^@@KATABLK SUM ' "$console")
    if [ $n -gt 0 ] && [ $bad -eq 0 ]; then
        echo "@@KATABLK PASS host-sums $n ranges match the backing file after the guest exited"
    else
        echo "@@KATABLK FAIL host-sums $bad of $n ranges differ from the backing file"
    fi
}

results=()
for nq in $queues_list; do
    serial=katablk-e2e-q$nq
    unset DISK_SERIAL DISK_DISCARD
    if ! provider_start "disk-q$nq" "$size_mib" "$nq" "$serial"; then
        failures=$((failures + 1))
        log "q$nq: FAILED: the provider ($provider) could not create and export the disk"
        continue
    fi
    serial=${DISK_SERIAL-$serial} # a provider may say the serial ("": not checked)
    log "q$nq: booting the guest (TCG, $nq vCPU, num-queues=$nq) on $DISK_SOCK"
    boot_guest "$nq"
    console=$out/console-q$nq.log
    check_sums "$console" >>"$console"
    provider_stop >>"$console" # a provider may check its own teardown (@@KATABLK lines)
    # fio's JSON, one file per job.
    for job in ${fio_jobs//,/ }; do
        [ "$job" = none ] && continue
        sed -n "/^@@KATABLK-FIO-BEGIN $job\$/,/^@@KATABLK-FIO-END $job\$/p" "$console" | sed '1d;$d' \
            >"$out/fio-q$nq-$job.json"
    done
    if ! grep -q "^@@KATABLK-END main rc=0\$" "$console" || grep -q '^@@KATABLK FAIL' "$console"; then
        failures=$((failures + 1))
        log "q$nq: FAILED after $boot_seconds s; guest console: $console"
        grep '^@@KATABLK FAIL' "$console" >&2 || tail -n 30 "$console" >&2
    else
        log "q$nq: passed in $boot_seconds s"
    fi
    grep -E '^@@KATABLK (PASS|SKIP|FAIL)' "$console" | sed "s/^@@KATABLK /  q$nq /" >&2
    results+=("$nq:$boot_seconds:$console")
done

# --- summary ---------------------------------------------------------------------------------
python3 - "$out" "$fio_jobs" "$(($(date +%s) - t_start))" "${results[@]}" <<'EOF' || failures=$((failures + 1))
import json, os, re, sys

out, jobs, total = sys.argv[1], [j for j in sys.argv[2].split(",") if j != "none"], int(sys.argv[3])
runs = []
for spec in sys.argv[4:]:
    nq, secs, console = spec.split(":", 2)
    checks = []
    for line in open(console, errors="replace"):
        m = re.match(r"^@@KATABLK (PASS|FAIL|SKIP) (\S+) ?(.*)$", line.rstrip("\n"))
        if m:
            checks.append({"status": m[1], "check": m[2], "detail": m[3]})
    fio = {}
    for job in jobs:
        path = os.path.join(out, f"fio-q{nq}-{job}.json")
        try:
            j = json.load(open(path))["jobs"][0]
        except (OSError, ValueError, KeyError, IndexError):
            fio[job] = None
            continue
        d = j["read"] if j["read"]["io_bytes"] else j["write"]
        pct = d["clat_ns"].get("percentile", {})
        fio[job] = {"iops": round(d["iops"]), "bw_MiBps": round(d["bw_bytes"] / 2**20, 1),
                    "clat_p50_us": round(pct.get("50.000000", 0) / 1000, 1),
                    "clat_p99_us": round(pct.get("99.000000", 0) / 1000, 1)}
    runs.append({"num_queues": int(nq), "guest_seconds": int(secs), "checks": checks, "fio": fio})
json.dump({"total_seconds": total, "runs": runs}, open(os.path.join(out, "results.json"), "w"), indent=2)
print(f"{'queues':>6} {'job':<20} {'IOPS':>8} {'MiB/s':>8} {'p50 us':>8} {'p99 us':>8}", file=sys.stderr)
for r in runs:
    for job, f in r["fio"].items():
        if f:
            print(f"{r['num_queues']:>6} {job:<20} {f['iops']:>8} {f['bw_MiBps']:>8} "
                  f"{f['clat_p50_us']:>8} {f['clat_p99_us']:>8}", file=sys.stderr)
        else:
            print(f"{r['num_queues']:>6} {job:<20} no result", file=sys.stderr)
EOF
log "total $(($(date +%s) - t_start)) s; results in $out/results.json"
if [ $failures -gt 0 ]; then
    log "FAILED ($failures run(s)); guest consoles kept in $out"
    exit 1
fi
log "all passed"
