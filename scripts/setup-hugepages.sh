#!/usr/bin/env bash
# Reserves 2 MiB hugepages and mounts hugetlbfs at /dev/hugepages, as Kata's vhost-user needs
# (guest memory is a shared memory-backend-file on hugepages). Idempotent: pages are only ever
# raised to the asked count, and an existing hugetlbfs mount is kept.
# Usage: scripts/setup-hugepages.sh [PAGES] [--persist]   (default 1024 pages = 2 GiB)
#   --persist also writes /etc/sysctl.d/80-katablk-hugepages.conf and an /etc/fstab line.
set -euo pipefail
pages=1024 persist=0
for a in "$@"; do
    case "$a" in
    --persist) persist=1 ;;
    [0-9]*) pages=$a ;;
    *) echo "usage: $0 [PAGES] [--persist]" >&2; exit 2 ;;
    esac
done
sysfs=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
[ -w "$sysfs" ] || { echo "setup-hugepages: $sysfs not writable (root? 2 MiB pages supported?)" >&2; exit 1; }
cur=$(cat "$sysfs")
if [ "$cur" -lt "$pages" ]; then
    echo "$pages" >"$sysfs"
    got=$(cat "$sysfs")
    echo "setup-hugepages: nr_hugepages $cur -> $got"
    [ "$got" -ge "$pages" ] || echo "setup-hugepages: warning: only $got of $pages pages (memory fragmented?)" >&2
else
    echo "setup-hugepages: nr_hugepages already $cur (>= $pages)"
fi
mkdir -p /dev/hugepages
if awk '$2 == "/dev/hugepages" && $3 == "hugetlbfs" { found = 1 } END { exit !found }' /proc/mounts; then
    echo "setup-hugepages: hugetlbfs already mounted at /dev/hugepages"
else
    mount -t hugetlbfs -o pagesize=2M nodev /dev/hugepages
    echo "setup-hugepages: mounted hugetlbfs at /dev/hugepages"
fi
if [ $persist = 1 ]; then
    echo "vm.nr_hugepages = $pages" >/etc/sysctl.d/80-katablk-hugepages.conf
    grep -qs '[[:space:]]/dev/hugepages[[:space:]]' /etc/fstab ||
        echo "nodev /dev/hugepages hugetlbfs pagesize=2M 0 0" >>/etc/fstab
    echo "setup-hugepages: persisted in /etc/sysctl.d/80-katablk-hugepages.conf and /etc/fstab"
fi
