"""Beam search (and greedy) in one session.run of an ort-generate file against transformers' generate() on the
same weights, interleaved in one run (each round times both, in alternating order; figures are medians).

    python -m scripts.bench_ort_generate models/gpt2-generate --batch 4 --beams 4 --new-tokens 32 --rounds 5

(run from the repository root, so that this checkout of gpt2onnx is the one imported). FOLDER is a folder
deployed with ``gpt2onnx deploy --target ort-generate``; the PyTorch side is the checkpoint its manifest
records (rebuilt from the seed for a random-init export), or ``--reference``.

Both sides decode exactly ``--new-tokens`` tokens (min_new_tokens = max_new_tokens, so no sequence stops
early), on a left-padded batch of seeded random prompts of lengths between ``--prompt-len``/2 and
``--prompt-len``, with length_penalty 0 (the setting where the op's beams are transformers'). Prints a
Markdown table: ms per generation, beams × steps per second, the ratio, and whether the tokens are equal.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--beams", default="1,4", help="comma-separated beam counts (1: GreedySearch)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reference", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()

    import torch

    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.artifact.generation import Decoding
    from gpt2onnx.pytorch.reference import reference_model
    from gpt2onnx.runtimes import ort_generate as og
    from gpt2onnx.verify.parity import reference_checkpoint
    from gpt2onnx.verify.timing import machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = open_folder(args.folder)
    model = reference_model(reference_checkpoint(folder, args.reference), device="cpu")
    generator = og.OrtGenerator(folder, og.OrtGenerateSettings(threads=args.threads))  # sessions made once, untimed
    fixed = generator.fixed
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    lengths = rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, size=args.batch)
    prompts = [rng.integers(0, vocab - 1, size=n).tolist() for n in lengths]
    width, new = max(lengths), args.new_tokens
    ids = torch.full((args.batch, width), fixed.pad_token_id)
    mask = torch.zeros((args.batch, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1

    rows = []
    for beams in [int(b) for b in args.beams.split(",")]:
        settings = dict(num_beams=beams, **({"length_penalty": 0.0} if beams > 1 else {}))

        def run_torch():
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=fixed.pad_token_id,
                    eos_token_id=fixed.eos_token_id,
                    **settings,
                )
            return out[:, width:].tolist()

        def run_ort():
            decoding = Decoding(min_new_tokens=new, **settings)
            got = generator.search(prompts, max_new_tokens=new, decoding=decoding)
            return [row[0] for row in got.tokens]

        times = {"torch": [], "ort-generate": []}
        equal = None
        for round_ in range(args.rounds + 1):  # round 0 warms up both
            order = [("torch", run_torch), ("ort-generate", run_ort)]
            results = {}
            for name, fn in order if round_ % 2 else order[::-1]:
                start = time.perf_counter()
                results[name] = fn()
                if round_:
                    times[name].append(time.perf_counter() - start)
            equal = results["torch"] == results["ort-generate"]
        medians = {name: float(np.median(t)) for name, t in times.items()}
        rows.append({"beams": beams, "median_s": medians, "tokens_equal": equal, "times_s": times})

    print(f"{args.folder}: batch {args.batch}, prompts {min(lengths)}-{max(lengths)} tokens, {new} new tokens,")
    print(f"threads {args.threads or 'default'}, {args.rounds} rounds; {machine_info().get('cpu')}")
    print(
        "| beams | transformers ms | ort-generate ms | transformers beams×steps/s | ort-generate beams×steps/s"
        " | ratio | tokens equal |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        t, o = row["median_s"]["torch"], row["median_s"]["ort-generate"]
        work = args.batch * row["beams"] * new
        print(
            f"| {row['beams']} | {t * 1e3:.0f} | {o * 1e3:.0f} | {work / t:.0f} | {work / o:.0f} | {t / o:.2f}x"
            f" | {row['tokens_equal']} |"
        )
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump({"machine": machine_info(), "args": vars(args), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
