"""deploy --target server: the OpenAI-compatible server's container build file and its KServe and Kubernetes manifests
(issue 54, item 2). No engine and no cluster here: the Dockerfile is parsed by BuildKit's own parser and the
manifests are built with the ``kserve`` and ``kubernetes`` packages' model classes (tests/workers/
server_files_check.py, under .venv-triton: skips without it, fails under CI=1); the image's layout (the files its
COPY names, in /models/NAME) is served by its CMD in a process that cannot import what the image lacks (torch,
transformers, onnxscript), and answers OpenAI's client; a switchable export's layout serves each adapter as
NAME:ADAPTER. About 27 s beyond the shared fixtures."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.targets import server_image as target
from gpt2onnx.targets.deploy import deploy
from gpt2onnx.targets.triton_server import triton_python

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "workers" / "server_files_check.py"
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# what the image does not install (gpt2onnx's export dependencies): the served process must not import them
NOT_IN_IMAGE = ("torch", "transformers", "onnxscript", "onnx_ir", "safetensors", "huggingface_hub")


def need_checker() -> str:
    python = triton_python()
    if python is None or subprocess.run([python, "-c", "import dockerfile, kserve, kubernetes"]).returncode != 0:
        message = "no .venv-triton with dockerfile, kserve and kubernetes: run scripts/setup.sh"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    return python


def checked(folder: Path) -> dict:
    proc = subprocess.run([need_checker(), str(CHECK), str(folder)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return json.loads(proc.stdout)


def instructions(report: dict, cmd: str) -> list[dict]:
    return [c for c in report["dockerfile"] if c["cmd"] == cmd]


def test_the_files_are_written_and_valid_for_buildkit_kserve_and_kubernetes(trained_export, tmp_path):
    """The Dockerfile copies the model's own files (exactly those .dockerignore lets in) into /models/NAME after its
    only RUN (pip), runs as a user, and its CMD serves that folder on 0.0.0.0:8080 with the batch that is KServe's
    concurrency target; both manifests run that image with the probes on /ready and /health."""
    out = tmp_path / "Docs_Model.v1"
    result = deploy(trained_export, "server", out=out, server_max_batch=4, server_image="registry.example.com/gpt2:1")
    assert result.targets["server"] == [
        "Dockerfile",
        ".dockerignore",
        "kubernetes/inferenceservice.yaml",
        "kubernetes/deployment.yaml",
    ]
    assert result.manifest.deploy.records["server"] == {
        "name": "docs-model-v1",
        "image": "registry.example.com/gpt2:1",
        "max_batch": 4,
    }
    report = checked(out)
    name, home = "docs-model-v1", "/models/docs-model-v1"

    (run,) = instructions(report, "RUN")
    assert run["value"][0].startswith("pip install --no-deps /tmp/wheels/gpt2onnx-") and "torch" not in run["value"][0]
    assert not instructions(report, "ADD")  # COPY only: no URL fetched, no archive unpacked
    wheel, model = instructions(report, "COPY")
    assert wheel["flags"] == ["--from=wheels"]
    assert model["json"] and model["value"][-1] == f"{home}/"
    cmds = [c["cmd"] for c in report["dockerfile"]]
    assert cmds.index("RUN") < cmds.index("COPY", cmds.index("RUN"))  # the folder arrives after the last RUN
    sources = model["value"][:-1]
    assert {"model.onnx", "config.json", "gpt2onnx.json", "tokenizer.json", "vocab.json", "merges.txt"} <= set(sources)
    ignore = (out / ".dockerignore").read_text().splitlines()
    assert [line for line in ignore if not line.startswith("#")] == ["*", *(f"!{s}" for s in sources)]
    assert instructions(report, "USER")[0]["value"] == [str(target.USER_ID)]
    assert instructions(report, "EXPOSE")[0]["value"] == ["8080"]
    (cmd,) = instructions(report, "CMD")
    assert cmd["json"] and cmd["value"] == [
        "gpt2onnx", "serve", home, "--host", "0.0.0.0", "--port", "8080", "--max-batch", "4",
    ]  # fmt: skip

    service, deployment, k8s_service = report["documents"]
    assert [d["kind"] for d in report["documents"]] == ["InferenceService", "Deployment", "Service"]
    assert all(DNS_LABEL.fullmatch(d["name"]) and d["name"] == name for d in report["documents"])
    assert (service["scale_metric"], service["scale_target"]) == ("concurrency", 4)
    for container in (*service["containers"], *deployment["containers"]):
        assert container["image"] == "registry.example.com/gpt2:1"
        assert container["ports"] == [8080]
        assert container["readiness"] == ["/ready", 8080] and container["liveness"] == ["/health", 8080]
        assert container["env"] == ["GPT2ONNX_API_KEY"] and container["run_as_non_root"]
        memory = int(container["resources"]["requests"]["memory"].removesuffix("Mi")) << 20
        assert memory >= 2 * (out / "model.onnx").stat().st_size + (1 << 30)
    assert service["containers"][0]["name"] == "kserve-container"
    assert deployment["selector"].items() <= deployment["pod_labels"].items()
    assert k8s_service["selector"] == deployment["selector"] and k8s_service["ports"] == [[80, 8080]]


def test_the_checker_fails_on_a_field_kubernetes_does_not_know(trained_export, tmp_path):
    out = tmp_path / "m"
    deploy(trained_export, "server", out=out)
    checked(out)
    path = out / "kubernetes" / "deployment.yaml"
    path.write_text(path.read_text().replace("  replicas: 1\n", "  replicas: 1\n  replica: 2\n"))
    proc = subprocess.run([need_checker(), str(CHECK), str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "replica is not a field of V1DeploymentSpec" in proc.stderr


def test_a_hostile_folder_name_becomes_a_label_and_nothing_else(trained_export, tmp_path):
    """A name with spaces, quotes, a shell substitution and non-ASCII letters: every name written is the label made
    from it; the raw name is in no file."""
    raw = 'Évil "name" $(touch x)\'; 9'
    out = tmp_path / raw
    deploy(trained_export, "server", out=out)
    label = "vil-name-touch-x-9"
    for rel in ("Dockerfile", ".dockerignore", "kubernetes/inferenceservice.yaml", "kubernetes/deployment.yaml"):
        text = (out / rel).read_text()
        assert raw not in text and "$(" not in text and text.isascii(), rel
    assert f'"/models/{label}"' in (out / "Dockerfile").read_text()
    assert target.label("-9_ _") == "gpt2onnx" and target.label("A" * 80) == "a" * 45
    assert all(DNS_LABEL.fullmatch(target.label(n)) for n in ("..", "Model.v1--", "x" * 100 + "-y", "日本"))


def test_the_image_holds_the_models_files_only(trained_export, tmp_path):
    """With the web page, Triton and a file of the user's beside it: the image copies the model, its config and
    tokenizer files and the manifest, never index.html (``serve`` would then serve the page), another target's
    folder or the user's file; deploying again writes the same files (idempotent)."""
    source = tmp_path / "m"
    shutil.copytree(trained_export, source)
    (source / "notes.txt").write_text("mine\n")
    out = tmp_path / "d"
    deploy(source, "server,web,triton", out=out, triton_name="m")
    dockerfile = (out / "Dockerfile").read_text()
    (copy,) = [line for line in dockerfile.splitlines() if line.startswith("COPY [")]
    sources = json.loads(copy.removeprefix("COPY "))[:-1]
    assert "index.html" not in sources and "notes.txt" not in sources
    assert not {"triton", "kserve", "onnx", "lib", "kubernetes", "Dockerfile"} & set(sources)
    assert (out / "notes.txt").is_file() and (out / "index.html").is_file()
    before = {p.relative_to(out): p.read_bytes() for p in (out / "kubernetes").iterdir()}
    before |= {Path(n): (out / n).read_bytes() for n in ("Dockerfile", ".dockerignore")}
    deploy(out, "server,web,triton", triton_name="m")  # in place, again
    after = {p.relative_to(out): p.read_bytes() for p in (out / "kubernetes").iterdir()}
    after |= {Path(n): (out / n).read_bytes() for n in ("Dockerfile", ".dockerignore")}
    assert after == before
    deploy(out, "genai")  # the server not asked for again: its files go
    assert not any((out / n).exists() for n in ("Dockerfile", ".dockerignore", "kubernetes"))


