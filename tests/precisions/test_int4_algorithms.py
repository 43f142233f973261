"""int4's weight algorithms as plug-ins (gpt2onnx.precisions.algorithms): each exports, passes its own file check and is
refused when its file is damaged, on trained and on random weights; the manifest says which algorithm chose the
weights, and a calibrated one on what text."""

import importlib
import pkgutil
from pathlib import Path

import numpy as np
import onnx
import pytest

import gpt2onnx.precisions.algorithms as int4_package
from gpt2onnx.errors import CheckFailed
from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.precisions.algorithms.all_algorithms import ALGORITHMS, DEFAULT_ALGORITHM
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.verify.gates import file_gates_for
from tests.cli.test_cli import assert_one_line_error, run
from tests.precisions.test_precision_recipes import _damage

HELDOUT = Path(__file__).parents[1] / "fixtures" / "trained-tiny" / "heldout.txt"


def test_the_registry_lists_one_module_per_algorithm():
    assert list(ALGORITHMS) == ["rtn", "hqq", "k-quant", "gptq"] and DEFAULT_ALGORITHM in ALGORITHMS
    modules = {m.name for m in pkgutil.iter_modules(int4_package.__path__)} - {"algorithm", "all_algorithms"}
    declared = {importlib.import_module(f"gpt2onnx.precisions.algorithms.{m}").ALGORITHM.name for m in modules}
    assert declared == set(ALGORITHMS)
    assert [a.name for a in ALGORITHMS.values() if a.calibrated] == ["gptq"]


def test_file_gates_follow_the_algorithm():
    """Round to nearest keeps every weight within a step; an algorithm that moves weights is judged by its RMS bound;
    a manifest from before the algorithm was recorded is round to nearest; an unknown one is refused."""
    assert "weight_steps" in file_gates_for("int4") and "weight_error" not in file_gates_for("int4")
    for name, algorithm in ALGORITHMS.items():
        gates = file_gates_for("int4", algorithm=name)
        if algorithm.weight_error is None:
            assert gates == file_gates_for("int4")
        else:
            assert gates["weight_error"] == algorithm.weight_error and "weight_steps" not in gates
    assert file_gates_for("int4", {"weight_error": 3.0}, algorithm="gptq")["weight_error"] == 3.0
    from gpt2onnx.errors import ContractError

    with pytest.raises(ContractError, match="int4 algorithm 'awq' is unknown"):
        file_gates_for("int4", algorithm="awq")


def _optimize(source, out, algorithm, **options):
    return optimize(source, out, fusion="none", quantization=QuantizeOptions("int4", algorithm=algorithm, **options))


@pytest.mark.parametrize("weights", ["trained", "random"])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_each_algorithm_passes_its_own_file_check(algorithm, weights, trained_export, gpt2_init_export, tmp_path):
    source = trained_export if weights == "trained" else gpt2_init_export
    result = _optimize(source, tmp_path / "q", algorithm)
    assert result.check.passed, result.check.summary()
    record = result.manifest.quantization
    assert record.algorithm == algorithm
    file_check = result.check.rounded
    bound = ALGORITHMS[algorithm].weight_error
    measured = file_check.measured.weights
    if bound is None:
        assert "weight_steps" in file_check.gates and measured.max_steps <= 1.001
    else:
        # the algorithm's weights are its own (not round to nearest: some weight lies more than a step away, or
        # the tensors' RMS error differs from round to nearest's), within its bound
        assert file_check.gates["weight_error"] == bound and measured.rms_ratio <= bound
        graph = onnx.load(str(result.folder / "model.onnx")).graph
        assert sum(n.op_type == "MatMulNBits" for n in graph.node) >= 4 * 2  # every block's four MatMuls
    assert (record.calibration is not None) == ALGORITHMS[algorithm].calibrated
    if weights == "trained":
        assert "quality gates applied" in result.check.quality_gates


