#!/bin/sh
# The e2e checks run inside the guest against /dev/vda (the vhost-user-blk disk). Parameters come
# from the kernel command line through /init (katablk.NAME=V -> KB_NAME):
#   KB_SECTORS    expected size in 512-byte sectors        KB_SERIAL   expected serial
#   KB_QUEUES     expected number of blk-mq hardware queues
#   KB_FIO        comma-separated fio job names of /fio/ (none to skip)   KB_FIO_RUNTIME seconds
#   KB_RECONNECT  1: verify loop across a backend restart (the host writes "restarted" on the
#                 console input when the new backend is up)
#   KB_RESIZE     new size in sectors to wait for after the host grew the disk, or "skip"
#   KB_DISCARD    0: the device is not expected to offer discard (skip those checks)
# Output: "@@KATABLK PASS|FAIL|SKIP <check> <detail>" lines, fio JSON between
# "@@KATABLK-FIO-BEGIN <job>" and "@@KATABLK-FIO-END <job>", data checksums as
# "@@KATABLK SUM <offset-bytes> <length> <sha256>" for the host to compare with the backing store.
# Layout of the disk: 0-64 MiB data checks, 64-128 MiB reconnect loop, 128 MiB on: fio.
dev=/dev/vda
blk=/sys/block/vda
failed=0

pass() { echo "@@KATABLK PASS $*"; }
fail() { echo "@@KATABLK FAIL $*"; failed=1; }
skip() { echo "@@KATABLK SKIP $*"; }
now() { cut -d' ' -f1 /proc/uptime; }  # seconds since boot, 1/100 s resolution

# Host input arrives on the console; each line received becomes a flag file /tmp/host.<line>.
(while read -r line; do : >"/tmp/host.$line"; done) </dev/console &

i=0
while [ ! -b $dev ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i + 1)); done
[ -b $dev ] || { fail device "no $dev after 20 s"; ls /sys/block; exit 1; }
pass device "$dev present"

# --- identity: size, serial, queues, advertised features -------------------------------------
size=$(cat $blk/size)
[ "$size" = "${KB_SECTORS:-$size}" ] && pass size "$size sectors" || fail size "$size sectors, want $KB_SECTORS"
serial=$(cat $blk/serial 2>/dev/null)
[ "$serial" = "${KB_SERIAL:-$serial}" ] && pass serial "'$serial'" || fail serial "'$serial', want '$KB_SERIAL'"
queues=$(ls $blk/mq | wc -l)
[ "$queues" = "${KB_QUEUES:-$queues}" ] && pass queues "$queues" || fail queues "$queues, want $KB_QUEUES"
for f in discard_max_bytes write_zeroes_max_bytes; do
    v=$(cat $blk/queue/$f)
    if [ "$f" = discard_max_bytes ] && [ "${KB_DISCARD:-1}" = 0 ]; then
        skip "$f" "$v (discard not expected from this server)"
        continue
    fi
    [ "$v" -gt 0 ] && pass "$f" "$v" || fail "$f" "0 (feature not offered)"
done
echo "@@KATABLK INFO cpus=$(grep -c ^processor /proc/cpuinfo) kernel=$(uname -r)" \
    "logical_block=$(cat $blk/queue/logical_block_size) wc=$(cat $blk/queue/write_cache)"

# --- data: write 8 MiB at 16 MiB with O_DIRECT, flush, read back, compare ---------------------
dd if=/dev/urandom of=/tmp/pat bs=1M count=8 2>/dev/null
if dd if=/tmp/pat of=$dev bs=1M seek=16 oflag=direct conv=fsync 2>/tmp/err &&
    dd if=$dev of=/tmp/back bs=1M skip=16 count=8 iflag=direct 2>>/tmp/err &&
    cmp /tmp/pat /tmp/back; then
    pass data "8 MiB at 16 MiB written, flushed, read back identical"
    echo "@@KATABLK SUM $((16 << 20)) $((8 << 20)) $(sha256sum </tmp/pat | cut -d' ' -f1)"
else
    fail data "$(cat /tmp/err)"
