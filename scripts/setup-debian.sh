#!/usr/bin/env bash
# Installs everything katablk's build, tests and benchmarks need on Debian 12 (run as root).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
need=()
for p in qemu-utils pkg-config fonts-dejavu-core util-linux; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
if ! command -v cargo-nextest >/dev/null 2>&1; then
    cargo install --locked cargo-nextest
fi

# SPDK's own JSON-RPC client (PyPI `spdk`, the `spdk-rpc` command), used by the target's tests.
venv=${KATABLK_SPDK_VENV:-/opt/katablk/spdk-venv}
if [ ! -x "$venv/bin/spdk-rpc" ]; then
    need_venv=()
    python3 -c 'import venv, ensurepip' 2>/dev/null || need_venv=(python3-venv)
    if [ ${#need_venv[@]} -gt 0 ]; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${need_venv[@]}"
    fi
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check spdk==26.9
fi

# Offline Kubernetes schema validation of deploy/ (tests/manifests.rs).
python3 -c 'import kubernetes_validate' 2>/dev/null || pip install -q --disable-pip-version-check kubernetes-validate
