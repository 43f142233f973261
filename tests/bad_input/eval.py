"""gpt2onnx eval: the text, the folders, the gates, an interrupted --json."""

from __future__ import annotations

import json
import os
from typing import Callable

from tests.bad_input.common import B, Case, Ctx, Outcome, _interrupted, export_copy, manifest_edit, other_checkpoint

CASES: list[Case] = [
    # -- eval: the text and the protocol's options, refused before any model is loaded --------------------------
    Case("eval-no-text", "options", ("eval", "{exp}"), B, match="--text FILE"),
    Case("eval-text-missing", "message", ("eval", "{exp}", "--text", "none.txt"), B, match="none.txt"),
    Case(
        "eval-text-fifo",
        "hang",
        ("eval", "{exp}", "--text", "pipe.txt"),
        B,
        lambda c: os.mkfifo(c.dir / "pipe.txt"),
        match="not a regular file",
        timeout=60,
        process=True,
    ),
    Case(
        "eval-context-zero",
        "options",
        ("eval", "{exp}", "--text", "t.txt", "--context", "0"),
        B,
        lambda c: (c.dir / "t.txt").write_text("Hello, world. " * 20),
        match="context",
    ),
    Case(
        "eval-dataset-form",
        "options",
        ("eval", "{exp}", "--dataset", "wikitext::test"),
        B,
        match="NAME\\[:CONFIG",
    ),
    Case(
        "eval-gate-nan",
        "options",
        ("eval", "{exp}", "--text", "t.txt", "--max-kl", "nan"),
        B,
        lambda c: (c.dir / "t.txt").write_text("Hello, world. " * 20),
        match="max-kl",
    ),
]


def _eval_not_token_by_token(c: Ctx, out: Outcome) -> None:
    report = json.loads((c.dir / "e.json").read_text())
    assert [row["token_by_token"] for row in report["rows"]] == [False], report["rows"]


def _bad_byte_at(position: int) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        data = bytearray(b"Hello, world. " * (position // 14 + 100))
        data[position] = 0xFF
        (c.dir / "bad.txt").write_bytes(bytes(data))

    return setup


CASES += [
    Case(
        "manifest-logits-last-on-all-logits-graph",
        "silent",
        ("eval", "m", "--text", "t.txt", "--greedy-tokens", "0", "--json", "e.json"),
        0,
        lambda c: (
            export_copy(manifest_edit(options={"logits": "last"}))(c),
            (c.dir / "t.txt").write_text("the quick brown fox. " * 30),
        ),
        creates=("e.json",),
        check=_eval_not_token_by_token,
    ),
    Case(
        "eval-reference-other-architecture",
        "silent",
        ("eval", "{exp}", "--text", "t.txt", "--greedy-tokens", "0", "--reference", "other"),
        B,
        lambda c: (other_checkpoint(n_layer=1, n_head=2)(c), (c.dir / "t.txt").write_text("Hello, world. " * 30)),
        match="does not match",
    ),
    Case(
        "text-bad-byte-position-from-start",
        "message",
        ("eval", "{exp}", "--text", "bad.txt"),
        B,
        _bad_byte_at(1_067_482),
        match="at byte 1,067,482 from its start",
    ),
]


CASES += [
    Case(
        "eval-json-interrupted",
        "data-loss",
        (),
        0,
        run=_interrupted(("eval", "{exp}", "--text", "t.txt", "--json", "e.json", "--greedy-tokens", "0"), ("e.json",)),
        creates=("e.json", "t.txt"),
        timeout=400,
    ),
]


CASES += [
    Case(
        "eval-adapter-not-switchable",
        "message",
        ("eval", "{exp}", "--text", "t.txt", "--adapter", "x"),
        B,
        lambda c: (c.dir / "t.txt").write_text("Hello, world. " * 20),
        match="has no adapter 'x'",
    ),
]
