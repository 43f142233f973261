"""Where weights come from, and every way a checkpoint or config can be refused."""

import json
import shutil

import pytest
import torch
from conftest import make_config, write_hf_folder

from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.pytorch.architecture import PRESETS, preset_config, spec_from_config
from gpt2onnx.pytorch.checkpoint import load_checkpoint


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_local_safetensors_and_bin_give_the_same_tensors(tiny_folder, tmp_path):
    bin_folder = write_hf_folder(tmp_path / "bin", make_config("h4-v1000"), safe_serialization=False)
    a, b = load_checkpoint(str(tiny_folder)), load_checkpoint(str(bin_folder))
    assert a.source["weights"] == ["model.safetensors"] and b.source["weights"] == ["pytorch_model.bin"]
    assert a.state_dict.keys() == b.state_dict.keys()
    for key in a.state_dict:
        torch.testing.assert_close(a.state_dict[key], b.state_dict[key], rtol=0, atol=0)


def test_random_init_is_seeded(tmp_path):
    a = load_checkpoint("tiny", random_init=True, seed=3)
    b = load_checkpoint("tiny", random_init=True, seed=3)
    c = load_checkpoint("tiny", random_init=True, seed=4)
    assert torch.equal(a.state_dict["h.0.attn.c_attn.weight"], b.state_dict["h.0.attn.c_attn.weight"])
    assert not torch.equal(a.state_dict["h.0.attn.c_attn.weight"], c.state_dict["h.0.attn.c_attn.weight"])
    assert a.source == {**b.source} and a.source["seed"] == 3
    # biases and gains are perturbed, so no two tensors are identical
    assert not torch.equal(a.state_dict["h.0.ln_1.weight"], a.state_dict["h.1.ln_1.weight"])


def test_random_init_from_config_json_and_from_folder(tiny_folder):
    from_file = load_checkpoint(str(tiny_folder / "config.json"), random_init=True)
    from_folder = load_checkpoint(str(tiny_folder), random_init=True)
    assert from_file.spec == from_folder.spec == load_checkpoint(str(tiny_folder)).spec


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_representable(name):
    spec = spec_from_config(preset_config(name))
    assert spec.n_embd % spec.n_head == 0 and spec.layer_norm_epsilon == 1e-5


# The families' published sizes (their names), in millions of parameters; ours is the exact count.
FAMILY_SIZES = {
    "cerebras-gpt-111m": 111,
    "cerebras-gpt-256m": 256,
    "cerebras-gpt-590m": 590,
    "cerebras-gpt-1.3b": 1300,
    "cerebras-gpt-2.7b": 2700,
    "cerebras-gpt-6.7b": 6700,
    "cerebras-gpt-13b": 13000,
    "biomedlm": 2700,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_count_is_transformers(name):
    """Each preset's exact parameter count (ours, analytic) is that of transformers' GPT2LMHeadModel of the same
    config, built on the meta device (no memory, no time), and the family's published size to 5%."""
    from transformers import GPT2LMHeadModel

    from gpt2onnx.pytorch.architecture import parameter_count
    from gpt2onnx.pytorch.checkpoint import expected_shapes

    config = preset_config(name)
    spec = spec_from_config(config)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    theirs = sum(p.numel() for p in model.parameters())  # a tied head is one parameter
    assert parameter_count(spec) == theirs
    assert sum(int(torch.Size(s).numel()) for s in expected_shapes(spec).values()) == theirs
    if name in FAMILY_SIZES:
        assert abs(theirs / 1e6 / FAMILY_SIZES[name] - 1) < 0.05, theirs
    assert spec.activation == ("gelu" if name.startswith("cerebras") else "gelu_new")
    mistral = name == "biomedlm" or name.startswith("mistral")
    assert spec.scale_attn_by_inverse_layer_idx == spec.reorder_and_upcast_attn == mistral


def test_gpt2_preset_parameter_count():
    from gpt2onnx.pytorch.checkpoint import expected_shapes

    shapes = expected_shapes(spec_from_config(preset_config("gpt2")))
    total = sum(int(torch.Size(s).numel()) for s in shapes.values())
    assert total == 124_439_808


def test_missing_path():
    with pytest.raises(Gpt2OnnxError, match="no such file or folder"):
        load_checkpoint("./does/not/exist")


def test_folder_without_config(tmp_path):
    with pytest.raises(Gpt2OnnxError, match="has no config.json"):
        load_checkpoint(str(tmp_path))


def test_folder_without_weights(tiny_folder, tmp_path):
    folder = tmp_path / "noweights"
    folder.mkdir()
    shutil.copy(tiny_folder / "config.json", folder)
    with pytest.raises(Gpt2OnnxError, match="has no weights"):
        load_checkpoint(str(folder))


def test_truncated_safetensors(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path / "trunc")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(Gpt2OnnxError, match="corrupt or truncated"):
        load_checkpoint(str(folder))


def test_garbage_safetensors(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path / "garbage")
    (folder / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(Gpt2OnnxError, match="corrupt or truncated"):
        load_checkpoint(str(folder))


def test_truncated_pytorch_bin(tmp_path):
    folder = write_hf_folder(tmp_path / "bin", make_config("h4-v1000"), safe_serialization=False)
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 3])
    with pytest.raises(Gpt2OnnxError, match="corrupt or truncated"):
        load_checkpoint(str(folder))


