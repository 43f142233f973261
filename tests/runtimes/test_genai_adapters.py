"""onnxruntime-genai with a switchable LoRA adapter active (genai's multi-LoRA: og.Adapters, set_active_adapter):
two real PEFT adapters on the trained fixture, exported switchable once; genai's greedy tokens with each adapter
(and with none) equal the onnxruntime runtime's, its logits pass fp32's gates against PEFT's merge of the adapter,
and the genai deploy target keeps the adapter files beside the model, where genai loads them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("peft")

from typer.testing import CliRunner  # noqa: E402

from gpt2onnx.artifact.folder import open_folder  # noqa: E402
from gpt2onnx.artifact.lora import adapter_of  # noqa: E402
from gpt2onnx.cli.app import app  # noqa: E402
from gpt2onnx.errors import BadInput  # noqa: E402
from gpt2onnx.files import sha256_file  # noqa: E402
from gpt2onnx.runtimes import genai  # noqa: E402
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime  # noqa: E402

if not (genai.in_process() or genai.genai_python()):
    pytest.skip(
        "onnxruntime-genai is not installed (bash scripts/setup.sh creates .venv-genai)", allow_module_level=True
    )

GENAI = RuntimeOptions("genai")
NEW = 12
# Two PEFT adapters of other shapes, B initialized non-zero so that each moves the greedy tokens (asserted below):
# 'a' on every projection, 'b' rsLoRA on c_attn and c_fc only. PEFT's own initialization, seeded: no training.
ADAPTERS = {
    "a": (1, {"r": 2, "lora_alpha": 8, "target_modules": ["c_attn", "c_proj", "c_fc"]}),
    "b": (2, {"r": 2, "lora_alpha": 4, "target_modules": ["c_attn", "c_fc"], "use_rslora": True}),
}
# A top-1 logit this far above the second cannot change places between two fp32 runs of one graph, whose logits
# differ by summation order only (fp32's gate is 1e-4; parity below measures ~3e-6 here).
MARGIN = 1e-3


@pytest.fixture(scope="module")
def switchable(trained_checkpoint, tmp_path_factory):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    from gpt2onnx.exporters.switchable import export_switchable

    folders = {}
    for name, (seed, settings) in ADAPTERS.items():
        torch.manual_seed(seed)
        base = GPT2LMHeadModel.from_pretrained(trained_checkpoint, attn_implementation="eager")
        config = LoraConfig(**settings, init_lora_weights=False, fan_in_fan_out=True)
        folders[name] = tmp_path_factory.mktemp("genai-lora") / name
        get_peft_model(base, config).save_pretrained(folders[name])
    out = tmp_path_factory.mktemp("genai-switchable") / "m"
    return export_switchable(str(trained_checkpoint), out, adapters=folders).folder


@pytest.fixture(scope="module")
def rows(trained_checkpoint) -> list[str]:
    """Two prompts of 10 tokens of held-out docstrings, as --ids gives them."""
    from transformers import GPT2TokenizerFast

    tokenizer = GPT2TokenizerFast.from_pretrained(trained_checkpoint)
    ids = tokenizer((trained_checkpoint / "heldout.txt").read_text()[:4000])["input_ids"][:20]
    return [",".join(map(str, ids[:10])), ",".join(map(str, ids[10:]))]


@pytest.fixture(scope="module")
def onnxruntime_tokens(switchable, rows) -> dict:
    """The onnxruntime runtime's greedy tokens, with no adapter and with each."""
    from gpt2onnx.decoding.generate import generate

    return {name: generate(switchable, ids=rows, max_new_tokens=NEW, adapter=name).tokens for name in (None, "a", "b")}


def test_genai_generate_with_each_adapter_equals_onnxruntime(switchable, rows, onnxruntime_tokens):
    """generate --runtime genai --adapter NAME gives the onnxruntime runtime's greedy tokens with NAME, and with no
    adapter the base's; each adapter really moves them (the three differ), so neither side can skip it."""
    from gpt2onnx.decoding.generate import generate

    theirs = onnxruntime_tokens
    assert theirs[None] != theirs["a"] and theirs[None] != theirs["b"] and theirs["a"] != theirs["b"]
    for name in (None, "a", "b"):
        ours = generate(switchable, ids=rows, max_new_tokens=NEW, adapter=name, runtime=GENAI)
        assert ours.settings.runtime == "genai"
        assert ours.tokens == theirs[name], name


