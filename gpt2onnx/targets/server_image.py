"""The OpenAI-compatible server (``gpt2onnx serve``) in a container, for KServe or plain Kubernetes.

    Dockerfile                      the image: Python, gpt2onnx (no torch) and the serve packages, the folder's
    .dockerignore                   files copied in as data under /models/NAME, ``gpt2onnx serve`` on port 8080
    kubernetes/inferenceservice.yaml  KServe: a custom-container predictor, autoscaled on concurrency
    kubernetes/deployment.yaml      plain Kubernetes: a Deployment and a Service (apps/v1, v1)

NAME is a DNS-1123 label (``--server-name``, default: the deployed folder's name made one): the image's model
folder, so the model's id in the API, and the manifests' names. The build context is the folder, limited by
.dockerignore to the files the Dockerfile copies (the model, its config and tokenizer files, a switchable export's
NAME.onnx_adapter files, served as model "NAME:ADAPTER", the manifest):
nothing from the folder runs while the image is built, and the other targets' files stay out of it. gpt2onnx
comes from a wheel given as the named build context ``wheels`` (docs/deploy.md). Each replica is one server whose
engine decodes up to ``--server-batch`` requests together: that is its ``--max-batch`` and KServe's
concurrency target. Nothing here runs Docker or Kubernetes: tests parse the Dockerfile with BuildKit's parser and
check the manifests against the ``kserve`` and ``kubernetes`` packages' model classes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpt2onnx.artifact.folder import CONFIG_FILE, MANIFEST_NAME, read_json_file
from gpt2onnx.artifact.lora import adapter_file
from gpt2onnx.artifact.manifest import MODEL_FILE
from gpt2onnx.artifact.tokenizer import TOKENIZER_JSON
from gpt2onnx.errors import BadInput, ContractError, shown
from gpt2onnx.targets.formats import yaml_string
from gpt2onnx.targets.target import Deployment, TargetSpec, Written

DOCKERFILE, DOCKERIGNORE, SUBFOLDER = "Dockerfile", ".dockerignore", "kubernetes"
INFERENCE_SERVICE, DEPLOYMENT = "inferenceservice.yaml", "deployment.yaml"
PORT = 8080
MODELS = "/models"  # the model folder in the image: /models/NAME
DEFAULT_MAX_BATCH = 16  # gpt2onnx serve's own default
MAX_BATCH = 256  # the batching engine's most rows
DRAIN_S = 60  # the server drains its requests for up to this long on SIGTERM; the pod waits a little longer
TIMEOUT_S = 600  # KServe: the longest request, a stream included
USER_ID = 10001  # the image runs as this user, not root
BASE_IMAGE = "python:3.11-slim"
# The serving path's packages, at the versions the tests run (onnxruntime's CPU build): no torch, no transformers
RUN_PACKAGES = (
    "onnxruntime==1.31.1",
    "onnx==1.23.2",
    "numpy==2.4.6",
    "tokenizers==0.22.2",
    "typer==0.29.2",
    "rich==15.0.0",
    "fastapi==0.165.0",
    "uvicorn==0.55.0",
    "openai==3.63.0",
    "prometheus-client==0.26.0",
    "jinja2==3.1.6",  # a folder's chat template (gpt2onnx.serving.openai.chat)
)
_LABEL = re.compile(r"[a-z]([a-z0-9-]{0,43}[a-z0-9])?")  # DNS-1123, at most 45 characters as KServe advises
_PLAIN_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # no glob, quote or space: COPY and .dockerignore read it
# distribution/reference's grammar: [host[:port]/]path[:tag][@digest]
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?/)?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
_IMAGE = re.compile(
    _HOST + _PATH + r"(?::[\w][\w.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
)


def label(name: str) -> str:
    """The deployed folder's name as a DNS-1123 label (lower case, letters, digits and '-', a letter first)."""
    text = re.sub(r"[^a-z0-9-]+", "-", str(name).lower()).strip("-")
    text = re.sub(r"^[^a-z]+", "", text)[:45].rstrip("-")
    return text or "gpt2onnx"


