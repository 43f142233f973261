"""Deployment targets, each proven by its own runtime on a tiny model, fp32 and int4:
onnxruntime-genai's Python API (in .venv-genai), transformers.js in Node (tests/js), Triton's config schema
(tritonclient, in .venv-genai). scripts/setup.sh installs all three; where one is absent the test skips with
the reason (and fails under CI=1, where the set-up must have run)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2onnx.artifact.contract import graph_io
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.targets.all_targets import parse_targets
from gpt2onnx.targets.deploy import deploy

ROOT = Path(__file__).resolve().parents[2]
GENAI_PYTHON = ROOT / ".venv-genai" / "bin" / "python"
JS = ROOT / "tests" / "js"
WORKERS = Path(__file__).parents[1] / "workers"
PROMPT = [5, 17, 42, 123, 7, 300, 9, 11]
NEW = 12
FP32_TOLERANCE = 1e-4  # fp32 logits against PyTorch
SAME_FILE_TOLERANCE = 1e-4  # another runtime on the same quantized file, against onnxruntime


def need(path: Path, what: str):
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{what} is missing ({path}): run scripts/setup.sh")
        pytest.skip(f"{what} is not installed ({path} is absent): run scripts/setup.sh")


def record(request, **row):
    """One line per runtime and variant in <basetemp>/deploy_runtimes.jsonl (the closing note's table)."""
    path = Path(request.config._tmp_path_factory.getbasetemp()) / "deploy_runtimes.jsonl"
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def reference(tiny_folder):
    """GPT2LMHeadModel's greedy tokens and its logits over prompt + generated tokens (all but the last)."""
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(tiny_folder).eval()
    sequence = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
        logits = model(torch.tensor([sequence[:-1]])).logits[0].numpy()
    return {"tokens": sequence[len(PROMPT) :], "logits": logits}


def ort_greedy(model_path: Path):
    """onnxruntime (the project's) on a file: greedy tokens, and the logits of every step as genai returns them."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    inputs, _ = graph_io(load_graph(model_path))
    past = {
        t.name: np.zeros((1, t.dims[1], 0, t.dims[3]), np.float32)
        for t in inputs
        if t.name.startswith("past_key_values")
    }
    ids, total, tokens, steps = np.array([PROMPT], np.int64), len(PROMPT), [], []
    names = [o.name for o in session.get_outputs()]
    for _ in range(NEW):
        length = ids.shape[1]
        feed = {
            "input_ids": ids,
            "attention_mask": np.ones((1, total), np.int64),
            "position_ids": np.arange(total - length, total, dtype=np.int64)[None],
            **past,
        }
        out = dict(zip(names, session.run(None, feed)))
        steps.append(out["logits"][0])
        tokens.append(int(out["logits"][0, -1].argmax()))
        past = {name: out[name.replace("past_key_values", "present")] for name in past}
        ids, total = np.array([[tokens[-1]]], np.int64), total + 1
    return {"tokens": tokens, "logits": np.concatenate(steps, 0)}


@pytest.fixture(scope="module")
def int4_export(tiny_folder, tmp_path_factory):
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    options = ExportOptions(quantization=QuantizeOptions("int4"), validate=False)
    return export(str(tiny_folder), tmp_path_factory.mktemp("deploy-int4") / "tiny-int4", options=options).folder


@pytest.fixture(scope="module")
def int8_export(tiny_folder, tmp_path_factory):
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    options = ExportOptions(quantization=QuantizeOptions("int8"), validate=False)
    return export(str(tiny_folder), tmp_path_factory.mktemp("deploy-int8") / "tiny-int8", options=options).folder


@pytest.fixture(scope="module")
def ort_fused_export(tiny_export, tmp_path_factory):
    """The fp32 export through gpt2onnx optimize (fusion profile ort: com.microsoft Attention and friends)."""
    from gpt2onnx.exporters.optimize import optimize

    out = tmp_path_factory.mktemp("deploy-ort") / "tiny-fp32-ort"
    optimize(tiny_export, out, fusion="ort", validate=False)
    return out


@pytest.fixture(scope="module", params=["fp32", "fp32-ort", "int4", "int8"])
def deployed(request, tiny_export, reference, tmp_path_factory):
    """The variant deployed to all three targets in a new folder, and what its runtime must reproduce:
    PyTorch for fp32 (exported, or optimized with the ort fusions), onnxruntime on the same file for int4
    and int8."""
    variants = {"fp32": lambda: tiny_export, "fp32-ort": lambda: request.getfixturevalue("ort_fused_export")}
    source = variants.get(request.param, lambda: request.getfixturevalue(f"{request.param}_export"))()
    out = tmp_path_factory.mktemp("deployed") / f"tiny-{request.param}"
    manifest = deploy(source, "genai,transformers-js,triton", out=out).manifest
    expected = reference if request.param.startswith("fp32") else ort_greedy(source / "model.onnx")
    return {"variant": request.param, "folder": out, "manifest": manifest, "expected": expected, "reference": reference}


def test_genai_generates_the_reference_tokens(deployed, tmp_path, request):
    need(GENAI_PYTHON, "onnxruntime-genai (.venv-genai)")
    out = tmp_path / "genai.npz"
    args = [
        str(GENAI_PYTHON),
        str(WORKERS / "genai_greedy.py"),
        str(deployed["folder"]),
        str(out),
        ",".join(map(str, PROMPT)),
        str(NEW),
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = np.load(out)
    expected = deployed["expected"]
    delta = float(np.abs(result["logits"] - expected["logits"][: len(result["logits"])]).max())
    tokens = result["tokens"].tolist()
    record(
        request,
        runtime=f"onnxruntime-genai {result['version']}",
        variant=deployed["variant"],
        against="PyTorch" if deployed["variant"].startswith("fp32") else "onnxruntime, same file",
        max_abs_delta_logits=delta,
        tokens_equal=tokens == expected["tokens"],
    )
    assert result["logits"].shape == (len(PROMPT) + NEW - 1, 1000)
    assert tokens == expected["tokens"]
    assert delta < (FP32_TOLERANCE if deployed["variant"].startswith("fp32") else SAME_FILE_TOLERANCE), delta


def test_transformers_js_generates_the_reference_tokens(deployed, tmp_path, request):
    need(JS / "node_modules" / "@huggingface" / "transformers", "transformers.js (tests/js/node_modules)")
    out = tmp_path / "tjs.json"
    dtype = {"fp32": "fp32", "fp32-ort": "fp32", "int4": "q4", "int8": "q8"}[deployed["variant"]]
    args = ["node", "greedy.mjs", str(deployed["folder"]), dtype, ",".join(map(str, PROMPT)), str(NEW), str(out)]
    proc = subprocess.run(args, cwd=JS, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    logits = np.array(result["logits"], np.float32).reshape(result["dims"])[0]
    expected = deployed["expected"]
    if not deployed["variant"].startswith("fp32"):  # one forward over the whole sequence, as transformers.js ran it
        sequence = PROMPT + expected["tokens"]
        expected = {
            "tokens": expected["tokens"],
            "logits": ort_forward(deployed["folder"] / "model.onnx", sequence[:-1]),
        }
    delta = float(np.abs(logits - expected["logits"]).max())
    record(
        request,
        runtime=f"transformers.js {result['version']} (Node)",
        variant=deployed["variant"],
        against="PyTorch" if deployed["variant"].startswith("fp32") else "onnxruntime, same file",
        max_abs_delta_logits=delta,
        tokens_equal=result["tokens"] == expected["tokens"],
    )
    assert result["tokens"] == expected["tokens"]
    assert delta < (FP32_TOLERANCE if deployed["variant"].startswith("fp32") else SAME_FILE_TOLERANCE), delta


def ort_forward(model_path: Path, sequence: list[int]) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    inputs, _ = graph_io(load_graph(model_path))
    n = len(sequence)
    feed = {
        "input_ids": np.array([sequence], np.int64),
        "attention_mask": np.ones((1, n), np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
    }
    feed.update(
        {
            t.name: np.zeros((1, t.dims[1], 0, t.dims[3]), t.dtype)
            for t in inputs
            if t.name.startswith("past_key_values")
        }
    )
    return session.run(["logits"], feed)[0][0]


# q4f16 against onnxruntime on the same file: fp16 activations, so two onnxruntime builds (onnxruntime-node 1.30 in
# transformers.js, 1.31 here) may round differently; measured 0 here (the same kernels)
Q4F16_SAME_FILE_TOLERANCE = 1e-2
# q4f16 against the int4 file's logits (the same 4-bit weights), mean relative logits error: 1.9 % here (tiny random
# model), 0.17 % on the GPT-2-shaped reference; the file check bounds a quantized file's activation path at 5 %
Q4F16_AGAINST_INT4 = 0.05


def test_transformers_js_runs_q4f16_from_an_int4_folder(int4_export, reference, tmp_path, request):
    """deploy writes onnx/model_q4f16.onnx beside model_q4.onnx: the int4 graph with fp16 activations; transformers.js
    (Node) runs it with dtype 'q4f16' and writes onnxruntime's tokens on the same file."""
    need(JS / "node_modules" / "@huggingface" / "transformers", "transformers.js (tests/js/node_modules)")
    folder = tmp_path / "tjs"
    written = deploy(int4_export, "transformers-js", out=folder).manifest.deploy.targets["transformers-js"]
    assert {"onnx/model_q4.onnx", "onnx/model_q4f16.onnx"} <= set(written)
    q4f16 = folder / "onnx" / "model_q4f16.onnx"
    inputs, outputs = graph_io(load_graph(q4f16))
    assert {t.dtype for t in inputs if t.name.startswith("past")} == {"float16"}
    assert next(t for t in outputs if t.name == "logits").dtype == "float32"  # fp16's default: logits kept fp32
    out = tmp_path / "tjs.json"
    args = ["node", "greedy.mjs", str(folder), "q4f16", ",".join(map(str, PROMPT)), str(NEW), str(out)]
    proc = subprocess.run(args, cwd=JS, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    logits = np.array(result["logits"], np.float32).reshape(result["dims"])[0]
    expected = ort_forward(q4f16, PROMPT + result["tokens"][:-1])
    delta = float(np.abs(logits - expected).max())
    int4_tokens = ort_greedy(int4_export / "model.onnx")["tokens"]
    record(
        request,
        runtime=f"transformers.js {result['version']} (Node)",
        variant="q4f16",
        against="onnxruntime, same file",
        max_abs_delta_logits=delta,
        tokens_equal_int4=result["tokens"] == int4_tokens,
    )
    assert result["tokens"] == [int(t) for t in expected.argmax(-1)[len(PROMPT) - 1 :]]
    assert delta < Q4F16_SAME_FILE_TOLERANCE, delta
    # against the int4 file it was made from (the same 4-bit weights; fp32 activations, int8 inside MatMulNBits at
    # accuracy level 4): the mean relative logits error (gpt2onnx.verify.metrics)
    from gpt2onnx.verify.metrics import relative_error

    int4 = ort_forward(int4_export / "model.onnx", PROMPT + result["tokens"][:-1])
    assert relative_error(int4, expected).mean() < Q4F16_AGAINST_INT4, relative_error(int4, expected).mean()


TRITON_TYPES = {"float32": "TYPE_FP32", "int64": "TYPE_INT64", "float16": "TYPE_FP16"}


def test_triton_config_parses_with_tritons_schema_and_names_the_graphs_io(deployed, request):
    need(GENAI_PYTHON, "tritonclient (.venv-genai)")
    name = deployed["folder"].name
    repository = deployed["folder"] / "triton" / name
    proc = subprocess.run(
        [str(GENAI_PYTHON), str(WORKERS / "triton_config.py"), str(repository / "config.pbtxt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads(proc.stdout)
    inputs, outputs = graph_io(load_graph(repository / "1" / "model.onnx"))

    def as_triton(specs):
        return [
            {
                "name": t.name,
                "data_type": TRITON_TYPES[t.dtype],
                "dims": [d if isinstance(d, int) else -1 for d in t.dims],
            }
            for t in specs
        ]

    assert config["name"] == name and config["platform"] == "onnxruntime_onnx"
    assert config["max_batch_size"] == 0 and config["instance_kinds"] == ["KIND_CPU"]
    assert config["inputs"] == as_triton(inputs)
    assert config["outputs"] == as_triton(outputs)
    assert (repository / "1" / "model.onnx").samefile(deployed["folder"] / "model.onnx") or os.environ.get(
        "GPT2ONNX_NO_LINKS"
    )
    record(
        request,
        runtime="Triton config (tritonclient model_config_pb2)",
        variant=deployed["variant"],
        against="the graph's IO",
        max_abs_delta_logits=None,
        tokens_equal=None,
    )


HOSTILE_NAMES = [
    'logits" } ] instance_group [ { kind: KIND_GPU count: 1 }, { kind: KIND_CPU count: 1 } ] output [ { name: "x',
    "line\nbreak",
    "back\\slash\\",
    "nul\x00tab\t",
    "quote'single",
    "unicode \u00e9\u2028",
]


def test_triton_config_escapes_hostile_tensor_names(tmp_path):
    """A graph's tensor names go into config.pbtxt as escaped strings: Triton's own parser reads each name back
    as it is, and no name adds a field (an instance kind, an output)."""
    from gpt2onnx.artifact.contract import TensorSpec
    from gpt2onnx.targets.triton import config_pbtxt

    need(GENAI_PYTHON, "tritonclient (.venv-genai)")
    inputs = [TensorSpec("input_ids", "int64", ("batch", "seq"))]
    outputs = [TensorSpec(name, "float32", ("batch", "seq", 7)) for name in HOSTILE_NAMES]
    path = tmp_path / "config.pbtxt"
    path.write_text(config_pbtxt("m", inputs, outputs))
    proc = subprocess.run(
        [str(GENAI_PYTHON), str(WORKERS / "triton_config.py"), str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads(proc.stdout)
    assert [t["name"] for t in config["outputs"]] == HOSTILE_NAMES
    assert config["instance_kinds"] == ["KIND_CPU"]


@pytest.mark.parametrize("cache", ["int8", "int4"])
def test_triton_config_of_a_quantized_cache(tiny_folder, tmp_path, cache):
    """A quantized K/V cache's int8 and packed uint8 tensors are TYPE_INT8 and TYPE_UINT8 in config.pbtxt, read back
    by Triton's own schema (once refused: "Triton's ONNX Runtime backend has no type for" int8)."""
    from gpt2onnx.exporters.export import ExportOptions, export

    need(GENAI_PYTHON, "tritonclient (.venv-genai)")
    options = ExportOptions(fusion="ort-shared-kv", kv_cache=cache, validate=False)
    folder = export(str(tiny_folder), tmp_path / "m", options=options).folder
    deploy(folder, "triton")
    config_file = next((folder / "triton").glob("*/config.pbtxt"))
    proc = subprocess.run(
        [str(GENAI_PYTHON), str(WORKERS / "triton_config.py"), str(config_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    pasts = [t for t in json.loads(proc.stdout)["inputs"] if t["name"].startswith("past_key_values.")]
    assert pasts and {t["data_type"] for t in pasts} == {"TYPE_INT8" if cache == "int8" else "TYPE_UINT8"}


def test_formats_escape_for_their_readers():
    """One escaping rule per written format, each read back by that format's own reader."""
    import yaml
    from google.protobuf import text_format

    from gpt2onnx.targets.formats import html_text, pbtxt_string, script_json, yaml_comment, yaml_string

    for name in HOSTILE_NAMES + ["</script><script>alert(1)</script>", "<!--", "a: b # c"]:
        tokenizer = text_format.Tokenizer([f"name: {pbtxt_string(name)}"])
        assert tokenizer.ConsumeIdentifier() == "name" and tokenizer.TryConsume(":")
        assert tokenizer.ConsumeString() == name and tokenizer.AtEnd()
        text = f"key: {yaml_string(name)}  # {yaml_comment(name)}\nnext: 1\n"
        assert yaml.safe_load(text) == {"key": name, "next": 1}
        data = script_json({"name": name})
        assert "<" not in data and ">" not in data and "\u2028" not in data and json.loads(data) == {"name": name}
        assert "<" not in html_text(name) and '"' not in html_text(name)


def test_deploy_records_targets_and_keeps_the_plain_folder(deployed):
    from gpt2onnx.artifact.folder import open_folder

    folder, manifest = deployed["folder"], deployed["manifest"]
    assert set(manifest.deploy.targets) == {"genai", "transformers-js", "triton"}
    assert "genai_config.json" in manifest.files and "model.onnx" in manifest.files
    from gpt2onnx.precisions.all_precisions import precision_of

    opened = open_folder(folder)  # the plain folder still opens, hashes and all
    assert (
        precision_of(opened.facts).name
        == {"fp32": "float32", "fp32-ort": "float32", "int4": "int4", "int8": "int8"}[deployed["variant"]]
    )
    config = json.loads((folder / "config.json").read_text())
    assert (
        config["transformers.js_config"]["dtype"]
        == {"fp32": "fp32", "fp32-ort": "fp32", "int4": "q4", "int8": "q8"}[deployed["variant"]]
    )
    genai = json.loads((folder / "genai_config.json").read_text())
    assert genai["model"]["context_length"] == 128 and genai["model"]["decoder"]["head_size"] == 16
    assert genai["model"]["eos_token_id"] == 999 and genai["search"]["past_present_share_buffer"] is False


def test_deploy_in_place_with_external_data(tiny_folder, tmp_path):
    """In place, on an external-data fp16 folder: the data file is linked under each target's name."""
    from gpt2onnx.exporters.export import ExportOptions, export

    folder = export(
        str(tiny_folder), tmp_path / "ext", options=ExportOptions(external_data=True, dtype="fp16", validate=False)
    ).folder
    deploy(folder, ["transformers-js", "triton"])
    assert (folder / "onnx" / "model_fp16.onnx_data").samefile(folder / "model.onnx_data")
    graph = load_graph(folder / "onnx" / "model_fp16.onnx")
    assert {e.value for i in graph.graph.initializer for e in i.external_data if e.key == "location"} == {
        "model_fp16.onnx_data"
    }
    config = json.loads((folder / "config.json").read_text())["transformers.js_config"]
    assert config == {"dtype": "fp16", "use_external_data_format": {"model_fp16.onnx": 1}}
    assert (folder / "triton" / "ext" / "1" / "model.onnx_data").is_file()
    result = deploy(folder, "genai")  # again: only genai now, the others dropped
    assert set(result.targets) == {"genai"} and result.folder == folder
    assert not (folder / "onnx").exists() and "transformers.js_config" not in json.loads(
        (folder / "config.json").read_text()
    )


def test_genai_config_token_ids_and_shared_cache(tiny_export, tmp_path):
    from gpt2onnx.artifact.genai_config import genai_config
    from gpt2onnx.targets.genai import write_genai_config

    folder = Path(shutil.copytree(tiny_export, tmp_path / "m"))
    manifest = json.loads((folder / "gpt2onnx.json").read_text())
    (folder / "gpt2onnx.json").write_text(json.dumps({**manifest, "kv_cache": "shared"}))
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(
        json.dumps({**generation, "max_length": 50, "top_k": 7, "pad_token_id": 3})
    )
    config = genai_config(folder)
    # the graph concatenates its cache (no GroupQueryAttention): the manifest's claim is not trusted
    assert config["search"]["past_present_share_buffer"] is False
    assert (config["search"]["max_length"], config["search"]["top_k"], config["model"]["pad_token_id"]) == (50, 7, 3)
    assert json.loads(write_genai_config(folder, tmp_path).read_text()) == config
    (folder / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": 1000}))
    with pytest.raises(BadInput, match="eos_token_id 1000 in '.*' is not a token id: an integer from 0 to 999"):
        genai_config(folder)


def test_deploy_refuses_what_it_cannot_deploy(tiny_folder, tiny_export, tmp_path):
    from gpt2onnx.exporters.export import ExportOptions, export

    with pytest.raises(BadInput, match="unknown --target"):
        parse_targets("genai,onnxruntime-web")
    block = export(str(tiny_folder), tmp_path / "block", options=ExportOptions(block=0, validate=False)).folder
    with pytest.raises(ContractError, match="single-block"):
        deploy(block, "genai", out=tmp_path / "x")
    with pytest.raises(BadInput, match="already exists"):
        deploy(tiny_export, "genai", out=block)
    with pytest.raises(BadInput, match="Triton model name"):
        deploy(tiny_export, "triton", out=tmp_path / "y", triton_name="a b")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_deploy_cli(tiny_export, tmp_path):
    from typer.testing import CliRunner

    from gpt2onnx.cli import app

    result = CliRunner().invoke(
        app, ["deploy", str(tiny_export), "--target", "triton", "-o", str(tmp_path / "d"), "--triton-device", "gpu"]
    )
    assert result.exit_code == 0, result.output
    assert "KIND_GPU" in (tmp_path / "d" / "triton" / "d" / "config.pbtxt").read_text()
    result = CliRunner().invoke(app, ["deploy", str(tiny_export), "--target", "nope"])
    assert result.exit_code != 0


def test_the_project_venv_keeps_onnxruntime_gpu_after_the_set_up():
    """onnxruntime-genai installs the CPU onnxruntime over onnxruntime-gpu: it lives in .venv-genai only."""
    from importlib import metadata

    import onnxruntime

    try:
        metadata.version("onnxruntime-gpu")
    except metadata.PackageNotFoundError:
        pytest.skip(
            "this platform's venv has the CPU onnxruntime (pyproject: onnxruntime-gpu on x86-64 Linux/Windows only)"
        )

    assert "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "show", "onnxruntime-genai"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0, (
        "onnxruntime-genai is installed in the project venv: remove it, it belongs in .venv-genai"
    )
