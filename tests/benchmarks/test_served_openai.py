"""`gpt2onnx bench served --server openai` on the trained test model: gpt2onnx's OpenAI endpoint (a real `gpt2onnx
serve` process) loaded by concurrent streaming clients, every request its full length (the command checks
finish_reason), and, where .venv-engines has llama-cpp-python's server, llama.cpp's server beside it on a GGUF of
the same checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

FIGURES = ("requests_per_s", "tokens_per_s", "first_token_p50_ms", "first_token_p99_ms", "end_to_end_p99_ms")


def _bench(folder: Path, tmp_path: Path, *extra: str) -> tuple[dict, str, str]:
    out, md = tmp_path / "served.json", tmp_path / "served.md"
    args = ["bench", "served", str(folder), "--server", "openai", "--concurrency", "1,4", "--requests", "1"]
    args += ["--new-tokens", "3", "--warmup", "1", "--repeat", "2", "--json", str(out), "--md", str(md), *extra]
    proc = subprocess.run([sys.executable, "-m", "gpt2onnx", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), md.read_text(), proc.stdout


def _check_positive(report: dict, servers: list[str]) -> None:
    rounds = report["rounds"]
    assert rounds["variants"] == [f"{s}, {c} client{'s' if c > 1 else ''}" for c in (1, 4) for s in servers]
    assert len(rounds["orders"]) == 2 and rounds["baseline"] is None
    for series in rounds["series"]:
        if series["figure"] in FIGURES or series["figure"] == "peak_rss_mb":
            assert len(series["values"]) == 2 and all(v > 0 for v in series["values"]), series
    for server in servers:
        memory = report["memory"][server]
        assert 0 < memory["at_rest"]["rss_mb"] <= memory["after"]["hwm_mb"], memory


def test_bench_served_openai_endpoint_alone(trained_export, tmp_path):
    report, md, stdout = _bench(trained_export, tmp_path)
    _check_positive(report, ["gpt2onnx serve"])
    assert report["servers"] == ["gpt2onnx serve"] and report["gguf"] is None
    assert "| 4 | gpt2onnx serve |" in md and "at rest" in md and "rounds in rotating order" in md
    assert "gpt2onnx serve" in stdout


@pytest.fixture(scope="module")
def tiny_gguf(trained_checkpoint, tmp_path_factory) -> Path:
    """A GGUF of the trained checkpoint, built by compare's llama.cpp worker in .venv-engines (skipped without)."""
    from gpt2onnx.benchmarks.compare import engine_worker
    from gpt2onnx.benchmarks.compare.compare import engines_python

    python = engines_python()
    probe = python and subprocess.run([python, "-I", "-c", "import llama_cpp.server.app"], capture_output=True)
    if not probe or probe.returncode != 0:
        pytest.skip("llama_cpp.server does not import in .venv-engines (ENGINES_LLAMA=1 bash scripts/setup-engines.sh)")
    gguf = tmp_path_factory.mktemp("gguf") / "tiny-F32.gguf"
    build = (
        f"import sys; sys.path.insert(0, {str(Path(engine_worker.__file__).parent)!r}); import engine_worker;"
        f" engine_worker.build('llama.cpp', {str(trained_checkpoint)!r}, {str(gguf)!r}, 'F32', 2)"
    )
    done = subprocess.run([python, "-c", build], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and gguf.is_file(), done.stderr[-2000:]
    return gguf


def test_bench_served_openai_beside_llama_cpp_server(trained_export, tiny_gguf, tmp_path):
    report, md, _ = _bench(trained_export, tmp_path, "--gguf", str(tiny_gguf))
    _check_positive(report, ["gpt2onnx serve", "llama.cpp server"])
    assert set(report["ratios"]["llama.cpp server"]) == {"1", "4"}
    assert "| 4 | llama.cpp server |" in md and "tokens/s ×" in md


def test_bench_served_openai_beside_llama_server_with_parallel_slots(trained_export, tiny_gguf, tmp_path):
    """llama.cpp's C++ server too (--llama-server: .venv-engines/bin/llama-server, ENGINES_LLAMA_SERVER=1), its
    --parallel slots = --max-batch: every request of every server its full length, a ratio row for each llama."""
    binary = Path(__file__).resolve().parents[2] / ".venv-engines" / "bin" / "llama-server"
    if not binary.exists():
        pytest.skip("no llama-server binary (ENGINES_LLAMA_SERVER=1 bash scripts/setup-engines.sh)")
    extra = ("--gguf", str(tiny_gguf), "--llama-server", str(binary), "--max-batch", "4")
    report, md, stdout = _bench(trained_export, tmp_path, *extra)
    _check_positive(report, ["gpt2onnx serve", "llama.cpp server", "llama-server"])
    assert set(report["ratios"]) == {"llama.cpp server", "llama-server"}
    assert "| 4 | llama-server |" in md and "beside llama-server: gpt2onnx's tokens/s ×" in stdout