@dataclass(frozen=True)
class ServerOptions:
    """deploy's options for the server: its name (default: the deployed folder's, made a DNS-1123 label), the
    image the manifests run (default gpt2onnx-NAME:latest: push it and give your registry's name) and the
    requests one replica decodes together."""

    server_name: str | None = None
    server_image: str | None = None
    server_max_batch: int = DEFAULT_MAX_BATCH

    def __post_init__(self) -> None:  # an invalid one cannot be built
        if self.server_name is not None and (
            not isinstance(self.server_name, str) or not _LABEL.fullmatch(self.server_name)
        ):
            raise BadInput(
                f"--server-name {shown(self.server_name)} is not a DNS-1123 label of at most 45 characters (lower-case"
                " letters, digits and '-', a letter first, no '-' last): give one, e.g. gpt2-int4"
            )
        if self.server_image is not None and (
            not isinstance(self.server_image, str)
            or len(self.server_image) > 255
            or not _IMAGE.fullmatch(self.server_image)
        ):
            raise BadInput(
                f"--server-image {shown(self.server_image)} is not an image reference"
                " ([REGISTRY/]NAME[:TAG][@DIGEST], the name in lower case): give one, e.g. registry.example.com/gpt2:1"
            )
        batch = self.server_max_batch
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
            given = batch if isinstance(batch, int) else shown(batch)
            raise BadInput(f"--server-batch {given} is not an integer from 1 to {MAX_BATCH}: give one")


@dataclass(frozen=True)
class Server:
    """What the files are written from: the name, the image, the batch, the files copied and the memory asked."""

    name: str
    image: str
    max_batch: int
    files: tuple[str, ...]
    memory: str

    @property
    def model_path(self) -> str:
        return f"{MODELS}/{self.name}"

    @property
    def command(self) -> list[str]:
        return [
            "gpt2onnx", "serve", self.model_path, "--host", "0.0.0.0", "--port", str(PORT),
            "--max-batch", str(self.max_batch),
        ]  # fmt: skip


# -- the image ---------------------------------------------------------------------------------------------------


def dockerfile(server: Server) -> str:
    """The container build file: JSON forms for COPY and CMD (no shell, no word splitting)."""
    copy = [*server.files, f"{server.model_path}/"]
    packages = " ".join(RUN_PACKAGES)
    return "\n".join(
        [
            "# syntax=docker/dockerfile:1",
            "# Written by gpt2onnx deploy --target server: the OpenAI-compatible server (gpt2onnx serve) for this",
            "# folder's model (docs/deploy.md, The OpenAI server in a container). From the gpt2onnx checkout:",
            "#   pip wheel --no-deps -w dist .",
            f"#   docker build --build-context wheels=dist -t {server.image} FOLDER",
            "# The folder's files are data: they are copied, nothing from them runs while the image is built.",
            f"FROM {BASE_IMAGE}",
            "ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1",
            "# gpt2onnx without its export dependencies (torch, transformers), then the serving path's packages",
            "COPY --from=wheels gpt2onnx-*.whl /tmp/wheels/",
            "RUN pip install --no-deps /tmp/wheels/gpt2onnx-*.whl \\",
            f" && pip install {packages} \\",
            " && rm -rf /tmp/wheels",
            f"COPY {_json_list(copy)}",
            f"USER {USER_ID}",
            f"EXPOSE {PORT}",
            "# SIGTERM drains the requests in flight, then the server exits",
            f"CMD {_json_list(server.command)}",
            "",
        ]
    )


def dockerignore(server: Server) -> str:
    """Only the files the Dockerfile copies go into the build context."""
    lines = ["# Written by gpt2onnx deploy --target server: the build context is the files the Dockerfile copies", "*"]
    return "\n".join([*lines, *(f"!{name}" for name in server.files), ""])


def _json_list(items: list[str]) -> str:
    return "[" + ", ".join(yaml_string(item) for item in items) + "]"  # JSON strings, ASCII


# -- the manifests -----------------------------------------------------------------------------------------------


