"""The file check reads what a quantized file is from its graph: each weight's width and block size from the op that
reads it, int8's storage from its tensors. The manifest is only compared with it: a manifest whose entries that
describe the weights are deleted or falsified (and re-hashed, as a crafted folder is) can make the check stricter,
never looser, so a file holding fewer bits than it runs is refused whatever its manifest says."""

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.verify.parity import parity
from tests.bad_input.common import rehash, rehash_all


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


# -- the bytes checked are the bytes loaded: a file swapped away and back while a runtime loads it ---------------------
# Another process renames the folder's file away and back between two hard links (the checked file A and another
# file B) every millisecond or so while each run opens the folder (the sha256 check) and loads it. Once, the check
# after the load compared A's stamp, moved only in its change time, and hashed the path again, by when A was back:
# 2 to 4 runs in 30 ran B. Now the runtime loads from the very descriptors that were hashed: a run runs A or is
# refused (B hashed, or the folder not naming A after the load), never B.
SWAPPER = """
import os, random, sys, time
path, a, b = sys.argv[1:4]
spare = f"{path}.{os.getpid()}"
random.seed(0)
print("swapping", flush=True)
while True:
    for side, dwell in ((b, 0.002), (a, 0.003)):
        os.link(side, spare)
        os.replace(spare, path)  # the folder's name: another file at once, never missing
        time.sleep(random.uniform(0, dwell))
"""
PROMPT = np.array([[5, 17, 300, 42, 7]], dtype=np.int64)
RACE_RUNS = 30


