"""fp16 exports of a reorder_and_upcast_attn config (BioMedLM, Mistral's GPT-2 runs): transformers computes the
attention scores in fp32 whatever the model's dtype, so the fp16 export keeps them fp32 (the Q·Kᵀ MatMul, its
scale, the mask's Add, the softmax) where attention is written out (fusion none, portable, tensorrt), and the fused
attention ops of ort and ort-shared-kv compute them in fp32 inside onnxruntime's CPU kernels (proven here on the ops
themselves; CUDA's unfused kernel does not, and the export warns).

The test model makes the difference visible: each head's first query and key channels are a constant 256, so
Q·Kᵀ is 65536 plus the data's part, past fp16's largest value (65504). Computed in fp16 (on a GPU, which the fp16
check emulates) the scores become inf and the logits NaN; kept fp32, the export passes fp16's gates against
transformers."""

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.passes.batch_invariance import strip
from gpt2onnx.precisions.fp16 import ATTENTION_SCORES, to_fp16, written_out_attention_scores
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.verify.fp16_emulation import emulate_fp16, tensor_types
from gpt2onnx.verify.lockstep import left_padded_batch

CONFIG = dict(
    n_layer=2,
    n_head=2,
    n_embd=32,
    vocab_size=100,
    n_positions=32,
    scale_attn_by_inverse_layer_idx=True,
    reorder_and_upcast_attn=True,
    initializer_range=0.1,
    bos_token_id=99,
    eos_token_id=99,
)
OVERFLOWING = 256.0  # 256 · 256 = 65536 > 65504