def _container(server: Server, indent: int, *, name: str) -> list[str]:
    """The server's container (a list item), as both manifests run it."""
    q = yaml_string
    pad = " " * indent
    lines = [
        f"- name: {q(name)}",
        f"  image: {q(server.image)}",
        "  ports:",
        f"    - containerPort: {PORT}",
        f"      name: {q('http1')}",
        f"      protocol: {q('TCP')}",
        "  env:",
        "    # the API key clients send as 'Bearer KEY', from a secret if you make one (none: no key asked)",
        f"    - name: {q('GPT2ONNX_API_KEY')}",
        "      valueFrom:",
        "        secretKeyRef:",
        f"          name: {q(server.name + '-api-key')}",
        f"          key: {q('key')}",
        "          optional: true",
        "  # /ready answers 503 until the model is loaded, /health 200 while the process runs",
        "  readinessProbe:",
        "    httpGet:",
        f"      path: {q('/ready')}",
        f"      port: {PORT}",
        "    periodSeconds: 5",
        "    failureThreshold: 3",
        "  livenessProbe:",
        "    httpGet:",
        f"      path: {q('/health')}",
        f"      port: {PORT}",
        "    initialDelaySeconds: 10",
        "    periodSeconds: 10",
        "    failureThreshold: 6",
        "  resources:",
        "    # the model twice (the session's copy, the file's pages), the K/V cache of max-batch rows at the full",
        "    # context, 1 GiB for the server; no CPU limit: onnxruntime's threads are not throttled",
        "    requests:",
        f"      cpu: {q('2')}",
        f"      memory: {q(server.memory)}",
        "    limits:",
        f"      memory: {q(server.memory)}",
        "  securityContext:",
        "    allowPrivilegeEscalation: false",
        "    runAsNonRoot: true",
        f"    runAsUser: {USER_ID}",
    ]
    return [pad + line for line in lines]


def inference_service(server: Server) -> str:
    """KServe's InferenceService: the image as a custom-container predictor, autoscaled on concurrency."""
    q = yaml_string
    return "\n".join(
        [
            "# Written by gpt2onnx deploy --target server: the OpenAI-compatible server on KServe (docs/deploy.md).",
            "# Nothing in gpt2onnx runs Kubernetes; this file is checked against the kserve package's model classes.",
            "apiVersion: serving.kserve.io/v1beta1",
            "kind: InferenceService",
            "metadata:",
            f"  name: {q(server.name)}",
            "spec:",
            "  predictor:",
            "    # each replica decodes up to max-batch requests together; the autoscaler (Knative, serverless mode)",
            "    # adds a replica when the requests in flight per replica pass scaleTarget",
            "    minReplicas: 1",
            "    maxReplicas: 4",
            f"    scaleMetric: {q('concurrency')}",
            f"    scaleTarget: {server.max_batch}",
            f"    timeout: {TIMEOUT_S}",
            f"    terminationGracePeriodSeconds: {DRAIN_S + 15}",
            "    containers:",
            *_container(server, 6, name="kserve-container"),
            "",
        ]
    )


def deployment_and_service(server: Server) -> str:
    """A Deployment of the image and a Service in front of it, for a cluster without KServe."""
    q = yaml_string
    labels = [
        f"app.kubernetes.io/name: {q(server.name)}",
        f"app.kubernetes.io/component: {q('openai-server')}",
        f"app.kubernetes.io/managed-by: {q('gpt2onnx')}",
    ]
    return "\n".join(
        [
            "# Written by gpt2onnx deploy --target server: the OpenAI-compatible server on plain Kubernetes",
            "# (docs/deploy.md). Nothing in gpt2onnx runs Kubernetes; these are checked against the kubernetes",
            "# package's model classes (the Kubernetes OpenAPI types).",
            "apiVersion: apps/v1",
            "kind: Deployment",
            "metadata:",
            f"  name: {q(server.name)}",
            "  labels:",
            *("    " + item for item in labels),
            "spec:",
            "  replicas: 1",
            "  selector:",
            "    matchLabels:",
            f"      app.kubernetes.io/name: {q(server.name)}",
            "  template:",
            "    metadata:",
            "      labels:",
            *("        " + item for item in labels),
            "    spec:",
            f"      terminationGracePeriodSeconds: {DRAIN_S + 15}",
            "      containers:",
            *_container(server, 8, name="server"),
            "---",
            "apiVersion: v1",
            "kind: Service",
            "metadata:",
            f"  name: {q(server.name)}",
            "  labels:",
            *("    " + item for item in labels),
            "spec:",
            "  selector:",
            f"    app.kubernetes.io/name: {q(server.name)}",
            "  ports:",
            f"    - name: {q('http')}",
            "      port: 80",
            f"      targetPort: {PORT}",
            f"      protocol: {q('TCP')}",
            "",
        ]
    )