@pytest.mark.parametrize(
    "algorithm, weights, damage",
    [(a, "trained", d) for a in ALGORITHMS if a != "rtn" for d in ("bits", "scales")]
    + [(a, "random", "bits") for a in ALGORITHMS if a != "rtn"],
)
def test_a_damaged_file_is_refused_under_every_algorithm(
    algorithm, weights, damage, trained_export, gpt2_init_export, tmp_path, monkeypatch
):
    """2-bit weights declared 4, or every scale doubled, through the algorithm's own quantizer call: refused by the
    algorithm's weight_error gate, and nothing is written (round to nearest:
    tests/precisions/test_precision_recipes.py)."""
    source = trained_export if weights == "trained" else gpt2_init_export
    _damage(monkeypatch, "int4", damage)
    with pytest.raises(CheckFailed, match="validation failed: int4") as failed:
        _optimize(source, tmp_path / "damaged", algorithm)
    assert not (tmp_path / "damaged").exists()
    # the file check refuses it: its weights against the algorithm's bound, or (k-quant's 2-bit blocks) the
    # file's own dequantized weights no longer predicting what onnxruntime computes from it
    failures = failed.value.report.failures
    assert any("weights are not the declared algorithm's" in f for f in failures) or any(
        f.startswith("the file against its own rounded weights: relative logits error") for f in failures
    ), failures
    if damage == "scales" or algorithm == "hqq":
        assert any("weights are not the declared algorithm's" in f for f in failures), failures


def test_gptq_calibrates_on_the_given_text(trained_export, trained_checkpoint, tmp_path):
    text = trained_checkpoint / "heldout.txt"
    result = _optimize(trained_export, tmp_path / "q", "gptq", calibration_text=str(text))
    assert result.check.passed, result.check.summary()
    assert result.manifest.quantization.calibration.startswith(f"{text}: 32 × 128 tokens")
    default = _optimize(trained_export, tmp_path / "d", "gptq")
    assert default.manifest.quantization.calibration.startswith("the standard library's module docstrings: 32 ×")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--quantize", "int4", "--algorithm", "awq"], "unknown --algorithm 'awq': choose one of rtn, hqq"),
        (["--quantize", "int8", "--algorithm", "hqq"], "--algorithm applies to int4"),
        (["--algorithm", "hqq"], "--algorithm applies to quantized weights"),
        (
            ["--quantize", "int4", "--algorithm", "hqq", "--calibration", "x.txt"],
            "--calibration applies to a calibrated int4 algorithm (gptq)",
        ),
        (
            ["--quantize", "int4", "--algorithm", "gptq", "--calibration", str(HELDOUT)],
            "--calibration needs the model's tokenizer",
        ),
    ],
)
def test_algorithm_bad_inputs(tmp_path, args, message):
    assert_one_line_error(run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "q", *args), message)
    assert not (tmp_path / "q").exists()


def test_a_missing_calibration_file_is_one_line(trained_export, tmp_path):
    result = run(
        "optimize", trained_export, "--out", tmp_path / "q", "--fusion", "none", "--quantize", "int4",
        "--algorithm", "gptq", "--calibration", tmp_path / "missing.txt",
    )  # fmt: skip
    assert_one_line_error(result, "is not a regular file")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("weights", ["trained", "random"])
def test_mixed_int8_gives_8_bits_to_the_most_sensitive_layers(weights, trained_export, gpt2_init_export, tmp_path):
    """--mixed-int8: every candidate's sensitivity measured and recorded; the chosen 8-bit weights are the most
    sensitive that fit the budget, stored as 8-bit MatMulNBits, and the file check holds them to 8 bits."""
    source = trained_export if weights == "trained" else gpt2_init_export
    result = _optimize(source, tmp_path / "q", None, mixed_int8=30)
    assert result.check.passed, result.check.summary()
    record = result.manifest.quantization
    assert record.int8_layers and 0 < record.int8_share <= 0.30 and len(record.sensitivity) >= 8
    # the greedy rule, redone from the source's weight sizes: most sensitive first, each taken where it fits
    sizes = {i.name: int(np.prod(i.dims)) for i in onnx.load(str(source / "model.onnx")).graph.initializer}
    size = {name: sizes[name.removesuffix("_for_matmul")] for name in record.sensitivity}
    budget, spent, expected = 0.30 * sum(size.values()), 0, []
    for name in sorted(record.sensitivity, key=lambda n: -record.sensitivity[n]):
        if spent + size[name] <= budget:
            expected.append(name)
            spent += size[name]
    assert record.int8_layers == expected and record.int8_share == pytest.approx(spent / sum(size.values()))
    graph = onnx.load(str(result.folder / "model.onnx")).graph
    eight = [
        n.input[1].removesuffix("_Q8")
        for n in graph.node
        if n.op_type == "MatMulNBits" and any(a.name == "bits" and a.i == 8 for a in n.attribute)
    ]
    # the measured layers and the recipe's 8-bit head (the tied embedding's transposed copy)
    head = [name for name in eight if name.endswith("_for_matmul")]
    assert record.lm_head == "int8" and len(head) == 1
    assert sorted(set(eight) - set(head)) == sorted(record.int8_layers)
    assert result.check.rounded.measured.weights.max_steps <= 1.001