def test_bad_options_are_refused_in_one_line(trained_export, tmp_path):
    with pytest.raises(BadInput, match="--server-name 'Gpt2' is not a DNS-1123 label"):
        deploy(trained_export, "server", out=tmp_path / "a", server_name="Gpt2")
    with pytest.raises(BadInput, match="--server-batch 257 is not an integer from 1 to 256"):
        deploy(trained_export, "server", out=tmp_path / "a", server_max_batch=257)
    with pytest.raises(BadInput, match="not an image reference"):
        deploy(trained_export, "server", out=tmp_path / "a", server_image="a b")
    with pytest.raises(ContractError, match="holds no model.onnx"):
        deploy(tmp_path, "server", out=tmp_path / "a")
    assert not (tmp_path / "a").exists()
    for good in ("gpt2", "localhost:5000/team/gpt2:v1.2", "ghcr.io/a_b/c__d:latest", "x@sha256:" + "a" * 64):
        target.ServerOptions(server_image=good)


def test_the_targets_limits_are_the_servers():
    """The target restates two of the server's numbers (targets sit below serving): they must stay the same."""
    import inspect

    from gpt2onnx.serving.engine import MAX_ROWS
    from gpt2onnx.serving.openai.server import open_openai_server

    assert target.MAX_BATCH == MAX_ROWS
    assert inspect.signature(open_openai_server).parameters["max_batch"].default == target.DEFAULT_MAX_BATCH