# -- the target --------------------------------------------------------------------------------------------------


def served_files(deployment: Deployment) -> tuple[str, ...]:
    """What the image holds: the source's own top-level files (the model, its config and tokenizer files; the
    manifest, written last), never another target's files or what deploy carried without owning it."""
    source, staging = deployment.source, deployment.staging
    owned = deployment.owned  # every target's paths: another target's files are not the source's
    names = {name for name in source.manifest.files if "/" not in name and name not in owned}
    names |= {TOKENIZER_JSON} & {p.name for p in staging.iterdir()}  # built from vocab.json + merges.txt
    files = sorted(name for name in names if (staging / name).is_file() and not (staging / name).is_symlink())
    for name in files:
        if not _PLAIN_FILE.fullmatch(name):
            raise ContractError(
                f"'{source.folder}' holds {shown(name)}, a name the Dockerfile cannot copy as written (a space,"
                " a glob or a quote): rename it, or export the folder again"
            )
    if MODEL_FILE not in files:
        raise ContractError(f"'{source.folder}' has no {MODEL_FILE} of its own: deploy an exported folder")
    # a switchable folder's NAME.onnx_adapter files: the server binds one per request (model "ID:NAME")
    missing = [
        adapter_file(staging, n).name for n in source.manifest.adapters if adapter_file(staging, n).name not in files
    ]
    if missing:
        raise ContractError(
            f"'{source.folder}' lists adapter files it does not hold ({', '.join(missing)}): export the folder again"
        )
    return (*files, MANIFEST_NAME)


def memory(deployment: Deployment, max_batch: int) -> str:
    """The memory one replica asks: the model twice (the session's copy and the file's pages), the K/V cache of
    ``max_batch`` rows at the full context, and 1 GiB for the server, in MiB."""
    source = deployment.source
    config = read_json_file(source.folder / CONFIG_FILE, "model config")
    layers, width = config.get("n_layer"), config.get("n_embd")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (layers, width)):
        raise ContractError(
            f"'{source.folder / CONFIG_FILE}' gives no positive n_layer and n_embd: export the folder again"
        )
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(source.facts.kv_dtype, 1)
    cache = 2 * layers * width * source.n_positions * max_batch * itemsize
    return f"{(2 * source.manifest.model_bytes + cache + (1 << 30) + (1 << 20) - 1) >> 20}Mi"


def _write(deployment: Deployment, options: ServerOptions) -> Written:
    name = options.server_name or label(deployment.name)
    server = Server(
        name=name,
        image=options.server_image or f"gpt2onnx-{name}:latest",
        max_batch=options.server_max_batch,
        files=served_files(deployment),
        memory=memory(deployment, options.server_max_batch),
    )
    staging = deployment.staging
    (staging / DOCKERFILE).write_text(dockerfile(server))
    (staging / DOCKERIGNORE).write_text(dockerignore(server))
    (staging / SUBFOLDER).mkdir()
    (staging / SUBFOLDER / INFERENCE_SERVICE).write_text(inference_service(server))
    (staging / SUBFOLDER / DEPLOYMENT).write_text(deployment_and_service(server))
    files = [DOCKERFILE, DOCKERIGNORE, f"{SUBFOLDER}/{INFERENCE_SERVICE}", f"{SUBFOLDER}/{DEPLOYMENT}"]
    return Written(files, {"name": name, "image": server.image, "max_batch": server.max_batch})


SPEC = TargetSpec(
    name="server",
    summary="the OpenAI-compatible server (gpt2onnx serve) in a container: Dockerfile, KServe and Kubernetes manifests",
    write=_write,
    paths=(DOCKERFILE, DOCKERIGNORE, SUBFOLDER),
    options=ServerOptions,
    record="server",
    aliases=("openai-server", "container"),
    # it runs the batching engine on onnxruntime's CPU provider, which takes every export (the compatibility
    # matrix's "batching engine" column; tests/targets/test_deploy_server.py holds the two columns equal)
    requires=(),
    carries_adapters=True,  # served_files copies each NAME.onnx_adapter; gpt2onnx serve takes model "ID:NAME"
)
