"""The GPT2LMHeadModel configurations that released checkpoints use beyond OpenAI's four, on tiny seeded models:
each exported with the default profile and with ort (and the portable one for the GELUs) and compared with
transformers' GPT2LMHeadModel through plain onnxruntime on a left-padded batch (prompt and decode steps) and
greedy generation, with the fused op each activation must become."""

from collections import Counter

import numpy as np
import onnx
import pytest
from conftest import write_hf_folder

from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.pytorch.architecture import ACTIVATIONS
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.runtimes.decoder import cpu_decoder
from gpt2onnx.verify.lockstep import compare_decoder, greedy, left_padded_batch, reference_greedy

# fp32 through the same ops in another order: |Δlogits| of a few 1e-6 measured; 1e-4 as every fp32 check here
FP32_TOL = 1e-4
BASE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=128, initializer_range=0.3)
MS = "com.microsoft"
# name → (config changes, the op its activation becomes in the ort profile (None: no fused op))
VARIANTS = {
    "cerebras-gelu-2048": (dict(activation_function="gelu", n_positions=2048, n_inner=200), (MS, "Gelu")),
    "biomedlm-scaling": (
        dict(n_layer=3, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
        (MS, "FastGelu"),
    ),
    "relu": (dict(activation_function="relu"), None),
    "silu": (dict(activation_function="silu"), None),
    "swish-untied": (dict(activation_function="swish", tie_word_embeddings=False), None),
    "quick-gelu": (dict(activation_function="quick_gelu"), (MS, "QuickGelu")),
    "tanh": (dict(activation_function="tanh"), None),
    "gelu-pytorch-tanh": (dict(activation_function="gelu_pytorch_tanh"), (MS, "FastGelu")),
    "unscaled-attention": (dict(scale_attn_weights=False, initializer_range=0.1), (MS, "FastGelu")),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    from transformers import GPT2Config

    changes, op = VARIANTS[request.param]
    params = {**BASE, **changes}
    config = GPT2Config(**params, bos_token_id=params["vocab_size"] - 1, eos_token_id=params["vocab_size"] - 1)
    folder = write_hf_folder(tmp_path_factory.mktemp(request.param) / "checkpoint", config, seed=3)
    ckpt = load_checkpoint(str(folder))
    return request.param, folder, ckpt, reference_model(ckpt), op


def _ops(path) -> Counter:
    return Counter((n.domain or "", n.op_type) for n in onnx.load(str(path)).graph.node)


@pytest.mark.parametrize("profile", ["none", "ort", "portable"])
def test_variant_matches_transformers(variant, tmp_path, profile):
    name, folder, ckpt, reference, op = variant
    if profile == "portable" and name not in ("cerebras-gelu-2048", "gelu-pytorch-tanh"):
        pytest.skip("portable: the GELU variants (the standard Gelu); the others are the default profile's graph")
    result = export(str(folder), tmp_path / profile, options=ExportOptions(fusion=profile))
    assert result.check.passed and result.check.measured.logits.max < FP32_TOL, result.check.summary()
    ops = _ops(result.folder / "model.onnx")
    L = ckpt.spec.n_layer
    if profile == "ort":
        assert ops[(MS, "MultiHeadAttention")] == L  # its scale attribute carries the layer's scaling
        fused = {k: v for k, v in ops.items() if k in {(MS, "FastGelu"), (MS, "Gelu"), (MS, "QuickGelu")}}
        assert fused == ({op: L} if op else {}), ops
        scales = [
            a.f
            for n in onnx.load(str(result.folder / "model.onnx")).graph.node
            for a in n.attribute
            if a.name == "scale"
        ]
        np.testing.assert_allclose(scales, [1 / ckpt.spec.attention_divisor(i) for i in range(L)], rtol=1e-6)
    if profile == "portable":
        assert ops[("", "Gelu")] == L and not any(domain for domain, _ in ops)
    decoder = cpu_decoder(result.folder / "model.onnx", n_positions=ckpt.spec.n_positions)
    ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=3, length=9, seed=5)
    parity = compare_decoder(decoder, reference, ids, mask, decode_steps=4, tolerance=FP32_TOL)
    assert parity.passed, parity
    print(f"{name} {profile}: max |Δlogits| {parity.measured.logits.max:.2e}")  # the figures, with -s
    np.testing.assert_array_equal(greedy(decoder, ids, mask, 8), reference_greedy(reference, ids, mask, 8))


@pytest.mark.parametrize("name", ["cerebras-gelu-2048", "biomedlm-scaling", "silu"])
def test_variant_deploys_to_every_target_and_runs(name, tmp_path):
    """The variants through the deploy targets and the runtimes installed here: every target written from the ort
    export, and generate's greedy tokens on onnxruntime, ort-generate (the loop in the graph) and OpenVINO (where
    installed) equal to transformers' generate()."""
    import importlib.util

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from typer.testing import CliRunner

    from gpt2onnx.cli.app import app

    changes, _ = VARIANTS[name]
    params = {**BASE, **changes}
    config = GPT2Config(**params, bos_token_id=params["vocab_size"] - 1, eos_token_id=params["vocab_size"] - 1)
    folder = write_hf_folder(tmp_path / "checkpoint", config, seed=3)
    from conftest import write_tokenizer

    write_tokenizer(folder, params["vocab_size"])  # the web page and transformers.js read tokenizer.json
    exported = export(str(folder), tmp_path / "ort", options=ExportOptions(fusion="ort")).folder
    runner = CliRunner()
    targets = "genai,transformers-js,triton,ort-generate,web"
    result = runner.invoke(app, ["deploy", str(exported), "-t", targets, "-o", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    prompt = [5, 17, 42, 7]
    # eager: transformers 4.57's sdpa path drops scale_attn_by_inverse_layer_idx (measured: its greedy tokens part
    # from its own eager path's at the fourth new token on biomedlm-scaling); eager is the exact one
    model = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
    runtimes = ["onnxruntime", "ort-generate"] + (["openvino"] if importlib.util.find_spec("openvino") else [])
    for runtime in runtimes:
        args = ["generate", str(tmp_path / "d"), "--ids", ",".join(map(str, prompt)), "--max-new-tokens", "6"]
        result = runner.invoke(app, [*args, "--runtime", runtime, "--min-new-tokens", "6"])
        assert result.exit_code == 0, (runtime, result.output)
        assert [int(t) for t in result.output.split()] == theirs[0].tolist(), (runtime, result.output)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_activation_matches_transformers(activation, tmp_path):
    """Every activation_function the export takes, against transformers' own (ACT2FN) on a one-layer model."""
    from transformers import GPT2Config

    params = {**BASE, "n_layer": 1, "activation_function": activation}
    config = GPT2Config(**params, bos_token_id=999, eos_token_id=999)
    folder = write_hf_folder(tmp_path / "checkpoint", config, seed=4)
    ckpt = load_checkpoint(str(folder))
    result = export(str(folder), tmp_path / "x")
    assert result.check.passed, result.check.summary()
    decoder = cpu_decoder(result.folder / "model.onnx", n_positions=ckpt.spec.n_positions)
    ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=2, length=6, seed=4)
    parity = compare_decoder(decoder, reference_model(ckpt), ids, mask, decode_steps=2, tolerance=FP32_TOL)
    assert parity.passed, parity
    print(f"{activation}: max |Δlogits| {parity.measured.logits.max:.2e}")
