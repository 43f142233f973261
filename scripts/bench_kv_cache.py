"""Decode step against past length for several exported folders, interleaved in one run (for a loaded machine:
each round times every folder once, in alternating order, and the figures are medians over rounds).

    python -m scripts.bench_kv_cache models/gpt2-ort-last models/gpt2-shared-kv-last --batch 8,1 --past 128,512,896

(run from the repository root, so that this checkout of gpt2onnx is the one imported)

Each point is gpt2onnx.runtimes.timing.decode_step_at_past: one decode step at that past on a zero-filled cache
(no prompt run). Prints a Markdown table: ms per step, the ratio of each folder to the first, and the growth
from the first past length to the last, then the K/V cache each folder's stepper holds at each point (a quantized
cache, --kv-cache int8, is a quarter of the fp32 one), and the load average before and after. ``--json`` writes
every time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.runtimes.decoder import open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.runtimes.timing import decode_step_at_past, machine_info, parse_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--batch", default="8,1")
    parser.add_argument("--past", default="128,512,896")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    batches, pasts = parse_batches(args.batch), parse_batches(args.past, what="past lengths")
    provider = ProviderConfig(threads=args.threads)
    decoders = [open_decoder(open_folder(f), provider) for f in args.folders]
    names = [open_folder(f).folder.name for f in args.folders]
    times = {}  # (name, batch, past) -> [seconds]
    started, load = time.time(), os.getloadavg()[0]
    for batch in batches:
        for past in pasts:
            for r in range(args.warmup + args.rounds):
                order = list(range(len(decoders)))[:: 1 if r % 2 == 0 else -1]
                for i in order:
                    seconds = decode_step_at_past(
                        decoders[i], batch, past, vocab_size=decoders[i].vocab_size or 50257, seed=r
                    )
                    if r >= args.warmup:
                        times.setdefault((names[i], batch, past), []).append(seconds)
    ms = {key: float(np.median(v)) * 1e3 for key, v in times.items()}
    print(
        f"{len(decoders)} folders interleaved, {args.rounds} rounds per point (median ms of one decode step),"
        f" {time.time() - started:.0f} s; machine: {machine_info()}\n"
    )
    header = ["batch", "past", *(f"{n} ms" for n in names), *(f"{n} / {names[0]}" for n in names[1:])]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for batch in batches:
        for past in pasts:
            row = [ms[(n, batch, past)] for n in names]
            print(
                "| "
                + " | ".join(
                    [str(batch), str(past), *(f"{v:.2f}" for v in row), *(f"{v / row[0]:.2f}" for v in row[1:])]
                )
                + " |"
            )
        growth = [ms[(n, batch, pasts[-1])] - ms[(n, batch, pasts[0])] for n in names]
        ratios = " ".join(f"{g / growth[0]:.2f}" if growth[0] > 0 else "n/a" for g in growth[1:])
        print(
            f"| {batch} | growth {pasts[0]}→{pasts[-1]} | " + " | ".join(f"{g:+.2f}" for g in growth) + f" | {ratios} |"
        )
    for batch in batches:
        for past in pasts:
            sizes = ", ".join(
                f"{n} {d.cache_bytes(batch, past + 1) / 2**20:.1f} MiB ({np.dtype(d.kv_dtype).name})"
                for n, d in zip(names, decoders)
            )
            print(f"\nK/V cache at batch {batch}, {past + 1} tokens: {sizes}", end="")
    print(f"\nload average (1 min): {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(
                {
                    "machine": machine_info(),
                    "folders": args.folders,
                    "rounds": args.rounds,
                    "times_s": {f"{n}|{b}|{p}": v for (n, b, p), v in times.items()},
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
