"""gpt2onnx compare on the trained test model: our folders beside the peers (optimum's export, PyTorch eager) and the
engines that install in CI time (CTranslate2, OpenVINO GenAI with NNCF; llama.cpp too where ENGINES_LLAMA=1 built
it), each in its own process, through the real command. Its figures are checked against a second measurement of the
same files: the quality figures of our folder against `gpt2onnx eval` on it, the engines' against a second compare
run reusing their files, and the speed figures of that second run against the first's within a factor that catches
a unit or bookkeeping error (milliseconds for seconds, per call for per token: 8× to 1000×), not a speed claim: the
test model's calls take 0.1 to 3 ms, where the scheduler of a shared 2-core machine moves single figures by 2× and
more.

Cost: one compare of four variants (the engines' files built: about 25 s, OpenVINO's export most of it) and one of
two reusing them, about 60 s in all on 2 cores."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2onnx.benchmarks.compare.compare import (
    ENGINES,
    SOURCE_RECORD,
    Settings,
    built_names,
    compare,
    engines_python,
    installed,
)
from gpt2onnx.benchmarks.compare.work_folder import build_source, claim_work
from gpt2onnx.errors import BadInput

ROOT = Path(__file__).resolve().parents[3]
TRAINED = ROOT / "tests" / "fixtures" / "trained-tiny"
SETTINGS = ["--repeat", "2", "--warmup", "1", "--prompt-len", "16", "--new-tokens", "8", "--batch", "2"]


def gpt2onnx(*args, env=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gpt2onnx", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)


@pytest.fixture(scope="module")
def engines() -> dict[str, bool]:
    found = installed(engines_python(), [e for e in ENGINES if e.name != "gpt2onnx"])
    if not (found.get("ctranslate2") and found.get("openvino")):
        message = "CTranslate2 and OpenVINO GenAI are not installed in .venv-engines: bash scripts/setup-engines.sh"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "heldout.txt"
    path.write_text(TRAINED.joinpath("heldout.txt").read_text()[:2000])
    return path


@pytest.fixture(scope="module")
def first(engines, text, tmp_path_factory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("compare")
    # (our int8 is made from the fp32 export); the peers: the exporter users would take instead, and PyTorch
    only = ["gpt2onnx:int8", "ctranslate2:int8", "openvino:int4", "optimum:fp32", "pytorch:eager"]
    if engines.get("llama.cpp"):
        only.append("llama.cpp:Q4_0")
    args = [a for item in only for a in ("--only", item)]
    outputs = ["--json", work / "report.json", "--md", work / "report.md", "--csv", work / "report.csv"]
    proc = gpt2onnx(
        "compare", TRAINED, "--work", work / "files", *args, *SETTINGS, "--text", text, "--context", 64, *outputs
    )
    assert proc.returncode == 0, proc.stderr
    return work, json.loads((work / "report.json").read_text())


def _by_variant(report: dict) -> dict[str, dict]:
    return {row["variant"]: row for row in report["summary"]}


def test_every_variant_is_measured_in_interleaved_rounds_with_its_files_and_memory(first):
    work, report = first
    rows = _by_variant(report)
    assert list(rows)[:3] == ["gpt2onnx int8", "ctranslate2 int8", "openvino int4"]
    speed = report["speed"]
    assert speed["rounds"] == 2 and speed["baseline"] == "gpt2onnx int8" and len(speed["orders"]) == 2
    assert speed["orders"][1] == speed["orders"][0][1:] + speed["orders"][0][:1]  # rotated
    for series in speed["series"]:
        assert len(series["values"]) == 2 and all(v == v and abs(v) < 1e9 for v in series["values"]), series
    for record in report["variants"]:
        path = Path(record["path"])
        on_disk = (
            sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
        )
        assert 0 < record["file_bytes"] <= on_disk, record  # the model files, not the configs beside them
        assert record["peak_bytes"] > 20e6, record  # a process with numpy and its engine loaded
        row = rows[record["name"]]
        assert row["prompt_ms"] > 0 and row["tokens_per_s"] > 0, row  # timed calls
        # a decode step: the mean of the steps each engine's loop timed (once the difference of two timed calls,
        # -8.44 ms on this model), so never below zero
        assert row["decode_ms"] > 0 and row["decode_ms_b2"] > 0, row
    for name, row in rows.items():
        assert 0 <= row["kl_mean"] < 0.5 and row["same_top1"] > 0.5, (name, row)  # quantized, not broken
    assert "| variant | prompt b1×16 ms |" in (work / "report.md").read_text()
    assert (work / "report.csv").read_text().startswith("variant,prompt_ms,")


def test_the_peers_run_through_the_same_rounds_and_score_as_the_reference(first):
    """optimum's fp32 file (on onnxruntime, through gpt2onnx's decode loop) and PyTorch eager (transformers'
    generate) are scored against PyTorch fp32 in this process: fp32 on every kernel path, so KL within 1e-6 (sums in
    another order, fused kernels: about 1e-13 here). PyTorch eager is the reference itself: its greedy tokens are
    all transformers'; optimum's are not held to that (a near-tie may flip on another kernel path)."""
    work, report = first
    rows = _by_variant(report)
    variants = {v["name"]: v for v in report["variants"]}
    assert Path(variants["optimum fp32"]["path"], "model.onnx").is_file()
    assert variants["optimum fp32"]["info"]["runtime"] == "onnxruntime"
    assert variants["pytorch eager"]["file_bytes"] == TRAINED.joinpath("model.safetensors").stat().st_size
    for name in ("optimum fp32", "pytorch eager"):
        assert rows[name]["kl_mean"] < 1e-6 and rows[name]["same_top1"] > 0.999, (name, rows[name])
        assert rows[name]["prompt_ms"] > 0 and rows[name]["decode_ms"] > 0  # (as above)
    assert rows["pytorch eager"]["greedy_matching"] == 8


def test_our_quality_figures_are_eval_s_on_the_same_file(first, text, tmp_path):
    """The same folder, text and windows through `gpt2onnx eval`: the same figures. Within 1e-6 relative (KL 1e-4):
    compare's scorer runs onnxruntime with --threads 2, eval with its default, and the order of a MatMul's sums
    may differ with the thread count."""
    work, report = first
    folder = next(v["path"] for v in report["variants"] if v["name"] == "gpt2onnx int8")
    proc = gpt2onnx("eval", folder, "--text", text, "--context", 64, "--stride", 64, "--json", tmp_path / "e.json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads((tmp_path / "e.json").read_text())["rows"][0]
    ours = _by_variant(report)["gpt2onnx int8"]
    assert ours["delta_ppl_percent"] == pytest.approx(row["delta_ppl_percent"], rel=1e-6, abs=1e-9)
    assert ours["kl_mean"] == pytest.approx(row["kl"]["mean"], rel=1e-4)
    assert ours["same_top1"] == pytest.approx(row["same_top1"], abs=1e-9)


def test_a_second_run_reuses_every_file_and_measures_alike(first, text):
    """Ours and the engines': nothing rebuilt (every file's mtime kept), the same quality figures."""
    work, report = first
    files = work / "files"
    stamps = {p: p.stat().st_mtime_ns for p in files.rglob("*") if p.is_file()}
    only = ["--only", "gpt2onnx:int8", "--only", "ctranslate2:int8", "--only", "openvino:int4"]
    proc = gpt2onnx(
        "compare",
        TRAINED,
        "--work",
        files,
        *only,
        *SETTINGS,
        "--text",
        text,
        "--context",
        64,
        "--json",
        work / "second.json",
    )
    assert proc.returncode == 0, proc.stderr
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing rebuilt
    again, before = _by_variant(json.loads((work / "second.json").read_text())), _by_variant(report)
    for name in ("gpt2onnx int8", "ctranslate2 int8", "openvino int4"):
        for figure in ("delta_ppl_percent", "kl_mean", "same_top1", "greedy_matching"):
            assert again[name][figure] == pytest.approx(before[name][figure], rel=1e-6, abs=1e-12), (name, figure)
        for figure in ("prompt_ms", "tokens_per_s"):  # measured again, not copied; speed is no test's business
            assert math.isfinite(again[name][figure]) and again[name][figure] > 0, (name, figure)


def test_an_engine_that_is_not_installed_is_refused_in_one_line_before_work(tmp_path):
    """The engines' Python is gpt2onnx's own here, which has none of them."""
    env = {**os.environ, "GPT2ONNX_ENGINES_PYTHON": sys.executable}
    proc = gpt2onnx("compare", TRAINED, "--work", tmp_path / "w", "--only", "llama.cpp", env=env)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert (
        "llama.cpp is not installed" in proc.stderr and "ENGINES_LLAMA=1 bash scripts/setup-engines.sh" in proc.stderr
    )
    proc = gpt2onnx("compare", TRAINED, "--work", tmp_path / "w", env=env)
    assert proc.returncode == 3 and "the engines are not installed" in proc.stderr, proc.stderr
    assert "bash scripts/setup-engines.sh" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "options, says",
    [
        ({"only": ["nosuch"]}, "--only 'nosuch': no engine 'nosuch'"),
        ({"only": ["llama.cpp:Q9_9"]}, "llama.cpp has no format 'Q9_9'"),
        ({"only": ["gpt2onnx:fp32"], "baseline": "llama.cpp F16"}, "--baseline 'llama.cpp F16' is not one of"),
        ({"only": ["gpt2onnx:fp32"], "plot": "x.svg"}, "must be a .png file"),
    ],
)
def test_bad_options_are_refused_before_work(tmp_path, options, says):
    """In this process (the CLI's one-line form of a BadInput is the corpus's: tests/bad_input/)."""
    with pytest.raises(BadInput, match=re.escape(says)):
        compare(str(TRAINED), work=tmp_path / "w", **options)
    with pytest.raises(BadInput, match=re.escape("new_tokens (--new-tokens) must be an integer of at least 2")):
        Settings(new_tokens=1)
    assert not (tmp_path / "w").exists()


def test_a_work_folder_of_another_checkpoint_is_refused(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    (work / "compare-source.json").write_text('{"kind": "folder", "sha256": "another"}\n')
    proc = gpt2onnx("compare", TRAINED, "--work", work, "--only", "gpt2onnx:fp32", *SETTINGS)
    assert proc.returncode == 2 and "holds files built from another checkpoint" in proc.stderr, proc.stderr


def test_the_engine_worker_imports_only_numpy_at_its_top():
    """It runs under the engines' Python, where gpt2onnx is not installed: an engine's package (or gpt2onnx, for our
    folders under gpt2onnx's Python) is imported only inside that engine's code."""
    import ast

    from gpt2onnx.benchmarks.compare.compare import WORKER

    tree = ast.parse(Path(WORKER).read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert top - set(sys.stdlib_module_names) - {"__future__"} == {"numpy"}


def test_our_formats_alone_never_probe_the_engines_python(monkeypatch):
    """Another user, who may not read the engines' environment, compares our formats alone: its Python is not
    looked for (once: the look-up failed the run)."""
    import gpt2onnx.benchmarks.compare.compare as module

    def unreadable():
        raise PermissionError(13, "Permission denied", ".venv-engines")

    monkeypatch.setattr(module, "engines_python", unreadable)
    variants, missing, python = module.select_installed(module.variants_of(["gpt2onnx:fp32"]), explicit=True)
    assert [v.name for v in variants] == ["gpt2onnx fp32"] and missing == [] and python is None
    monkeypatch.undo()
    monkeypatch.delenv("GPT2ONNX_ENGINES_PYTHON", raising=False)
    monkeypatch.setattr(Path, "exists", lambda self: unreadable())
    assert engines_python() is None  # as good as none, not an error


def test_the_work_folder_is_claimed_by_everything_that_defines_a_build(tmp_path, monkeypatch):
    """The record names the weights, the config, generation and tokenizer files, the build options and gpt2onnx's
    version: a change of any of them refuses the folder (once only the weights were named: a build was reused after
    config.json changed), and --rebuild removes what was built there, nothing else, and claims it anew."""
    import gpt2onnx
    from gpt2onnx.pytorch.checkpoint import load_checkpoint

    ck = Path(shutil.copytree(TRAINED, tmp_path / "ck"))
    source = build_source(load_checkpoint(str(ck)), recipe="a")
    work = tmp_path / "w"
    claim_work(work, source, SOURCE_RECORD, built=built_names())
    (work / "gpt2onnx-fp32").mkdir()
    (work / "mine.txt").write_text("the user's own file")
    claim_work(work, source, SOURCE_RECORD, built=built_names())  # the same build: claimed again
    assert json.loads((work / SOURCE_RECORD).read_text()) == source

    files = "its config, generation or tokenizer files"
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, "bos_token_id": 3}))
    changed = [(files, build_source(load_checkpoint(str(ck)), recipe="a"))]
    (ck / "config.json").write_text(json.dumps(config))
    (ck / "tokenizer_config.json").write_text((ck / "tokenizer_config.json").read_text() + " ")
    changed.append((files, build_source(load_checkpoint(str(ck)), recipe="a")))
    changed.append(("the build options", build_source(load_checkpoint(str(TRAINED)), recipe="b")))
    monkeypatch.setattr(gpt2onnx, "__version__", "0.0.0-other")
    changed.append(("gpt2onnx's version", build_source(load_checkpoint(str(TRAINED)), recipe="a")))
    for part, other in changed:
        assert other["checkpoint"] == source["checkpoint"]  # the same weights
        with pytest.raises(BadInput, match=f"holds files built from another checkpoint .*differs in {part}"):
            claim_work(work, other, SOURCE_RECORD, built=built_names())
    claim_work(work, other, SOURCE_RECORD, built=built_names(), rebuild=True)
    assert sorted(p.name for p in work.iterdir()) == [SOURCE_RECORD, "mine.txt"]
    assert json.loads((work / SOURCE_RECORD).read_text()) == other


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "huge", "not-json", "build-alone"])
def test_a_work_folder_without_a_readable_record_is_refused_or_rebuilt(tmp_path, kind):
    """A record that is no small regular JSON file is never read into (a FIFO once hung, /dev/zero grew past 2 GB,
    a folder gave exit 70), nor is a build found without a record taken as ours: refused in one line, and on
    --rebuild removed with the build."""
    work = tmp_path / "w"
    work.mkdir()
    record = work / SOURCE_RECORD
    if kind == "fifo":
        os.mkfifo(record)
    elif kind == "dev-zero":
        record.symlink_to("/dev/zero")
    elif kind == "folder":
        (record / "inside").mkdir(parents=True)
    elif kind == "huge":
        record.write_text("{" + " " * (2 << 20) + "}")
    elif kind == "not-json":
        record.write_text("[1, 2]")
    (work / "gpt2onnx-int8").mkdir()
    says = {
        "fifo": r"not a regular file \(a FIFO\)",
        "dev-zero": r"not a regular file \(a symbolic link\)",
        "folder": r"not a regular file \(a folder\)",
        "huge": "of 2,097,154 bytes, not a record",
        "not-json": "not a record",
        "build-alone": "holds 'gpt2onnx-int8' but no compare-source.json",
    }[kind]
    with pytest.raises(BadInput, match=says + ".*--rebuild"):
        claim_work(work, {"a": 1}, SOURCE_RECORD, built=built_names())
    claim_work(work, {"a": 1}, SOURCE_RECORD, built=built_names(), rebuild=True)
    assert sorted(p.name for p in work.iterdir()) == [SOURCE_RECORD] and not record.is_symlink()
    assert json.loads(record.read_text()) == {"a": 1}


def test_compare_says_what_it_builds_and_measures_k_of_n(tmp_path):
    """The progress callback (the CLI's bar, on a terminal only): each stage named, with its count."""
    calls = []
    settings = Settings(prompt_len=16, new_tokens=8, batch=2, threads=2, rounds=2, warmup=1)
    report = compare(
        str(TRAINED),
        work=tmp_path / "w",
        only=["gpt2onnx:fp32"],
        settings=settings,
        quality=False,
        progress=lambda *call: calls.append(call),
    )
    assert calls[:2] == [("building gpt2onnx fp32", 0, 1), ("built", 1, 1)]
    assert ("opening gpt2onnx fp32", 0, 1) in calls
    measured = [(done, total) for what, done, total in calls if what == "measuring gpt2onnx fp32"]
    assert measured == [(0, 3), (1, 3), (1, 3), (2, 3), (2, 3), (3, 3)]
    row = report.rows()[0]
    assert row["decode_ms"] > 0 and row["decode_ms_b2"] > 0
