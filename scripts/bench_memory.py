"""Memory of a run: how much host memory one greedy decode grows by at its peak, beside the estimate that
refuses runs this machine cannot hold (OnnxDecoder.run_bytes), one process per run.

    python -m scripts.bench_memory models/tiny:2000x4+100 models/gpt2:256x8+64 models/gpt2:16x200+50

(run from the repository root, so that this checkout of gpt2onnx is the one imported)

Each run is FOLDER:ROWSxPROMPT+NEW, measured in a fresh process: the session is opened and warmed on one short
row, the peak resident size is reset (/proc/self/clear_refs), the batch is decoded greedily, and the growth is
the peak (VmHWM) less the resident size before. Prints a Markdown table: growth, estimate, growth / estimate (an
estimate that holds is above every growth: the ratio stays under 1) and the final key/value cache for scale.
``--json`` writes every figure. Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def _resident(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key))


def measure(folder: str, rows: int, prompt: int, new: int, threads: int | None = None) -> dict:
    """One run in this process: its growth at the peak and the estimate, in bytes."""
    import numpy as np

    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.decoding.generate import decode
    from gpt2onnx.runtimes.decoder import open_decoder
    from gpt2onnx.runtimes.providers import ProviderConfig

    decoder = open_decoder(open_folder(folder), ProviderConfig(threads=threads))
    ids = np.random.default_rng(0).integers(0, decoder.vocab_size, (rows, prompt))
    decode(decoder, ids[:1, :2], max_new_tokens=2)  # the session's lazy allocations go into the baseline
    before = _resident("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current resident size
    decode(decoder, ids, max_new_tokens=new)
    grown = _resident("VmHWM") - before
    return {
        "folder": folder,
        "rows": rows,
        "prompt": prompt,
        "new": new,
        "grown_bytes": grown,
        "estimate_bytes": decoder.run_bytes(rows, prompt, prompt + new),
        "cache_bytes": decoder.cache_bytes(rows, prompt + new),
    }


def parse_run(text: str) -> tuple[str, int, int, int]:
    folder, _, shape = text.rpartition(":")
    rows, _, rest = shape.partition("x")
    prompt, _, new = rest.partition("+")
    try:
        return folder, int(rows), int(prompt), int(new)
    except ValueError:
        raise SystemExit(f"'{text}': write each run as FOLDER:ROWSxPROMPT+NEW, e.g. models/tiny:2000x4+100") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="FOLDER:ROWSxPROMPT+NEW")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one run, JSON out
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*parse_run(args.runs[0]), threads=args.threads)))
        return
    from gpt2onnx.verify.timing import machine_info

    figures = []
    for run in args.runs:
        parse_run(run)
        command = [sys.executable, "-m", "scripts.bench_memory", "--one", run]
        command += ["--threads", str(args.threads)] if args.threads else []
        figures.append(json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout))
    machine = machine_info()
    print(f"Greedy decode, onnxruntime cpu; {machine.get('cpu')}, {machine.get('cpu_count')} cores\n")
    print("| folder | rows × prompt + new | grew by MB | estimate MB | grown / estimate | final cache MB |")
    print("|---|---|---|---|---|---|")
    for f in figures:
        print(
            f"| {f['folder']} | {f['rows']} × {f['prompt']} + {f['new']} | {f['grown_bytes'] / 1e6:,.0f} |"
            f" {f['estimate_bytes'] / 1e6:,.0f} | {f['grown_bytes'] / f['estimate_bytes']:.2f} |"
            f" {f['cache_bytes'] / 1e6:,.0f} |"
        )
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump({"machine": machine, "runs": figures}, fh, indent=1)


if __name__ == "__main__":
    main()
