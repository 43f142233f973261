"""A request's tokens do not depend on its neighbours (issue 54, item 3).

A peaked random-weights 2-layer × 64 GPT-2 (GPT-2 config, initializer_range 0.5: logits peaked enough that a
kernel's other arithmetic changes greedy tokens; the trained fixtures hide it) exported with every precision the
compatibility matrix allows on the cpu provider, each unvalidated (random weights fail the quantized gates). The
exports cover every precision, int4 algorithm and prompt kernel, fusion profile, cache layout and K/V cache type.

Bitwise, not within a tolerance: a row's logits alone, beside another row and left-padded by 1 to 17 columns are
the same floats (onnxruntime's CPU kernels sum in an order tied to the column index and the row count;
gpt2onnx/passes/batch_invariance.py writes graphs whose rows do not see it: whole blocks of 16 padded columns, rows
in pairs). That holds on every x86 CPU these tests run on by construction (16 columns is a multiple of every
vector width, MatMulNBits' kernels take rows in pairs on AVX2 and AVX-512); a kernel whose order followed anything
else would fail it. Where attention is a fused kernel (its sums out of a rewrite's reach), the folder says so
(``padding_dependent``, and ``check`` reports the batch row as no) and the batching engine runs a step's rows in
groups whose padding differs by multiples of 16. Then, for every export: prompt B continued alone, as row 2 of
``generate A B`` and as every row of ``generate B B B`` (where the folder is batch-invariant), and in the batching
engine among 63 other requests (prefilled in groups, decoded in steps of 64 rows) gets the same greedy tokens, and
in the engine the same log-probabilities, float for float, as alone."""

import pytest

from gpt2onnx.decoding.generate import generate
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.preflight.check import preflight
from gpt2onnx.serving.engine import BatchingEngine
from tests.conftest import write_hf_folder

NEW = 12
A = "3,14,15,92,65,35,89,79,32,38,46,26,43,38,32,79,50,28,84,19,71,69,39,93"  # 24 tokens: a prompt step of its own
B = "7,1,8,2,8"  # 5 tokens: alone, a step of 5 rows
OTHERS = [[(11 * i + j) % 97 + 1 for j in range(1 + i % 7)] for i in range(63)]  # 64 requests with B

# every precision, int4 algorithm, prompt kernel, fusion profile, cache layout and K/V cache type the compatibility
# matrix allows on the cpu provider (gptq needs calibration text: its weights are rounded as rtn's, its kernels the
# same MatMulNBits)
EXPORTS = {
    "fp32": dict(),
    "fp16": dict(dtype="fp16"),
    "int8": dict(quantization=QuantizeOptions("int8")),
    "int8-weights": dict(quantization=QuantizeOptions("int8-weights")),
    "int4": dict(quantization=QuantizeOptions("int4")),
    "int4-hqq": dict(quantization=QuantizeOptions("int4", algorithm="hqq")),
    "int4-k-quant": dict(quantization=QuantizeOptions("int4", algorithm="k-quant")),
    "int4-prompt-int8": dict(quantization=QuantizeOptions("int4", prompt_kernel="int8")),
    "ort": dict(fusion="ort"),
    "portable": dict(fusion="portable"),  # attention left unfused (aligned), LayerNorm and Gelu fused
    "tensorrt": dict(fusion="tensorrt"),  # LayerNorm only: TensorRT fuses the rest itself
    "onnx": dict(fusion="onnx"),  # the standard Attention op, concat layout
    "ort-shared-kv": dict(fusion="ort-shared-kv"),
    "ort-shared-kv-int8-cache": dict(fusion="ort-shared-kv", kv_cache="int8"),
    "ort-shared-kv-int4-cache": dict(fusion="ort-shared-kv", kv_cache="int4"),
    "onnx-static-kv": dict(fusion="onnx-static-kv"),
    "int8-ort-shared-kv": dict(fusion="ort-shared-kv", quantization=QuantizeOptions("int8")),
}
# attention in a fused kernel: a row's sums follow its padding (declared), and the engine isolates such rows
FUSED = {
    "ort",
    "onnx",
    "ort-shared-kv",
    "ort-shared-kv-int8-cache",
    "ort-shared-kv-int4-cache",
    "onnx-static-kv",
    "int8-ort-shared-kv",
}


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=64, initializer_range=0.5)
    config.bos_token_id = config.eos_token_id = 99
    return write_hf_folder(tmp_path_factory.mktemp("peaked") / "checkpoint", config, seed=3)