def test_mixed_int8_layers_are_judged_at_8_bits(trained_export, tmp_path, monkeypatch):
    """A file whose measured 8-bit layers hold 4-bit values is refused: the record says 8 bits."""
    import gpt2onnx.precisions.weights as precision

    real = precision.matmul_nbits
    monkeypatch.setattr(precision, "matmul_nbits", lambda m, o, **kw: real(m, o, **{**kw, "bits": 4}))
    with pytest.raises(CheckFailed, match="validation failed: int4") as failed:
        _optimize(trained_export, tmp_path / "damaged", None, mixed_int8=30)
    assert any("weights are not the declared rounding" in f for f in failed.value.report.failures)
    assert not (tmp_path / "damaged").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--quantize", "int4", "--mixed-int8", "0"], "--mixed-int8 0.0 is out of range"),
        (["--quantize", "int4", "--mixed-int8", "101"], "--mixed-int8 101.0 is out of range"),
        (["--quantize", "int8", "--mixed-int8", "20"], "--mixed-int8 applies to int4"),
    ],
)
def test_mixed_int8_bad_inputs(tmp_path, args, message):
    assert_one_line_error(run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "q", *args), message)


@pytest.mark.parametrize("widths", [("int4", "int4"), ("int8", "int8")])
def test_the_tied_embedding_is_stored_once(widths, trained_export, tmp_path, monkeypatch):
    """int4 with the head and the embeddings at the same width: the token Gather reads the head's MatMulNBits
    weights, the file shrinks by the table's copy, and its logits are those of the file that stores it twice."""
    import onnxruntime as ort

    import gpt2onnx.precisions.weights as precision

    head, embeddings = widths
    shared = _optimize(trained_export, tmp_path / "shared", None, lm_head=head, embeddings=embeddings)
    assert shared.check.passed, shared.check.summary()
    assert shared.manifest.quantization.shared_embedding == "wte.weight"
    graph = onnx.load(str(shared.folder / "model.onnx")).graph
    heads = {n.input[1] for n in graph.node if n.op_type == "MatMulNBits"}
    token = next(n for n in graph.node if n.op_type == "GatherBlockQuantized" and n.input[1] == "input_ids")
    assert token.input[0] in heads
    monkeypatch.setattr(precision, "share_tied_embedding", lambda model: None)
    twice = _optimize(trained_export, tmp_path / "twice", None, lm_head=head, embeddings=embeddings)
    assert twice.manifest.quantization.shared_embedding is None
    size = {r.folder: (r.folder / "model.onnx").stat().st_size for r in (shared, twice)}
    vocab, width = 512, 64  # the trained fixture's table, at the recipe's width (the scales are a small copy)
    assert size[twice.folder] - size[shared.folder] >= 0.9 * vocab * width * (4 if head == "int4" else 8) / 8
    feed = {"input_ids": np.array([[5, 17, 3, 200]]), "attention_mask": np.ones((1, 4), np.int64)}
    feed["position_ids"] = np.arange(4)[None]
    logits = []
    for folder in (shared.folder, twice.folder):
        session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
        pasts = {i.name: np.zeros((1, 4, 0, 16), np.float32) for i in session.get_inputs() if "past" in i.name}
        logits.append(session.run(["logits"], {**feed, **pasts})[0])
    if head == "int4":  # the same stored values (onnxruntime's 4-bit rounding of the table), the same kernels
        np.testing.assert_array_equal(*logits)
    else:  # the table's 8 bits are the head's rounding (scale amax/128) instead of gpt2onnx's own (amax/127): the
        # values move by less than a step, the logits by far less than int8's own error (the check's 0.2)
        assert np.abs(logits[0] - logits[1]).max() < 0.05
