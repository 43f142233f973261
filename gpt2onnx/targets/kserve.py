"""KServe: the InferenceService that serves the Triton repository (``triton/``) on KServe's Triton runtime.

    kserve/inferenceservice.yaml

Written with the triton target. The predictor is KServe's ``triton`` model format (the ``kserve-tritonserver``
runtime, open inference protocol v2) on a storage URI that holds the repository (``pvc://CLAIM/NAME/triton``:
copy the deployed folder to that volume claim as NAME/, or change the URI to your bucket). Its image is NVIDIA's Triton
of the same release as the bundled test server (24.10 = Triton 2.51) with gpt2onnx and its run-time packages
added, named here and built from the Dockerfile in the README; the generation model decodes up to
``max_batch`` requests together in each replica, so that is the autoscaler's concurrency target. Nothing here
runs Kubernetes: tests check the manifest against the ``kserve`` package's model classes only.
"""

from __future__ import annotations

import re
from pathlib import Path

from gpt2onnx.targets.formats import yaml_comment, yaml_string

SUBFOLDER = "kserve"
FILE = "inferenceservice.yaml"
IMAGE = "gpt2onnx-tritonserver:24.10"  # FROM nvcr.io/nvidia/tritonserver:24.10-py3 (README: Deploy, KServe)
CLAIM = "gpt2onnx-models"
RUNTIME = "kserve-tritonserver"


def service_name(name: str) -> str:
    """A Kubernetes name (DNS-1123 label, at most 45 characters as KServe advises) from a Triton model name."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    label = re.sub(r"^[^a-z]+", "", label)[:45].rstrip("-")
    return label or "gpt2onnx"


def memory_request(model_bytes: int) -> str:
    """Twice the model (the session's copy and the file's pages) plus 1 GiB for the server and the K/V cache."""
    return f"{(2 * model_bytes + (1 << 30) + (1 << 20) - 1) >> 20}Mi"


def inference_service(name: str, *, model_bytes: int, gpu: bool, max_batch: int) -> str:
    """The manifest as YAML text (values JSON-quoted: valid YAML scalars), with comments for the person applying it."""
    q = yaml_string
    resources = [
        "      resources:",
        "        requests:",
        f"          cpu: {q('2')}",
        f"          memory: {q(memory_request(model_bytes))}",
        "        limits:",
        f"          memory: {q(memory_request(model_bytes))}",
    ]
    if gpu:
        resources += [f"          nvidia.com/gpu: {q('1')}"]
    return "\n".join(
        [
            "# Written by gpt2onnx deploy --target triton: KServe's Triton runtime serving triton/ (README: Deploy,",
            "# KServe). Nothing in gpt2onnx runs Kubernetes; this file is checked against kserve's model classes.",
            "apiVersion: serving.kserve.io/v1beta1",
            "kind: InferenceService",
            "metadata:",
            f"  name: {q(service_name(name))}",
            "spec:",
            "  predictor:",
            "    # replicas: each decodes up to max_batch requests together; the autoscaler (Knative, serverless mode)",
            "    # adds a replica when the requests in flight per replica pass scaleTarget",
            "    minReplicas: 1",
            "    maxReplicas: 4",
            f"    scaleMetric: {q('concurrency')}",
            f"    scaleTarget: {int(max_batch)}",
            "    model:",
            "      modelFormat:",
            f"        name: {q('triton')}",
            f"      protocolVersion: {q('v2')}",
            f"      runtime: {q(RUNTIME)}",
            f"      # the deployed folder copied to this volume claim as {yaml_comment(name)}/ (or your bucket's URI of"
            " its triton/)",
            f"      storageUri: {q(f'pvc://{CLAIM}/{name}/triton')}",
            "      # NVIDIA's Triton 24.10 with gpt2onnx, onnxruntime, onnx, numpy and tokenizers added (README)",
            f"      image: {q(IMAGE)}",
            *resources,
            "",
        ]
    )


def write_kserve(out: Path, *, name: str, model_bytes: int, gpu: bool, max_batch: int) -> list[str]:
    """Write kserve/inferenceservice.yaml into ``out``; returns the file written."""
    folder = out / SUBFOLDER
    folder.mkdir()
    (folder / FILE).write_text(inference_service(name, model_bytes=model_bytes, gpu=gpu, max_batch=max_batch))
    return [f"{SUBFOLDER}/{FILE}"]
