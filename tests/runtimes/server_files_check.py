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
import kserve.models as ks
import kubernetes.client as k8s_client
import kubernetes.client.models as k8s
import yaml

PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
KINDS = {
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "Service"): "V1Service",
}


def build(data, kind: str, path: str):
    # kserve's generated classes write list[X] and dict(str, X), kubernetes' newer ones List[X] and Dict[str, X]
    if kind.startswith("List["):
        kind = f"list[{kind[5:-1]}]"
    if kind.startswith("Dict["):
        kind = f"dict({kind[5:-1]})"
    if kind.startswith("list["):
        if not isinstance(data, list):
            sys.exit(f"{path}: a list is expected, got {type(data).__name__}")
        return [build(item, kind[5:-1], f"{path}[{i}]") for i, item in enumerate(data)]
    if kind.startswith("dict("):
        if not isinstance(data, dict):
            sys.exit(f"{path}: an object is expected, got {type(data).__name__}")
        inner = kind[5:-1].split(", ", 1)[1]
        return {key: build(value, inner, f"{path}.{key}") for key, value in data.items()}
    if kind in PRIMITIVES:
        if kind != "object" and (not isinstance(data, PRIMITIVES[kind]) or (kind == "int" and isinstance(data, bool))):
            sys.exit(f"{path}: {kind} expected, got {data!r}")
        return data
    cls = getattr(ks, kind, None) or getattr(k8s, kind, None)
    if cls is None:
        sys.exit(f"{path}: no class {kind} in kserve or kubernetes")
    if not isinstance(data, dict):
        sys.exit(f"{path}: an object ({kind}) is expected, got {type(data).__name__}")
    fields = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        sys.exit(f"{path}: {', '.join(unknown)} is not a field of {kind}")
    kwargs = {fields[key]: build(value, cls.openapi_types[fields[key]], f"{path}.{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as err:
        sys.exit(f"{path}: {kind} refuses it: {err}")


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
