"""The file check reads what a quantized file is from its graph: each weight's width and block size from the op that
reads it, int8's storage from its tensors. The manifest is only compared with it: a manifest whose entries that
describe the weights are deleted or falsified (and re-hashed, as a crafted folder is) can make the check stricter,
never looser, so a file holding fewer bits than it runs is refused whatever its manifest says."""

import json
import shutil

import numpy as np
import onnx
import pytest
from bad_input_cases import rehash
from onnx import numpy_helper

from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.verify.parity import parity


@pytest.fixture(scope="module")
def mixed(trained_export, tmp_path_factory):
    """int4 with --mixed-int8: measured 8-bit layers and an 8-bit head, as 8-bit MatMulNBits."""
    out = tmp_path_factory.mktemp("file-check") / "int4-mixed"
    result = optimize(trained_export, out, fusion="none", quantization=QuantizeOptions("int4", mixed_int8=30))
    assert result.manifest.quantization.int8_layers and result.manifest.quantization.lm_head == "int8"
    return result.folder


@pytest.fixture(scope="module")
def int8(trained_export, tmp_path_factory):
    out = tmp_path_factory.mktemp("file-check") / "int8"
    return optimize(trained_export, out, fusion="none", quantization=QuantizeOptions("int8")).folder


def _attr(node, name, default=None):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _coarser(q: np.ndarray, zero: int, step: int, low: int, high: int) -> np.ndarray:
    """Integers rounded to every ``step``-th level around ``zero``: log2(step) bits fewer of information."""
    return np.clip(np.rint((q.astype(np.int32) - zero) / step) * step + zero, low, high)


def _eight_bits_hold_four(which: str):
    """Damage: each 8-bit MatMulNBits of ``which`` ("layers": the measured layers; "head": the logits projection)
    rewritten to hold 4 bits of information, its bits attribute and scales kept. Returns how many."""

    def damage(folder) -> int:
        return _eight_bit_weights_hold_four_bits(folder, head=which == "head")

    return damage


def _eight_bit_weights_hold_four_bits(folder, head: bool) -> int:
    path = folder / "model.onnx"
    model = onnx.load(str(path))
    weights = {init.name: init for init in model.graph.initializer}
    damaged = 0
    for node in model.graph.node:
        is_head = "_for_matmul" in node.input[1] if node.op_type == "MatMulNBits" else False
        if node.op_type == "MatMulNBits" and _attr(node, "bits", 4) == 8 and is_head == head:
            init = weights[node.input[1]]
            q = _coarser(numpy_helper.to_array(init), 128, 16, 0, 255).astype(np.uint8)
            init.CopyFrom(numpy_helper.from_array(q, init.name))
            damaged += 1
    onnx.save(model, str(path))
    return damaged


def _int8_weights_hold_four_bits(folder) -> int:
    path = folder / "model.onnx"
    model = onnx.load(str(path))
    damaged = 0
    for init in model.graph.initializer:
        if init.data_type == onnx.TensorProto.INT8 and init.name.endswith("_quantized"):
            q = _coarser(numpy_helper.to_array(init), 0, 16, -128, 127).astype(np.int8)
            init.CopyFrom(numpy_helper.from_array(q, init.name))
            damaged += 1
    onnx.save(model, str(path))
    return damaged


def _copy(folder, tmp_path, damage, falsify):
    copy = tmp_path / "crafted"
    shutil.copytree(folder, copy)
    assert damage(copy) >= 1
    manifest = json.loads((copy / "gpt2onnx.json").read_text())
    falsify(manifest["quantization"])
    (copy / "gpt2onnx.json").write_text(json.dumps(manifest))
    rehash(copy)
    return copy


def _refused_by_its_weights(folder) -> None:
    report = parity(folder, cases=2, seed=0)
    assert not report.passed
    assert report.rounded is not None and report.rounded.measured.weights.max_steps > 2, report.rounded


INT4_FIELDS = {
    "honest": lambda q: None,
    "int8_layers deleted": lambda q: q.pop("int8_layers"),
    "int8_layers emptied": lambda q: q.update(int8_layers=[]),
    "block size larger": lambda q: q.update(block_size=q["block_size"] * 4),
    "algorithm gptq": lambda q: q.update(algorithm="gptq"),
    "algorithm hqq": lambda q: q.update(algorithm="hqq"),
    "head's bits": lambda q: q.update(lm_head="int4"),
    "every width": lambda q: (q.pop("int8_layers"), q.update(lm_head="int4", embeddings="int4")),
    "tied table's sharing": lambda q: q.pop("shared_embedding", None),
}


@pytest.mark.parametrize("field", list(INT4_FIELDS))
@pytest.mark.parametrize("which", ["layers", "head"])
def test_a_damaged_mixed_int8_file_is_refused_whatever_its_manifest_says(mixed, tmp_path, which, field):
    """8-bit weights holding 4 bits: refused with the manifest as written and with each entry that describes the
    weights deleted or falsified (int8_layers and lm_head once decided the width the check used: deleting the
    first passed damaged layers, falsifying the second a damaged head)."""
    _refused_by_its_weights(_copy(mixed, tmp_path, _eight_bits_hold_four(which), INT4_FIELDS[field]))


INT8_FIELDS = {
    "honest": lambda q: None,
    "storage deleted": lambda q: q.pop("int8_weights"),
    "storage per tensor": lambda q: q.update(int8_weights="u8s8 per-tensor 7-bit"),
    "storage unsigned": lambda q: q.update(int8_weights="u8u8 per-tensor"),
}


@pytest.mark.parametrize("field", list(INT8_FIELDS))
def test_a_damaged_int8_file_is_refused_whatever_its_manifest_says(int8, tmp_path, field):
    _refused_by_its_weights(_copy(int8, tmp_path, _int8_weights_hold_four_bits, INT8_FIELDS[field]))


def test_a_sound_file_passes_under_a_manifest_that_claims_less(mixed, tmp_path):
    """What the graph says decides: a manifest claiming fewer bits or larger blocks than the file has neither
    loosens the check (above) nor fails a sound file."""
    report = parity(_copy(mixed, tmp_path, lambda folder: 1, INT4_FIELDS["every width"]), cases=2, seed=0)
    assert report.passed, report.failures
    assert report.rounded.measured.weights.max_steps <= 1.001
