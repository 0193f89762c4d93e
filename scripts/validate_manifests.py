#!/usr/bin/env python3
"""Validates rendered Kubernetes manifests offline (called by validate-manifests.sh).

Arguments: NAME=FILE for each rendered kustomization. Every object is checked against the
Kubernetes JSON schemas of kubernetes-validate (strict) or, for CRD kinds, against
--schemas/<kind>-<group>-<version>.json; then cross-object consistency rules are applied.
"""
import argparse
import json
import os
import re
import sys

import jsonschema
import yaml
from kubernetes_validate import utils as kv

CLUSTER_SCOPED = {"Namespace", "CSIDriver", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "VolumeSnapshotClass", "PersistentVolume"}


def crd_schema(schemas, obj):
    group, _, version = obj["apiVersion"].rpartition("/")
    path = os.path.join(schemas, f"{obj['kind'].lower()}-{group.split('.')[0]}-{version}.json")
    return json.load(open(path)) if os.path.exists(path) else None


def schema_errors(obj, versions, schemas):
    """Schema problems of one object, as strings."""
    crd = crd_schema(schemas, obj)
    if crd is not None:
        v = jsonschema.Draft7Validator(crd)
        return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in v.iter_errors(obj)]
    errs = []
    for version in versions:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as e:
            errs.append(f"k8s {version}: {'.'.join(map(str, e.path)) or '(root)'}: {e.message}")
        except kv.SchemaNotFoundError:
            errs.append(f"k8s {version}: no schema for {obj['kind']} {obj['apiVersion']} "
                        f"(a CRD kind needs its schema in {schemas})")
    return errs


def pod_spec(obj):
    kind = obj["kind"]
    if kind == "Pod":
        return obj["spec"]
    if kind in ("DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job"):
        return obj["spec"]["template"]["spec"]
    if kind == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return None


def consistency_errors(objs):
    """What the schemas cannot see: references between objects and fields."""
    errs = []
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    drivers = {o["metadata"]["name"] for o in by_kind.get("CSIDriver", [])}
    accounts = {(o["metadata"].get("namespace"), o["metadata"]["name"]) for o in by_kind.get("ServiceAccount", [])}
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
             for o in by_kind.get("Role", []) + by_kind.get("ClusterRole", [])}
    classes = {o["metadata"]["name"] for o in by_kind.get("StorageClass", [])}
    claims = {(o["metadata"].get("namespace"), o["metadata"]["name"]) for o in by_kind.get("PersistentVolumeClaim", [])}

    for o in by_kind.get("StorageClass", []):
        if drivers and o["provisioner"] not in drivers:
            errs.append(f"StorageClass {o['metadata']['name']}: provisioner {o['provisioner']} is no CSIDriver here")
    for o in by_kind.get("VolumeSnapshotClass", []):
        if drivers and o["driver"] not in drivers:
            errs.append(f"VolumeSnapshotClass {o['metadata']['name']}: driver {o['driver']} is no CSIDriver here")
    for o in by_kind.get("RoleBinding", []) + by_kind.get("ClusterRoleBinding", []):
        name = f"{o['kind']} {o['metadata']['name']}"
        ref = o["roleRef"]
        ns = o["metadata"].get("namespace") if ref["kind"] == "Role" else None
        if (ref["kind"], ns, ref["name"]) not in roles:
            errs.append(f"{name}: roleRef {ref['kind']} {ref['name']} not defined")
        for s in o.get("subjects", []):
            if s["kind"] == "ServiceAccount" and (s.get("namespace"), s["name"]) not in accounts:
                errs.append(f"{name}: subject ServiceAccount {s.get('namespace')}/{s['name']} not defined")
    for o in by_kind.get("PersistentVolumeClaim", []):
        sc = o["spec"].get("storageClassName")
        if sc not in classes:
            errs.append(f"PVC {o['metadata']['name']}: storageClassName {sc} not defined")

    for o in objs:
        spec = pod_spec(o)
        if spec is None:
            continue
        name = f"{o['kind']} {o['metadata']['name']}"
        ns = o["metadata"].get("namespace")
        sa = spec.get("serviceAccountName")
        if sa and accounts and (ns, sa) not in accounts:
            errs.append(f"{name}: serviceAccountName {sa} not defined in {ns}")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        used = set()
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            cname = f"{name} container {c['name']}"
            privileged = c.get("securityContext", {}).get("privileged", False)
            for m in c.get("volumeMounts", []) + c.get("volumeDevices", []):
                used.add(m["name"])
                if m["name"] not in volumes:
                    errs.append(f"{cname}: mounts undeclared volume {m['name']}")
                if m.get("mountPropagation") == "Bidirectional" and not privileged:
                    errs.append(f"{cname}: Bidirectional propagation of {m['name']} needs privileged")
            for m in c.get("volumeDevices", []):
                if "persistentVolumeClaim" not in volumes.get(m["name"], {}):
                    errs.append(f"{cname}: volumeDevices {m['name']} is not a PVC volume")
            declared = {e["name"] for e in c.get("env", [])}
            for arg in c.get("args", []) + c.get("command", []):
                for var in re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", str(arg)):
                    if var not in declared:
                        errs.append(f"{cname}: argument uses $({var}) but no env {var}")
        for v in set(volumes) - used:
            errs.append(f"{name}: volume {v} is declared but mounted nowhere")
        for v in volumes.values():
            pvc = v.get("persistentVolumeClaim")
            if pvc and claims and (ns, pvc["claimName"]) not in claims:
                errs.append(f"{name}: claim {pvc['claimName']} not defined")
            if "hostPath" in v and not v["hostPath"]["path"].startswith("/"):
                errs.append(f"{name}: hostPath {v['hostPath']['path']} is not absolute")
    return errs


