"""Check an InferenceService manifest against KServe's own model classes (the kserve package, in .venv-triton):
every key must be a field of the class the schema names at that place (kubernetes' classes for pod fields),
every value of the field's type, and each object is built with its class (whose setters refuse missing required
fields). Prints what was built as JSON; a failure exits non-zero with the path of the field at fault."""

import json
import sys

import kserve.models as ks
import kubernetes.client.models as k8s
import yaml

PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


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


def main() -> None:
    manifest = yaml.safe_load(open(sys.argv[1]))
    if manifest.get("apiVersion") != "serving.kserve.io/v1beta1" or manifest.get("kind") != "InferenceService":
        sys.exit("not a serving.kserve.io/v1beta1 InferenceService")
    service = build(manifest, "V1beta1InferenceService", "$")
    predictor = service.spec.predictor
    print(
        json.dumps(
            {
                "name": service.metadata.name,
                "model_format": predictor.model.model_format.name,
                "runtime": predictor.model.runtime,
                "protocol": predictor.model.protocol_version,
                "storage_uri": predictor.model.storage_uri,
                "image": predictor.model.image,
                "scale_metric": predictor.scale_metric,
                "scale_target": predictor.scale_target,
                "replicas": [predictor.min_replicas, predictor.max_replicas],
                "resources": predictor.model.resources.to_dict(),
            }
        )
    )


if __name__ == "__main__":  # server_files_check.py imports build()
    main()
