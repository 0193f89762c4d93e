#!/usr/bin/env bash
# Guest fio numbers, katablk against qemu-storage-daemon in one run: boots the e2e guest
# (scripts/e2e/guest-e2e.sh, QEMU under TCG) on the node stack (provider csi: a thick lvol of
# katablk-target, published through katablk-csi) and then on qemu-storage-daemon serving a file
# (provider qsd), with the same fio jobs, queue counts and guest, and writes a table with the
# ratios: DIR/guest-fio.md and DIR/guest-fio.json (plus each run's results under DIR/<provider>/).
#
# Usage: scripts/e2e/guest-fio-compare.sh [--out DIR] [--queues "1 2"] [--fio-runtime S]
# Under TCG the guest's CPU, not the server, bounds most of these numbers: read the ratios as
# "what a slow guest sees", and the host-side benchmarks (scripts/bench-target.sh) for servers.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=$repo/target/e2e/compare
queues="1 2"
runtime=5
jobs=randread-4k-qd1,randread-4k-qd32,randwrite-4k-qd1,randwrite-4k-qd32,seqread-128k-qd8
while [ $# -gt 0 ]; do
    case "$1" in
    --out) out=$2; shift 2 ;;
    --queues) queues=$2; shift 2 ;;
    --fio-runtime) runtime=$2; shift 2 ;;
    --fio) jobs=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
status=0
for p in csi qsd; do
    # The qsd run's reconnect/resize checks are not the point; its fio numbers are.
    rc=0
    KATABLK_E2E_PROVIDER=$p "$here/guest-e2e.sh" --out "$out/$p" --queues "$queues" \
        --fio "$jobs" --fio-runtime "$runtime" || rc=$?
    if [ $rc = 77 ]; then exit 77; fi
    if [ $p = csi ] && [ $rc != 0 ]; then status=$rc; fi
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
res = {p: json.load(open(os.path.join(out, p, "results.json"))) for p in ("csi", "qsd")}
def fio(p):
    return {(r["num_queues"], j): f for r in res[p]["runs"] for j, f in r["fio"].items() if f}
k, q = fio("csi"), fio("qsd")
rows = []
for key in sorted(k):
    a, b = k[key], q.get(key)
    row = {"num_queues": key[0], "job": key[1], "katablk": a, "qsd": b}
    if b:
        row["iops_ratio"] = round(a["iops"] / b["iops"], 2) if b["iops"] else None
        row["p50_ratio"] = round(a["clat_p50_us"] / b["clat_p50_us"], 2) if b["clat_p50_us"] else None
    rows.append(row)
json.dump(rows, open(os.path.join(out, "guest-fio.json"), "w"), indent=2)
with open(os.path.join(out, "guest-fio.md"), "w") as f:
    f.write("| queues | fio job | katablk IOPS | qsd IOPS | ratio | katablk MiB/s | qsd MiB/s | "
            "katablk p50/p99 µs | qsd p50/p99 µs |\n|---:|---|---:|---:|---:|---:|---:|---|---|\n")
    for r in rows:
        a, b = r["katablk"], r["qsd"] or {}
        f.write(f"| {r['num_queues']} | {r['job']} | {a['iops']} | {b.get('iops', '–')} | "
                f"{r.get('iops_ratio', '–')}× | {a['bw_MiBps']} | {b.get('bw_MiBps', '–')} | "
                f"{a['clat_p50_us']} / {a['clat_p99_us']} | {b.get('clat_p50_us', '–')} / {b.get('clat_p99_us', '–')} |\n")
print(open(os.path.join(out, "guest-fio.md")).read())
PY
exit $status