def render(kdir):
    """A kustomize build of what deploy/ uses: resources, namespace, images, labels."""
    k = yaml.safe_load(open(os.path.join(kdir, "kustomization.yaml")))
    known = {"apiVersion", "kind", "resources", "namespace", "images", "labels"}
    if set(k) - known:
        sys.exit(f"built-in renderer: {kdir} uses {sorted(set(k) - known)}; install kustomize")
    images = {i["name"]: i for i in k.get("images", [])}
    labels = {}
    for entry in k.get("labels", []):
        labels.update(entry.get("pairs", {}))
    docs = []
    for res in k.get("resources", []):
        for o in yaml.safe_load_all(open(os.path.join(kdir, res))):
            if not o:
                continue
            if "namespace" in k and o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
            o["metadata"].setdefault("labels", {}).update(labels)
            spec = pod_spec(o)
            for c in (spec or {}).get("initContainers", []) + (spec or {}).get("containers", []):
                name, _, tag = c["image"].partition(":")
                if name in images:
                    i = images[name]
                    c["image"] = f"{i.get('newName', name)}:{i.get('newTag', tag or 'latest')}"
            docs.append(o)
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--render":
        render(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", required=True)
    ap.add_argument("--versions", required=True)
    ap.add_argument("rendered", nargs="+", help="NAME=FILE")
    a = ap.parse_args()
    versions = a.versions.split()

    # A known-bad object must be rejected, or a pass would mean nothing.
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {"containers": [{"name": "a", "image": "b", "volumeMount": []}]}}
    bad_vsc = {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
               "metadata": {"name": "x"}, "driver": "d", "deletionPolicy": "Keep"}
    if not schema_errors(bad, versions, a.schemas) or not schema_errors(bad_vsc, versions, a.schemas):
        print("validate-manifests: the validator accepted a known-bad object", file=sys.stderr)
        return 1

    failed = 0
    total = 0
    everything = []
    for spec in a.rendered:
        name, _, path = spec.partition("=")
        objs = [o for o in yaml.safe_load_all(open(path)) if o]
        for o in objs:
            total += 1
            what = f"{name}: {o.get('kind')} {o.get('metadata', {}).get('name')}"
            if o.get("kind") not in CLUSTER_SCOPED and not o.get("metadata", {}).get("namespace"):
                print(f"FAIL {what}: namespaced object without a namespace")
                failed += 1
            errs = schema_errors(o, versions, a.schemas)
            for e in errs:
                print(f"FAIL {what}: {e}")
            failed += bool(errs)
            if not errs:
                print(f"ok   {what}")
        everything += objs
    # References may cross kustomizations (an example's claim names the base's StorageClass).
    for e in consistency_errors(everything):
        print(f"FAIL {e}")
        failed += 1
    print(f"validate-manifests: {total} objects, Kubernetes {', '.join(versions)}: "
          f"{'all valid' if not failed else f'{failed} problem(s)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
