"""Decode step against past length for several exported folders, interleaved in one run (for a loaded machine:
each round times every folder at every past length once, in alternating order, and the figures are medians over
rounds: a change of load during the run then weighs on every column and every past alike).

    python -m scripts.bench_kv_cache models/gpt2-ort-last models/gpt2-shared-kv-last --batch 8,1 --past 128,512,896

(run from the repository root, so that this checkout of gpt2onnx is the one imported)

Each point is gpt2onnx.verify.timing.decode_step_at_past: one decode step at that past on a zero-filled cache
(no prompt run). Prints a Markdown table: ms per step, the ratio of each folder to the first, and the growth
from the first past length to the last, then the K/V cache each folder's stepper holds at each point (a quantized
cache, --kv-cache int8|int4, is a quarter or an eighth of the fp32 one), and the load average before and after.
``--json`` writes every time.

``--capacity N`` adds, for each folder whose stepper preallocates its cache (ort-shared-kv, onnx-static-kv), a
column timed with a buffer of N columns at every past (a whole context's buffer; the other columns use a buffer
of past + 1, what the step needs). ``--prompt-len N`` also times the prompt step at batch 1 × N (empty past; a
buffer of N + 1), interleaved the same way, and prints it as one more row.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.runtimes.decoder import OnnxDecoder, open_decoder
from gpt2onnx.verify.timing import decode_step_at_past, machine_info, parse_batches


def prompt_step(decoder, length: int, *, vocab_size: int, seed: int) -> float:
    """Seconds of the prompt step at batch 1 × ``length`` (empty past; a preallocating stepper gets length + 1)."""
    ids = np.random.default_rng(seed).integers(0, vocab_size, size=(1, length), dtype=np.int64)
    mask = np.ones((1, length), np.int64)
    past = decoder.empty_past(1, capacity=length + 1)
    start = time.perf_counter()
    decoder.run(ids, mask, np.arange(length, dtype=np.int64)[None], past)
    return time.perf_counter() - start


def main() -> None:
    from gpt2onnx.runtimes.providers import ProviderConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--batch", default="8,1")
    parser.add_argument("--past", default="128,512,896")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--capacity", type=int, default=None, help="also time preallocating steppers at this buffer")
    parser.add_argument("--prompt-len", type=int, default=0, help="also time the prompt step at batch 1 × this")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    batches, pasts = parse_batches(args.batch), parse_batches(args.past, what="past lengths")
    provider = ProviderConfig(threads=args.threads)
    # (label, decoder, buffer length: None for past + 1)
    columns = []
    for folder in args.folders:
        decoder = open_decoder(open_folder(folder), provider)
        name = open_folder(folder).folder.name
        columns.append((name, decoder, None))
        if args.capacity and type(decoder) is not OnnxDecoder:  # it preallocates: also a whole-context buffer
            columns.append((f"{name} (buffer {args.capacity})", decoder, args.capacity))
    names = [c[0] for c in columns]
    times = {}  # (name, batch, past) -> [seconds]
    started, load = time.time(), os.getloadavg()[0]
    for batch in batches:
        for r in range(args.warmup + args.rounds):
            for past in pasts[:: 1 if r % 2 == 0 else -1]:
                for name, decoder, capacity in columns[:: 1 if r % 2 == 0 else -1]:
                    vocab = decoder.vocab_size or 50257
                    seconds = decode_step_at_past(decoder, batch, past, vocab_size=vocab, seed=r, capacity=capacity)
                    if r >= args.warmup:
                        times.setdefault((name, batch, past), []).append(seconds)
    if args.prompt_len:
        plain = [c for c in columns if c[2] is None]  # the prompt step does not depend on the buffer's extra room
        for r in range(args.warmup + args.rounds):
            for name, decoder, _ in plain[:: 1 if r % 2 == 0 else -1]:
                seconds = prompt_step(decoder, args.prompt_len, vocab_size=decoder.vocab_size or 50257, seed=r)
                if r >= args.warmup:
                    times.setdefault((name, "prompt", args.prompt_len), []).append(seconds)
    ms = {key: float(np.median(v)) * 1e3 for key, v in times.items()}
    print(
        f"{len(args.folders)} folders interleaved, {args.rounds} rounds per point (median ms of one step),"
        f" {time.time() - started:.0f} s; machine: {machine_info()}\n"
    )
    header = ["batch", "past", *(f"{n} ms" for n in names), *(f"{n} / {names[0]}" for n in names[1:])]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))

    def row(batch, past, label):
        values = [ms.get((n, batch, past)) for n in names]
        cells = [f"{v:.2f}" if v is not None else "" for v in values]
        ratios = [f"{v / values[0]:.2f}" if v is not None else "" for v in values[1:]]
        print("| " + " | ".join([str(label[0]), str(label[1]), *cells, *ratios]) + " |")

    for batch in batches:
        for past in pasts:
            row(batch, past, (batch, past))
        growth = [ms[(n, batch, pasts[-1])] - ms[(n, batch, pasts[0])] for n in names]
        ratios = " | ".join(f"{g / growth[0]:.2f}" if growth[0] > 0 else "n/a" for g in growth[1:])
        print(
            f"| {batch} | growth {pasts[0]}→{pasts[-1]} | " + " | ".join(f"{g:+.2f}" for g in growth) + f" | {ratios} |"
        )
    if args.prompt_len:
        row("prompt", args.prompt_len, ("1", f"prompt of {args.prompt_len}"))
    for batch in batches:
        for past in pasts:
            sizes = ", ".join(
                f"{n} {d.cache_bytes(batch, past + 1) / 2**20:.1f} MiB ({np.dtype(d.kv_dtype).name})"
                for n, d, _ in columns
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
