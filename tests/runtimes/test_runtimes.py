"""Runtimes: onnxruntime, OpenVINO and onnxruntime-genai on tiny exports, each against PyTorch with the
precision's gates, the same greedy tokens, bench side by side, and the one-line errors when one cannot run.

OpenVINO comes with the set-up (scripts/setup.sh installs it into .venv); onnxruntime-genai lives in its own
.venv-genai (its wheel replaces onnxruntime-gpu). A runtime that is not installed is skipped, with the reason."""

import ast
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.benchmarks.bench import bench
from gpt2onnx.benchmarks.timing import BenchConfig
from gpt2onnx.capabilities import UnsupportedRuntime
from gpt2onnx.cli import app
from gpt2onnx.decoding.generate import generate
from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.runtimes import genai
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime, parse_runtimes, runtime_options
from gpt2onnx.runtimes.openvino import OpenVinoSettings
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.verify.parity import parity


def _openvino_missing() -> str | None:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return "openvino is not installed (bash scripts/setup.sh installs it)"
    return None


def _genai_missing() -> str | None:
    if genai.in_process() or genai.genai_python():
        return None
    return "onnxruntime-genai is not installed (bash scripts/setup.sh creates .venv-genai)"


MISSING = {"onnxruntime": lambda: None, "openvino": _openvino_missing, "genai": _genai_missing}


def runtime_param(name):
    reason = MISSING[name]()
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


ALL = [runtime_param(name) for name in MISSING]  # the runtimes of an exported folder (ort-generate runs a deployed one)


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    """The built-in tiny architecture, random weights with GPT-2's init spread, weights in int4."""
    out = tmp_path_factory.mktemp("int4") / "tiny-int4"
    return export("tiny", out, random_init=True, options=ExportOptions(quantization=QuantizeOptions("int4"))).folder


@pytest.mark.parametrize("name", ALL)
def test_parity_fp32_on_each_runtime(tiny_export, name):
    report = parity(tiny_export, runtime=RuntimeOptions(name=name), cases=4)
    assert report.passed, report.summary()
    assert report.runtime == name
    assert report.measured.tokens_equal_cases == 4
    if name == "genai":  # no presents exposed: none compared, the gate does not apply
        assert report.measured.present is None and all(c["case"]["batch"] == 1 for c in report.cases)
    else:
        assert report.measured.present.max <= report.gates["present"]


@pytest.mark.parametrize("name", ALL)
def test_parity_int4_on_each_runtime(tiny_int4, name):
    report = parity(tiny_int4, runtime=RuntimeOptions(name=name), cases=3)
    assert report.precision == "int4" and report.passed, report.summary()
    assert report.measured.kl.mean < 0.01 and report.measured.top5_agreement >= 0.95


@pytest.mark.skipif(_openvino_missing() is not None, reason=str(_openvino_missing()))
def test_openvino_s_refusal_says_why(tmp_path):
    """Blocks wider than the model's 64-wide embedding (a user's --block-size 128; the recipe fits its own): the
    8-bit GatherBlockQuantized runs on onnxruntime, OpenVINO's frontend refuses it. Its reason in one line, not the
    frame its error text opens with ("Exception from src/inference/src/cpp/core.cpp:84:")."""
    options = ExportOptions(quantization=QuantizeOptions("int4", 128), validate=False)
    folder = export("tiny", tmp_path / "b128", random_init=True, options=options).folder
    with pytest.raises(RuntimeUnavailable) as refused:
        open_runtime(open_folder(folder), RuntimeOptions(name="openvino"))
    message = str(refused.value)
    assert "\n" not in message and "Exception from" not in message
    assert "quantize dimension (64) must be a multiple of block_size (128)" in message


@pytest.mark.parametrize("name", ALL)
def test_generate_gives_the_same_greedy_tokens(tiny_export, name):
    ids = ["1,2,3,4,5", "7,8"]  # rows of different lengths: a left-padded batch
    ours = generate(tiny_export, ids=ids, max_new_tokens=6, runtime=RuntimeOptions(name=name))
    want = generate(tiny_export, ids=ids, max_new_tokens=6)
    assert ours.tokens == want.tokens


def test_bench_measures_every_runtime_side_by_side(tiny_export, tmp_path):
    names = [n for n in MISSING if MISSING[n]() is None]
    out = tmp_path / "bench.json"
    result = runner_invoke(
        "bench",
        tiny_export,
        "--runtime",
        ",".join(names),
        "--batch",
        "1,2",
        "--prompt-len",
        "8",
        "--new-tokens",
        "4",
        "--warmup",
        "0",
        "--repeat",
        "2",
        "--json",
        out,
    )
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["runtime"], r["batch"]) for r in runs] == [(n, b) for n in names for b in (1, 2)]
    for run in runs:
        assert run["label"] == f"{tiny_export.name} {run['runtime']}"
        assert run["prompt_ms"]["p50"] > 0 and set(run["decode_ms"]) == {"p50", "p90", "p99"}
        assert run["tokens_per_s"] > 0 and run["peak_host_bytes"] > 0