def _other_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with every float weight halved: other logits, the same file layout."""
    other = onnx.ModelProto()
    other.CopyFrom(model)
    for init in other.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 0.5, init.name))
    return other


def _save_external(model: onnx.ModelProto, path) -> None:
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx_data", size_threshold=0)


@pytest.fixture(scope="module")
def swap_pairs(tiny_export, tmp_path_factory):
    """For each file that may be swapped: (folder, name, A: a hard link to the checked file, B: another file of
    the same size): "model": model.onnx holding its weights; "data": model.onnx_data, the weights of a model.onnx
    that holds none (B: the data file of other weights, at the same offsets)."""
    root = tmp_path_factory.mktemp("swap")
    pairs = {}
    for which, name in (("model", "model.onnx"), ("data", "model.onnx_data")):
        folder = shutil.copytree(tiny_export, root / which / "m")
        side = root / which / "side"
        side.mkdir()
        model = onnx.load(str(folder / "model.onnx"))
        if which == "model":
            onnx.save_model(_other_weights(model), str(side / "b"))
        else:
            other = _other_weights(model)  # first: saving moves the model's weights out of it
            _save_external(model, folder / "model.onnx")
            _save_external(other, side / "b.onnx")
            os.replace(side / "model.onnx_data", side / "b")
            rehash_all(folder)
        os.link(folder / name, side / "a")
        assert (side / "a").stat().st_size == (side / "b").stat().st_size
        pairs[which] = folder, name, side / "a", side / "b"
    return pairs


def _put(source, path) -> None:
    """``path`` becomes another name of ``source`` (a hard link renamed over it)."""
    spare = f"{path}.put"
    os.link(source, spare)
    os.replace(spare, path)
    if os.path.lexists(spare):  # a rename between two names of one file does nothing: it was already there
        os.unlink(spare)


def _swapped(path, a, b):
    """The swapping process, started and swapping (stop it with :func:`_stop`)."""
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(path), str(a), str(b)], stdout=subprocess.PIPE)
    assert swapper.stdout.readline() == b"swapping\n"
    time.sleep(0.01)
    return swapper


def _stop(swapper, path, a) -> None:
    swapper.kill()
    swapper.wait()
    spare = f"{path}.{swapper.pid}"
    if os.path.lexists(spare):  # killed between its link and its rename
        os.unlink(spare)
    _put(a, path)  # A back in place


def _loaded_b(pair, logits_of) -> np.ndarray:
    """The logits of B, loaded unchecked, to tell the two files apart."""
    folder, name, a, b = pair
    _put(b, folder / name)
    try:
        return logits_of(folder, verify_files=False)
    finally:
        _put(a, folder / name)


def _check_race(pair, logits_of) -> None:
    from gpt2onnx.errors import IntegrityError

    folder, name, a, b = pair
    expected, other = logits_of(folder), _loaded_b(pair, logits_of)
    assert not np.allclose(expected, other, atol=1e-3)  # the two files tell apart
    outcomes = {"A": 0, "refused": 0, "B": 0}
    swapper = _swapped(folder / name, a, b)
    try:
        for _ in range(RACE_RUNS):
            try:
                got = logits_of(folder)
            except IntegrityError:
                outcomes["refused"] += 1
                continue
            outcomes["A" if np.allclose(got, expected, atol=1e-5) else "B"] += 1
    finally:
        _stop(swapper, folder / name, a)
    assert outcomes["B"] == 0, f"ran the other file: {outcomes}"
    assert np.allclose(logits_of(folder), expected, atol=1e-5)  # A back: it loads


def _ort_logits(folder, *, verify_files: bool = True) -> np.ndarray:
    from gpt2onnx.artifact.contract import position_ids_for
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.runtimes.decoder import open_decoder
    from gpt2onnx.runtimes.providers import ProviderConfig

    decoder = open_decoder(open_folder(folder, verify_files=verify_files), ProviderConfig(threads=1))
    mask = np.ones_like(PROMPT)
    return decoder.run(PROMPT, mask, position_ids_for(mask), decoder.empty_past(1))[0]


def _openvino_logits(folder, *, verify_files: bool = True) -> np.ndarray:
    from gpt2onnx.artifact.contract import position_ids_for
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.runtimes.openvino import OpenVinoSettings, open_runtime

    decoder = open_runtime(open_folder(folder, verify_files=verify_files), OpenVinoSettings(threads=1))
    mask = np.ones_like(PROMPT)
    return decoder.run(PROMPT, mask, position_ids_for(mask), decoder.empty_past(1))[0]


def _genai_logits(folder, *, verify_files: bool = True) -> np.ndarray:
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.runtimes.genai import GenaiSettings, open_runtime

    runner = open_runtime(open_folder(folder, verify_files=verify_files), GenaiSettings(threads=1))
    try:
        result = runner.run_loop([int(t) for t in PROMPT[0]], max_new_tokens=0, forced=[], return_logits=True)
        return np.asarray(result.logits[0])[-1:]
    finally:
        runner.close()


def _runtime(name):
    if name == "openvino":
        pytest.importorskip("openvino", reason="the openvino runtime is not installed (pip install openvino)")
        return _openvino_logits
    if name == "genai":
        from gpt2onnx.runtimes.genai import genai_python, in_process

        if not in_process() and genai_python() is None:
            pytest.skip("onnxruntime-genai is not installed (.venv-genai: bash scripts/setup.sh)")
        return _genai_logits
    return _ort_logits


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="loads through /proc/PID/fd (Linux)")
@pytest.mark.parametrize("which", ["model", "data"])
@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino", "genai"])
def test_a_file_swapped_away_and_back_while_loading_never_runs(swap_pairs, runtime, which):
    """30 runs while model.onnx (or its data file) is swapped away and back between two hard links: each runs
    the checked file or is refused, none runs the other (once 2 to 4 in 30 did)."""
    _check_race(swap_pairs[which], _runtime(runtime))


def test_a_link_or_chmod_while_loading_still_loads(swap_pairs, tmp_path, monkeypatch):
    """What 098c635 accepted stays accepted: a hard link made to a checked file, or a chmod, while it is being
    loaded moves only its change time; the descriptor hashed is the file, unwritten, and the folder names it."""
    import gpt2onnx.runtimes.decoder as decoder
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.runtimes.decoder import open_decoder
    from gpt2onnx.runtimes.providers import ProviderConfig

    folder, name, _, _ = swap_pairs["data"]
    opened = open_folder(folder)
    real = decoder.create_session

    def linking(model_path, *args, **kwargs):
        os.link(folder / name, tmp_path / "linked")
        os.chmod(folder / "model.onnx", 0o640)
        return real(model_path, *args, **kwargs)

    monkeypatch.setattr(decoder, "create_session", linking)
    try:
        open_decoder(opened, ProviderConfig(threads=1))  # loads: the same bytes
    finally:
        os.chmod(folder / "model.onnx", 0o644)
    assert os.stat(folder / name).st_ctime_ns != opened.stamps[folder / name][0][4]  # its change time moved
