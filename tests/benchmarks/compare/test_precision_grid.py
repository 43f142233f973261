"""gpt2onnx bench precision on the trained test model: a few rows of the grid built, scored on its held-out text,
held to the gates' statistics and timed in rotating rounds; the quality figures checked against `gpt2onnx eval` of
the same folder, the gate figures against `gpt2onnx parity`'s. Cost: about 20 s."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2onnx.benchmarks.compare.precision_grid import DEFAULT, GRID, variants_of
from gpt2onnx.errors import BadInput

TRAINED = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "trained-tiny"


def gpt2onnx(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpt2onnx", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("grid")
    args = ["--text", TRAINED / "heldout.txt", "--work", out / "work", "--only", "fp32-ort,int8,int4-bs32"]
    args += ["--max-chars", 3000, "--repeat", 2, "--warmup", 1, "--gate-cases", 2, "--greedy-tokens", 8]
    args += ["--past", 16, "--prompt-len", 16, "--json", out / "grid.json", "--md", out / "grid.md"]
    # one window of 128 tokens on the emulated CPU (the default 512 tokens make 7: the same kernels, 7× under QEMU)
    args += ["--cpus", "EPYC-Rome", "--cpu-tokens", 128] if shutil.which("qemu-x86_64") else []
    proc = gpt2onnx("bench", "precision", TRAINED, *args)
    assert proc.returncode == 0, proc.stderr
    return out, json.loads((out / "grid.json").read_text())


def test_every_row_is_built_scored_gated_and_timed(grid):
    out, report = grid
    rows = {row["variant"]: row for row in report["summary"]}
    assert list(rows) == ["fp32", "fp32-ort", "int8", "int4-bs32"]  # fp32 first: the others are made from it
    assert rows["fp32"]["kl_mean"] < 1e-9 and rows["fp32-ort"]["kl_mean"] < 1e-6
    assert 0 < rows["int4-bs32"]["kl_mean"] < 1.0 and rows["int4-bs32"]["recipe"].startswith("int4 bs32")
    for name, row in rows.items():
        files = sum(p.stat().st_size for p in (out / "work" / name).iterdir() if p.name.startswith("model.onnx"))
        assert row["file_mb"] == pytest.approx(files / 1e6), name
        assert row["decode_ms"] > 0 and row["prompt_ms"] > 0 and 0 <= row["gate_top5"] <= 1
    assert rows["fp32-ort"]["decode_ms_ratio"] == 1.0
    assert report["rounds"]["baseline"] == "fp32-ort" and len(report["rounds"]["orders"]) == 2
    assert report["refused"] == {}
    assert "| int4-bs32 | int4 bs32 acc4" in (out / "grid.md").read_text()


def test_the_quality_and_gate_figures_are_eval_s_and_parity_s_on_the_same_folder(grid, tmp_path):
    out, report = grid
    int8 = next(row for row in report["summary"] if row["variant"] == "int8")
    text = out / "work" / "scored.txt"
    proc = gpt2onnx("eval", out / "work" / "int8", "--text", text, "--greedy-tokens", 8, "--json", tmp_path / "e.json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads((tmp_path / "e.json").read_text())["rows"][0]
    # the same file, text and windows; eval runs on all cores, the grid on 2: a MatMul's sums may be ordered apart
    assert int8["kl_mean"] == pytest.approx(row["kl"]["mean"], rel=1e-4)
    assert int8["delta_ppl_percent"] == pytest.approx(row["delta_ppl_percent"], rel=1e-4, abs=1e-9)
    proc = gpt2onnx("parity", out / "work" / "int8", "--cases", 2, "--json", tmp_path / "p.json")
    assert proc.returncode == 0, proc.stderr
    measured = json.loads((tmp_path / "p.json").read_text())["measured"]
    assert int8["gate_kl_mean"] == pytest.approx(measured["kl"]["mean"], rel=1e-3)


def test_the_grid_is_named_and_checked():
    assert [v.name for v in variants_of(None)] == list(dict.fromkeys(("fp32", *DEFAULT)))
    assert len(variants_of(["all"])) == len(GRID)
    with pytest.raises(BadInput, match="--only 'int3' is not a variant of the grid"):
        variants_of(["int4,int3"])


def test_every_row_gives_this_cpu_s_answers_on_an_emulated_avx2_cpu(grid):
    """--cpus EPYC-Rome: each row's windows and greedy tokens under qemu-x86_64 against this CPU's. The bound is
    loose (KL 1e-6; tests/verify/test_portability.py holds each precision to its own, 1e-9 to 1e-8): this checks that
    the grid runs and reads the emulated CPU, which takes AVX2's kernel paths whatever this CPU is."""
    if not shutil.which("qemu-x86_64"):
        message = "qemu-x86_64 is missing: run scripts/setup.sh as root (apt-get install qemu-user)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    out, report = grid
    assert set(report["portability"]) == {"fp32", "fp32-ort", "int8", "int4-bs32"}
    for name, by_cpu in report["portability"].items():
        figures = by_cpu["EPYC-Rome"]
        assert figures["kl_mean"] < 1e-6 and figures["same_top1"] > 0.99 and figures["greedy_equal"], (name, figures)
    assert "AVX2" in report["cpus"]["EPYC-Rome"]["int8_path"] and report["settings"]["cpu_tokens"] == 128
    assert "KL this‖ EPYC-Rome" in (out / "grid.md").read_text()


def test_a_second_run_reuses_the_folders_built_from_the_same_source_only(grid, tmp_path):
    """The rows' folders are kept under --work and reused (nothing rebuilt: every file's mtime kept); a run with
    other build options (here --outliers) on that folder is refused before any work, as is another checkpoint."""
    from gpt2onnx.benchmarks.compare.precision_grid import bench_precision

    out, _ = grid
    work = out / "work"
    built = {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file() and "model.onnx" in p.name}
    calls = []  # the progress (the CLI's bar on a terminal): each stage named, with its count
    bench_precision(
        str(TRAINED),
        text=TRAINED / "heldout.txt",
        work=work,
        only=["int8"],
        max_chars=3000,
        repeat=1,
        warmup=0,
        gate_cases=1,
        greedy_tokens=4,
        past=8,
        prompt_len=8,
        json_path=tmp_path / "again.json",
        progress=lambda *call: calls.append(call),
    )
    assert {p: p.stat().st_mtime_ns for p in built} == built
    assert [r["variant"] for r in json.loads((tmp_path / "again.json").read_text())["summary"]] == ["fp32", "int8"]
    assert calls[:3] == [("building fp32", 0, 2), ("building int8", 1, 2), ("built", 2, 2)]
    assert ("gate figures of int8", 1, 2) in calls and calls[-1] == ("timing", 2, 2)
    windows = [call for call in calls if call[0].startswith("scoring on the text")]
    assert windows and windows[-1][1] == windows[-1][2] > 0
    for options in ({"outliers": 3.0}, {"random_init": True, "seed": 1}):
        model = "tiny" if options.get("random_init") else str(TRAINED)
        with pytest.raises(BadInput, match="holds files built from another checkpoint or with other options"):
            bench_precision(model, text=TRAINED / "heldout.txt", work=work, only=["int8"], **options)
    assert {p: p.stat().st_mtime_ns for p in built} == built