@pytest.fixture(scope="module")
def upcast_folder(tmp_path_factory):
    """A tiny upcast-attention checkpoint whose Q·Kᵀ overflows fp16 in every head."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(36)
    config = GPT2Config(**CONFIG)
    model = GPT2LMHeadModel(config)
    C, D = config.n_embd, config.n_embd // config.n_head
    with torch.no_grad():
        for block in model.transformer.h:
            for start in (0, C):  # the query block, then the key block of c_attn (Conv1D: weight [in, out])
                for head in range(config.n_head):
                    column = start + head * D
                    block.attn.c_attn.weight[:, column] = 0.0
                    block.attn.c_attn.bias[column] = OVERFLOWING
    folder = tmp_path_factory.mktemp("upcast") / "checkpoint"
    model.save_pretrained(folder)
    return folder


def _score_types(model: onnx.ModelProto) -> list[int]:
    types = tensor_types(model)
    return [
        types[n.output[0]]
        for nodes in written_out_attention_scores(model.graph)
        for n in nodes
        if n.op_type != "Constant"
    ]


def test_fp16_export_keeps_the_scores_fp32_and_passes_its_gates(upcast_folder, tmp_path):
    """Fusion none, validated: against transformers' fp32 model within fp16's gates, on the CPU and with fp16
    arithmetic emulated as a GPU computes it (where fp16 scores would be inf)."""
    result = export(str(upcast_folder), tmp_path / "fp16", options=ExportOptions(dtype="fp16"))
    assert result.check.passed and result.check.fp16_emulated.passed, result.check.summary()
    record = result.manifest.fp16
    assert record.kept_fp32[-1] == ATTENTION_SCORES
    L = CONFIG["n_layer"]
    assert {op: record.kept_fp32_nodes.get(op) for op in ("MatMul", "Div", "Add", "Softmax")} == dict.fromkeys(
        ("MatMul", "Div", "Add", "Softmax"), L
    )
    model = onnx.load(str(result.folder / "model.onnx"))
    assert _score_types(model) == [TensorProto.FLOAT] * 4 * L
    # and only those: the probabilities weigh V in fp16 (transformers casts them back to V's dtype too)
    types = tensor_types(model)
    matmuls = [types[n.output[0]] for n in model.graph.node if n.op_type == "MatMul"]
    assert matmuls.count(TensorProto.FLOAT) == L and TensorProto.FLOAT16 in matmuls


@pytest.mark.parametrize("profile", ["portable", "tensorrt"])
def test_every_written_out_profile_keeps_the_scores_fp32(upcast_folder, tmp_path, profile):
    options = ExportOptions(fusion=profile, dtype="fp16", validate=False)
    result = export(str(upcast_folder), tmp_path / profile, options=options)
    assert ATTENTION_SCORES in result.manifest.fp16.kept_fp32
    model = onnx.load(str(result.folder / "model.onnx"))
    assert _score_types(model) == [TensorProto.FLOAT] * 4 * CONFIG["n_layer"]


def test_fp16_scores_overflow_where_they_are_not_kept(upcast_folder, tmp_path):
    """The same graph converted without the architecture's keep: emulated as a GPU computes it, Q·Kᵀ is inf and
    the logits NaN; with it, they match transformers' fp32 logits to fp16's precision."""
    exported = export(str(upcast_folder), tmp_path / "fp32", options=ExportOptions(validate=False)).folder
    ckpt = load_checkpoint(str(upcast_folder))
    ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=2, length=6, seed=1)
    import torch

    with torch.no_grad():
        positions = np.maximum(mask.cumsum(1) - 1, 0)
        model = reference_model(ckpt)
        theirs = model(torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions))
        theirs = theirs.logits.numpy()
    logits = {}
    for upcast in (False, True):
        # as export converts it: before its last pass (the batch-invariance rewrites, undone here)
        fp16, _ = to_fp16(strip(onnx.load(str(exported / "model.onnx"))), upcast_attention=upcast)
        session = ort.InferenceSession(emulate_fp16(fp16).SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        for i in session.get_inputs():
            if i.name.startswith("past_key_values"):
                feeds[i.name] = np.zeros((2, ckpt.spec.n_head, 0, ckpt.spec.head_dim), np.float32)
        logits[upcast] = session.run(["logits"], feeds)[0]
    real = mask.astype(bool)
    assert not np.isfinite(logits[False][real]).all()
    assert np.abs(logits[True][real] - theirs[real]).max() < 0.05  # fp16 activations: measured 2.6e-3


def test_optimize_to_fp16_reads_the_architecture_from_the_manifest(upcast_folder, tmp_path):
    exported = export(str(upcast_folder), tmp_path / "fp32", options=ExportOptions(validate=False)).folder
    result = optimize(exported, tmp_path / "fp16", fusion="none", dtype="fp16", validate=False)
    assert result.manifest.fp16.kept_fp32[-1] == ATTENTION_SCORES
    assert _score_types(onnx.load(str(result.folder / "model.onnx"))) == [TensorProto.FLOAT] * 4 * CONFIG["n_layer"]


def _attention_probe(op: str, dtype: int, q, k_past, k_new) -> np.ndarray:
    """One fused attention node over one head: the weights it gives two keys (read off V = the identity rows)."""
    D = len(q)
    np_type = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}[dtype]
    feeds = {
        "q": np.array([[q]], np_type),
        "k": np.array([[k_new]], np_type),
        "v": np.array([[[0, 1] + [0] * (D - 2)]], np_type),
        "past_key": np.array([[[k_past]]], np_type),
        "past_value": np.array([[[[1, 0] + [0] * (D - 2)]]], np_type),
        "bias": np.zeros((1, 1, 1, 2), np_type),
    }
    shapes = {"q": [1, 1, D], "k": [1, 1, D], "v": [1, 1, D], "past_key": [1, 1, 1, D], "past_value": [1, 1, 1, D]}
    inputs = [helper.make_tensor_value_info(n, dtype, s) for n, s in shapes.items()]
    inputs.append(helper.make_tensor_value_info("bias", dtype, [1, 1, 1, 2]))
    if op == "MultiHeadAttention":
        names = ["q", "k", "v", "", "", "bias", "past_key", "past_value"]
        attributes = {"num_heads": 1, "scale": 1.0}
    else:
        names = ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total", "", "", "", "bias"]
        attributes = {"num_heads": 1, "kv_num_heads": 1, "scale": 1.0}
        inputs += [
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
            helper.make_tensor_value_info("total", TensorProto.INT32, []),
        ]
        feeds.update(seqlens_k=np.array([1], np.int32), total=np.array(2, np.int32))
    outputs = [helper.make_tensor_value_info(n, dtype, None) for n in ("y", "present_key", "present_value")]
    node = helper.make_node(op, names, [o.name for o in outputs], domain="com.microsoft", **attributes)
    model = helper.make_model(
        helper.make_graph([node], "probe", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 9
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0].ravel()[:2].astype(np.float64)


@pytest.mark.parametrize("op", ["MultiHeadAttention", "GroupQueryAttention"])
@pytest.mark.parametrize(
    ("q", "k_past", "k_new"),
    [
        ([1, 1], [2048, 1], [2048, 0]),  # scores 2049 and 2048: fp16 has no 2049 (its step there is 2)
        ([256, 256], [256, 1 / 256], [256, 0]),  # scores 65537 and 65536: past fp16's 65504
    ],
    ids=["rounding", "overflow"],
)
def test_fused_attention_computes_fp16_scores_in_fp32_on_the_cpu(op, q, k_past, k_new):
    """What ort and ort-shared-kv fp16 exports rely on: onnxruntime's CPU MultiHeadAttention and GroupQueryAttention
    take fp16 Q, K, V and compute Q·Kᵀ and the softmax in fp32 (the two scores 1 apart: weights e/(1+e), 1/(1+e)),
    where scores stored in fp16 would give 0.5, 0.5 or NaN."""
    pad = [0] * 6  # GroupQueryAttention: a head size that is a multiple of 8
    expected = np.array([np.e, 1.0]) / (1 + np.e)
    fp16 = _attention_probe(op, TensorProto.FLOAT16, q + pad, k_past + pad, k_new + pad)
    np.testing.assert_allclose(fp16, expected, atol=1e-3)  # fp16's output rounding
    np.testing.assert_allclose(_attention_probe(op, TensorProto.FLOAT, q + pad, k_past + pad, k_new + pad), expected)


def _standard_attention_probe(dtype, q, k_past, k_new) -> np.ndarray:
    """The probe above on ai.onnx Attention (opset 23, the onnx profile's op)."""
    D = len(q)
    np_type = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}[dtype]
    feeds = {
        "q": np.array([[q]], np_type),
        "k": np.array([[k_new]], np_type),
        "v": np.array([[[0, 1] + [0] * (D - 2)]], np_type),
        "bias": np.zeros((1, 1, 1, 2), np_type),
        "past_key": np.array([[[k_past]]], np_type),
        "past_value": np.array([[[[1, 0] + [0] * (D - 2)]]], np_type),
    }
    shapes = {"q": [1, 1, D], "k": [1, 1, D], "v": [1, 1, D], "bias": [1, 1, 1, 2]}
    shapes.update(past_key=[1, 1, 1, D], past_value=[1, 1, 1, D])
    inputs = [helper.make_tensor_value_info(n, dtype, s) for n, s in shapes.items()]
    outputs = [helper.make_tensor_value_info(n, dtype, None) for n in ("y", "present_key", "present_value")]
    node = helper.make_node(
        "Attention", list(shapes), [o.name for o in outputs], q_num_heads=1, kv_num_heads=1, scale=1.0
    )
    graph = helper.make_graph([node], "probe", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0].ravel()[:2].astype(np.float64)


