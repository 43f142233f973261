"""The output rule, on every command that writes a file: no output over an input, a hostile output place, each
option that writes."""

from __future__ import annotations

import os
import shutil
from typing import Callable

from tests.bad_input.common import BENCH_QUICK, COST_QUICK, MEMORY_QUICK, SPEC_QUICK, B, Case, Ctx, _parameters

GENERATE_QUICK = (*BENCH_QUICK, "--num-beams", "2")


def output_options() -> list[tuple[str, str, str]]:
    """Every (command, option, kind) of the CLI that names a path it writes: the options declared with the
    OutputPath parser (gpt2onnx.cli). Found from the commands themselves, so a new one cannot be missed."""
    from gpt2onnx.cli import OutputPath

    return sorted(
        (command, option, info.parser.kind)
        for command, _, option, info, _ in _parameters()
        if isinstance(info.parser, OutputPath)
    )


# The command line each output option is fed into, otherwise valid ({out}: the hostile path); {read}: the model
# folder that command reads (an output inside it, or that is it, is refused).
OUTPUT_COMMANDS = {
    ("generate", "--json"): (
        ("generate", "{exp}", "--ids", "1,2", "--max-new-tokens", "1", "--json", "{out}"),
        "{exp}",
    ),
    ("eval", "--json"): (("eval", "{exp}", "--text", "t.txt", "--greedy-tokens", "0", "--json", "{out}"), "{exp}"),
    ("parity", "--json"): (("parity", "{exp}", "--cases", "1", "--json", "{out}"), "{exp}"),
    ("bench", "--json"): (("bench", "{exp}", *BENCH_QUICK, "--json", "{out}"), "{exp}"),
    ("bench", "--plot"): (("bench", "{exp}", *BENCH_QUICK, "--plot", "{out}"), "{exp}"),
    ("bench", "--csv"): (("bench", "{exp}", *BENCH_QUICK, "--csv", "{out}"), "{exp}"),
    ("bench", "--md"): (("bench", "{exp}", *BENCH_QUICK, "--md", "{out}"), "{exp}"),
    ("bench generate", "--json"): (("bench", "generate", "{exp}", *GENERATE_QUICK, "--json", "{out}"), "{exp}"),
    ("bench speculative", "--json"): (("bench", "speculative", "{exp}", *SPEC_QUICK, "--json", "{out}"), "{exp}"),
    ("bench speculative", "--md"): (("bench", "speculative", "{exp}", *SPEC_QUICK, "--md", "{out}"), "{exp}"),
    ("bench constraint", "--json"): (("bench", "constraint", "{exp}", *COST_QUICK, "--json", "{out}"), "{exp}"),
    ("bench constraint", "--md"): (("bench", "constraint", "{exp}", *COST_QUICK, "--md", "{out}"), "{exp}"),
    ("bench generate", "--md"): (("bench", "generate", "{exp}", *GENERATE_QUICK, "--md", "{out}"), "{exp}"),
    ("bench memory", "--json"): (("bench", "memory", "{exp}", *MEMORY_QUICK, "--json", "{out}"), "{exp}"),
    ("bench memory", "--md"): (("bench", "memory", "{exp}", *MEMORY_QUICK, "--md", "{out}"), "{exp}"),
    ("check", "--json"): (("check", "{exp}", "--json", "{out}"), "{exp}"),
    **{
        ("compare", option): (("compare", "{src}", "--only", "gpt2onnx:fp32", option, "{out}"), "{src}")
        for option in ("--json", "--md", "--csv", "--plot", "--work")
    },
    ("bench web", "--json"): (("bench", "web", "{exp}", "--json", "{out}"), "{exp}"),
    ("bench web", "--md"): (("bench", "web", "{exp}", "--md", "{out}"), "{exp}"),
    ("bench served", "--json"): (("bench", "served", "{exp}", "--json", "{out}"), "{exp}"),
    ("bench served", "--md"): (("bench", "served", "{exp}", "--md", "{out}"), "{exp}"),
    **{
        ("bench precision", option): (
            ("bench", "precision", "{src}", "--text", "t.txt", "--only", "fp32", option, "{out}"),
            "{src}",
        )
        for option in ("--json", "--md", "--csv", "--work")
    },
    ("export", "--out"): (("export", "--model", "{src}", "--no-validate", "-o", "{out}"), "{src}"),
    ("optimize", "--out"): (("optimize", "{exp}", "-o", "{out}"), "{exp}"),
    ("deploy", "--out"): (("deploy", "{exp}", "--target", "genai", "-o", "{out}"), None),  # -o FOLDER itself: in place
    **{
        (cmd, "--trt-cache-dir"): ((*base, "--provider", "tensorrt", "--trt-cache-dir", "{out}"), None)
        for cmd, base in (
            ("generate", ("generate", "{exp}", "--ids", "1,2", "--max-new-tokens", "1")),
            ("parity", ("parity", "{exp}", "--cases", "1")),
            ("bench", ("bench", "{exp}", *BENCH_QUICK)),
            ("bench generate", ("bench", "generate", "{exp}", *GENERATE_QUICK)),
            ("bench speculative", ("bench", "speculative", "{exp}", *SPEC_QUICK)),
            ("bench constraint", ("bench", "constraint", "{exp}", *COST_QUICK)),
            ("eval", ("eval", "{exp}", "--text", "t.txt", "--greedy-tokens", "0")),
            ("check", ("check", "{exp}")),
        )
    },
}


