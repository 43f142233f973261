"""The GPT2LMHeadModel configurations that released checkpoints use beyond OpenAI's four, on tiny seeded models:
each exported with the default profile and with ort (and the portable one for the GELUs) and compared with
transformers' GPT2LMHeadModel through plain onnxruntime on a left-padded batch (prompt and decode steps) and
greedy generation, with the fused op each activation must become; and the runtimes and eval on them: the deploy
targets with onnxruntime, ort-generate and OpenVINO, gpt2onnx eval and onnxruntime-genai on exact GELU with
per-layer scaling, and genai's one-line refusal of what it cannot represent."""

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
from tests.runtimes.test_runtimes import runtime_param

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


# exact GELU (Cerebras-GPT) with BioMedLM's per-layer scaling and upcast attention, in the ort profile (com.microsoft
# Gelu, MultiHeadAttention whose scale carries the layer's scaling)
GELU_SCALED = dict(activation_function="gelu", scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)


@pytest.fixture(scope="module")
def gelu_scaled(tmp_path_factory):
    """The variant's checkpoint with a tokenizer, and its ort export (unvalidated: the tests below compare it)."""
    from conftest import write_tokenizer
    from transformers import GPT2Config

    params = {**BASE, **GELU_SCALED}
    config = GPT2Config(**params, bos_token_id=params["vocab_size"] - 1, eos_token_id=params["vocab_size"] - 1)
    root = tmp_path_factory.mktemp("gelu-scaled")
    folder = write_hf_folder(root / "checkpoint", config, seed=3)
    write_tokenizer(folder, params["vocab_size"])
    options = ExportOptions(fusion="ort", validate=False)
    return folder, export(str(folder), root / "ort", options=options).folder


def test_eval_on_a_variant_equals_pytorch(gelu_scaled, tmp_path):
    """gpt2onnx eval on the variant: transformers' sliding-window perplexity (its eager model, which applies the
    per-layer scaling) equal to our own PyTorch reference's and the export's, the same top-1 and greedy tokens."""
    import json

    from transformers import GPT2TokenizerFast
    from typer.testing import CliRunner

    from gpt2onnx.cli.app import app
    from tests.verify.test_eval import pytorch_perplexity, real_text

    checkpoint, exported = gelu_scaled
    text = tmp_path / "text.txt"
    text.write_text(real_text()[:1500])
    args = ["eval", str(exported), "--text", str(text), "--context", "48", "--stride", "24", "--greedy-tokens", "8"]
    result = CliRunner().invoke(app, [*args, "--json", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "eval.json").read_text())
    ids = GPT2TokenizerFast.from_pretrained(checkpoint).encode(text.read_text())
    expected = pytorch_perplexity(checkpoint, ids, context=48, stride=24)
    assert abs(report["reference"]["ppl"] / expected - 1) < 1e-6, (report["reference"], expected)
    (row,) = report["rows"]
    assert abs(row["ppl"] / expected - 1) < 1e-4 and row["same_top1"] == 1.0, row
    assert row["kl"]["max"] < 1e-8 and row["greedy"]["first_divergence"] is None, row


@pytest.mark.parametrize("runtime", [runtime_param("genai")])
def test_genai_generates_transformers_tokens_on_a_variant(gelu_scaled, runtime):
    """generate --runtime genai (onnxruntime-genai's own loop) on the variant: transformers' greedy tokens."""
    import torch
    from transformers import GPT2LMHeadModel
    from typer.testing import CliRunner

    from gpt2onnx.cli.app import app

    checkpoint, exported = gelu_scaled
    prompt = [5, 17, 42, 7]
    model = GPT2LMHeadModel.from_pretrained(checkpoint, attn_implementation="eager").eval()  # sdpa drops the scaling
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
    args = ["generate", str(exported), "--ids", ",".join(map(str, prompt)), "--max-new-tokens", "8"]
    result = CliRunner().invoke(app, [*args, "--runtime", runtime])
    assert result.exit_code == 0, result.output
    assert [int(t) for t in result.output.split()] == theirs, result.output


def test_genai_refuses_a_variant_it_cannot_represent_in_one_line(tmp_path):
    """What genai cannot represent is not the architecture (it runs the graph as exported) but an eos that never
    comes: GPT-2's default 50256 kept beside a smaller vocabulary, which genai needs inside it. Refused before any
    worker starts, whether onnxruntime-genai is installed or not."""
    from transformers import GPT2Config
    from typer.testing import CliRunner

    from gpt2onnx.cli.app import app

    folder = write_hf_folder(tmp_path / "checkpoint", GPT2Config(**{**BASE, **GELU_SCALED}), seed=3)  # eos 50256
    exported = export(str(folder), tmp_path / "x", options=ExportOptions(validate=False)).folder
    result = CliRunner().invoke(app, ["generate", str(exported), "--ids", "5,17", "--runtime", "genai"])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and line.startswith("error: eos_token_id 50256 is outside the model's vocabulary"), line


@pytest.mark.parametrize("changes", [dict(scale_attn_by_inverse_layer_idx=True), dict(scale_attn_weights=False), {}])
def test_export_says_once_which_attention_path_is_the_reference(changes, tmp_path, caplog):
    """transformers 4.x's default attention (sdpa) drops these two settings and its eager path applies them
    (measured here: the two paths' logits differ on such a config); the export follows eager, and says so once
    where the installed transformers disagrees with itself. transformers 5 applies them on both: no warning."""
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(**{**BASE, **changes})
    logits = {}
    for path in ("eager", "sdpa"):
        config._attn_implementation = path
        torch.manual_seed(0)
        with torch.no_grad():
            logits[path] = GPT2LMHeadModel(config).eval()(torch.arange(12)[None]).logits
    # the two paths' own fp32 rounding: 4e-6 measured (logits up to 10); a dropped setting moves them by 1 to 4
    disagrees = not torch.allclose(logits["eager"], logits["sdpa"], atol=1e-2, rtol=0)
    assert disagrees == (bool(changes) and int(transformers.__version__.split(".")[0]) < 5)
    folder = write_hf_folder(tmp_path / "checkpoint", GPT2Config(**{**BASE, **changes}), seed=3)
    with caplog.at_level("WARNING", logger="gpt2onnx"):
        export(str(folder), tmp_path / "out", options=ExportOptions(validate=False))
    said = [r.getMessage() for r in caplog.records if "sdpa" in r.getMessage()]
    assert len(said) == (1 if disagrees else 0), said