def test_the_server_column_is_the_batching_engines_on_cpu():
    """The target declares no need of its own: it runs the batching engine on onnxruntime's CPU provider. The
    matrix's two columns agree on every export it allows (a need added to the engine or the CPU provider that the
    target does not follow fails here)."""
    from gpt2onnx.preflight.check import preflight
    from gpt2onnx.preflight.matrix import plans
    from gpt2onnx.runtimes.all_runtimes import RuntimeOptions

    allowed = [passes for *_, passes, _ in plans() if passes is not None]
    assert len(allowed) > 20
    for passes in allowed:
        served = preflight(plan=passes, targets="server")
        engine = preflight(plan=passes, runtime=RuntimeOptions(), engine=True)
        assert served.ok == engine.ok, (passes, served.conflicts, engine.conflicts)


@contextlib.contextmanager
def image_layout_served(out: Path, tmp_path: Path):
    """What the image would hold, without an engine: the files the Dockerfile's COPY names, in /models/NAME's place,
    served by its CMD (on 127.0.0.1 and a free port here) in a process where torch, transformers and gpt2onnx's
    other export dependencies cannot be imported. Yields OpenAI's client on it, once /ready answers."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    dockerfile = (out / "Dockerfile").read_text().splitlines()
    (copy,) = [line for line in dockerfile if line.startswith("COPY [")]
    (cmd,) = [line for line in dockerfile if line.startswith("CMD [")]
    *sources, home = json.loads(copy.removeprefix("COPY "))
    image = tmp_path / "image"
    models = image / home.strip("/")
    models.mkdir(parents=True)
    for name in sources:
        shutil.copyfile(out / name, models / name)
    argv = json.loads(cmd.removeprefix("CMD "))
    assert argv[:3] == ["gpt2onnx", "serve", home.rstrip("/")]
    argv[2] = str(models)
    argv[argv.index("--host") + 1], argv[argv.index("--port") + 1] = "127.0.0.1", "0"
    blocker = (
        "import sys, runpy\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {NOT_IN_IMAGE!r}: raise ImportError('not in the image: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_module('gpt2onnx', run_name='__main__')\n"
    )
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", blocker, *argv], stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    try:
        found = re.search(r" at (http://\S+)/v1", proc.stdout.readline())
        assert found, log.read_text()[-2000:]
        root = found.group(1)
        deadline = time.monotonic() + 120
        while httpx.get(f"{root}/ready").status_code != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        yield openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "not in the image" not in log.read_text()


def test_the_images_layout_serves_openais_client_without_torch(trained_export, tmp_path):
    """The image's layout served by its CMD without torch: OpenAI's client lists the model by NAME and gets a
    completion."""
    out = tmp_path / "deployed"
    deploy(trained_export, "server", out=out, server_name="gpt2-test")
    with image_layout_served(out, tmp_path) as client:
        assert [m.id for m in client.models.list().data] == ["gpt2-test"]
        completion = client.completions.create(model="gpt2-test", prompt="Return the", max_tokens=4, temperature=0)
        assert completion.usage.completion_tokens == 4 and completion.choices[0].text


@pytest.fixture(scope="module")
def switchable_export(trained_checkpoint, tmp_path_factory) -> Path:
    """A switchable export of the trained checkpoint with one adapter, 'hot': a real PEFT LoRA (rank 4, alpha 64,
    every module) with random non-zero factors, so that its greedy continuation differs from the base's."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import GPT2LMHeadModel

    from gpt2onnx.exporters.switchable import export_switchable

    torch.manual_seed(3)
    base = GPT2LMHeadModel.from_pretrained(trained_checkpoint, attn_implementation="eager").eval()
    config = peft.LoraConfig(
        r=4, lora_alpha=64, target_modules=["c_attn", "c_proj", "c_fc"], init_lora_weights=False, fan_in_fan_out=True
    )
    hot = tmp_path_factory.mktemp("hot") / "hot"
    peft.get_peft_model(base, config).save_pretrained(hot)
    out = tmp_path_factory.mktemp("switchable") / "m"
    return export_switchable(str(trained_checkpoint), out, adapters={"hot": hot}).folder


