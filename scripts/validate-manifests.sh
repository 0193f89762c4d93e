#!/usr/bin/env bash
# Validates the Kubernetes manifests under deploy/ offline:
#   1. renders each kustomization (deploy/, deploy/examples/) with `kustomize build`, else
#      `kubectl kustomize`, else a built-in renderer of the features deploy/ uses;
#   2. checks every rendered object against the Kubernetes JSON schemas bundled with the PyPI
#      package kubernetes-validate (strict: unknown fields are errors), for each version in
#      $KATABLK_K8S_VERSIONS (default "1.30 1.37"); CRD objects (VolumeSnapshotClass) against
#      the schemas in scripts/schemas/;
#   3. checks what schemas cannot: names that must agree across objects (driver name, service
#      account, volumes of each mount, RBAC subjects), and Bidirectional propagation only in
#      privileged containers (the API server rejects it otherwise);
#   4. makes sure the validator rejects a known-bad object (so a pass means something).
# Exit status: 0 valid; 77 kubernetes-validate is missing; 1 invalid.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)

skip() { echo "validate-manifests: skip: $*" >&2; exit 77; }
python3 -c 'import kubernetes_validate, jsonschema, yaml' 2>/dev/null ||
    skip "the Python package kubernetes-validate is not installed (pip install kubernetes-validate)"
if command -v kustomize >/dev/null 2>&1; then
    render() { kustomize build "$1"; }
elif command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
    render() { kubectl kustomize "$1"; }
else
    # No kustomize here: render the subset deploy/ uses (resources, namespace, images).
    echo "validate-manifests: no kustomize or kubectl: using the built-in renderer" >&2
    render() { python3 "$here/validate_manifests.py" --render "$1"; }
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
args=()
for k in "$repo"/deploy "$repo"/deploy/examples; do
    name=${k#"$repo"/}
    render "$k" >"$out/${name//\//_}.yaml" || { echo "validate-manifests: kustomize build $name failed" >&2; exit 1; }
    args+=("$name=$out/${name//\//_}.yaml")
done
exec python3 "$here/validate_manifests.py" --schemas "$here/schemas" \
    --versions "${KATABLK_K8S_VERSIONS:-1.30 1.37}" "${args[@]}"
