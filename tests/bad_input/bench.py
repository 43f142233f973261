"""gpt2onnx bench and its subcommands (memory, generate, speculative, constraint, precision, served, web)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable

from tests.bad_input.common import (
    BENCH_QUICK,
    COST_QUICK,
    EXIT_RUNTIME,
    MEMORY_QUICK,
    SPEC_QUICK,
    B,
    Case,
    Ctx,
    Outcome,
    _interrupted,
    _work_record,
    export_copy,
    int8_export,
    other_checkpoint,
)

CASES: list[Case] = [
    Case(
        "bench-batch-huge",
        "hang",
        (
            "bench",
            "{exp}",
            "--batch",
            "100000",
            "--prompt-len",
            "100",
            "--new-tokens",
            "2",
            "--warmup",
            "0",
            "--repeat",
            "1",
        ),
        B,
        match="batch",
        timeout=60,
    ),
    Case(
        "bench-batch-empty-item",
        "silent",
        (
            "bench",
            "{exp}",
            "--batch",
            "1,,2",
            "--prompt-len",
            "4",
            "--new-tokens",
            "2",
            "--warmup",
            "0",
            "--repeat",
            "1",
        ),
        B,
        match="--batch",
    ),
    Case(
        "plot-unwritable",
        "traceback",
        (
            "bench",
            "{exp}",
            "--batch",
            "1",
            "--prompt-len",
            "4",
            "--new-tokens",
            "2",
            "--warmup",
            "0",
            "--repeat",
            "1",
            "--json",
            "b.json",
            "--plot",
            "/proc/nope/x.png",
        ),
        B,
        match="plot|x.png",
    ),
    Case(
        "plot-not-png",
        "message",
        (
            "bench",
            "{exp}",
            "--batch",
            "1",
            "--prompt-len",
            "4",
            "--new-tokens",
            "2",
            "--warmup",
            "0",
            "--repeat",
            "1",
            "--json",
            "b.json",
            "--plot",
            "latency.jpg",
        ),
        B,
        match="png",
    ),
    Case("bench-folder-without-model", "options", ("bench", "{src}"), B, match="model.onnx"),
    # -- bench served --server openai: gpt2onnx serve beside llama.cpp's server (issue 54) -----------------------------
    Case(
        "bench-served-server-bogus",
        "options",
        ("bench", "served", "{exp}", "--server", "vllm"),
        B,
        match="--server 'vllm' is not one of triton, openai",
    ),
    Case(
        "bench-served-gguf-with-triton",
        "options",
        ("bench", "served", "{exp}", "--gguf", "{exp}/model.onnx"),
        B,
        match="--gguf applies to --server openai",
    ),
    Case(
        "bench-served-threads-with-openai",
        "options",
        ("bench", "served", "{exp}", "--server", "openai", "--threads", "2"),
        B,
        match="--threads applies to --server triton",
    ),
    Case(
        "bench-served-gguf-missing",
        "message",
        ("bench", "served", "{exp}", "--server", "openai", "--gguf", "nope.gguf"),
        B,
        match="--gguf 'nope.gguf' is not a file",
    ),
    Case(
        "bench-served-gguf-not-gguf",
        "message",
        ("bench", "served", "{exp}", "--server", "openai", "--gguf", "t.txt"),
        B,
        lambda c: (c.dir / "t.txt").write_text("not a model"),
        match="--gguf 't.txt' is not a GGUF file",
    ),
    Case(
        "bench-served-llama-server-with-triton",
        "options",
        ("bench", "served", "{exp}", "--llama-server", "{exp}/model.onnx"),
        B,
        match="--llama-server applies to --server openai",
    ),
    Case(
        "bench-served-llama-server-without-gguf",
        "options",
        ("bench", "served", "{exp}", "--server", "openai", "--llama-server", "t.txt"),
        B,
        lambda c: (c.dir / "t.txt").write_text("not a program"),
        match="--llama-server serves the --gguf file beside ours: give --gguf too",
    ),
    Case(
        "bench-served-llama-server-not-executable",
        "message",
        ("bench", "served", "{exp}", "--server", "openai", "--gguf", "m.gguf", "--llama-server", "t.txt"),
        B,
        lambda c: ((c.dir / "t.txt").write_text("not a program"), (c.dir / "m.gguf").write_bytes(b"GGUF" + bytes(60))),
        match="--llama-server 't.txt' is not an executable file",
    ),
]


CASES += [
    # -- data loss: --json and --plot -------------------------------------------------------------------------------
    Case(
        "json-onto-model",
        "data-loss",
        ("bench", "m", *BENCH_QUICK, "--json", "m/model.onnx"),
        B,
        export_copy(),
        match="inside the model folder",
    ),
    Case(
        "json-into-model-folder-new-file",
        "data-loss",
        ("bench", "{exp}", *BENCH_QUICK, "--json", "{exp}/bench.json"),
        B,
        match="inside the model folder",
    ),
    Case(
        "json-fifo",
        "hang",
        ("bench", "{exp}", *BENCH_QUICK, "--json", "pipe.json"),
        B,
        lambda c: os.mkfifo(c.dir / "pipe.json"),
        match="not a regular file",
    ),
    Case(
        "json-symlink",
        "data-loss",
        ("bench", "{exp}", *BENCH_QUICK, "--json", "link.json"),
        B,
        lambda c: ((c.dir / "keep.txt").write_text("keep"), (c.dir / "link.json").symlink_to("keep.txt")),
        match="symbolic link",
    ),
    Case(
        "plot-is-folder",
        "traceback",
        ("bench", "{exp}", *BENCH_QUICK, "--plot", "d.png"),
        B,
        lambda c: (c.dir / "d.png").mkdir(),
        match="not a regular file",
    ),
    Case(
        "plot-in-model-folder",
        "data-loss",
        ("bench", "m", *BENCH_QUICK, "--plot", "m/p.png"),
        B,
        export_copy(),
        match="inside the model folder",
    ),
    Case(
        "plot-same-as-json",
        "data-loss",
        ("bench", "{exp}", *BENCH_QUICK, "--json", "a.png", "--plot", "a.png"),
        B,
        match="give each its own file",
    ),
    Case(
        "csv-same-as-md",
        "data-loss",
        ("bench", "{exp}", *BENCH_QUICK, "--csv", "t.md", "--md", "./t.md"),
        B,
        match="name 't.md': give each its own file",
    ),
    Case(
        "json-regular-file-replaced",
        "data-loss",
        ("bench", "{exp}", *BENCH_QUICK, "--json", "old.json"),
        0,
        lambda c: (c.dir / "old.json").write_text("{}"),
        creates=("old.json",),
    ),
    Case("batch-underscore", "silent", ("bench", "{exp}", *BENCH_QUICK[2:], "--batch", "1_0"), B, match="--batch"),
    Case(
        "bench-reference-other-architecture",
        "silent",
        ("bench", "{exp}", *BENCH_QUICK, "--baseline", "torch", "--reference", "other"),
        B,
        other_checkpoint(n_head=8),
        match="does not match",
    ),
    Case(
        "reference-without-baseline",
        "options",
        ("bench", "{exp}", *BENCH_QUICK, "--reference", "{src}"),
        B,
        match="--baseline torch",
    ),
    Case(
        "bench-runtime-twice",
        "options",
        ("bench", "{exp}", *BENCH_QUICK, "--runtime", "openvino,openvino"),
        B,
        match="twice",
    ),
    Case("bench-draft-missing", "message", ("bench", "{exp}", *BENCH_QUICK, "--draft", "nope"), B, match="draft"),
    Case(
        "bench-lookup-openvino",
        "options",
        ("bench", "{exp}", *BENCH_QUICK, "--prompt-lookup", "3", "--runtime", "openvino"),
        B,
        match="runtime openvino .* runs no step of several proposals",
    ),
    Case(
        "bench-new-tokens-1",
        "traceback",
        ("bench", "{exp}", "--batch", "1", "--prompt-len", "4", "--new-tokens", "1", "--warmup", "0", "--repeat", "1"),
        B,
        match="new tokens",
    ),
    Case(
        "bench-new-tokens-0",
        "traceback",
        ("bench", "{exp}", "--batch", "1", "--prompt-len", "4", "--new-tokens", "0", "--warmup", "0", "--repeat", "1"),
        B,
        match="new tokens",
    ),
]


# -- GPU providers (issue 28): what a provider cannot run is refused from what it declares, before any session ----
CASES += [
    Case(
        "int8-bench-on-cuda-writes-nothing",
        "data-loss",
        ("bench", "m", *BENCH_QUICK, "--provider", "cuda", "--json", "b.json"),
        EXIT_RUNTIME,
        int8_export,
        match="MatMulInteger",
    ),
]


CASES += [
    Case(
        "bench-json-plot-interrupted",
        "data-loss",
        (),
        0,
        run=_interrupted(
            (
                "bench",
                "{exp}",
                "--batch",
                "1,4",
                "--prompt-len",
                "32",
                "--new-tokens",
                "32",
                "--warmup",
                "1",
                "--repeat",
                "150",
                "--json",
                "b.json",
                "--plot",
                "b.png",
            ),
            ("b.json", "b.png"),
        ),
        creates=("b.json", "b.png", "t.txt"),
        timeout=400,
    ),
]


def _two_named_m(c: Ctx) -> None:
    (c.dir / "a").mkdir()
    (c.dir / "b").mkdir()
    shutil.copytree(c.exp, c.dir / "a" / "m", symlinks=True)
    shutil.copytree(c.q4, c.dir / "b" / "m", symlinks=True)


def _both_kept(c: Ctx, out: Outcome) -> None:
    report = json.loads((c.dir / "b.json").read_text())
    assert [run["label"] for run in report["runs"]] == ["a/m", "b/m"], report["runs"]
    assert "a/m:" in out.stdout and "b/m:" in out.stdout, out.stdout


CASES += [
    Case(
        "bench-two-folders-named-alike",  # once one label for both: the ratios kept one of them
        "silent",
        ("bench", "a/m", "b/m", *BENCH_QUICK, "--json", "b.json"),
        0,
        _two_named_m,
        creates=("b.json",),
        check=_both_kept,
    ),
    Case("bench-one-folder-twice", "options", ("bench", "{exp}", "{exp}/", *BENCH_QUICK), B, match="given twice"),
]


def _scored_text_in_work(how: str) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        (c.dir / "w").mkdir()
        text = "A line of the user's own text, longer than the characters scored.\n" * 40
        if how == "hard-link":
            (c.dir / "t.txt").write_text(text)
            os.link(c.dir / "t.txt", c.dir / "w" / "scored.txt")
        elif how == "variant":
            (c.dir / "w" / "fp32").mkdir()
            (c.dir / "w" / "fp32" / "t.txt").write_text(text)
        else:
            (c.dir / "w" / "scored.txt").write_text(text)

    return setup


def _t_txt(c: Ctx) -> None:
    (c.dir / "t.txt").write_text("Hello, world. " * 40)


PRECISION_W = ("bench", "precision", "{src}", "--work", "w", "--only", "fp32", "--max-chars", "200")


CASES += [
    Case(
        "precision-text-is-scored-txt",  # once cut to 187 bytes, exit 0: the grid writes scored.txt into --work
        "data-loss",
        (*PRECISION_W, "--text", "w/scored.txt"),
        B,
        _scored_text_in_work("itself"),
        match="writes 'w/scored.txt'",
    ),
    Case(
        "precision-text-hard-link-of-scored-txt",
        "data-loss",
        (*PRECISION_W, "--text", "t.txt"),
        B,
        _scored_text_in_work("hard-link"),
        match="writes 'w/scored.txt'",
    ),
    Case(
        "precision-text-in-variant-folder",  # the fp32 folder is built there with --force: the text would go
        "data-loss",
        (*PRECISION_W, "--text", "w/fp32/t.txt"),
        B,
        _scored_text_in_work("variant"),
        match="writes 'w/fp32'",
    ),
    Case(
        "precision-threads-0-writes-nothing",  # once W/fp32 exported first, then the refusal
        "options",
        ("bench", "precision", "{src}", "--text", "t.txt", "--work", "w", "--only", "fp32", "--threads", "0"),
        B,
        _t_txt,
        match="thread",
    ),
    Case(
        "precision-json-beside-the-text",  # once refused as 'inside the model folder .': the text's folder
        "message",
        ("bench", "precision", "tiny", "--random-init", "--text", "t.txt", "--json", "r.json", "--threads", "0"),
        B,
        _t_txt,
        match="thread",
    ),
    Case(
        "precision-repeat-0-writes-nothing",
        "options",
        ("bench", "precision", "{src}", "--text", "t.txt", "--work", "w", "--only", "fp32", "--repeat", "0"),
        B,
        _t_txt,
        match="--repeat",
    ),
]


CASES += [
    Case(
        "precision-record-fifo",  # once a hang
        "hang",
        ("bench", "precision", "{src}", "--text", "t.txt", "--work", "w", "--only", "fp32"),
        B,
        _work_record("grid-source.json", "fifo"),
        match=r"grid-source\.json that is not a regular file \(a FIFO\)",
        process=True,
        timeout=90,
    ),
    Case(
        "precision-build-without-record",
        "silent",
        ("bench", "precision", "{src}", "--text", "t.txt", "--work", "w", "--only", "fp32"),
        B,
        _work_record("grid-source.json", "fp32"),
        match="holds 'fp32' but no grid-source.json",
    ),
]


# -- round six: bench's own options ---------------------------------------------------------------------------------
def _same_export_twice_named_m(c: Ctx) -> None:
    c.copy("exp", "a/m")
    c.copy("exp", "b/m")


def _both_labels(c: Ctx, out: Outcome) -> None:
    table = (c.dir / "mem.md").read_text()
    assert "| a/m |" in table and "| b/m |" in table, table  # once both 'm'


CASES += [
    Case(
        "memory-folder-twice",  # once measured twice under one label
        "message",
        ("bench", "memory", "{exp}", "{exp}", *MEMORY_QUICK),
        B,
        match="given twice",
    ),
    Case(
        "memory-two-folders-one-name",
        "message",
        ("bench", "memory", "a/m", "b/m", *MEMORY_QUICK, "--md", "mem.md"),
        0,
        _same_export_twice_named_m,
        creates=("a", "b", "mem.md"),
        check=_both_labels,
    ),
]


CASES += [
    Case(
        "speculative-prompt-past-context",  # once IndexError (exit 70): transformers' prompt lookup ran past it
        "traceback",
        (
            "bench",
            "speculative",
            "{exp}",
            *SPEC_QUICK,
            "--prompt-lookup",
            "4",
            "--new-tokens",
            "3",
            "--prompt-tokens",
            "500",
        ),
        0,
    ),
    Case(
        "speculative-no-room-for-proposals",
        "traceback",
        ("bench", "speculative", "{exp}", "--prompt-lookup", "4", "--new-tokens", "126", "--warmup", "0"),
        B,
        match="126 new tokens and 4 proposed leave no room",
    ),
]


CASES += [
    Case(
        f"{command.replace(' ', '-')}-{flag.strip('-')}-1e8",  # once accepted (hours of runs, or a hang)
        "message",
        (*argv, flag, "100000000"),
        B,
        match=rf"{flag} must be an integer from",
    )
    for command, argv in (
        ("bench generate", ("bench", "generate", "{exp}", *BENCH_QUICK)),
        ("bench speculative", ("bench", "speculative", "{exp}", *SPEC_QUICK)),
    )
    for flag in ("--warmup", "--repeat")
]


CASES += [
    Case(
        "bench-constraint-schema-missing",
        "message",
        ("bench", "constraint", "{exp}", "--json-schema", "nope.json", *COST_QUICK[2:]),
        B,
        match="--json-schema 'nope.json': no such file",
    ),
    Case(
        "bench-constraint-two-kinds",
        "options",
        ("bench", "constraint", "{exp}", "--regex", "a", "--choice", "a,b", *COST_QUICK[2:]),
        B,
        match="give one constraint",
    ),
    Case(
        "bench-constraint-one-token",  # one new token: no decode step between two tokens to time
        "options",
        ("bench", "constraint", "{exp}", *COST_QUICK[:2], "--new-tokens", "1"),
        B,
        match="--new-tokens must be an integer from 2",
    ),
]


CASES += [
    Case("bench-adapter-not-switchable", "message", ("bench", "{exp}", "--adapter", "x"), B, match="has no adapter"),
]
