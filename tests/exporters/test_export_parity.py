"""Integration: exports of seeded tiny GPT-2 checkpoints against transformers' GPT2LMHeadModel."""

import json

import numpy as np
import onnx
import pytest

from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.runtimes.decoder import OnnxDecoder
from gpt2onnx.runtimes.providers import cpu_session
from gpt2onnx.verify.lockstep import compare_block, compare_decoder, greedy, left_padded_batch, reference_greedy

FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def exported(hf_folder, tmp_path_factory):
    """(checkpoint, reference, {variant: folder}) for one tiny config."""
    ckpt = load_checkpoint(str(hf_folder))
    out = tmp_path_factory.mktemp("out")
    folders = {
        "all": export(str(hf_folder), out / "all").folder,
        "last": export(str(hf_folder), out / "last", options=ExportOptions(logits="last")).folder,
    }
    return ckpt, reference_model(ckpt), folders


@pytest.mark.parametrize("logits", ["all", "last"])
def test_prompt_then_decode_steps_match_reference(exported, logits):
    ckpt, reference, folders = exported
    decoder = OnnxDecoder(cpu_session(folders[logits] / "model.onnx"))
    # batch 4, each row left-padded differently; empty past, then 5 decode steps feeding presents back
    ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=4, length=9, seed=1)
    assert len({int(m.sum()) for m in mask}) > 1, "rows must differ in padding"
    result = compare_decoder(decoder, reference, ids, mask, decode_steps=5, tolerance=FP32_TOL)
    assert result.measured.logits.max <= FP32_TOL, result
    assert result.measured.present.max <= FP32_TOL, result


def test_single_unpadded_prompt_and_one_token_prompt(exported):
    ckpt, reference, folders = exported
    decoder = OnnxDecoder(cpu_session(folders["all"] / "model.onnx"))
    for length in (1, 6):
        ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=1, length=length, seed=length)
        result = compare_decoder(decoder, reference, ids, mask, decode_steps=2, tolerance=FP32_TOL)
        assert result.passed, result


def test_logits_shapes(exported):
    ckpt, _, folders = exported
    ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=2, length=5, seed=2)
    for variant, length in (("all", 5), ("last", 1)):
        decoder = OnnxDecoder(cpu_session(folders[variant] / "model.onnx"))
        logits, presents = decoder.step(ids, mask, np.zeros_like(ids), decoder.empty_past(2))
        assert logits.shape == (2, length, ckpt.spec.vocab_size)
        assert presents[0].shape == (2, ckpt.spec.n_head, 5, ckpt.spec.head_dim)


@pytest.mark.parametrize("logits", ["all", "last"])
def test_greedy_generation_identical_to_transformers_generate(exported, logits):
    ckpt, reference, folders = exported
    decoder = OnnxDecoder(cpu_session(folders[logits] / "model.onnx"))
    ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=3, length=7, seed=3)
    ours = greedy(decoder, ids, mask, max_new_tokens=12)
    theirs = reference_greedy(reference, ids, mask, max_new_tokens=12)
    np.testing.assert_array_equal(ours, theirs)
    assert len(np.unique(theirs)) > 3, "generation too degenerate to prove anything"


def test_single_block_export_matches_reference_block(hf_folder, tmp_path):
    ckpt = load_checkpoint(str(hf_folder))
    reference = reference_model(ckpt)
    last = ckpt.spec.n_layer - 1
    for index in sorted({0, last}):
        folder = export(str(hf_folder), tmp_path / f"block{index}", options=ExportOptions(block=index)).folder
        manifest = json.loads((folder / "gpt2onnx.json").read_text())
        assert manifest["kind"] == "block" and manifest["parity"]["passed"]
        model = onnx.load(str(folder / "model.onnx"))
        assert [i.name for i in model.graph.input] == ["hidden_states", "attention_mask", "past_key", "past_value"]
        assert [o.name for o in model.graph.output] == ["output_hidden_states", "present_key", "present_value"]
        ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=3, length=6, seed=4)
        result = compare_block(
            cpu_session(folder / "model.onnx"), reference, index, ids, mask, decode_steps=3, tolerance=FP32_TOL
        )
        assert result.passed, result


def test_manifest_and_folder_contents(exported):
    ckpt, _, folders = exported
    folder = folders["all"]
    manifest = json.loads((folder / "gpt2onnx.json").read_text())
    assert manifest["format_version"] == 1 and manifest["kind"] == "decoder" and manifest["dtype"] == "float32"
    assert manifest["source"]["kind"] == "local" and len(manifest["source"]["sha256"]) == 64
    assert manifest["opset"] == 17 and manifest["opset_imports"] == {"ai.onnx": 17}
    assert manifest["parity"]["passed"] and manifest["parity"]["measured"]["logits"]["max"] <= FP32_TOL
    assert set(manifest["versions"]) >= {"torch", "onnx", "onnxruntime", "gpt2onnx"}
    names = [t["name"] for t in manifest["io"]["inputs"]]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert names[3:] == [f"past_key_values.{i}.{k}" for i in range(ckpt.spec.n_layer) for k in ("key", "value")]
    assert {"model.onnx", "config.json", "generation_config.json"} <= set(manifest["files"])
    from gpt2onnx.files import sha256_file

    for name, info in manifest["files"].items():
        assert sha256_file(folder / name) == info["sha256"]
    assert not any(p.name.startswith(".") for p in folder.parent.iterdir()), "staging folders left behind"


def test_tied_embedding_stored_once(exported):
    ckpt, _, folders = exported
    model = onnx.load(str(folders["all"] / "model.onnx"))
    vocab_sized = [i.name for i in model.graph.initializer if ckpt.spec.vocab_size in i.dims]
    expected = ["wte.weight"] if ckpt.spec.tie_word_embeddings else ["wte.weight", "lm_head"]
    assert sorted(vocab_sized) == sorted(expected)
    n_params = sum(int(np.prod(t.shape)) for t in ckpt.state_dict.values())
    assert (
        sum(int(np.prod(i.dims)) for i in model.graph.initializer if len(i.dims) >= 1 and np.prod(i.dims) > 1)
        == n_params
    )


def test_nan_in_the_onnx_output_fails_parity(tiny_folder, tmp_path):
    """A graph that returns NaN must not pass (NaN compares false with everything, so max() would skip it)."""
    from onnx import TensorProto, helper

    folder = export(str(tiny_folder), tmp_path / "nan").folder
    model = onnx.load(str(folder / "model.onnx"))
    logits = next(o for o in model.graph.output if o.name == "logits")
    for node in model.graph.node:  # rename the producer's output and add NaN · x behind it
        node.output[:] = ["logits_raw" if name == "logits" else name for name in node.output]
    model.graph.initializer.append(helper.make_tensor("nan", TensorProto.FLOAT, [], [float("nan")]))
    model.graph.node.append(helper.make_node("Mul", ["logits_raw", "nan"], [logits.name]))
    onnx.save(model, str(folder / "model.onnx"))
    ckpt = load_checkpoint(str(tiny_folder))
    ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=2, length=4, seed=0)
    result = compare_decoder(
        OnnxDecoder(cpu_session(folder / "model.onnx")),
        reference_model(ckpt),
        ids,
        mask,
        decode_steps=1,
        tolerance=FP32_TOL,
    )
    assert not result.passed and result.measured.logits.max == float("inf")