fi
# Through the page cache too (buffered write, fsync, drop caches, read back).
dd if=/tmp/pat of=$dev bs=64k seek=512 conv=fsync 2>/dev/null
echo 3 >/proc/sys/vm/drop_caches
dd if=$dev of=/tmp/back bs=64k skip=512 count=128 2>/dev/null
cmp /tmp/pat /tmp/back && pass data-buffered "8 MiB at 32 MiB" || fail data-buffered "mismatch"
echo "@@KATABLK SUM $((32 << 20)) $((8 << 20)) $(sha256sum </tmp/pat | cut -d' ' -f1)"
# Discard then write zeroes over 1 MiB at 48 MiB (the zeroed range must read back as zeroes).
dd if=/tmp/pat of=$dev bs=1M seek=48 count=1 oflag=direct 2>/dev/null
if [ "${KB_DISCARD:-1}" = 0 ]; then skip discard "not expected from this server"
elif blkdiscard -o $((48 << 20)) -l $((1 << 20)) $dev 2>/tmp/err; then pass discard "1 MiB at 48 MiB"
else fail discard "$(cat /tmp/err)"; fi
rm -f /tmp/pat /tmp/back

# --- fio ---------------------------------------------------------------------------------------
if [ "${KB_FIO:-none}" != none ]; then
    export FIO_DEV=$dev FIO_RUNTIME=${KB_FIO_RUNTIME:-5} FIO_NUMJOBS=${KB_QUEUES:-1}
    for job in $(echo "$KB_FIO" | tr , ' '); do
        if fio --output-format=json --output=/tmp/fio.json "/fio/$job.fio" >/tmp/err 2>&1; then
            echo "@@KATABLK-FIO-BEGIN $job"
            cat /tmp/fio.json
            echo "@@KATABLK-FIO-END $job"
            pass "fio-$job" ok
        else
            fail "fio-$job" "$(tail -n 5 /tmp/err)"
        fi
    done
fi

# --- reconnect: verify loop across a backend kill -9 + restart ---------------------------------
if [ "${KB_RECONNECT:-0}" = 1 ]; then
    mkdir -p /tmp/sums
    n=0 after=0 worst=0 bad=0
    echo "@@KATABLK RECONNECT-READY"
    t_start=$(now | cut -d. -f1)
    while :; do
        slot=$((n % 64))
        t0=$(now)
        dd if=/dev/urandom of=/tmp/r bs=64k count=16 2>/dev/null
        dd if=/tmp/r of=$dev bs=1M seek=$((64 + slot)) oflag=direct conv=fsync 2>/dev/null &&
            dd if=$dev of=/tmp/rb bs=1M skip=$((64 + slot)) count=1 iflag=direct 2>/dev/null &&
            cmp -s /tmp/r /tmp/rb || { bad=$((bad + 1)); echo "@@KATABLK INFO reconnect mismatch at iteration $n"; }
        sha256sum </tmp/r | cut -d' ' -f1 >/tmp/sums/$slot
        t1=$(now)
        ms=$(echo "$t0 $t1" | awk '{ printf "%d", ($2 - $1) * 1000 }')
        [ "$ms" -gt "$worst" ] && worst=$ms
        n=$((n + 1))
        if [ -e /tmp/host.restarted ]; then after=$((after + 1)); fi
        [ $after -ge 20 ] && break
        # Give up if the host never says it restarted the backend (2 min guest time).
        [ "${t1%.*}" -gt $((t_start + 120)) ] && break
    done
    # Every slot written during the loop must read back with the checksum recorded for it.
    for f in /tmp/sums/*; do
        slot=${f##*/}
        got=$(dd if=$dev bs=1M skip=$((64 + slot)) count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
        [ "$got" = "$(cat $f)" ] || { bad=$((bad + 1)); echo "@@KATABLK INFO reconnect slot $slot lost"; }
        echo "@@KATABLK SUM $(((64 + slot) << 20)) $((1 << 20)) $(cat $f)"
    done
    detail="$n iterations ($after after the restart), longest $worst ms, $bad bad"
    if [ $after -lt 20 ]; then fail reconnect "host never signalled the restart: $detail"
    elif [ $bad -gt 0 ]; then fail reconnect "$detail"
    else pass reconnect "$detail"; fi
fi

# --- resize: the host grew the device; the guest must see the new capacity ---------------------
case "${KB_RESIZE:-skip}" in
skip) skip resize "needs katablk-target (bdev_lvol_resize); katablk-vhost has no resize trigger" ;;
*)
    echo "@@KATABLK RESIZE-READY"
    i=0
    while [ "$(cat $blk/size)" != "$KB_RESIZE" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
    got=$(cat $blk/size)
    [ "$got" = "$KB_RESIZE" ] && pass resize "$got sectors" || fail resize "$got sectors, want $KB_RESIZE"
    ;;
esac

exit $failed
