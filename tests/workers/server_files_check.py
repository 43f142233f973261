"""Check what deploy --target server wrote, with the tools of .venv-triton (no engine, no cluster):

- the Dockerfile parsed by BuildKit's own parser (the ``dockerfile`` package wraps moby/buildkit's Go parser);
- each manifest document built strictly with the model class its apiVersion and kind name (kserve's for the
  InferenceService, the kubernetes client's, its OpenAPI types, for the Deployment and Service): every key a field
  of the class at that place, every value of the field's type, each object built by its class (whose setters refuse
  a missing required field); and deserialized again by the kubernetes client's ApiClient, as kubectl's client would.

Usage: server_files_check.py FOLDER. Prints JSON (the Dockerfile's instructions, each document's fields that the
tests read); a failure exits non-zero with the path of the field at fault."""

import json
import sys
from pathlib import Path

import dockerfile
import kubernetes.client as k8s_client
import yaml
from kserve_check import build  # one strict builder (this folder is on sys.path: run as a script)

KINDS = {
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "Service"): "V1Service",
}


def container(c) -> dict:
    return {
        "name": c.name,
        "image": c.image,
        "ports": [p.container_port for p in c.ports],
        "readiness": [c.readiness_probe.http_get.path, c.readiness_probe.http_get.port],
        "liveness": [c.liveness_probe.http_get.path, c.liveness_probe.http_get.port],
        "resources": c.resources.to_dict(),
        "env": [e.name for e in c.env or []],
        "run_as_non_root": c.security_context.run_as_non_root,
    }


def document(data: dict, where: str) -> dict:
    key = (data.get("apiVersion"), data.get("kind"))
    if key not in KINDS:
        sys.exit(f"{where}: {key} is not an InferenceService, a Deployment or a Service")
    built = build(data, KINDS[key], f"{where}$")
    # the kubernetes client's own reading (ApiClient.deserialize's path): the same object back
    if key[0] != "serving.kserve.io/v1beta1":
        again = k8s_client.ApiClient()._ApiClient__deserialize(data, KINDS[key])
        if again.to_dict() != built.to_dict():
            sys.exit(f"{where}: the ApiClient reads it otherwise than the classes build it")
    out = {"kind": key[1], "name": built.metadata.name}
    if key[1] == "InferenceService":
        p = built.spec.predictor
        out |= {
            "scale_metric": p.scale_metric,
            "scale_target": p.scale_target,
            "replicas": [p.min_replicas, p.max_replicas],
            "containers": [container(c) for c in p.containers],
        }
    elif key[1] == "Deployment":
        spec = built.spec
        out |= {
            "selector": spec.selector.match_labels,
            "pod_labels": spec.template.metadata.labels,
            "containers": [container(c) for c in spec.template.spec.containers],
        }
    else:
        out |= {"selector": built.spec.selector, "ports": [[p.port, p.target_port] for p in built.spec.ports]}
    return out


folder = Path(sys.argv[1])
commands = dockerfile.parse_file(str(folder / "Dockerfile"))
report = {
    "dockerfile": [{"cmd": c.cmd, "json": c.json, "flags": list(c.flags), "value": list(c.value)} for c in commands],
    "documents": [],
}
for name in ("inferenceservice.yaml", "deployment.yaml"):
    for i, data in enumerate(yaml.safe_load_all((folder / "kubernetes" / name).read_text())):
        report["documents"].append(document(data, f"{name}[{i}]"))
print(json.dumps(report))
