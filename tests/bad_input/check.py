"""gpt2onnx check: a folder or a planned export against runtimes, providers, targets and decoding."""

from __future__ import annotations

import json
import os
import re
from typing import Callable

from tests.bad_input.common import B, Case, Ctx, F, Outcome, _og_deployed, config_file

CASES: list[Case] = [
    # -- check: a folder or a plan, read as export and generate read them, never run -------------------------------
    Case("check-folder-and-plan", "options", ("check", "{exp}", "--fusion", "ort"), B, match="drop the planned"),
    Case("check-model-typo", "message", ("check", "--model", "./nope", "--fusion", "ort"), B, match="no such file"),
    Case("check-draft-missing", "message", ("check", "{exp}", "--draft", "nope"), B, match="draft.*does not exist"),
    Case("check-target-bogus", "options", ("check", "{exp}", "--target", "bogus"), B, match="unknown --target"),
    Case(
        "check-config-fifo",
        "hang",
        ("check", "--model", "pipe.json"),
        B,
        lambda c: os.mkfifo(c.dir / "pipe.json"),
        match="not a regular file",
        timeout=60,
        process=True,
    ),
    Case(
        "check-config-not-gpt2",
        "message",
        ("check", "--model", "config.json"),
        B,
        config_file(model_type="llama"),
        match="expected 'gpt2'",
    ),
]


def _other_vocabulary_draft(c: Ctx) -> None:
    """'d': an export of a checkpoint with a vocabulary of 997 tokens (the shared export's has 1000)."""
    from conftest import make_config, write_hf_folder

    from gpt2onnx.exporters.export import ExportOptions, export

    source = write_hf_folder(c.dir / "ck", make_config("h3-v997"))
    export(str(source), c.dir / "d", options=ExportOptions(validate=False))


def _verdict(words: str) -> Callable[[Ctx, Outcome], None]:
    """check's --json report 'r.json' written, with the verdict: not supported, its first conflict matching."""

    def check(c: Ctx, out: Outcome) -> None:
        report = json.loads((c.dir / "r.json").read_text())
        assert report["supported"] is False and re.search(words, report["conflicts"][0]), report

    return check


OG_CHECK = ("check", "og", "--runtime", "ort-generate", "--json", "r.json")


CASES += [
    *(
        Case(
            f"check-{algorithm}-prompt-kernel-verdict",  # once exit 2 without the report
            "message",
            ("check", "--quantize", "int4", "--algorithm", algorithm, "--prompt-kernel", "int8", "--json", "r.json"),
            F,
            match=f"not supported: prompt kernel int8 .* algorithm {algorithm}",
            creates=("r.json",),
            check=_verdict(f"algorithm {algorithm}"),
        )
        for algorithm in ("hqq", "gptq", "k-quant")
    ),
    Case(
        "check-draft-other-vocabulary-verdict",  # once exit 2 without the report
        "message",
        ("check", "{exp}", "--draft", "d", "--json", "r.json"),
        F,
        _other_vocabulary_draft,
        match="the draft .* has a vocabulary of 997 tokens, but the model .* has one of 1000",
        creates=("r.json",),
        check=_verdict("vocabulary of 997"),
    ),
    Case(
        "check-ort-generate-beams",  # once "supported", and generate refused it
        "message",
        (*OG_CHECK, "--num-beams", "2"),
        F,
        _og_deployed,
        match="length_penalty to 1.0: pass --length-penalty 0",
        creates=("r.json",),
        check=_verdict("length_penalty"),
    ),
    Case(
        "check-ort-generate-no-repeat-ngram",
        "message",
        (*OG_CHECK, "--no-repeat-ngram-size", "2"),
        F,
        _og_deployed,
        match="no_repeat_ngram_size fixed at 0 .* sets no_repeat_ngram_size to 2: set no_repeat_ngram_size in",
        creates=("r.json",),
        check=_verdict("no_repeat_ngram_size"),
    ),
    Case(
        "check-ort-generate-temperature",
        "message",
        (*OG_CHECK, "--sample", "--temperature", "0.7"),
        F,
        _og_deployed,
        match="temperature fixed at 1.0 .* sets temperature to 0.7",
        creates=("r.json",),
        check=_verdict("temperature"),
    ),
    Case(
        "check-ort-generate-top-p",
        "message",
        (*OG_CHECK, "--sample", "--top-p", "0.9"),
        F,
        _og_deployed,
        match="top_p fixed at 1.0 .* sets top_p to 0.9",
        creates=("r.json",),
        check=_verdict("top_p"),
    ),
    Case(
        "check-ort-generate-not-deployed",  # once "supported", and generate refused the folder
        "message",
        ("check", "{exp}", "--runtime", "ort-generate", "--json", "r.json"),
        F,
        match="has no ort-generate/ files .*: deploy it first",
        creates=("r.json",),
        check=_verdict("ort-generate/ files"),
    ),
    Case("check-matrix-json", "options", ("check", "--matrix", "--json", "r.json"), B, match="--matrix .* drop --json"),
    Case("check-matrix-folder", "options", ("check", "--matrix", "{exp}"), B, match="--matrix .* drop FOLDER"),
    Case("check-matrix-fusion-bogus", "options", ("check", "--matrix", "--fusion", "bogus"), B, match="drop --fusion"),
    Case(
        "check-matrix-planned",
        "options",
        ("check", "--matrix", "--quantize", "int4", "--num-beams", "2"),
        B,
        match="drop --dtype/--quantize and its options, the decoding options",
    ),
]


CASES += [
    Case("check-adapter-not-switchable", "message", ("check", "{exp}", "--adapter", "x"), B, match="has no adapter"),
    Case("check-adapter-no-folder", "options", ("check", "-m", "{src}", "--adapter", "x"), B, match="give the folder"),
]
