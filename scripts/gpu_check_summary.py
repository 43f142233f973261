"""The one-screen summary of scripts/gpu_check.sh: reads what is in RESULTS_DIR so far (steps.jsonl, environment.json,
plan.json, parity-*.json, bench-*.json), writes summary.txt there (atomically) and prints it. The check rewrites it
after every step; --final marks the last one, which gives the verdict and the exit status (0: pass). Only the
standard library: it runs in whatever environment ran the check.

    python scripts/gpu_check_summary.py RESULTS_DIR [--final] [--mirror DIR]

--mirror DIR also writes summary.txt and gpu-check.json (everything in one object) into DIR.

The verdict is FAIL when a step failed, timed out or was not reached before the deadline, when a parity or bench row
on a GPU provider did not run where it was asked (another provider, compute nodes on the CPU, placement not
reported) or when bench compared onnxruntime and PyTorch with different TF32 settings.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROW_ORDER = ("fp32", "fp32-tf32", "fp16", "int4", "trt")
FAILING = ("failed", "timeout", "out-of-time")


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def steps_of(results: Path) -> list[dict]:
    try:
        lines = (results / "steps.jsonl").read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line))
        except ValueError:  # a line cut by a kill: the steps before it still count
            continue
    return steps


def rows_of(results: Path, kind: str) -> dict[str, dict]:
    """{row: report} of the parity-ROW.json or bench-ROW.json files, in the order of ROW_ORDER, others after."""
    found = {p.stem.removeprefix(f"{kind}-"): load(p) for p in results.glob(f"{kind}-*.json")}
    order = sorted(found, key=lambda r: (ROW_ORDER.index(r) if r in ROW_ORDER else len(ROW_ORDER), r))
    return {r: found[r] for r in order if found[r] is not None}


def asked_provider(row: str, plan: dict) -> str:
    return "tensorrt" if row == "trt" else plan.get("provider", "cpu")


def placement_problems(row: str, asked: str, ran_on: str, placement: dict | None) -> list[str]:
    """Why a row did not run where it was asked: another provider, or compute nodes on the CPU."""
    if asked == "cpu":
        return []
    problems = []
    if not ran_on.startswith(asked):
        problems.append(f"{row} ran on {ran_on}, not {asked}")
    if not placement or not placement.get("reported", False):
        problems.append(f"{row}: node placement not reported (not verified)")
    elif placement.get("fallback"):
        ops = ", ".join(f"{op} ×{n}" for op, n in placement["fallback"].items())
        problems.append(f"{row}: compute nodes on the CPU ({ops})")
    return problems


def placement_text(placement: dict | None) -> str:
    if not placement:
        return "placement not recorded"
    if not placement.get("reported", True):
        return "placement not reported"
    nodes = sorted(placement.get("nodes", {}).items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{n} on {name.removesuffix('ExecutionProvider')}" for name, n in nodes)
    if placement.get("fallback"):
        text += " (CPU compute: " + ", ".join(f"{op} ×{n}" for op, n in placement["fallback"].items()) + ")"
    elif placement.get("cpu_ops"):
        text += " (CPU: shapes, mask)"
    return text


def parity_line(row: str, report: dict) -> str:
    m = report["measured"]
    verdict = "pass" if report.get("passed") else "FAIL"
    return (
        f"  {row:9} {verdict:4} |Δlogits| {m['logits']['max']:.1e} top-1 {100 * m['top1_agreement']:.2f}%"
        f" KL {m['kl']['mean']:.1e} greedy {m['tokens_equal_cases']}/{m['cases']}"
        f" | {placement_text(report.get('placement'))}"
    )


def mb(n) -> str:
    return f"{n / 2**20:.0f}" if isinstance(n, (int, float)) else "-"


def bench_lines(row: str, report: dict) -> tuple[list[str], list[str]]:
    """The row's lines (ours beside PyTorch's, per batch) and its problems (TF32 not matched)."""
    ours = {r["batch"]: r for r in report["runs"] if r["engine"] != "torch"}
    torch = {r["batch"]: r for r in report["runs"] if r["engine"] == "torch"}
    lines, problems = [], []
    for batch, r in sorted(ours.items()):
        decode = r["decode_ms"].get("p50", float("nan"))
        line = f"  {row:9} {batch:>3} {r['prompt_ms']['p50']:8.2f} {decode:7.3f} {r['tokens_per_s']:7.0f}"
        t = torch.get(batch)
        if t:
            s = t["extra"].get("speedup_of_onnx") or {}
            tf32 = (r["extra"].get("tf32"), t["extra"].get("tf32"))
            if tf32[0] is not None and tf32[1] is not None and tf32[0] != tf32[1]:
                problems.append(f"bench {row} batch {batch}: TF32 {tf32[0]} in onnxruntime, {tf32[1]} in PyTorch")
            shown = "/".join("-" if v is None else ("on" if v else "off") for v in tf32)
            line += (
                f" | {t['prompt_ms']['p50']:8.2f} {t['decode_ms'].get('p50', float('nan')):7.3f}"
                f" {t['tokens_per_s']:7.0f} ×{s.get('decode', float('nan')):.2f} {shown:>7}"
                f" {mb(r.get('peak_device_bytes'))}/{mb(t.get('peak_device_bytes'))}"
            )
        lines.append(line)
    return lines, problems


def environment_lines(env: dict, plan: dict) -> list[str]:
    gpus = ", ".join(f"{g['name']} (driver {g['driver']})" for g in env.get("gpus", [])) or "no GPU"
    libs = env.get("gpu_libraries", {})
    versions = env.get("versions", {})
    ort = env.get("onnxruntime", {})
    torch = env.get("torch", {})
    lib_text = ", ".join(f"{k} {v}" for k, v in libs.items()) or "no CUDA library loaded"
    return [
        f"gpt2onnx GPU check: {gpus}; asked: {plan.get('provider', '?')}, {plan.get('size', '?')},"
        f" fusion {plan.get('fusion', '?')}",
        f"  onnxruntime {ort.get('version')} ({'onnxruntime-gpu' if versions.get('onnxruntime-gpu') else 'cpu build'});"
        f" {lib_text}",
        f"  providers that load: {', '.join(env.get('working_providers', [])) or 'none'}; torch {torch.get('version')}"
        f" (CUDA {torch.get('cuda')}, cuDNN {torch.get('cudnn')}) sees CUDA: {torch.get('sees_cuda')};"
        f" python {env.get('python')}, transformers {versions.get('transformers')}",
    ]


def summarize(results: Path, final: bool = False) -> tuple[str, bool]:
    """The summary text, and whether the check passed (meaningful with ``final``)."""
    env = load(results / "environment.json") or {}
    plan = load(results / "plan.json") or {}
    steps = steps_of(results)
    out = environment_lines(env, plan) if env else ["gpt2onnx GPU check: environment not recorded yet"]
    problems = []
    exports = [s for s in steps if s["step"].startswith("export-")]
    if exports:
        out.append("exports: " + " | ".join(f"{s['step'][7:]} {s['status']} {s['seconds']:.0f}s" for s in exports))
    for s in steps:
        if s["step"].startswith("refusal-") or s["step"] == "tensorrt":
            out.append(f"{s['step']}: {s['status']} (exit {s['rc']}) {s['detail'][:160]}")
    parity = rows_of(results, "parity")
    if parity:
        cases = next(iter(parity.values()))["measured"]["cases"]
        out.append(f"parity, {cases} randomized cases each (row, verdict, figures | node placement):")
        for row, report in parity.items():
            out.append(parity_line(row, report))
            asked = asked_provider(row, plan)
            problems += placement_problems(f"parity {row}", asked, report.get("provider", "?"), report.get("placement"))
    bench = rows_of(results, "bench")
    if bench:
        config = next(iter(bench.values()))["models"][0]["config"]
        out.append(
            f"bench: prompt {config['prompt_len']}, {config['new_tokens']} new tokens, p50 of {config['repeat']} runs;"
            " PyTorch eager on the same device and precision"
        )
        head = f"  {'row':9} {'b':>3} {'TTFT ms':>8} {'step ms':>7} {'tok/s':>7}"
        out.append(f"{head} | {'torch':>8} {'step ms':>7} {'tok/s':>7}  speed-up TF32 o/t  device MiB o/t")
        for row, report in bench.items():
            lines, row_problems = bench_lines(row, report)
            out += lines
            problems += row_problems
            model = report["models"][0]
            asked = asked_provider(row, plan)
            problems += placement_problems(f"bench {row}", asked, model.get("provider", "?"), model.get("placement"))
    for s in steps:
        if s["status"] == "skipped":
            out.append(f"skipped {s['step']}: {s['detail']}")
    failed = [s for s in steps if s["status"] in FAILING]
    for s in failed:
        out.append(f"{s['status'].upper()} {s['step']} (exit {s['rc']}): {s['detail'][:200]}")
    for p in problems:
        out.append(f"FAIL {p}")
    passed = final and bool(steps) and not failed and not problems
    if final:
        out.append("verdict: " + ("pass" if passed else "FAIL") + f" (every figure: {results}/*.json)")
    else:
        last = steps[-1]["step"] if steps else "none"
        out.append(f"verdict: incomplete ({len(steps)} steps recorded, the last: {last}; running, or stopped)")
    return "\n".join(out) + "\n", passed


def bundle(results: Path, text: str) -> dict:
    """Everything the check wrote so far in one JSON object: the summary, the environment and plan, the steps, every
    parity and bench report, and the last lines of the log of each step that did not end as planned."""
    steps = steps_of(results)
    logs = {}
    for s in steps:
        log = results / "logs" / f"{s['step']}.log"
        if s["status"] in FAILING and log.exists():
            logs[s["step"]] = log.read_text(errors="replace").splitlines()[-40:]
    return {
        "summary": text.splitlines(),
        "environment": load(results / "environment.json"),
        "plan": load(results / "plan.json"),
        "steps": steps,
        "parity": rows_of(results, "parity"),
        "bench": rows_of(results, "bench"),
        "logs": logs,
    }


def write_atomic(path: Path, text: str) -> None:
    staging = path.parent / f".{path.name}.{os.getpid()}"
    staging.write_text(text)
    os.replace(staging, path)  # readers never see half a file; parallel steps race safely


def main(argv: list[str]) -> int:
    final = "--final" in argv
    args = [a for a in argv if a != "--final"]
    mirror = None
    if "--mirror" in args:
        at = args.index("--mirror")
        mirror = Path(args[at + 1]) if at + 1 < len(args) else None
        args = args[:at] + args[at + 2 :]
    if len(args) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    results = Path(args[0])
    text, passed = summarize(results, final=final)
    write_atomic(results / "summary.txt", text)
    if mirror is not None:  # two files, where a size-limited copy-back picks them up even after a kill
        mirror.mkdir(parents=True, exist_ok=True)
        write_atomic(mirror / "summary.txt", text)
        write_atomic(mirror / "gpu-check.json", json.dumps(bundle(results, text), indent=1))
    sys.stdout.write(text)
    return 0 if passed or not final else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
