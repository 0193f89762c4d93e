#!/usr/bin/env bash
# Runs every test of the workspace (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KATABLK_SPDK_VENV:-/opt/katablk/spdk-venv}
if [ -z "${SPDK_RPC:-}" ] && [ -x "$venv/bin/spdk-rpc" ]; then
    export SPDK_RPC="$venv/bin/spdk-rpc"
fi
if [ -z "${SPDK_RPC:-}" ] && ! command -v spdk-rpc >/dev/null 2>&1; then
    echo "spdk-rpc (PyPI spdk) is missing: run scripts/setup-debian.sh first" >&2
    exit 1
fi
cargo build --workspace --all-targets
cargo nextest run --workspace --no-fail-fast "$@"