def _hostile_place(kind: str) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        (c.dir / "t.txt").write_text("Hello, world. " * 40)
        (c.dir / "keep.txt").write_text("keep")
        (c.dir / "real").mkdir()
        (c.dir / "link").symlink_to("keep.txt" if kind == "file" else "real")
        (c.dir / "dangling").symlink_to(c.dir / "nowhere")
        (c.dir / "read-link").symlink_to(c.exp)
        os.mkfifo(c.dir / "pipe")
        (c.dir / "afile").write_text("mine")
        (c.dir / "d").mkdir()

    return setup


# the same hostile set for every output option: (name, path, applies to kinds)
HOSTILE_OUTPUTS = (
    ("model-file", "{read}/model.onnx", ("file",)),
    ("manifest", "{read}/gpt2onnx.json", ("file",)),
    ("config", "{read}/config.json", ("file",)),
    ("new-file-in-model-folder", "{read}/new.json", ("file",)),
    ("input-text", "t.txt", ("file",)),
    ("link", "link", ("file", "folder")),
    ("dangling-link", "dangling", ("file", "folder")),
    ("fifo", "pipe", ("file", "folder")),
    ("device", "/dev/null", ("file", "folder")),
    ("folder", "d", ("file",)),
    ("no-such-folder", "nope/x.json", ("file",)),
    ("a-file", "afile", ("folder",)),
    ("the-model-folder", "{read}", ("folder",)),
    ("link-to-the-model-folder", "read-link", ("folder",)),
    ("working-directory", ".", ("folder",)),
)


def _output_cases() -> list[Case]:
    cases = []
    for command, option, kind in output_options():
        argv, read = OUTPUT_COMMANDS[(command, option)]
        for name, path, kinds in HOSTILE_OUTPUTS:
            if kind not in kinds or ("{read}" in path and read is None) or (name == "input-text" and command != "eval"):
                continue
            if option == "--trt-cache-dir" and name in ("working-directory", "link-to-the-model-folder"):
                continue  # a cache is written into, never replaced: these are allowed
            if option == "--work" and name == "working-directory":
                continue  # a work folder is written into, never replaced: the working directory may be one
            out = path.replace("{read}", read or "")
            cases.append(
                Case(
                    f"output-{command}-{option.strip('-')}-{name}",
                    "data-loss",
                    tuple(a.replace("{out}", out) for a in argv),
                    B,
                    _hostile_place(kind),
                )
            )
    return cases


CASES: list[Case] = [
    *_output_cases(),
]


