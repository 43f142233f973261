"""The decode-step cost of a switchable LoRA adapter against the merged file (docs/adapters.md's figures).

    .venv/bin/python -m scripts.bench_adapters [--work DIR] [--rounds 7] [--steps 20]

GPT-2 124M with seeded random weights and a rank-8 PEFT adapter (c_attn, c_proj, c_fc of every layer, B non-zero),
exported merged and switchable (fp32, onnxruntime's CPU provider, torch on one thread); one decode step at batch
1 after a 128-token prompt: the merged file, the switchable graph with no adapter active (the base), and with the
adapter active. Variants run in rotating order round by round; each round's figure is the median of its steps, and
the ratios to the merged file are taken per round before the median. Files are kept in --work between runs.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np


def _make(work: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2onnx.exporters.export import export
    from gpt2onnx.exporters.switchable import export_switchable

    base, lora = work / "base", work / "lora"
    if not base.exists():
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(base)
        torch.manual_seed(1)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], init_lora_weights=False)
        get_peft_model(GPT2LMHeadModel.from_pretrained(base), config).save_pretrained(lora)
    if not (work / "switchable").exists():
        export_switchable(str(base), work / "switchable", adapters={"a": lora})
    if not (work / "merged").exists():
        export(str(base), work / "merged", adapter=lora)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("models/bench-adapters"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    _make(args.work)
    import torch

    from gpt2onnx.runtimes.decoder import cpu_decoder

    torch.set_num_threads(1)
    sw = args.work / "switchable"
    variants = {
        "merged": cpu_decoder(args.work / "merged" / "model.onnx"),
        "switchable, none active": cpu_decoder(sw / "model.onnx"),
        "switchable, adapter active": cpu_decoder(sw / "model.onnx", adapter=sw / "a.onnx_adapter"),
    }
    ids = np.random.default_rng(0).integers(0, 50257, (1, 128))
    past = {}
    for name, decoder in variants.items():
        _, past[name] = decoder.run(ids, np.ones((1, 128), np.int64), np.arange(128)[None], decoder.empty_past(1))
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            steps = []
            for _ in range(args.steps):
                start = time.perf_counter()
                variants[name].run(ids[:, :1], np.ones((1, 129), np.int64), np.array([[128]]), past[name])
                steps.append(time.perf_counter() - start)
            times[name].append(statistics.median(steps) * 1e3)
    print(f"{platform.processor() or platform.machine()}, load average {' '.join(f'{x:.1f}' for x in _load())}")
    print("| variant | decode b1 @128 (ms, median of rounds) | ratio to merged (median of per-round ratios) |")
    print("|---|---|---|")
    for name, values in times.items():
        ratio = statistics.median(v / m for v, m in zip(values, times["merged"]))
        print(f"| {name} | {statistics.median(values):.2f} | {ratio:.3f} |")
    sizes = {"merged model.onnx": args.work / "merged" / "model.onnx", "switchable model.onnx": sw / "model.onnx"}
    sizes["a.onnx_adapter"] = sw / "a.onnx_adapter"
    print("; ".join(f"{name} {path.stat().st_size / 1e6:.1f} MB" for name, path in sizes.items()))


def _load() -> tuple[float, ...]:
    import os

    return os.getloadavg()


if __name__ == "__main__":
    main()