def test_the_images_layout_serves_a_switchable_folders_adapters(switchable_export, trained_export, tmp_path):
    """A switchable folder deploys (the target carries its adapter files): the image copies what it copies of the
    same checkpoint exported without adapters, and hot.onnx_adapter, nothing else. Its layout, served by its CMD
    without torch, verifies against the manifest (each file's sha256, the adapter's too), lists NAME and NAME:hot,
    and a completion for NAME:hot has the greedy text of generate with the adapter, which differs from the base's
    (the base's completion, for NAME, too)."""
    from gpt2onnx.decoding.generate import generate

    out = tmp_path / "deployed"
    deploy(switchable_export, "server", out=out, server_name="gpt2-test")
    base_out = tmp_path / "base-deployed"  # the same checkpoint exported without adapters
    deploy(trained_export, "server", out=base_out, server_name="gpt2-test")

    def copied(folder: Path) -> list[str]:
        (copy,) = [line for line in (folder / "Dockerfile").read_text().splitlines() if line.startswith("COPY [")]
        return json.loads(copy.removeprefix("COPY "))[:-1]

    assert sorted(copied(out)) == sorted([*copied(base_out), "hot.onnx_adapter"])
    assert "!hot.onnx_adapter" in (out / ".dockerignore").read_text().splitlines()
    prompt, new = "Return the number of", 6
    expected = {
        adapter: generate(out, prompts=[prompt], max_new_tokens=new, adapter=adapter).texts[0]
        for adapter in (None, "hot")
    }
    assert expected[None] != expected["hot"]
    with image_layout_served(out, tmp_path) as client:
        assert [m.id for m in client.models.list().data] == ["gpt2-test", "gpt2-test:hot"]
        for adapter, text in expected.items():
            model = "gpt2-test" + (f":{adapter}" if adapter else "")
            completion = client.completions.create(model=model, prompt=prompt, max_tokens=new, temperature=0)
            assert completion.model == model and completion.choices[0].text == text
