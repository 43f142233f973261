"""scripts/gpu_check.sh rehearsed on a CPU-only machine: the tiny architecture on the cpu provider (the fp32 row,
the refusals, TensorRT's one-line error), the summary rewritten after every step, a FAIL when the provider asked
for does not load, timeouts and the deadline recorded; and the summary's verdict on rows that did not run where
they were asked, from the rehearsal's own JSON edited as a GPU run would have written it.

Cost: the rehearsal about 30 s of CPU (ten short processes, four of them exports in parallel), the other runs a
few seconds each."""

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpt2onnx.runtimes.providers import working_providers

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TINY = {
    "PYTHON": sys.executable,
    "SIZE": "tiny",
    "PRECISIONS": "fp32",
    "CASES": "2",
    "BENCH_BATCHES": "1,2",
    "BENCH_PROMPT_LEN": "8",
    "BENCH_NEW_TOKENS": "3",
    "BENCH_WARMUP": "0",
    "BENCH_REPEAT": "1",
}


def run_check(results: Path, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The check, with the summary.txt versions seen while it ran (polled), in order."""
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), str(results)],
        env={**os.environ, **TINY, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen, deadline = [], time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            text = (results / "summary.txt").read_text()
        except OSError:
            text = None
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        time.sleep(0.05)
    out, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    if (results / "summary.txt").exists() and (not seen or seen[-1] != (results / "summary.txt").read_text()):
        seen.append((results / "summary.txt").read_text())  # the final one, written just before the exit
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen


def steps_of(results: Path) -> dict[str, dict]:
    return {s["step"]: s for s in map(json.loads, (results / "steps.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    if "cuda" in working_providers():
        pytest.skip("CUDA works here: the rehearsal is the CPU path (run the check itself)")
    results = tmp_path_factory.mktemp("gpu-check") / "results"
    proc, seen = run_check(results, MIRROR_DIR=str(results.parent / "out"))
    return results, proc, seen


def test_rehearsal_on_the_cpu(rehearsal):
    results, proc, seen = rehearsal
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (results / "summary.txt").read_text()
    assert summary in proc.stdout and "verdict: pass" in summary and len(summary.splitlines()) <= 35
    # the summary was rewritten as the steps went, each version a readable record of the steps so far
    assert len(seen) >= 5 and seen[-1] == summary
    assert all("verdict: incomplete" in text for text in seen[:-1])
    counts = [int(text.split("verdict: incomplete (")[1].split()[0]) for text in seen[:-1]]
    assert counts == sorted(counts) and counts[-1] > counts[0]
    env = json.loads((results / "environment.json").read_text())
    assert env["gpu_present"] is False and env["working_providers"] == ["cpu"] and "cuda" in env["refused_providers"]
    assert env["onnxruntime"]["version"] and "onnxruntime_built_for_cuda" in env["gpu_libraries"]
    assert json.loads((results / "plan.json").read_text())["provider"] == "cpu"

    steps = steps_of(results)
    assert {s for s in steps if s.startswith("export-")} == {"export-fp32", "export-trt", "export-int8-tiny"}
    assert not [s for s in steps.values() if s["status"] in ("failed", "timeout", "out-of-time")], steps
    int8, contrib = steps["refusal-int8-on-cuda"], steps["refusal-contrib-on-tensorrt"]
    assert int8["status"] == contrib["status"] == "expected-error" and int8["rc"] == contrib["rc"] == 3
    assert "MatMulInteger" in int8["detail"] and "MultiHeadAttention" in contrib["detail"]
    assert steps["tensorrt"]["status"] == "expected-error" and "provider 'tensorrt'" in steps["tensorrt"]["detail"]
    assert steps["bench-cuda-graphs"]["status"] == steps["gpu-rows"]["status"] == "skipped"

    parity = json.loads((results / "parity-fp32.json").read_text())
    assert parity["passed"] and parity["provider"] == "cpu" and parity["measured"]["cases"] == 2
    assert parity["placement"]["reported"] and list(parity["placement"]["nodes"]) == ["CPUExecutionProvider"]
    bench = json.loads((results / "bench-fp32.json").read_text())
    assert {(r["engine"], r["batch"]) for r in bench["runs"]} == {
        ("onnxruntime", 1),
        ("onnxruntime", 2),
        ("torch", 1),
        ("torch", 2),
    }
    assert bench["models"][0]["placement"]["nodes"] == parity["placement"]["nodes"]
    assert bench["models"][0]["provider_options"]["tf32"] is False
    assert all(r["extra"]["device"] == "cpu" for r in bench["runs"] if r["engine"] == "torch")
    assert "fp32 " in summary and "on CPU" in summary and "refusal-int8-on-cuda: expected-error" in summary
    # the two files a size-limited copy-back takes: the summary, and everything in one object
    out = results.parent / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "summary.txt"]
    assert (out / "summary.txt").read_text() == summary
    everything = json.loads((out / "gpu-check.json").read_text())
    assert everything["parity"]["fp32"] == parity and everything["bench"]["fp32"] == bench
    assert everything["environment"] == env and len(everything["steps"]) == len(steps) and everything["logs"] == {}


def _summary_module():
    spec = importlib.util.spec_from_file_location("gpu_check_summary", ROOT / "scripts" / "gpu_check_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_verdict_fails_rows_that_did_not_run_where_asked(rehearsal, tmp_path):
    """The rehearsal's JSON, edited as a CUDA run would have written it: the same figures pass; compute nodes on the
    CPU, a session on another provider and TF32 set differently on the two sides each fail the verdict."""
    summary = _summary_module()
    results = tmp_path / "as-if-cuda"
    shutil.copytree(rehearsal[0], results)
    plan = json.loads((results / "plan.json").read_text())
    (results / "plan.json").write_text(json.dumps({**plan, "provider": "cuda"}))
    parity = json.loads((results / "parity-fp32.json").read_text())
    bench = json.loads((results / "bench-fp32.json").read_text())
    on_gpu = {"asked": "cuda", "nodes": {"CUDAExecutionProvider": 40, "CPUExecutionProvider": 7}, "reported": True}
    on_gpu |= {"cpu_ops": {"Shape": 3, "Gather": 4}, "fallback": {}}

    def write(parity_edit, bench_edit):
        p, b = copy.deepcopy(parity), copy.deepcopy(bench)
        p.update(provider="cuda", placement=on_gpu)
        b["models"][0].update(provider="cuda", placement=on_gpu)
        for run in b["runs"]:
            run["extra"]["tf32"] = False
        parity_edit(p)
        bench_edit(b)
        (results / "parity-fp32.json").write_text(json.dumps(p))
        (results / "bench-fp32.json").write_text(json.dumps(b))
        return summary.summarize(results, final=True)

    text, passed = write(lambda p: None, lambda b: None)
    assert passed and "verdict: pass" in text and "40 on CUDA, 7 on CPU (CPU: shapes, mask)" in text

    def fallback(p):
        p["placement"] = {**on_gpu, "fallback": {"DynamicQuantizeLinear": 9, "MatMulInteger": 9}}

    text, passed = write(fallback, lambda b: None)
    assert (
        not passed and "FAIL parity fp32: compute nodes on the CPU (DynamicQuantizeLinear ×9, MatMulInteger ×9)" in text
    )

    text, passed = write(lambda p: p.update(provider="cpu"), lambda b: b["models"][0].update(placement=None))
    assert not passed and "FAIL parity fp32 ran on cpu, not cuda" in text
    assert "FAIL bench fp32: node placement not reported (not verified)" in text

    def tf32_differs(b):
        next(r for r in b["runs"] if r["engine"] == "torch")["extra"]["tf32"] = True

    text, passed = write(lambda p: None, tf32_differs)
    assert not passed and "TF32 False in onnxruntime, True in PyTorch" in text


def test_fails_at_once_when_the_asked_provider_does_not_load(tmp_path):
    if "cuda" in working_providers():
        pytest.skip("CUDA loads here")
    results = tmp_path / "results"
    proc, _ = run_check(results, PROVIDER="cuda")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    steps = steps_of(results)
    assert set(steps) == {"environment", "cuda-provider"}  # nothing else was started
    assert steps["cuda-provider"]["status"] == "failed" and "could not be used" in steps["cuda-provider"]["detail"]
    summary = (results / "summary.txt").read_text()
    assert "FAILED cuda-provider" in summary and "no GPU here" in summary and "verdict: FAIL" in summary


def test_timeouts_and_the_deadline_are_recorded(tmp_path):
    """A step past its timeout is stopped and recorded; a step the deadline would cut is not started. Either fails."""
    results = tmp_path / "timeouts"
    proc, _ = run_check(results, EXPORT_TIMEOUT="1", PRECISIONS="fp32", TRT="0", MIRROR_DIR=str(tmp_path / "out"))
    assert proc.returncode == 1
    steps = steps_of(results)
    assert steps["export-fp32"]["status"] == steps["export-int8-tiny"]["status"] == "timeout"
    assert steps["parity-fp32"]["detail"] == "no export to check"
    assert "TIMEOUT export-fp32" in (results / "summary.txt").read_text()
    assert "export-fp32" in json.loads((tmp_path / "out" / "gpu-check.json").read_text())["logs"]  # its log's tail
    late = tmp_path / "late"
    proc, _ = run_check(late, DEADLINE="25")
    assert proc.returncode == 1 and steps_of(late)["environment"]["status"] == "out-of-time"
    assert "verdict: FAIL" in (late / "summary.txt").read_text()
