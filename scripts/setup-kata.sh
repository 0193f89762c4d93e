#!/usr/bin/env bash
# Turns on what katablk needs in Kata Containers' (Go runtime) configuration.toml, in every
# [hypervisor.*] section: enable_vhost_user_store = true, vhost_user_store_path = STORE,
# enable_hugepages = true, and vhost_user_reconnect_timeout_sec (QEMU reconnects to a restarted
# target). An existing line for a key (commented out or not) is replaced in place; a missing key
# is added under the section header. Comments and everything else are kept. Idempotent.
#
# Usage: scripts/setup-kata.sh [--dry-run] [--config FILE] [--store DIR] [--reconnect-timeout S]
#   --config   default /etc/kata-containers/configuration.toml; when it does not exist it is
#              created from the packaged defaults (/opt/kata/share/defaults/kata-containers/ or
#              /usr/share/defaults/kata-containers/), the override location Kata documents.
#   --dry-run  print the diff, change nothing (exit 0 either way).
set -euo pipefail
config=/etc/kata-containers/configuration.toml
store=/var/run/kata-containers/vhost-user
reconnect=5
dry=0
while [ $# -gt 0 ]; do
    case "$1" in
    --dry-run) dry=1; shift ;;
    --config) config=$2; shift 2 ;;
    --store) store=$2; shift 2 ;;
    --reconnect-timeout) reconnect=$2; shift 2 ;;
    *) echo "usage: $0 [--dry-run] [--config FILE] [--store DIR] [--reconnect-timeout S]" >&2; exit 2 ;;
    esac
done

src=$config
if [ ! -f "$config" ]; then
    for d in /opt/kata/share/defaults/kata-containers /usr/share/defaults/kata-containers; do
        [ -f "$d/configuration.toml" ] && { src=$d/configuration.toml; break; }
    done
    [ -f "$src" ] || { echo "setup-kata: no $config and no packaged configuration.toml" >&2; exit 1; }
    echo "setup-kata: $config does not exist: starting from $src"
fi

new=$(mktemp)
trap 'rm -f "$new"' EXIT
python3 - "$src" "$new" "$store" "$reconnect" <<'PY'
import re, sys
src, dst, store, reconnect = sys.argv[1:]
want = {
    "enable_vhost_user_store": "true",
    "vhost_user_store_path": f'"{store}"',
    "enable_hugepages": "true",
    "vhost_user_reconnect_timeout_sec": reconnect,
}
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