def test_the_standard_attention_computes_fp16_scores_in_fp16_on_the_cpu():
    """Why an upcast architecture is refused in fp16 with the onnx profiles: onnxruntime 1.31's CPU Attention keeps
    fp16 scores (2049 and 2048 both round to 2048: equal weights), unlike MultiHeadAttention above."""
    pad = [0] * 6
    fp16 = _standard_attention_probe(TensorProto.FLOAT16, [1, 1] + pad, [2048, 1] + pad, [2048, 0] + pad)
    np.testing.assert_allclose(fp16, [0.5, 0.5])
    fp32 = _standard_attention_probe(TensorProto.FLOAT, [1, 1] + pad, [2048, 1] + pad, [2048, 0] + pad)
    np.testing.assert_allclose(fp32, np.array([np.e, 1.0]) / (1 + np.e), rtol=1e-6)


@pytest.mark.parametrize("profile", ["onnx", "onnx-static-kv"])
def test_fp16_of_an_upcast_config_is_refused_with_the_onnx_profiles(upcast_folder, tmp_path, profile):
    options = ExportOptions(fusion=profile, dtype="fp16", validate=False)
    with pytest.raises(Gpt2OnnxError, match="computes fp16 attention scores in fp16"):
        export(str(upcast_folder), tmp_path / profile, options=options)
    assert not (tmp_path / profile).exists()


def test_fused_fp16_export_of_an_upcast_config_says_where_the_scores_are(upcast_folder, tmp_path, caplog):
    options = ExportOptions(fusion="ort", dtype="fp16", validate=False)
    with caplog.at_level(logging.WARNING, logger="gpt2onnx.precisions.fp16"):
        result = export(str(upcast_folder), tmp_path / "ort", options=options)
    assert ATTENTION_SCORES not in result.manifest.fp16.kept_fp32  # nothing written out to keep
    (line,) = [r.getMessage() for r in caplog.records if "reorder_and_upcast_attn" in r.getMessage()]
    assert "MultiHeadAttention" in line and "fp32 on the CPU" in line and "--fusion none" in line
