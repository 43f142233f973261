"""Exported decoder files timed against each other in one process, interleaved round by round (A/B under load).

    .venv/bin/python -m scripts.bench_step_ab FILE.onnx FILE.onnx ... [--repeat 60] [--generate 8] [--threads 2]

For each file, per round: the prompt step (batch 1 × 128 tokens, empty past) and one decode step (batch 1 at past
128, random past), then, with ``--generate N``, N rounds of greedy 32 + 64 (the prompt, then 63 one-token steps
with the presents fed back). The files take turns inside each round, so another process's load falls on all of
them alike; medians and minimums are printed. Inputs as gpt2onnx's GPT-2 graphs name them (input_ids,
attention_mask, position_ids, past_key_values.N.key/value → logits, present.N.key/value).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def session(path: str, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def past_shape(sess) -> tuple[int, int]:
    """(heads, head size) of the first past input."""
    past = next(i for i in sess.get_inputs() if i.name.startswith("past"))
    return int(past.shape[1]), int(past.shape[3])


def step_feeds(sess, new: int, past_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    heads, size = past_shape(sess)
    rng = np.random.default_rng(seed)
    feeds = {
        "input_ids": (np.arange(new, dtype=np.int64)[None] * 7919) % 50000,
        "attention_mask": np.ones((1, past_len + new), np.int64),
        "position_ids": np.arange(past_len, past_len + new, dtype=np.int64)[None],
    }
    for i in sess.get_inputs():
        if i.name.startswith("past"):
            feeds[i.name] = rng.standard_normal((1, heads, past_len, size)).astype(np.float32)
    return feeds


def generate(sess, prompt_len: int = 32, new: int = 64) -> tuple[float, float]:
    """Seconds for greedy ``prompt_len`` + ``new`` tokens, and for its prompt step."""
    feeds = step_feeds(sess, prompt_len, 0)
    outputs = [o.name for o in sess.get_outputs()]
    total, prompt_s = prompt_len, 0.0
    started = time.perf_counter()
    for step in range(new):
        out = sess.run(None, feeds)
        if step == 0:
            prompt_s = time.perf_counter() - started
        nxt = out[0][:, -1].argmax(-1)[:, None].astype(np.int64)
        feeds = {n.replace("present", "past_key_values"): v for n, v in zip(outputs[1:], out[1:])}
        total += 1
        feeds.update(
            input_ids=nxt,
            attention_mask=np.ones((1, total), np.int64),
            position_ids=np.array([[total - 1]], np.int64),
        )
    return time.perf_counter() - started, prompt_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--repeat", type=int, default=60)
    parser.add_argument("--generate", type=int, default=0, help="rounds of greedy 32 + 64 (0: none)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sessions = {path: session(path, args.threads) for path in args.files}
    inputs = {p: (step_feeds(s, 128, 0), step_feeds(s, 1, 128)) for p, s in sessions.items()}
    for p, s in sessions.items():  # warm-up
        for feeds in inputs[p]:
            s.run(None, feeds)
            s.run(None, feeds)
    print(f"load average before {os.getloadavg()}")
    steps = {p: ([], []) for p in sessions}
    for _ in range(args.repeat):
        for p, s in sessions.items():
            for kind, feeds in enumerate(inputs[p]):
                started = time.perf_counter()
                s.run(None, feeds)
                steps[p][kind].append((time.perf_counter() - started) * 1000)
    runs = {p: [] for p in sessions}
    for _ in range(args.generate):
        for p, s in sessions.items():
            runs[p].append(generate(s))
    for p, (prompt, decode) in steps.items():
        line = (
            f"{p}: prompt b1x128 {statistics.median(prompt):.1f} ms (min {min(prompt):.1f}), "
            f"decode b1@128 {statistics.median(decode):.2f} ms (min {min(decode):.2f})"
        )
        if runs[p]:
            total = statistics.median(r[0] for r in runs[p]) * 1000
            prompt_ms = statistics.median(r[1] for r in runs[p]) * 1000
            line += f", 32+64 {64000 / total:.1f} tok/s (its 32-token prompt {prompt_ms:.1f} ms)"
        print(line, flush=True)
    print(f"load average after {os.getloadavg()}; {args.repeat} rounds, {args.threads} threads")


if __name__ == "__main__":
    main()