def test_bench_api_keeps_one_runtime_labels(tiny_export):
    result = bench(tiny_export, config=BenchConfig(batches=(1,), prompt_len=4, new_tokens=3, warmup=0, repeat=1))
    assert [(r.label, r.runtime, r.engine) for r in result.runs] == [(tiny_export.name, "onnxruntime", "onnxruntime")]


@pytest.mark.parametrize("name", [runtime_param("openvino")])
def test_cli_parity_on_openvino(tiny_export, name):
    result = runner_invoke("parity", tiny_export, "--runtime", name, "--cases", "2")
    assert result.exit_code == 0, result.output
    assert "parity on openvino/CPU" in result.output


@pytest.mark.parametrize("name", [runtime_param("genai")])
def test_genai_config_written_on_the_fly_leaves_the_folder_alone(tiny_export, name):
    runner = open_runtime(open_folder(tiny_export), RuntimeOptions(name=name))
    try:
        assert runner.config_written and not (tiny_export / genai.CONFIG_FILE).exists()
        forced = runner.run_loop([1, 2, 3], max_new_tokens=0, forced=[4, 5], return_logits=True)
        assert [lg.shape for lg in forced.logits] == [(3, 1000), (1, 1000), (1, 1000)]
    finally:
        runner.close()
    assert not runner.tmp.exists()


def test_genai_config_names_the_contract(tiny_export):
    config = genai.genai_config(open_folder(tiny_export))
    decoder = config["model"]["decoder"]
    assert decoder["num_hidden_layers"] == 2 and decoder["num_attention_heads"] == 4 and decoder["head_size"] == 16
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert decoder["outputs"]["present_value_names"] == "present.%d.value"
    assert 0 <= config["model"]["eos_token_id"] < config["model"]["vocab_size"] == 1000
    assert config["search"]["past_present_share_buffer"] is False


