#!/usr/bin/env bash
# Installs everything katablk's build, tests and benchmarks need on Debian 12 (run as root).
# Idempotent: what is already there is kept. A new machine has 0 hugepages and package lists that
# may be older than the mirror; both are handled here (and the lists again by the guest test).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export DEBIAN_FRONTEND=noninteractive
need=()
for p in qemu-utils pkg-config fonts-dejavu-core util-linux e2fsprogs xfsprogs shellcheck; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# 2 MiB hugepages and hugetlbfs on /dev/hugepages: the 2 MiB-aligned client buffers of the tests
# and of the CSI formatter (bdev::shm), and SPDK's vhost when it is the target. Only ever raised.
"$here/setup-hugepages.sh" "${KATABLK_HUGEPAGES:-512}"

# Loop devices (the CSI node's tests, kubelet's block-volume lock): the control node, if the
# kernel has the driver but /dev lacks the node (minimal containers).
if [ ! -e /dev/loop-control ] && [ -e /sys/class/misc/loop-control/dev ]; then
    IFS=: read -r maj min </sys/class/misc/loop-control/dev
    mknod -m 0660 /dev/loop-control c "$maj" "$min"
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