# -- round six: the output rule ------------------------------------------------------------------------------------
# Every input of every command that writes a file, by its parameter's name: the command line that reads it as {in}
# (otherwise valid), and what it is: a copy of {exp} ("export", at 'in'), of {src} ("checkpoint", at 'in'), or a
# text ('in.txt'). Each of the command's file outputs is pointed at that input's file (a folder's model.onnx or
# config.json), and --json also at a hard link to it and at it through a symbolic link the input is given by: all
# refused before any work, nothing written. tests/artifact/test_output_rule.py checks that every input a command
# reads has its row here.
GEN_ONE = ("--ids", "1,2", "--max-new-tokens", "1")
EVAL_T = ("--text", "t.txt", "--greedy-tokens", "0")
PRECISION_T = ("--text", "t.txt", "--only", "fp32", "--work", "w")
SPEC_DRAFT = ("--new-tokens", "2", "--warmup", "0", "--repeat", "1")
OUTPUT_INPUTS: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "generate": {
        "folder": (("generate", "{in}", *GEN_ONE), "export"),
        "draft": (("generate", "{exp}", *GEN_ONE, "--draft", "{in}"), "export"),
        "json_schema": (("generate", "{exp}", *GEN_ONE, "--json-schema", "{in}"), "text"),
        "grammar": (("generate", "{exp}", *GEN_ONE, "--grammar", "{in}"), "text"),
    },
    "check": {
        "folder": (("check", "{in}"), "export"),
        "model": (("check", "--model", "{in}"), "checkpoint"),
        "draft": (("check", "{exp}", "--draft", "{in}"), "export"),
        "json_schema": (("check", "{exp}", "--json-schema", "{in}"), "text"),
        "grammar": (("check", "{exp}", "--grammar", "{in}"), "text"),
        "calibration": (
            ("check", "--model", "{src}", "--quantize", "int4", "--algorithm", "gptq", "--calibration", "{in}"),
            "text",
        ),
    },
    "eval": {
        "folders": (("eval", "{in}", *EVAL_T), "export"),
        "text": (("eval", "{exp}", "--text", "{in}", "--greedy-tokens", "0"), "text"),
        "reference": (("eval", "{exp}", *EVAL_T, "--reference", "{in}"), "checkpoint"),
    },
    "parity": {
        "folder": (("parity", "{in}", "--cases", "1"), "export"),
        "text": (("parity", "{exp}", "--cases", "1", "--text", "{in}"), "text"),
        "reference": (("parity", "{exp}", "--cases", "1", "--reference", "{in}"), "checkpoint"),
    },
    "bench": {
        "folders": (("bench", "{in}", *BENCH_QUICK), "export"),
        "draft": (("bench", "{exp}", *BENCH_QUICK, "--draft", "{in}"), "export"),
        "reference": (("bench", "{exp}", *BENCH_QUICK, "--baseline", "torch", "--reference", "{in}"), "checkpoint"),
    },
    "bench generate": {
        "folder": (("bench", "generate", "{in}", *GENERATE_QUICK), "export"),
        "reference": (("bench", "generate", "{exp}", *GENERATE_QUICK, "--reference", "{in}"), "checkpoint"),
    },
    "bench speculative": {
        "folder": (("bench", "speculative", "{in}", *SPEC_QUICK), "export"),
        "draft": (("bench", "speculative", "{exp}", "--draft", "{in}", *SPEC_DRAFT), "export"),
    },
    "bench constraint": {
        "folder": (("bench", "constraint", "{in}", *COST_QUICK), "export"),
        "json_schema": (("bench", "constraint", "{exp}", "--json-schema", "{in}", *COST_QUICK[2:]), "text"),
        "grammar": (("bench", "constraint", "{exp}", "--grammar", "{in}", *COST_QUICK[2:]), "text"),
    },
    "bench memory": {"folders": (("bench", "memory", "{in}", *MEMORY_QUICK), "export")},
    "bench web": {"folder": (("bench", "web", "{in}"), "export")},
    "bench served": {
        "folder": (("bench", "served", "{in}"), "export"),
        "gguf": (("bench", "served", "{exp}", "--server", "openai", "--gguf", "{in}"), "text"),
        "llama_server": (
            ("bench", "served", "{exp}", "--server", "openai", "--gguf", "m.gguf", "--llama-server", "{in}"),
            "text",
        ),
    },
    "compare": {
        "model": (("compare", "{in}", "--only", "gpt2onnx:fp32", "--work", "w"), "checkpoint"),
        "text": (("compare", "{src}", "--only", "gpt2onnx:fp32", "--work", "w", "--text", "{in}"), "text"),
    },
    "bench precision": {
        "model": (("bench", "precision", "{in}", *PRECISION_T), "checkpoint"),
        "text": (("bench", "precision", "{src}", "--text", "{in}", "--only", "fp32", "--work", "w"), "text"),
        "calibration": (("bench", "precision", "{src}", *PRECISION_T, "--calibration", "{in}"), "text"),
    },
}
INPUT_FILE = {"export": "in/model.onnx", "checkpoint": "in/config.json", "text": "in.txt"}
INPUT_VARIANTS = ("itself", "hard-link", "through-link")  # the output names: the file, a hard link, the link's file


def _input_place(kind: str, variant: str) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        (c.dir / "t.txt").write_text("Hello, world. " * 40)
        if kind == "text":
            (c.dir / "in.txt").write_text("The user's own text, kept as it is.\n" * 20)
        else:
            shutil.copytree(c.exp if kind == "export" else c.src, c.dir / "in", symlinks=True)
        if variant == "hard-link":
            os.link(c.dir / INPUT_FILE[kind], c.dir / "hard.json")
        if variant == "through-link":
            (c.dir / "in-link").symlink_to("in.txt" if kind == "text" else "in")

    return setup


def _input_cases() -> list[Case]:
    cases = []
    for command, option, kind in output_options():
        if kind != "file":
            continue
        for name, (argv, what) in OUTPUT_INPUTS[command].items():
            for variant in INPUT_VARIANTS if option == "--json" else INPUT_VARIANTS[:1]:  # the links: one option
                given = "in-link" if variant == "through-link" else ("in.txt" if what == "text" else "in")
                out = "hard.json" if variant == "hard-link" else INPUT_FILE[what]
                line = tuple(a.replace("{in}", given) for a in argv) + (option, out)
                cases.append(
                    Case(
                        f"over-input-{command.replace(' ', '-')}-{option.strip('-')}-{name}-{variant}",
                        "data-loss",
                        line,
                        B,
                        _input_place(what, variant),
                    )
                )
    return cases


CASES += [
    *_input_cases(),
]
