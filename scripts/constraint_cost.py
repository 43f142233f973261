"""The per-token cost of a constraint's mask beside an unconstrained decode step (issue 57), printed, never asserted.

    .venv/bin/python scripts/constraint_cost.py FOLDER [--steps 64] [--threads 2]

FOLDER: an exported folder with tokenizer files (e.g. `gpt2onnx export --model gpt2 --random-init -o models/gpt2`).
Greedy decoding at batch 1 of the same prompt with and without each constraint, in rotating rounds (this machine's
decode step moves between windows); per constraint: the median decode step without it, the median time per token of
the mask (llguidance's mask, applied to the logits) and of advancing the matcher, and their ratio to the step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.decoding.constraints import Constraint, vocabulary_of
from gpt2onnx.runtimes.base import RuntimeOptions, open_runtime
from gpt2onnx.runtimes.decoder import position_ids_for
from gpt2onnx.runtimes.providers import ProviderConfig

CONSTRAINTS = {
    "json schema": Constraint.json_schema(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "tags"],
        }
    ),
    "any JSON object": Constraint.json_object(),
    "regex": Constraint.regex(r"[A-Za-z ,.]{1,400}"),
    "choice": Constraint.choice(["yes", "no", "maybe"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = open_folder(args.folder, verify_files=False)
    eos = read_generation_config(model.folder, vocab_size=model.facts.vocab_size).eos_token_ids
    vocabulary = vocabulary_of(model.folder, vocab_size=model.facts.vocab_size, eos_token_ids=eos)
    settings = ProviderConfig(threads=args.threads)
    decoder = open_runtime(model, RuntimeOptions(settings=settings))
    bound = {name: c.bind(vocabulary) for name, c in CONSTRAINTS.items()}
    steps: list[float] = []
    masks: dict[str, list[float]] = {name: [] for name in bound}
    advances: dict[str, list[float]] = {name: [] for name in bound}
    prompt = np.arange(1, 17, dtype=np.int64)[None]
    for _ in range(args.rounds):
        for name in [None, *bound]:  # rotating: every variant in every round
            matchers = bound[name].start(1) if name else None
            mask = np.ones_like(prompt)
            full = decoder.prompt_mask(mask)
            past = decoder.empty_past(1, capacity=full.shape[1] + args.steps)
            out, past = decoder.run(prompt, full, position_ids_for(mask), past)
            positions = position_ids_for(mask)
            for _ in range(args.steps):
                last = out[:, -1].astype(np.float32)
                if matchers is not None:
                    start = time.perf_counter()
                    last = matchers.mask(last)
                    masks[name].append(time.perf_counter() - start)
                token = last.argmax(-1)
                if matchers is not None:
                    start = time.perf_counter()
                    matchers.advance(token)
                    advances[name].append(time.perf_counter() - start)
                    if matchers.matchers[0].is_stopped():
                        break
                full = np.concatenate([full, np.ones((1, 1), np.int64)], axis=1)
                positions = positions[:, -1:] + 1
                start = time.perf_counter()
                out, past = decoder.run(token[:, None].astype(np.int64), full, positions, past)
                if name is None:
                    steps.append(time.perf_counter() - start)
    step = statistics.median(steps) * 1e3
    print(f"decode step, batch 1, no constraint: {step:.2f} ms (median of {len(steps)})")
    for name in bound:
        m, a = statistics.median(masks[name]) * 1e3, statistics.median(advances[name]) * 1e3
        print(
            f"{name:16s} mask {m:.3f} ms + advance {a:.3f} ms per token = {100 * (m + a) / step:.1f} % of a step"
            f" (median of {len(masks[name])} tokens)"
        )
    decoder.close()


if __name__ == "__main__":
    main()
