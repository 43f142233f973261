"""int8 on every CPU: each way of storing int8's MatMulInteger weights (precision.INT8_SCHEMES), measured in one run
on a trained model and real text, on this CPU and on CPUs emulated by QEMU, and timed here.

    nice -n 10 .venv/bin/python -m scripts.bench_int8_schemes models/reference-docstrings-small \\
        --text models/reference-docstrings-small/heldout.txt --work /tmp/int8-schemes --cpus EPYC-Rome,Nehalem

(run from the repository root; needs Debian's qemu-user for --cpus)

Every scheme quantizes the same fp32 export (fusion ort, the recommended CPU profile) with int8's recipe (lm_head
and embeddings at 8 bits); only the MatMulInteger weights differ. Per scheme:
- quality against PyTorch fp32 on the first ``--tokens`` tokens of the text (the model's tokenizer), windows of
  ``--context`` tokens every ``--stride`` from an empty past (transformers' perplexity guide: each token scored
  once): ΔPPL %, mean KL, same top-1 — on this CPU;
- portability: the same windows and greedy tokens (``--new-tokens`` from two prompts of the text) computed by
  scripts/cpu_worker.py on each ``--cpus`` model under ``qemu-x86_64 -cpu MODEL``: mean KL(this CPU ‖ that CPU),
  same top-1, and whether the greedy tokens are equal;
- speed on this CPU (onnxruntime's cpu provider, ``--threads``): the decode step at batch 1 with ``--past`` tokens
  of cache and the prompt step at batch 1 × ``--prompt`` tokens, medians of interleaved ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "scripts" / "cpu_worker.py"
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json")


def run_worker(cpu: str | None, folders: list[Path], ids: Path, prompts: Path, out: Path, args) -> dict:
    """scripts/cpu_worker.py on this CPU (``cpu`` None) or under QEMU as ``cpu``; its npz loaded."""
    command = [sys.executable, str(WORKER), *map(str, folders), "--ids", str(ids), "--prompts", str(prompts)]
    command += ["--context", str(args.context), "--stride", str(args.stride), "--new-tokens", str(args.new_tokens)]
    command += ["--out", str(out)]
    if cpu is not None:
        command = ["qemu-x86_64", "-cpu", cpu, *command]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the worker failed on {cpu or 'this CPU'}:\n{done.stderr[-3000:]}")
    return dict(np.load(out))


def torch_window_logits(checkpoint: Path, ids: np.ndarray, context: int, stride: int) -> np.ndarray:
    import torch

    from gpt2onnx.pytorch.checkpoint import load_checkpoint
    from gpt2onnx.pytorch.reference import reference_model

    model = reference_model(load_checkpoint(str(checkpoint)))
    windows = []
    with torch.no_grad():
        for begin in range(0, max(1, len(ids) - context + 1), stride):
            window = torch.from_numpy(ids[None, begin : begin + context])
            windows.append(model(input_ids=window).logits[0].float().numpy())
    return np.stack(windows)


def scored_nll(logits: np.ndarray, ids: np.ndarray, context: int, stride: int) -> np.ndarray:
    """The NLL of every scored token (each once: a later window scores only the tokens after the previous end)."""
    from gpt2onnx.verify.metrics import log_softmax

    nll = []
    for index, window_logits in enumerate(logits):
        window = ids[index * stride : index * stride + context]
        logprobs = log_softmax(window_logits[: len(window) - 1])
        picked = -logprobs[np.arange(len(window) - 1), window[1:]]
        nll.append(picked if index == 0 else picked[len(window) - 1 - stride :])
    return np.concatenate(nll)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a trained checkpoint folder with tokenizer.json")
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "int8-schemes")
    parser.add_argument("--cpus", default="EPYC-Rome,Nehalem", help="QEMU CPU models, comma-separated ('' for none)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--past", type=int, default=96)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", dest="json_path", type=Path)
    parser.add_argument("--reuse", action="store_true", help="reuse the CPUs' results already in --work (same text)")
    args = parser.parse_args()

    import onnx
    from tokenizers import Tokenizer

    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.machine import describe_cpu
    from gpt2onnx.precisions.int8 import INT8_SCHEME, INT8_SCHEMES
    from gpt2onnx.precisions.quantize_options import QuantizeOptions
    from gpt2onnx.precisions.weights import quantize
    from gpt2onnx.verify.metrics import kl_divergence
    from scripts.bench_precision import time_folders

    args.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    base = args.work / "fp32-ort"
    if not (base / "gpt2onnx.json").is_file():
        export(str(args.model), base, options=ExportOptions(fusion="ort", force=True))
    folders = {"fp32-ort": base}
    for name, scheme in INT8_SCHEMES.items():
        out = args.work / f"int8-{name}"
        if not (out / "model.onnx").is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            for file in COPIED:
                if (base / file).is_file():
                    shutil.copy(base / file, out / file)
            model, _ = quantize(onnx.load(str(base / "model.onnx")), QuantizeOptions("int8"), int8_scheme=scheme)
            onnx.save(model, str(out / "model.onnx"))
        folders[name] = out

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    ids = np.asarray(tokenizer.encode(args.text.read_text(encoding="utf-8")[: args.tokens * 8]).ids[: args.tokens])
    ids_path, prompts_path = args.work / "ids.npy", args.work / "prompts.json"
    np.save(ids_path, ids)
    prompts_path.write_text(json.dumps([ids[:32].tolist(), ids[len(ids) // 2 : len(ids) // 2 + 16].tolist()]))
    reference = torch_window_logits(args.model, ids, args.context, args.stride)
    reference_nll = scored_nll(reference, ids, args.context, args.stride)

    names = list(folders)
    cpus = [None] + [c for c in args.cpus.split(",") if c]
    results = {}
    for cpu in cpus:
        label = cpu or "host"
        out = args.work / f"{label}.npz"
        if args.reuse and out.is_file():
            results[label] = dict(np.load(out))
        else:
            results[label] = run_worker(cpu, list(folders.values()), ids_path, prompts_path, out, args)
        print(f"ran on {label}: {json.loads(str(results[label]['cpu']))['model']}", file=sys.stderr)
    decode, prefill = time_folders(
        folders, threads=args.threads, past=args.past, prompt=args.prompt, rounds=args.rounds, warmup=3
    )

    host = results["host"]
    rows = {}
    for index, name in enumerate(names):
        logits = host[f"logits_{index}"]
        nll = scored_nll(logits, ids, args.context, args.stride)
        row = {
            "delta_ppl_percent": float(np.expm1(nll.mean() - reference_nll.mean()) * 100),
            "kl_mean": float(kl_divergence(reference, logits).mean()),
            "same_top1": float((reference.argmax(-1) == logits.argmax(-1)).mean()),
            "decode_ms": decode[name],
            "prompt_ms": prefill[name],
            "cpus": {},
        }
        for cpu in cpus[1:]:
            other = results[cpu]
            row["cpus"][cpu] = {
                "kl_mean": float(kl_divergence(logits, other[f"logits_{index}"]).mean()),
                "same_top1": float((logits.argmax(-1) == other[f"logits_{index}"].argmax(-1)).mean()),
                "greedy_equal": bool((host[f"tokens_{index}"] == other[f"tokens_{index}"]).all()),
            }
        rows[name] = row

    cpu_models = {label: json.loads(str(r["cpu"])) for label, r in results.items()}
    header = "| scheme | ΔPPL % | mean KL | same top-1 | decode b1 ms | prompt b1 ms |"
    header += "".join(f" KL host‖{c} | top-1 = {c} | greedy = {c} |" for c in cpus[1:])
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for name, row in rows.items():
        chosen = " (default)" if name in INT8_SCHEMES and INT8_SCHEMES[name] == INT8_SCHEME else ""
        cells = [
            f"{name}{chosen}",
            f"{row['delta_ppl_percent']:+.3f}",
            f"{row['kl_mean']:.2e}",
            f"{100 * row['same_top1']:.2f} %",
            f"{row['decode_ms']:.2f}",
            f"{row['prompt_ms']:.1f}",
        ]
        for cpu in cpus[1:]:
            c = row["cpus"][cpu]
            cells += [f"{c['kl_mean']:.1e}", f"{100 * c['same_top1']:.2f} %", "yes" if c["greedy_equal"] else "**no**"]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    print()
    for label, cpu in cpu_models.items():
        print(f"- {label}: {cpu['model']}; int8 kernels: {cpu['int8_path']}")
    end_load = os.getloadavg()[0]
    print(f"- this CPU: {describe_cpu().summary()}; load average {load[0]:.1f} at the start, {end_load:.1f} at the end")
    windows = f"windows {args.context} every {args.stride}"
    print(f"- text: {len(ids)} tokens of {args.text.name}, {windows}; {len(reference_nll)} scored")
    if args.json_path:
        args.json_path.write_text(json.dumps({"rows": rows, "cpus": cpu_models, "load": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