def test_genai_runner_switches_adapters_and_refuses_another_models(switchable, rows, onnxruntime_tokens, tmp_path):
    """One genai runner, its adapter switched between runs (base, a, b, base again): each pass's top-1 is the
    onnxruntime runtime's token with that adapter, by a margin no fp32 rounding can cross (so the equality above
    holds on any CPU); an adapter file of another model's slots is refused in one line before genai loads it."""
    import onnxruntime as ort

    model = open_folder(switchable)
    runner = open_runtime(model, GENAI)
    try:
        for name in (None, "a", "b", None):
            runner.activate_adapter(adapter_of(model, name) if name else None)
            for row, tokens in zip(rows, onnxruntime_tokens[name]):
                prompt = [int(t) for t in row.split(",")]
                passes = runner.run_loop(prompt, max_new_tokens=0, forced=tokens, return_logits=True).logits
                last = np.stack([np.asarray(p)[-1] for p in passes[: len(tokens)]])  # each new token's logits
                assert last.argmax(axis=-1).tolist() == tokens, name
                top2 = np.sort(last, axis=-1)[:, -2:]
                assert (top2[:, 1] - top2[:, 0]).min() > MARGIN, name
        foreign = tmp_path / "other.onnx_adapter"
        adapter = ort.AdapterFormat()
        adapter.set_adapter_version(1)
        adapter.set_model_version(1)
        factor = np.zeros((64, 2), np.float32)  # kept alive until written: the OrtValue holds no copy
        adapter.set_parameters({"lora.h.9.attn.c_attn.A": ort.OrtValue.ortvalue_from_numpy(factor)})
        adapter.export_adapter(str(foreign))
        with pytest.raises(BadInput, match="lora.h.9.attn.c_attn.A, which this model has no slot for"):
            runner.activate_adapter(foreign)
    finally:
        runner.close()


def test_genai_parity_with_an_adapter_against_peft(switchable):
    """parity --runtime genai --adapter a: genai's logits, pass by pass, against PEFT's merge of 'a' under fp32's
    gates (not vacuous: 'a' moves the greedy tokens, so logits without it fail the gate)."""
    from gpt2onnx.verify.parity import parity

    report = parity(switchable, runtime=GENAI, adapter="a", cases=2, max_batch=1)
    assert report.passed, report.failures
    assert report.against == "PyTorch with adapter 'a' (PEFT, merged)"


def test_genai_deploy_carries_the_adapter_files(switchable, rows, onnxruntime_tokens, tmp_path):
    """deploy --target genai keeps each NAME.onnx_adapter beside model.onnx and genai_config.json, the bytes
    exported; the deployed folder runs on genai with --adapter (the CLI), giving the onnxruntime runtime's tokens."""
    runner = CliRunner()
    out = tmp_path / "deployed"
    result = runner.invoke(app, ["deploy", str(switchable), "--target", "genai", "-o", str(out)])
    assert result.exit_code == 0, result.output
    exported = json.loads((switchable / "gpt2onnx.json").read_text())["files"]
    for name in ADAPTERS:
        assert sha256_file(out / f"{name}.onnx_adapter") == exported[f"{name}.onnx_adapter"]["sha256"]
    assert (out / "genai_config.json").is_file()
    result = runner.invoke(app, ["check", str(out), "--adapter", "b", "--runtime", "genai"])
    assert result.exit_code == 0, result.output
    answer = Path(tmp_path / "generated.json")
    argv = ["generate", str(out), "--ids", rows[1], "--max-new-tokens", str(NEW), "--runtime", "genai"]
    result = runner.invoke(app, [*argv, "--adapter", "b", "--json", str(answer)])
    assert result.exit_code == 0, result.output
    assert json.loads(answer.read_text())["prompts"][0]["sequences"][0]["token_ids"] == onnxruntime_tokens["b"][1]