def test_shape_mismatch_names_the_tensor(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path / "mismatch")
    config = json.loads((folder / "config.json").read_text())
    config["n_positions"] = 256  # the saved wpe has 128 rows
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        Gpt2OnnxError, match=r"'transformer\.wpe\.weight' has shape \[128, 64\], but the config implies \[256, 64\]"
    ):
        load_checkpoint(str(folder))


def test_missing_and_unexpected_tensors(tiny_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_folder / "model.safetensors"))
    folder = _copy(tiny_folder, tmp_path / "missing")
    save_file(
        {k: v for k, v in tensors.items() if k != "transformer.h.1.mlp.c_fc.bias"}, str(folder / "model.safetensors")
    )
    with pytest.raises(Gpt2OnnxError, match="missing tensor 'h.1.mlp.c_fc.bias'"):
        load_checkpoint(str(folder))
    folder = _copy(tiny_folder, tmp_path / "unexpected")
    save_file({**tensors, "transformer.h.7.ln_1.weight": torch.ones(64)}, str(folder / "model.safetensors"))
    with pytest.raises(Gpt2OnnxError, match="'transformer.h.7.ln_1.weight' is not part of"):
        load_checkpoint(str(folder))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"activation_function": "prelu"}, "activation_function 'prelu' cannot be exported: choose one of gelu_new"),
        # transformers 4 accepts any value and gpt2onnx refuses it; transformers 5 refuses it first, naming it too
        (
            {"scale_attn_by_inverse_layer_idx": 1},
            r"scale_attn_by_inverse_layer_idx(' expected bool, got int \(value: 1\)| must be true or false, got 1)",
        ),
        (
            {"reorder_and_upcast_attn": "yes"},
            r"reorder_and_upcast_attn(' expected bool, got str \(value: 'yes'\)| must be true or false)",
        ),
        ({"add_cross_attention": True}, "add_cross_attention=True cannot be exported"),
        ({"n_head": 5}, "not divisible by n_head=5"),
        ({"model_type": "llama"}, "model_type is 'llama'"),
    ],
)
def test_unrepresentable_configs_are_refused(tiny_folder, tmp_path, change, message):
    folder = _copy(tiny_folder, tmp_path / "cfg")
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(Gpt2OnnxError, match=message):
        load_checkpoint(str(folder))


def test_invalid_config_json(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path / "badjson")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(Gpt2OnnxError, match="not valid JSON"):
        load_checkpoint(str(folder))


def test_unknown_preset():
    with pytest.raises(Gpt2OnnxError, match="unknown architecture 'gpt3'.*gpt2-medium"):
        load_checkpoint("gpt3", random_init=True)


def test_hub_id_that_cannot_be_fetched(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(
        Gpt2OnnxError, match=r"could not be fetched from the Hugging Face Hub.*--model PATH.*--random-init"
    ) as err:
        load_checkpoint("someone/no-such-gpt2")
    message = str(err.value)  # huggingface_hub's whole sentence, on one line (it was cut: "... connection and;")
    assert "\n" not in message and " and; use" not in message
    reason = message.split("Hub (HF_HUB_OFFLINE is set): ", 1)[-1].split("; use --model PATH")[0]
    assert not reason.endswith((" and", " or", ",")), reason


def test_hub_id_served_from_the_local_cache_when_offline(monkeypatch, tmp_path, tiny_folder):
    """A Hub id resolves through huggingface_hub's own cache (the layout it writes when online)."""
    import huggingface_hub.constants as hub_constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--someone--tiny-gpt2"
    shutil.copytree(tiny_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    ckpt = load_checkpoint("someone/tiny-gpt2")
    assert ckpt.source["kind"] == "hub" and ckpt.source["commit"] == commit and ckpt.name == "tiny-gpt2"
    assert torch.equal(ckpt.state_dict["wte.weight"], load_checkpoint(str(tiny_folder)).state_dict["wte.weight"])


def test_a_hub_error_is_kept_whole_on_one_line():
    """issue 37: huggingface_hub's reasons span lines; the first line alone ended mid-sentence ("...Please check
    your internet connection and; use --model PATH...")."""
    from gpt2onnx.pytorch.checkpoint import _one_sentence_or_more

    hub = (
        "An error happened while trying to locate the files on the Hub and we cannot find the appropriate snapshot"
        " folder for the specified revision on the local disk. Please check your internet connection and\ntry again."
    )
    assert _one_sentence_or_more(" ".join(hub.split())).endswith("internet connection and try again")
    long = "First sentence. " + "word " * 100
    assert _one_sentence_or_more(long.strip()) == "First sentence"