def test_genai_worker_imports_only_numpy_and_genai():
    tree = ast.parse(Path(genai.WORKER).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert names - set(sys.stdlib_module_names) - {"__future__"} == {"numpy", "onnxruntime_genai"}


def test_genai_not_installed_is_one_line_with_the_install_command(tiny_export, monkeypatch):
    monkeypatch.setattr(genai, "in_process", lambda: False)
    monkeypatch.setattr(genai, "genai_python", lambda: None)
    with pytest.raises(RuntimeUnavailable, match=r"not installed: python3 -m venv \.venv-genai") as error:
        open_runtime(open_folder(tiny_export), RuntimeOptions(name="genai"))
    assert "\n" not in str(error.value)


def test_genai_python_that_lacks_it_is_refused(tiny_export, monkeypatch):
    if _has_genai_here():
        pytest.skip("onnxruntime_genai is importable in this Python")
    monkeypatch.setattr(genai, "in_process", lambda: False)
    monkeypatch.setenv(genai.PYTHON_ENV, sys.executable)  # this Python has no onnxruntime_genai
    with pytest.raises(RuntimeUnavailable, match="not installed in"):
        open_runtime(open_folder(tiny_export), RuntimeOptions(name="genai"))


def _has_genai_here() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def test_openvino_not_installed_is_one_line(tiny_export, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(RuntimeUnavailable, match="pip install openvino"):
        open_runtime(open_folder(tiny_export), RuntimeOptions(name="openvino"))


@pytest.mark.parametrize("name", [runtime_param("openvino")])
def test_openvino_refuses_a_device_it_does_not_list(tiny_export, name):
    import openvino

    if "NPU9" in openvino.Core().available_devices:
        pytest.skip("the device exists here")
    result = runner_invoke("generate", tiny_export, "--ids", "1,2", "--runtime", name, "--device", "NPU9")
    assert result.exit_code == 3 and "cannot use device 'NPU9'" in result.output


@pytest.mark.parametrize("name", [runtime_param("openvino")])
def test_openvino_precision_is_f32_unless_asked(tiny_export, name):
    decoder = open_runtime(open_folder(tiny_export), RuntimeOptions(name=name))
    assert decoder.compiled.get_property("INFERENCE_PRECISION_HINT").to_string() == "f32"
    ids = np.array([[1, 2, 3]])
    logits, presents = decoder.step(ids, np.ones_like(ids), np.arange(3)[None], decoder.empty_past(1))
    assert logits.shape == (1, 3, 1000) and len(presents) == 4 and presents[0].shape == (1, 4, 3, 16)


def test_runtime_options_refuse_what_does_not_apply():
    """A runtime's name and its own settings, each checked when built; an option of another runtime is refused."""
    with pytest.raises(BadInput, match="unknown"):
        RuntimeOptions(name="tvm")
    with pytest.raises(BadInput, match="not the onnxruntime runtime's settings"):
        RuntimeOptions("onnxruntime", OpenVinoSettings(device="GPU"))
    with pytest.raises(BadInput, match="--device applies to the openvino runtime, not onnxruntime"):
        runtime_options(["onnxruntime"], {"--device": "GPU"})
    with pytest.raises(BadInput, match="precision 'int3'"):
        OpenVinoSettings(precision="int3")
    assert RuntimeOptions("openvino", OpenVinoSettings(precision="fp16")).settings.precision == "f16"
    ov, ort = runtime_options(
        ["openvino", "onnxruntime"], {"--threads": 2, "--ov-precision": "bf16", "--device": "CPU"}
    )
    assert (ov.settings, ort.settings) == (OpenVinoSettings(precision="bf16", threads=2), ProviderConfig(threads=2))
    with pytest.raises(BadInput, match="twice"):
        parse_runtimes("openvino,openvino")
    assert parse_runtimes("onnxruntime,genai,openvino") == ["onnxruntime", "genai", "openvino"]


def test_cli_refuses_device_without_openvino(tiny_export):
    result = runner_invoke("bench", tiny_export, "--runtime", "onnxruntime", "--device", "GPU")
    assert result.exit_code == 2 and "--device applies to the openvino runtime" in result.output


def test_emulate_fp16_is_onnxruntime_only(tiny_export):
    with pytest.raises(BadInput):
        parity(tiny_export, runtime=RuntimeOptions(name="openvino"), emulate_fp16=True, cases=1)


def runner_invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


PROFILES = ("none", "ort", "ort-shared-kv", "portable", "onnx", "onnx-static-kv")


@pytest.fixture(scope="module")
def profile_exports(tiny_folder, tmp_path_factory):
    """The tiny checkpoint exported with each fusion profile (validated against PyTorch at export)."""
    root = tmp_path_factory.mktemp("profiles")
    return {p: export(str(tiny_folder), root / p, options=ExportOptions(fusion=p)).folder for p in PROFILES}


@pytest.mark.parametrize("name", ALL)
def test_each_runtime_runs_each_profile_at_batch_1_and_2(profile_exports, name):
    """Every runtime on every profile, one prompt and a left-padded batch of two: the greedy tokens of
    onnxruntime on the plain export (itself checked against PyTorch), or a one-line refusal. OpenVINO on the
    shared-cache graph once failed at batch 2 (its GroupQueryAttention reshape); it now runs the rows apart."""
    prompts = {1: ["5,6,7"], 2: ["5,6,7", "9"]}
    expected = {
        batch: generate(profile_exports["none"], ids=ids, max_new_tokens=4).tokens for batch, ids in prompts.items()
    }
    for profile, folder in profile_exports.items():
        for batch, ids in prompts.items():
            if profile == "onnx-static-kv" and name == "openvino":  # its frontend has no TensorScatter-24 rule
                with pytest.raises(UnsupportedRuntime, match="no conversion rule .* for TensorScatter"):
                    generate(folder, ids=ids, max_new_tokens=4, runtime=RuntimeOptions(name=name))
                continue
            result = generate(folder, ids=ids, max_new_tokens=4, runtime=RuntimeOptions(name=name))
            assert result.tokens == expected[batch], (profile, batch, result.tokens, expected[batch])


def test_freed_heap_memory_goes_back_to_the_system():
    """What a session's loading frees stays in glibc's arenas (counted as resident) until malloc_trim: 100 MB of
    64 KB blocks (below malloc's mmap threshold: from the heap) allocated, every other one kept (so the heap cannot
    shrink from its top alone), the rest freed; release_freed_memory gives the freed half back. glibc only: the
    allocator of musl or macOS returns memory by other rules (and there it returns False)."""
    import platform

    from gpt2onnx.runtimes.heap import release_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    blocks = [bytearray(b"x" * (64 << 10)) for _ in range(1600)]
    kept = blocks[::2]
    del blocks
    before = resident()
    assert release_freed_memory() is True
    assert before - resident() > 30 << 20, (before, resident())
    del kept
