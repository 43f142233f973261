"""Run exported folders on this process's CPU and save what they compute, for comparing CPUs.

    python -m gpt2onnx.verify.cpu_worker --ids ids.npy --prompts prompts.json --out result.npz FOLDER...
    qemu-x86_64 -cpu Haswell .venv/bin/python -m gpt2onnx.verify.cpu_worker ...    (the same, on an emulated CPU)

(`gpt2onnx bench precision --cpus` and tests/verify/test_portability.py run it.)

Run under QEMU's user-mode emulator, the process sees the emulated CPU's CPUID, so onnxruntime picks that CPU's
kernels (AVX2 without VNNI, SSE4.2 only, ...) whatever the host is. For each folder: the logits of every
position of sliding windows over ``ids`` (each window from an empty past, as ``gpt2onnx eval`` runs them) and
greedy tokens from each prompt (``gpt2onnx generate``'s loop). Needs only numpy, onnxruntime and gpt2onnx's run
path (no torch), so the emulated process starts in seconds. One intra-op thread: the figures must not depend on
how the work is split.

Output (npz): ``cpu`` (the CPU description this process saw), and per folder index i ``logits_i``
[windows, context, vocab] float32 and ``tokens_i`` [prompts, new] int64.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# OpenBLAS's name for each emulated CPU. Where the machine forces OpenBLAS's kernels for its own CPU
# (OPENBLAS_CORETYPE, set on some hosts because older OpenBLAS builds misdetect them), an emulated process must not
# inherit that choice: Haswell's AVX2 kernels on an emulated SSE4.2 CPU die with SIGILL in numpy's import.
OPENBLAS_CORES = {"EPYC-Rome": "ZEN", "Nehalem": "NEHALEM", "Haswell": "HASWELL", "Skylake-Client": "SKYLAKEX"}


def emulated_env(env: dict[str, str], cpu: str) -> dict[str, str]:
    """``env`` for a process on the emulated ``cpu``: OPENBLAS_CORETYPE, where set, names that CPU's kernels."""
    return {**env, "OPENBLAS_CORETYPE": OPENBLAS_CORES.get(cpu, "PRESCOTT")} if "OPENBLAS_CORETYPE" in env else env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--ids", type=Path, required=True, help="a .npy of token ids (1-D)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--stride", type=int, default=32)
    parser.add_argument("--prompts", type=Path, required=True, help="a JSON list of prompts (lists of token ids)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from gpt2onnx.artifact.folder import MODEL_FILE
    from gpt2onnx.artifact.generation import read_generation_config
    from gpt2onnx.decoding.generate import decode
    from gpt2onnx.machine import describe_cpu
    from gpt2onnx.runtimes.decoder import stepper_for
    from gpt2onnx.runtimes.providers import cpu_session

    ids = np.load(args.ids).astype(np.int64)
    prompts = json.loads(args.prompts.read_text())
    out: dict[str, np.ndarray] = {"cpu": np.array(json.dumps(describe_cpu().as_dict()))}
    for index, folder in enumerate(args.folders):
        from gpt2onnx.artifact.graph import graph_facts, load_graph

        path = folder / MODEL_FILE
        kind = stepper_for(graph_facts(load_graph(path)).layout)
        decoder = kind(cpu_session(path, threads=1))
        windows = []
        for begin in range(0, max(1, len(ids) - args.context + 1), args.stride):
            window = ids[None, begin : begin + args.context]
            mask = np.ones_like(window)
            positions = np.arange(window.shape[1])[None]
            logits, _ = decoder.run(window, mask, positions, decoder.empty_past(1), last_logits_only=False)
            windows.append(np.asarray(logits, dtype=np.float32)[0])
        out[f"logits_{index}"] = np.stack(windows)
        pad = read_generation_config(folder, vocab_size=decoder.vocab_size).pad_token_id
        tokens = []
        for prompt in prompts:
            prompt_ids = np.asarray([prompt], dtype=np.int64)
            result = decode(decoder, prompt_ids, max_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=pad)
            tokens.append(result.tokens[0])
        out[f"tokens_{index}"] = np.stack(tokens)
    np.savez(args.out, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
