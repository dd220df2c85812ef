"""Regenerate the trimmed CRD schemas in this folder from upstream CRD manifests (a one-off; the
output is committed, so the tests need no network and no cluster).

    python tests/deploy/schemas/vendor_crds.py \
        KUBERAY/ray-operator/config/crd/bases/ray.io_rayclusters.yaml \
        PROMOP/example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml \
        PROMOP/example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml

For each CRD: the openAPIV3Schema of its storage version, without `status` and descriptions.
Embedded core types are cut to `{"type": "object"}` where tests/deploy/test_helm.py validates
them against the Kubernetes schemas instead (a RayCluster group's pod `template` becomes a
PodTemplate, its `headService` a Service). test_helm.py then closes every object that lists
properties (additionalProperties: false, as `kubernetes-validate --strict` does), so a misspelt
key fails the way the API server would drop it silently.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CUT = {"template", "headService"}  # validated as core types by test_helm.py


def trim(node, key: str | None = None):
    if isinstance(node, dict):
        if key in CUT and node.get("type") == "object":
            return {"type": "object"}
        return {k: trim(v, k) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [trim(v) for v in node]
    return node


def main(paths: list[str]) -> int:
    for path in paths:
        crd = yaml.safe_load(Path(path).read_text())
        kind = crd["spec"]["names"]["kind"]
        group = crd["spec"]["group"]
        version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
        schema = version["schema"]["openAPIV3Schema"]
        schema.get("properties", {}).pop("status", None)
        out = {
            "$comment": f"{kind} {group}/{version['name']}, trimmed from {Path(path).name} by vendor_crds.py",
            "apiVersion": f"{group}/{version['name']}",
            "kind": kind,
            "schema": trim(schema),
        }
        target = HERE / f"{kind.lower()}.json"
        target.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        print(f"wrote {target} ({target.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
