"""gpt2onnx compare: its work folder, the peers and engines, a config changed between runs."""

from __future__ import annotations

import json
import shutil

from tests.bad_input.common import B, Case, Ctx, Outcome, _work_record

CASES: list[Case] = [
    Case(
        "compare-unknown-engine",  # refused before the engines are probed or anything is built
        "options",
        ("compare", "{src}", "--only", "llama.cpp:Q9_9", "--work", "w"),
        B,
        match="llama.cpp has no format 'Q9_9'",
    ),
]


# -- round six: compare and the grid -------------------------------------------------------------------------------
COMPARE_W = ("compare", "{src}", "--only", "gpt2onnx:fp32", "--work", "w")
COMPARE_QUICK = ("--prompt-len", "4", "--new-tokens", "2", "--batch", "1", "--warmup", "0", "--repeat", "1")


def _compare_after_config_change(c: Ctx, cli) -> Outcome:
    """compare builds into 'w' from 'ck'; 'ck/config.json' changes (its weights do not): the next compare refuses
    'w' (once: reused, the old build taken as this config's), and with --rebuild builds again and claims it."""
    shutil.copytree(c.src, c.dir / "ck")
    argv = ["compare", "ck", "--only", "gpt2onnx:fp32", "--work", "w", "--no-quality", *COMPARE_QUICK]
    first = cli(argv, c)
    assert first.code == 0, first.stderr[-800:]
    config = json.loads((c.dir / "ck" / "config.json").read_text())
    config["bos_token_id"] = 3  # the build's config: the exported folder's config.json and generation settings
    (c.dir / "ck" / "config.json").write_text(json.dumps(config))
    refused = cli(argv, c)
    assert refused.code == 2, (refused.code, refused.stderr[-800:])
    assert "its config, generation or tokenizer files" in refused.stderr and "--rebuild" in refused.stderr
    rebuilt = cli([*argv, "--rebuild"], c)
    assert rebuilt.code == 0, rebuilt.stderr[-800:]
    assert json.loads((c.dir / "w" / "gpt2onnx-fp32" / "config.json").read_text())["bos_token_id"] == 3
    return refused


CASES += [
    Case(
        "compare-stride-0",  # once accepted (eval refuses it)
        "options",
        (*COMPARE_W, *COMPARE_QUICK, "--stride", "0"),
        B,
        match=r"stride \(--stride\) must be an integer of at least 1",
    ),
    Case(
        "compare-stride-past-the-context",  # once refused by the scoring, after every build
        "options",
        (*COMPARE_W, *COMPARE_QUICK, "--context", "64", "--stride", "100"),
        B,
        match=r"stride \(--stride\) must be 1 to the context \(64\)",
    ),
    Case(
        "compare-warmup-1e8",  # once accepted (bench caps it)
        "options",
        (*COMPARE_W, *COMPARE_QUICK, "--warmup", "100000000"),
        B,
        match=r"--warmup must be an integer from 0 to 1,000",
    ),
    Case(
        "compare-repeat-1e8",
        "options",
        (*COMPARE_W, *COMPARE_QUICK, "--repeat", "100000000"),
        B,
        match=r"--repeat must be an integer from 1 to 10,000",
    ),
    Case(
        "compare-prompt-past-the-context",  # once exit 3 after building
        "options",
        (*COMPARE_W, "--prompt-len", "120", "--new-tokens", "16"),
        B,
        match="is 136, past the model's context of 128",
    ),
    Case(
        "compare-huge-batch",  # once exit 3 after building
        "options",
        (*COMPARE_W, "--prompt-len", "16", "--new-tokens", "16", "--batch", "100000"),
        B,
        match="more than 1,048,576 tokens",
    ),
    Case(
        "compare-record-fifo",  # once a hang
        "hang",
        (*COMPARE_W, *COMPARE_QUICK),
        B,
        _work_record("compare-source.json", "fifo"),
        match=r"compare-source\.json that is not a regular file \(a FIFO\).*--rebuild",
        process=True,
        timeout=90,
    ),
    Case(
        "compare-record-dev-zero",  # once grew past 2 GB
        "hang",
        (*COMPARE_W, *COMPARE_QUICK),
        B,
        _work_record("compare-source.json", "dev-zero"),
        match=r"not a regular file \(a symbolic link\)",
        process=True,
        timeout=90,
    ),
    Case(
        "compare-record-folder",  # once exit 70
        "traceback",
        (*COMPARE_W, *COMPARE_QUICK),
        B,
        _work_record("compare-source.json", "folder"),
        match=r"not a regular file \(a folder\)",
    ),
    Case(
        "compare-build-without-record",  # once taken as this checkpoint's build (KL 4.36 reported as ours)
        "silent",
        (*COMPARE_W, *COMPARE_QUICK),
        B,
        _work_record("compare-source.json", "gpt2onnx-fp32"),
        match="holds 'gpt2onnx-fp32' but no compare-source.json",
    ),
    Case(
        "compare-config-changed",  # once the build of the old config reused
        "silent",
        (),
        B,
        run=_compare_after_config_change,
        creates=("ck", "w"),
        timeout=400,
    ),
]
