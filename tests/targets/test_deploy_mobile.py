"""deploy --target mobile on the trained test model (fp32 unfused, the ort profile, int4): the ORT file runs in
onnxruntime (which reads the ORT format on every platform) with the ONNX folder's greedy tokens, on this CPU and
on an emulated aarch64 (QEMU's Neoverse-N1 with onnxruntime's aarch64 wheel, scripts/setup-arm64.sh); the
reduced-build configuration names the ops of the converted graph; onnxruntime's usability checker's report names
the providers.

Tolerances: greedy tokens must be equal (the trained model's top tokens are not near ties at these prompts:
tests/verify/test_portability.py checks the same on these CPUs). The prompt step's logits of the ORT file against the
ONNX folder run as ``generate`` runs it (all of onnxruntime's optimizations, so other fused kernels and another order
of sums): fp32 within 1e-4, the project's fp32 gate; the int4 file runs the same MatMulNBits kernels in both and
differs by the float order of the fused ops around them: the same bound.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

from gpt2onnx.targets import mobile
from gpt2onnx.targets.deploy import deploy

ROOT = Path(__file__).resolve().parents[2]
ARM = ROOT / ".arm64"  # scripts/setup-arm64.sh: Debian's arm64 python3.11 and onnxruntime's aarch64 wheel
NEW_TOKENS = 12
LOGITS_TOLERANCE = 1e-4
# greedy tokens from ORT files with onnxruntime and numpy alone (under emulation, importing onnx and gpt2onnx's run
# path takes another 15 s): prompt step with an empty past, then one token per step, presents fed back as the past
RUN_ORT = """
import json, sys
import numpy as np, onnxruntime as ort
jobs, out = json.loads(sys.argv[1]), {}
for name, job in jobs.items():
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(job["ort"], options, providers=["CPUExecutionProvider"])
    ids = np.asarray(job["prompts"], np.int64)
    rows, total = ids.shape
    past = {i.name: np.zeros((rows, i.shape[1], 0, i.shape[3]), np.float32)
            for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    names = ["logits"] + [n.replace("past_key_values", "present") for n in past]
    tokens, step = [], ids
    for _ in range(job["new"]):
        feed = {"input_ids": step, "attention_mask": np.ones((rows, total), np.int64),
                "position_ids": np.tile(np.arange(total - step.shape[1], total), (rows, 1)), **past}
        logits, *presents = session.run(names, feed)
        step = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        tokens.append(step[:, 0].tolist())
        past = dict(zip(past, presents))
        total += 1
    out[name] = np.asarray(tokens).T.tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def deployed(trained_export, tmp_path_factory) -> dict[str, Path]:
    """Each variant exported and deployed for mobile (in-process: one export, two optimizes, three deploys)."""
    from gpt2onnx.exporters.optimize import optimize
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    work = tmp_path_factory.mktemp("mobile")
    ort_folder = optimize(trained_export, work / "fp32-ort", fusion="ort").folder
    int4 = optimize(ort_folder, work / "int4", fusion="none", quantization=QuantizeOptions("int4")).folder
    sources = {"fp32": trained_export, "fp32-ort": ort_folder, "int4": int4}
    return {name: deploy(folder, "mobile", out=work / f"{name}-mobile").folder for name, folder in sources.items()}


@pytest.fixture(scope="module")
def prompts(trained_checkpoint) -> list[list[int]]:
    from tokenizers import Tokenizer

    text = (trained_checkpoint / "heldout.txt").read_text(encoding="utf-8")
    ids = Tokenizer.from_file(str(trained_checkpoint / "tokenizer.json")).encode(text[:2000]).ids
    return [ids[:16], ids[100:116]]


def jobs(deployed, prompts) -> dict:
    from gpt2onnx.artifact.generation import read_generation_config

    out = {}
    for name, folder in deployed.items():
        config = read_generation_config(folder, vocab_size=None)
        out[name] = {
            "ort": str(folder / mobile.SUBFOLDER / mobile.ORT_FILE),
            "prompts": prompts,
            "new": NEW_TOKENS,
            "eos": list(config.eos_token_ids),
            "pad": config.pad_token_id if config.pad_token_id is not None else config.eos_token_ids[0],
        }
    return out


@pytest.fixture(scope="module")
def folder_tokens(deployed, prompts) -> dict[str, list[list[int]]]:
    """The ONNX folders' greedy tokens, by gpt2onnx.generate (model.onnx, onnxruntime's default optimizations)."""
    from gpt2onnx.decoding.generate import generate

    ids = [",".join(map(str, p)) for p in prompts]
    return {name: generate(folder, ids=ids, max_new_tokens=NEW_TOKENS).tokens for name, folder in deployed.items()}


def _same(decoded: list[list[int]], generated: list[list[int]], pad: int) -> bool:
    """decode's rows (padded after a row ends) hold generate's (which end at end-of-sequence)."""
    return len(decoded) == len(generated) and all(
        row[: len(want)] == want and set(row[len(want) :]) <= {pad} for row, want in zip(decoded, generated)
    )


def test_the_ort_file_generates_the_folders_tokens(deployed, prompts, folder_tokens):
    """model.ort in onnxruntime (this CPU), through the package's stepper and decode loop, gives generate's tokens
    on the ONNX folder; its prompt-step logits are within the fp32 gate of model.onnx's."""
    import onnxruntime as ort

    from gpt2onnx.decoding.generate import decode
    from gpt2onnx.runtimes.decoder import OnnxDecoder

    for name, job in jobs(deployed, prompts).items():
        decoder = OnnxDecoder(ort.InferenceSession(job["ort"], providers=["CPUExecutionProvider"]))
        ids = np.asarray(prompts, np.int64)
        tokens = decode(decoder, ids, max_new_tokens=NEW_TOKENS, eos_token_id=job["eos"], pad_token_id=job["pad"])
        assert _same(tokens.tokens.tolist(), folder_tokens[name], job["pad"]), (name, tokens.tokens)
        reference = ort.InferenceSession(str(deployed[name] / "model.onnx"), providers=["CPUExecutionProvider"])
        feed = mobile.prompt_feed(onnx.load(str(deployed[name] / "model.onnx"), load_external_data=False), prompts[0])
        got, want = decoder.session.run(["logits"], feed)[0], reference.run(["logits"], feed)[0]
        assert np.abs(got - want).max() <= LOGITS_TOLERANCE, name


def _graph_ops(graph: onnx.GraphProto) -> set[tuple[str, str]]:
    ops = set()
    for node in graph.node:
        ops.add((node.domain or "ai.onnx", node.op_type))
        for attribute in node.attribute:
            if attribute.HasField("g"):
                ops |= _graph_ops(attribute.g)
    return ops


def test_the_config_names_the_converted_graphs_ops(deployed, tmp_path):
    """The reduced-build configuration lists exactly the op types of the graph onnxruntime converted (its basic
    optimizations saved as ONNX here, by another path: a session's optimized_model_filepath), each at the version
    the model's opset gives it; the folder's com.microsoft ops are all there, and the basic level adds none."""
    import onnxruntime as ort
    from onnxruntime.tools.reduced_build_config_parser import parse_config

    for name, folder in deployed.items():
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(str(tmp_path / f"{name}.onnx"))
        source = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        for config in (mobile.OPS_CONFIG, mobile.TYPES_CONFIG):
            ops, _ = parse_config(str(folder / mobile.SUBFOLDER / config), config == mobile.TYPES_CONFIG)
            listed = {(domain, op) for domain, versions in ops.items() for names in versions.values() for op in names}
            assert listed == _graph_ops(optimized.graph), (name, config)
        contrib = {op for domain, op in _graph_ops(source.graph) if domain == "com.microsoft"}
        assert {op for domain, op in listed if domain == "com.microsoft"} == contrib, name
        assert listed <= _graph_ops(source.graph), name  # basic optimizations only fold and remove
        opset = next(o.version for o in source.opset_import if o.domain in ("", "ai.onnx"))
        for version, names in ops["ai.onnx"].items():
            for op in names:
                assert onnx.defs.get_schema(op, opset).since_version == version, (name, op, version)


def test_the_reduced_package_verdict():
    """The check against onnxruntime-mobile 1.18's ops reads op versions: MatMul 13 is in it (the config names 13),
    Add 14 is not (it names 12 and 13), And 7 is (unchanged since 7, so 12 names it); MatMulNBits is not; nor are
    fp16 types (it was built for float, int8 and uint8)."""
    ops = {"ai.onnx": {13: {"MatMul"}, 14: {"Add"}, 7: {"And"}}, "com.microsoft": {1: {"MatMulNBits", "FusedMatMul"}}}
    assert mobile.missing_from_reduced_package(ops) == ["ai.onnx:Add:14", "com.microsoft:MatMulNBits:1"]
    types = 'ai.onnx;13;MatMul{"inputs": {"0": ["MLFloat16"]}}'
    assert mobile.missing_from_reduced_package({"ai.onnx": {13: {"MatMul"}}}, types) == ["type:MLFloat16"]


def test_the_usability_report_and_the_record(deployed, tmp_path):
    """onnxruntime's usability checker's report names NNAPI and both CoreML formats, counts the converted graph's
    nodes, and lists the com.microsoft ops among those no provider takes; the manifest records the target's files and
    its summary, which the CLI prints."""
    from typer.testing import CliRunner

    from gpt2onnx.cli.app import app

    for name, folder in deployed.items():
        report = mobile.load_report(folder)
        assert set(report["providers"]) == {"NNAPI", "CoreML MLProgram", "CoreML NeuralNetwork"}, name
        manifest = json.loads((folder / "gpt2onnx.json").read_text())
        files = manifest["deploy"]["targets"]["mobile"]
        for path in files:
            assert (folder / path).is_file(), path
        assert {"mobile/model.ort", "mobile/tokenizer.json", "mobile/generation_config.json"} <= set(files)
        source = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        contrib = {f"com.microsoft:{op}" for domain, op in _graph_ops(source.graph) if domain == "com.microsoft"}
        for provider, row in report["providers"].items():
            assert 0 <= row["supported"] < row["nodes"] and contrib <= set(row["unsupported_ops"]), (name, provider)
        record = manifest["deploy"]["mobile"]
        assert record["read_back_max_diff"] == 0.0 and record["optimization"] == "basic (fixed)"
        assert (folder / "mobile" / "usability.md").read_text().count("## ") == 3
    result = CliRunner().invoke(app, ["deploy", str(deployed["fp32"]), "--target", "mobile", "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "NNAPI" in result.output and "CoreML MLProgram" in result.output and "XNNPACK" in result.output


def test_the_ort_file_on_emulated_arm(deployed, prompts, folder_tokens):
    """The same ORT files on an emulated Neoverse-N1 (aarch64, NEON with dot product: onnxruntime's ARM kernels),
    run by a greedy loop of onnxruntime and numpy alone, give the ONNX folders' greedy tokens."""
    python = ARM / "root" / "usr" / "bin" / "python3.11"
    if not python.is_file() or shutil.which("qemu-aarch64") is None or os.geteuid() != 0:
        message = "no aarch64 python (.arm64): run scripts/setup.sh as root (it runs scripts/setup-arm64.sh)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    work = jobs(deployed, prompts)
    inner = ["env", f"PYTHONPATH={ARM / 'site'}:{ROOT}", "qemu-aarch64", "-cpu", "neoverse-n1", "-L", str(ARM / "root")]
    inner += [str(python), "-c", RUN_ORT, json.dumps(work)]
    # QEMU 7.2 shows the host's x86 /proc/cpuinfo, on which onnxruntime's CPU detection crashes: an ARM one over it
    script = f"mount --bind {ARM / 'cpuinfo'} /proc/cpuinfo && exec " + " ".join(map(shlex.quote, inner))
    done = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    for name in work:  # generate's rows end at end-of-sequence; this loop goes on
        assert [row[: len(want)] for row, want in zip(tokens[name], folder_tokens[name])] == folder_tokens[name], name