@pytest.fixture(scope="module", params=list(EXPORTS))
def folder(request, peaked, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "model"
    return export(str(peaked), out, options=ExportOptions(validate=False, **EXPORTS[request.param])).folder


@pytest.fixture
def fused(request) -> bool:
    return request.node.callspec.params["folder"] in FUSED


def _tokens(folder, *rows: str) -> list[list[int]]:
    return generate(folder, ids=list(rows), max_new_tokens=NEW, verify_files=False).tokens


def _events(engine, ids: list[int]) -> list[tuple]:
    stream = engine.submit(ids, max_new_tokens=NEW, logprobs=5)
    return [(event.token_ids, event.logprobs) for event in stream]


def test_a_row_gets_its_tokens_alone_in_a_batch_and_in_the_engine(folder, fused):
    (alone,) = _tokens(folder, B)
    facts = preflight(folder).facts  # what check reports
    assert facts["batch_invariant"] is not fused
    assert facts["padding_dependent"] is fused
    if not fused:
        assert _tokens(folder, A, B)[1] == alone
        assert _tokens(folder, B, B, B) == [alone] * 3
    mine = [int(t) for t in B.split(",")]
    with BatchingEngine.open(folder, max_batch=64, verify_files=False, tokenizer=None) as engine:
        by_itself = _events(engine, mine)
        # queued before the engine thread wakes (it waits on the lock we hold): the 64 prompts prefilled in groups
        # (at most 128 padded tokens a step), then decode steps of 64 rows
        with engine._lock:
            streams = [engine.submit(ids, max_new_tokens=NEW) for ids in OTHERS]
            among = engine.submit(mine, max_new_tokens=NEW, logprobs=5)
        events = [(event.token_ids, event.logprobs) for event in among]
        for stream in streams:
            stream.result(timeout=60)
    assert [t for tokens, _ in by_itself for t in tokens] == alone
    assert events == by_itself  # the tokens and their log-probabilities, float for float


def test_a_rows_logits_are_the_same_floats_beside_a_neighbour_and_left_padded(folder, fused):
    """Below the tokens: a decode step's logits for one row alone, beside a neighbour of the same length whose
    activations span another range (per-tensor scales moved int8's by ~1e-2; MatMulNBits' one-row kernel int4's
    by ~1e-5) and left-padded by 1 to 17 masked columns (Softmax's and MatMul's summation order moved every
    precision's by ~1e-7 unless the padding was a multiple of 4, measured on an AVX-512 Xeon), bitwise."""
    import numpy as np

    from gpt2onnx.artifact.contract import position_ids_for
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime

    if fused:
        pytest.skip("a fused attention kernel's sums follow the padding: declared, and isolated by the engine")
    decoder = open_runtime(open_folder(folder, verify_files=False), RuntimeOptions())
    mine = [int(t) for t in B.split(",")]
    prompts = np.array([mine, [50, 98, 3, 77, 21]], np.int64)
    mask = np.ones_like(prompts)
    _, past = decoder.run(prompts, mask, position_ids_for(mask), decoder.empty_past(2))
    past = [np.asarray(p.numpy() if hasattr(p, "numpy") else p) for p in past]
    step, width = np.array([[9], [42]], np.int64), len(mine) + 1
    position = np.full((2, 1), len(mine), np.int64)

    def logits(rows, pad=0):
        cache = [np.pad(p[rows], ((0, 0), (0, 0), (pad, 0), (0, 0))) for p in past]
        mask = np.pad(np.ones((len(rows), width), np.int64), ((0, 0), (pad, 0)))
        out, _ = decoder.run(step[rows], mask, position[rows], cache)
        return out[0]

    alone = logits([0])
    assert np.array_equal(logits([0, 1]), alone)  # beside a neighbour
    for pad in range(1, 18):
        assert np.array_equal(logits([0], pad), alone), f"left-padded by {pad}"


def test_int8_files_store_their_weights_column_sums(peaked, tmp_path):
    """The per-token zero points' correction reads Σ_k w from an initializer written at export: computed in the
    graph (a Cast of each int8 weight to int32, then ReduceSum), onnxruntime's constant folding made an int32 copy
    of every weight while loading (the 124M int8 file peaked at 1.3 GB loading, 0.32 GB now)."""
    import onnx
    from onnx import numpy_helper

    out = export(str(peaked), tmp_path / "int8", options=ExportOptions(validate=False, **EXPORTS["int8"])).folder
    model = onnx.load(str(out / "model.onnx"))
    initializers = {t.name: t for t in model.graph.initializer}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMulInteger"]
    assert matmuls
    assert not [n for n in model.graph.node if n.op_type in ("Cast", "ReduceSum") and n.input[0] in initializers]
    for node in matmuls:
        offsets = {n.input[1] for n in model.graph.node if n.op_type == "Mul" and n.output[0].endswith("/offsets")}
        (sums,) = offsets & {name for name in initializers if name.startswith(node.name)}
        weight = numpy_helper.to_array(initializers[node.input[1]]).astype("int64")
        if len(node.input) > 3 and node.input[3]:
            weight = weight - numpy_helper.to_array(initializers[node.input[3]]).astype("int64")
        assert (numpy_helper.to_array(initializers[sums]) == weight.sum(axis=0)).all()
