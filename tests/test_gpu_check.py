"""scripts/gpu_check.sh on a CPU-only machine: the tiny architecture, the cpu provider, the CUDA steps skipped,
every figure written as JSON and the one-screen summary at the end."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_the_cpu(tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "SIZE": "tiny",
        "CASES": "2",
        "BENCH_BATCHES": "1,2",
        "BENCH_PROMPT_LEN": "8",
        "BENCH_NEW_TOKENS": "3",
        "BENCH_WARMUP": "0",
        "BENCH_REPEAT": "1",
    }
    results = tmp_path / "results"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), str(results)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env_json = json.loads((results / "environment.json").read_text())
    if env_json["cuda_provider"]:  # a machine where CUDA works runs the real thing; the CPU path is what is tested here
        return
    for p in ("fp32", "fp16", "int4"):
        parity = json.loads((results / f"parity-{p}.json").read_text())
        assert parity["passed"] and parity["provider"] == "cpu" and parity["measured"]["cases"] == 2, p
        bench = json.loads((results / f"bench-{p}.json").read_text())
        assert {(r["engine"], r["batch"]) for r in bench["runs"]} == {
            ("onnxruntime", 1),
            ("onnxruntime", 2),
            ("torch", 1),
            ("torch", 2),
        }
        assert all(r["extra"]["device"] == "cpu" for r in bench["runs"] if r["engine"] == "torch")
    trt = json.loads((results / "tensorrt.json").read_text())
    assert trt["status"] in ("clear-error", "loads"), trt
    if trt["status"] == "clear-error":
        assert trt["exit_code"] == 3 and "provider 'tensorrt'" in trt["message"]
    steps = {s["step"]: s for s in map(json.loads, (results / "steps.jsonl").read_text().splitlines())}
    assert steps["bench-cuda"]["status"] == steps["bench-cuda-graphs"]["status"] == "skipped"
    assert not [s for s in steps.values() if s["status"] == "failed"]
    summary = (results / "summary.txt").read_text()
    assert summary in proc.stdout and "verdict: pass" in summary and len(summary.splitlines()) <= 30
    assert "skipped bench-cuda: the CUDA provider does not load here" in summary
