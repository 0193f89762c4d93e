#!/usr/bin/env bash
# Turns on what katablk needs in a Kata Containers configuration.toml, in every [hypervisor.*]
# section. An existing line for a key (commented out or not) is replaced in place; a missing key
# is added under the section header. Comments and everything else are kept. Idempotent.
#
# --runtime go (default): Kata's Go runtime (kata-qemu). Block PVs (241 device nodes) and the
#   Filesystem PVs' mountInfo.json go through its vhost-user store: enable_vhost_user_store =
#   true, vhost_user_store_path = STORE, disable_block_device_use = false, enable_hugepages = true
#   (qemu.go refuses the store without hugepages: the VMM's RAM must be shared), and
#   vhost_user_reconnect_timeout_sec (QEMU reconnects to a restarted target). Only QEMU
#   hot-plugs vhost-user-blk in the Go runtime (clh.go has no vhost-user device): a config
#   without a [hypervisor.qemu] section is reported.
# --runtime rs: runtime-rs (kata-dragonball). spdkvol direct volumes need no store; Dragonball's
#   default RAM (shmem) is shared already, so katablk-target needs no change; with --hugepages
#   (SPDK's vhost as the target: its vhost-user needs hugepage-backed guest RAM) enable_hugepages
#   = true. Only Dragonball attaches spdkvol (runtime-rs' QEMU and Cloud Hypervisor hot-plug no
#   vhost-user-blk): a config without [hypervisor.dragonball] is reported.
#
# Usage: scripts/setup-kata.sh [--dry-run] [--runtime go|rs] [--config FILE] [--store DIR]
#                              [--reconnect-timeout S] [--hugepages]
#   --config   default /etc/kata-containers/configuration.toml (rs:
#              /etc/kata-containers/runtime-rs/configuration.toml); when it does not exist it is
#              created from the packaged defaults (/opt/kata/share/defaults/kata-containers/ or
#              /usr/share/defaults/kata-containers/, + runtime-rs/ for rs), the override location
#              Kata documents.
#   --dry-run  print the diff, change nothing (exit 0 either way).
set -euo pipefail
runtime=go
config=
store=/var/run/kata-containers/vhost-user
reconnect=5
hugepages=0
dry=0
usage="usage: $0 [--dry-run] [--runtime go|rs] [--config FILE] [--store DIR] [--reconnect-timeout S] [--hugepages]"
while [ $# -gt 0 ]; do
    case "$1" in
    --dry-run) dry=1; shift ;;
    --runtime) runtime=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --store) store=$2; shift 2 ;;
    --reconnect-timeout) reconnect=$2; shift 2 ;;
    --hugepages) hugepages=1; shift ;;
    *) echo "$usage" >&2; exit 2 ;;
    esac
done
case "$runtime" in
go) sub= ;;
rs) sub="runtime-rs/" ;;
*) echo "setup-kata: --runtime go or rs, not $runtime" >&2; exit 2 ;;
esac
config=${config:-/etc/kata-containers/${sub}configuration.toml}

src=$config
if [ ! -f "$config" ]; then
    for d in /opt/kata/share/defaults/kata-containers /usr/share/defaults/kata-containers; do
        [ -f "$d/${sub}configuration.toml" ] && { src=$d/${sub}configuration.toml; break; }
    done
    [ -f "$src" ] || { echo "setup-kata: no $config and no packaged configuration.toml" >&2; exit 1; }
    echo "setup-kata: $config does not exist: starting from $src"
fi

new=$(mktemp)
trap 'rm -f "$new"' EXIT
python3 - "$src" "$new" "$store" "$reconnect" "$runtime" "$hugepages" <<'PY'
import re, sys
src, dst, store, reconnect, runtime, hugepages = sys.argv[1:]
if runtime == "go":
    want = {
        "enable_vhost_user_store": "true",
        "vhost_user_store_path": f'"{store}"',
        "disable_block_device_use": "false",
        "enable_hugepages": "true",
        "vhost_user_reconnect_timeout_sec": reconnect,
    }
    vmm = "qemu"
else:
    want = {"enable_hugepages": "true"} if hugepages == "1" else {}
    vmm = "dragonball"
lines = open(src).read().splitlines()
out, section, seen, found_hv = [], None, set(), False

def flush():
    # Keys this hypervisor section lacked go right under its header.
    if section is not None and section.startswith("hypervisor."):
        at = header_at + 1
        for k, v in want.items():
            if k not in seen:
                out.insert(at, f"{k} = {v}")
                at += 1

for line in lines:
    m = re.match(r"^\s*\[([^\]]+)\]\s*(#.*)?$", line)
    if m:
        flush()
        section, seen = m[1].strip(), set()
        found_hv |= section.startswith("hypervisor.")
        out.append(line)
        header_at = len(out) - 1
        continue
    if section is not None and section.startswith("hypervisor."):
        k = re.match(r"^\s*#?\s*([a-z_]+)\s*=", line)
        if k and k[1] in want:
            if k[1] not in seen:
                out.append(f"{k[1]} = {want[k[1]]}")
                seen.add(k[1])
            elif not line.lstrip().startswith("#"):
                out.append(f"# {line.strip()}  # superseded by katablk above")  # no duplicate key
            else:
                out.append(line)
            continue
    out.append(line)
flush()
if not found_hv:
    sys.exit(f"setup-kata: {src} has no [hypervisor.*] section")
if not any(re.match(rf"^\s*\[hypervisor\.{vmm}\]", l) for l in lines):
    print(f"setup-kata: warning: {src} has no [hypervisor.{vmm}] section: katablk volumes reach "
          f"Kata's {'Go runtime' if runtime == 'go' else 'runtime-rs'} through {vmm} only",
          file=sys.stderr)
open(dst, "w").write("\n".join(out) + "\n")
PY

if cmp -s "$config" "$new" 2>/dev/null; then
    echo "setup-kata: $config already configured"
    exit 0
fi
if [ $dry = 1 ]; then
    diff -u --label "$config" --label "$config (katablk)" "$src" "$new" || true
    exit 0
fi
mkdir -p "$(dirname "$config")"
backup=
if [ -f "$config" ]; then cp -p "$config" "$config.katablk.bak"; backup=" (backup: $config.katablk.bak)"; fi
install -m 0644 "$new" "$config"
echo "setup-kata: updated $config$backup"
