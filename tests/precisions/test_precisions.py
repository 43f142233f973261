"""Precisions as plug-ins (gpt2onnx/precisions): the registry lists every precision module, the rest of the package
names none of them, each written precision is told back from its graph, and the near-lossless int8-weights tier
exports, passes its own checks, is refused when damaged and is accepted by the CUDA kernel table."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import gpt2onnx.precisions as package
from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.errors import CheckFailed
from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.precisions.all_precisions import PRECISIONS, precision_of
from gpt2onnx.precisions.precision import Precision
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.runtimes.providers import ProviderConfig, check_kernels, unsupported_nodes

ROOT = Path(__file__).resolve().parents[2]


def test_the_registry_lists_every_precision_module():
    declared = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Precision):
                declared[value.name] = value
    assert declared == PRECISIONS
    assert list(PRECISIONS) == ["float32", "tf32", "float16", "int8", "int4", "int8-weights"]


# The precision keys: what --quantize and --dtype take, and the names the registry gives them. Outside the precision
# modules each may appear only where it is not a precision: an ONNX element type, another tool's spelling, a manifest
# record's key, an option's name (each allowed line below says which).
_KEYS = re.compile(r"""["'](int4|int8|int8-weights|fp16|fp32|tf32)["']""")
_NOT_A_PRECISION = {
    ("artifact/contract.py", '3: "int8"'): "ONNX's element type names",
    ("artifact/contract.py", '"tensor(int8)": "int8"'): "ONNX Runtime's element type names",
    ("benchmarks/bench.py", "'fp16' if half else 'fp32'"): "torch's dtype in a label",
    ("runtimes/providers.py", '("int8",)'): "the ONNX element type MatMulInteger's activations must have on CUDA",
    ("targets/triton.py", '"int8": "TYPE_INT8"'): "ONNX's element type names (Triton's type map)",
    ("runtimes/providers.py", '"tf32": "--tf32"'): "the provider option's name",
    ("runtimes/providers.py", 'cache_dir / "tf32"'): "a cache folder's name",
    ("runtimes/openvino.py", "_SPELLINGS"): "OpenVINO's INFERENCE_PRECISION_HINT spellings",
    ("benchmarks/timing.py", 'extra["tf32"]'): "a record's key",
    ("cli/render.py", '"tf32"'): "a record's key",
    ("benchmarks/bench.py", '"tf32"'): "a record's key",
    ("passes/pipeline.py", '"fp16": self.fp16'): "the manifest record's key",
    ("passes/pipeline.py", 'record: ClassVar[str] = "fp16"'): "the manifest record's key",
    ("passes/pipeline.py", 'timing: ClassVar[str] = "fp16"'): "a timing's key",
    ("artifact/manifest.py", '"fp16"'): "the manifest record's key",
    ("benchmarks/compare/compare.py", "optimum-cli's --weight-format values"): "OpenVINO's weight formats",
    ("benchmarks/compare/compare.py", "its quantizations"): "CTranslate2's quantization names",
    ("benchmarks/compare/engine_worker.py", "optimum-cli's --weight-format value"): "OpenVINO's weight format",
    ("artifact/inspect.py", '"fp16"'): "the manifest record's key",
}


def test_no_precision_key_outside_the_precision_modules():
    found = []
    for path in sorted((ROOT / "gpt2onnx").rglob("*.py")):
        relative = path.relative_to(ROOT / "gpt2onnx").as_posix()
        if relative.startswith("precisions/"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _KEYS.search(line) and not any(
                relative == file and fragment in line for file, fragment in _NOT_A_PRECISION
            ):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert found == []


@pytest.fixture(scope="module")
def trained_ort(trained_checkpoint, tmp_path_factory):
    from gpt2onnx.exporters.export import ExportOptions, export

    out = tmp_path_factory.mktemp("precisions") / "fp32-ort"
    return export(str(trained_checkpoint), out, options=ExportOptions(fusion="ort")).folder


def _written(source, out, **options):
    return optimize(source, out, fusion="ort", quantization=QuantizeOptions(**options))


@pytest.mark.parametrize("method", ["int8", "int4", "int8-weights"])
def test_each_quantized_precision_is_told_back_from_its_graph(trained_ort, tmp_path, method):
    result = _written(trained_ort, tmp_path / method, method=method)
    assert result.check.passed, result.check.summary()
    assert precision_of(open_folder(result.folder).facts).name == method == result.manifest.precision


def test_int8_weights_is_near_lossless_and_runs_on_cuda(trained_ort, tmp_path):
    """int8-weights: every block weight at 8 bits (MatMulNBits), the head and the embeddings fp32 by its recipe or
    at 8 bits (GatherBlockQuantized, one stored table), checked against its own gates and as a file; its graph
    passes CUDA's kernel table, where int8's MatMulInteger graph is refused."""
    recipe = _written(trained_ort, tmp_path / "w8-recipe", method="int8-weights").manifest.quantization
    assert (recipe.lm_head, recipe.embeddings, set(recipe.ops)) == ("fp32", "fp32", {"MatMulNBits (8-bit)"})
    result = _written(trained_ort, tmp_path / "w8", method="int8-weights", lm_head="int8", embeddings="int8")
    record = result.manifest.quantization
    assert record.method == "int8-weights" and record.shared_embedding == "wte.weight"
    assert set(record.ops) == {"MatMulNBits (8-bit)", "GatherBlockQuantized (8-bit)"}
    # the trained test model measured KL 1.6e-5 at accuracy level 4 (int8 activations per block, AVX-512 VNNI) on
    # this check's random prompts, 8.0e-6 at level 0 (what a CPU without AVX2 computes); int8 (per-tensor uint8
    # activations) reads 3e-5 to 1e-4. Half the gate leaves 3x room for another CPU's int8 kernel path and still
    # separates this tier from int8
    assert result.check.measured.kl.mean < 1e-4 / 2
    assert result.check.rounded.measured.weights.max_steps <= 1.001
    graph = load_graph(result.folder / "model.onnx")
    assert unsupported_nodes(graph, "cuda") == {}
    check_kernels(graph, ProviderConfig(name="cuda"))  # accepted: no refusal before a session
    int8 = _written(trained_ort, tmp_path / "int8", method="int8")
    assert "MatMulInteger" in unsupported_nodes(load_graph(int8.folder / "model.onnx"), "cuda")


def test_int8_weights_damaged_is_refused(trained_ort, tmp_path, monkeypatch):
    """4-bit weights declared 8: the file check refuses them, nothing is written."""
    import gpt2onnx.precisions.weights as weights

    real = weights.matmul_nbits
    monkeypatch.setattr(weights, "matmul_nbits", lambda model, options, **kw: real(model, options, **{**kw, "bits": 4}))
    with pytest.raises(CheckFailed, match="validation failed: int8-weights") as failed:
        _written(trained_ort, tmp_path / "damaged", method="int8-weights")
    assert any("weights are not the declared rounding" in f for f in failed.value.report.failures)
    assert not (tmp_path / "damaged").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"method": "int8-weights", "algorithm": "hqq"}, "--algorithm applies to int4: drop it"),
        ({"method": "int8-weights", "lm_head": "int4"}, "--lm-head 'int4' is not valid with --quantize int8-weights"),
        ({"method": "int8-weights", "mixed_int8": 10}, "--mixed-int8 applies to int4"),
        ({"method": "int8", "accuracy_level": 4}, "--accuracy-level applies to int4 or int8-weights"),
        ({"method": "int2"}, "unknown --quantize 'int2': choose one of none, int8, int4, int8-weights"),
    ],
)
def test_options_a_precision_does_not_take_are_refused(options, message):
    from gpt2onnx.errors import BadInput

    with pytest.raises(BadInput, match=re.escape(message)):
        QuantizeOptions(**options)


def test_a_graph_without_quantized_ops_is_its_dtype(tiny_export):
    facts = open_folder(tiny_export).facts
    assert precision_of(facts).name == "float32" and not facts.quantized_ops
