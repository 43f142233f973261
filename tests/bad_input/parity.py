"""gpt2onnx parity: the folders, references and options it compares."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Callable

from tests.bad_input.common import (
    B,
    Case,
    Ctx,
    _int4_external,
    export_copy,
    genai_config_file,
    no_marker,
    other_checkpoint,
    source_copy,
    write,
)


def _parity_huge(c: Ctx) -> None:
    """An export whose manifest names, as its source, a folder whose config.json is huge."""
    source_copy(n_layer=100000)(c)
    folder = c.copy("exp", "e")
    manifest = json.loads((folder / "gpt2onnx.json").read_text())
    manifest["source"] = {**manifest["source"], "path": str(c.dir / "m")}
    (folder / "gpt2onnx.json").write_text(json.dumps(manifest))


CASES: list[Case] = [
    Case("parity-huge-source-config", "hang", ("parity", "e", "--cases", "1"), B, _parity_huge, match="n_layer"),
    Case("parity-seed-negative", "traceback", ("parity", "{exp}", "--seed", "-1", "--cases", "1"), B, match="seed"),
    Case(
        "manifest-missing-fields",
        "traceback",
        ("parity", "m", "--cases", "1"),
        B,
        export_copy(write("gpt2onnx.json", '{"format_version": 1, "source": {"kind": "random"}}')),
        match="gpt2onnx.json|manifest",
    ),
    Case(
        "reference-missing",
        "message",
        ("parity", "{exp}", "--reference", "./nowhere", "--cases", "1"),
        B,
        match="--reference",
        absent="--model",
    ),
    Case("parity-cases-zero", "options", ("parity", "{exp}", "--cases", "0"), B, match="cases"),
]


CASES += [
    Case(
        "genai-parity-custom-ops",
        "security",
        ("parity", "m", "--cases", "1", "--runtime", "genai"),
        0,
        genai_config_file(session={"custom_ops_library": "{lib}"}),
        check=no_marker,
    ),
    Case(
        "json-onto-manifest",
        "data-loss",
        ("parity", "m", "--cases", "1", "--json", "m/gpt2onnx.json"),
        B,
        export_copy(),
        match="inside the model folder",
    ),
    Case(
        "json-folder",
        "traceback",
        ("parity", "{exp}", "--cases", "1", "--json", "d"),
        B,
        lambda c: (c.dir / "d").mkdir(),
        match="not a regular file",
    ),
    Case(
        "json-no-folder",
        "traceback",
        ("parity", "{exp}", "--cases", "1", "--json", "nope/p.json"),
        B,
        match="does not exist",
    ),
    Case(
        "parity-reference-other-heads",
        "silent",
        ("parity", "{exp}", "--cases", "1", "--reference", "other"),
        B,
        other_checkpoint(n_head=8),
        match="does not match",
    ),
    Case("emulate-fp16-on-fp32", "options", ("parity", "{exp}", "--cases", "1", "--emulate-fp16"), B, match="fp16"),
]


@contextlib.contextmanager
def environment(name: str, value: str):
    """An environment variable set for an in-process case."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# -- GPU providers (issue 28): what a provider cannot run is refused from what it declares, before any session ----
CASES += [
    Case(
        "tf32-against-the-override",
        "options",
        ("parity", "{exp}", "--cases", "1", "--provider", "cuda", "--tf32"),
        B,
        match="NVIDIA_TF32_OVERRIDE=0",
        inject=lambda c: environment("NVIDIA_TF32_OVERRIDE", "0"),
    ),
]


# -- text read in bounded pieces --------------------------------------------------------------------------------
def _big_text(kind: str, megabytes: int) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        import random

        rng = random.Random(0)
        words = ["the", "model", "of", "a", "text", "and", "runs", "hello", "world"]
        block = "a" * (1 << 20) if kind == "letter" else " ".join(rng.choices(words, k=200_000))[: (1 << 20) - 1] + " "
        with open(c.dir / "big.txt", "w") as fh:
            for _ in range(megabytes):  # one block of 1 MB, written again: no punctuation anywhere
                fh.write(block)

    return setup


CASES += [
    # -- text read in bounded pieces (the runner caps each process at 3 GB of address space) ----------------------
    Case(
        "text-20mb-words-and-spaces",
        "hang",
        ("parity", "{exp}", "--cases", "1", "--text", "big.txt"),
        0,
        _big_text("words", 20),
        process=True,
        timeout=240,
    ),
    Case(
        "text-16mb-one-letter",
        "hang",
        ("parity", "{exp}", "--cases", "1", "--text", "big.txt"),
        0,
        _big_text("letter", 16),
        process=True,
        timeout=240,
    ),
]


def _deployed_with_links(c: Ctx) -> None:
    from gpt2onnx.targets.deploy import deploy

    _int4_external(c)
    deploy(c.dir / "q", "triton", out=c.dir / "d")  # the data file now has three hard links
    assert (c.dir / "d" / "model.onnx_data").stat().st_nlink > 1


CASES += [
    Case(
        "parity-of-a-deployed-folder",  # its data file hard-linked into triton/ and onnx/: once exit 70
        "traceback",
        # random weights in a local folder: the quality gates are loosened, the file check (which loads the data) not
        ("parity", "d", "--cases", "1", "--gate", "kl_mean=10", "--gate", "top1=0.01", "--gate", "top5=0.01"),
        0,
        _deployed_with_links,
        timeout=240,
    ),
]


CASES += [
    # parity, eval, bench, check --adapter: one declaration, the same refusal before any work (issue 56)
    Case("parity-adapter-not-switchable", "message", ("parity", "{exp}", "--adapter", "x"), B, match="has no adapter"),
]
