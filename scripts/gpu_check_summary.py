"""The one-screen summary of scripts/gpu_check.sh: reads the JSON files in RESULTS_DIR, writes summary.txt there
and prints it. Only the standard library: it runs in whatever environment ran the check.

    python scripts/gpu_check_summary.py RESULTS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PRECISIONS = ("fp32", "fp16", "int4")


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def steps_of(results: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (results / "steps.jsonl").read_text().splitlines() if line.strip()]
    except OSError:
        return []


def parity_line(p: str, report: dict | None) -> str:
    if report is None:
        return f"  {p:5} no result"
    m = report["measured"]
    verdict = "pass" if report.get("passed") else "FAIL: " + "; ".join(report.get("failures", []))
    return (
        f"  {p:5} {verdict:5} |Δlogits| max {m['logits']['max']:.1e}  top-1 {100 * m['top1_agreement']:.2f}%"
        f"  top-5 {100 * m['top5_agreement']:.2f}%  KL {m['kl']['mean']:.1e}  greedy equal"
        f" {m['tokens_equal_cases']}/{m['cases']}"
    )


def bench_lines(p: str, report: dict | None) -> list[str]:
    if report is None:
        return [f"  {p:5} no result"]
    ours = {r["batch"]: r for r in report["runs"] if r["engine"] == "onnxruntime"}
    torch = {r["batch"]: r for r in report["runs"] if r["engine"] == "torch"}
    lines = []
    for batch, r in sorted(ours.items()):
        line = f"  {p:5} {batch:>5} {r['prompt_ms']['p50']:8.2f} {r['decode_ms']['p50']:8.3f} {r['tokens_per_s']:8.0f}"
        t = torch.get(batch)
        if t:
            s = t["extra"]["speedup_of_onnx"]
            where = f"{t['extra'].get('device', '?')} {t['extra'].get('dtype', '')}".strip()
            torch_figures = f"{t['prompt_ms']['p50']:8.2f} {t['decode_ms']['p50']:8.3f} {t['tokens_per_s']:8.0f}"
            line += f" | {torch_figures}  ×{s['decode']:.2f} ({where})"
        lines.append(line)
    return lines


def summarize(results: Path) -> str:
    env = load(results / "environment.json") or {}
    steps = steps_of(results)
    versions = env.get("versions", {})
    provider = "cuda" if env.get("cuda_provider") else "cpu"
    ort = versions.get("onnxruntime-gpu") or versions.get("onnxruntime")
    out = [
        f"gpt2onnx GPU check: onnxruntime provider {provider}; torch {versions.get('torch')} sees CUDA: "
        f"{env.get('torch_cuda')} ({env.get('gpu') or 'no GPU'})",
        f"  python {env.get('python')}, transformers {versions.get('transformers')}, onnxruntime {ort}, optimum "
        f"{versions.get('optimum-onnx') or 'absent'}; providers that load:"
        f" {', '.join(env.get('working_providers', []))}",
    ]
    by_step = {s["step"]: s for s in steps}
    exports = []
    for p in PRECISIONS:
        s = by_step.get(f"export-{p}")
        exports.append(f"{p} {s['status']} {s['seconds']:.0f}s" if s else f"{p} not run")
    out.append("exports: " + " | ".join(exports))
    parity = {p: load(results / f"parity-{p}.json") for p in PRECISIONS}
    cases = next((r["measured"]["cases"] for r in parity.values() if r), "?")
    out.append(f"parity on {provider}, {cases} randomized cases each:")
    out += [parity_line(p, parity[p]) for p in PRECISIONS]
    bench = {p: load(results / f"bench-{p}.json") for p in PRECISIONS}
    config = next((b["models"][0]["config"] for b in bench.values() if b), None)
    if config:
        out.append(
            f"bench on {provider}: prompt {config['prompt_len']}, {config['new_tokens']} new tokens, p50 of"
            f" {config['repeat']} runs"
        )
    out.append(
        f"  {'':5} {'batch':>5} {'TTFT ms':>8} {'step ms':>8} {'tok/s':>8} | {'torch':>8} {'step ms':>8} {'tok/s':>8} "
        " decode speed-up"
    )
    for p in PRECISIONS:
        out += bench_lines(p, bench[p])
    trt = load(results / "tensorrt.json")
    if trt:
        out.append(f"TensorRT: {trt['status']} (exit {trt['exit_code']}): {trt['message']}")
    for s in steps:
        if s["status"] == "skipped":
            out.append(f"skipped {s['step']}: {s['detail']}")
    failed = [s for s in steps if s["status"] == "failed"]
    for s in failed:
        out.append(f"FAILED {s['step']} (exit {s['rc']}): {s['detail']}")
    out.append("verdict: " + ("FAIL" if failed else "pass") + f" (every figure: {results}/*.json)")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    results = Path(argv[0])
    text = summarize(results)
    (results / "summary.txt").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
