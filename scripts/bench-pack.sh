#!/usr/bin/env bash
# Packs a benchmark run's raw data for committing: DIR/raw/, DIR/logs/ and DIR/guest/ go into one
# reproducible archive DIR/raw.tar.gz (sorted, no owners or times) and are removed; the summary,
# plots, env.txt and notes stay as files. katablk-bench-summary reads the archive when raw/ is
# gone. Usage: scripts/bench-pack.sh DIR
set -euo pipefail
dir=${1:?usage: $0 DIR}
parts=()
for p in raw logs guest; do [ -d "$dir/$p" ] && parts+=("$p"); done
if [ ${#parts[@]} -eq 0 ]; then
    echo "bench-pack: nothing to pack in $dir" >&2
    exit 0
fi
# Data packed earlier is kept: unpack it first, so one archive holds the whole run.
if [ -f "$dir/raw.tar.gz" ]; then
    tar -xzf "$dir/raw.tar.gz" -C "$dir"
    parts=()
    for p in raw logs guest; do [ -d "$dir/$p" ] && parts+=("$p"); done
fi
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$dir" -cf - "${parts[@]}" |
    gzip -9 -n >"$dir/raw.tar.gz.tmp"
mv "$dir/raw.tar.gz.tmp" "$dir/raw.tar.gz"
for p in "${parts[@]}"; do rm -rf "${dir:?}/$p"; done
echo "bench-pack: ${parts[*]} -> $dir/raw.tar.gz ($(du -h "$dir/raw.tar.gz" | cut -f1))" >&2
