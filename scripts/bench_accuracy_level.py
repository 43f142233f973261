"""Does int4's accuracy_level 4 pick the wrong top token on GPT-2 with massive activations (onnxruntime#29849)?

    nice -n 10 .venv/bin/python -m scripts.bench_accuracy_level --work /tmp/acc-level \\
        --json /work/results/accuracy-level.json [--trained /work/reference/gpt2like-6x384]

(run from the repository root, so that this checkout of gpt2onnx is the one imported)

MatMulNBits with accuracy_level 4 quantizes its activations to int8 (one scale per block of ``block_size``
inputs of a row) before the int8 dot products; accuracy_level 0 computes in fp32 from the dequantized weights.
Trained GPT-2 carries a few residual-stream channels in the thousands on the first token (the attention sink;
``--outliers``: gpt2onnx.pytorch.checkpoint.inject_outlier_channels puts them on position 0 of a random model).
An activation row holding such a channel leaves the rest of its block few int8 levels.

For each model (the random 124M with and without outliers, both seeded alike): fp32 exported with the ort
fusion profile (no validation: the figures below are the check), then int4 block 32 round to nearest with
accuracy_level 0 and 4 (``optimize``, gates open), lm_head and embeddings at the recipe's int4. Then ``--cases``
sequences of ``--length`` seeded random token ids, prompt step from an empty past, logits of every position,
against PyTorch fp32 (the manifest's source): mean KL(PyTorch ‖ ONNX), its 99th percentile, same top-1 %, max
|Δlogits|, at position 0 (the token that carries the outliers) and at the other positions apart.

``--trained FOLDER``: also the largest residual-stream activation of a trained checkpoint on its heldout.txt
(transformers, output_hidden_states) and the ratio to the median |activation|: whether it has massive
activations at all.

``--probe FOLDER``: a massive activation at a MatMulNBits input of a trained checkpoint, the function kept: in
each block of ``--probe-layers``, value channel 0 of the attention (c_attn's V column and bias) is multiplied by
``--probe-scale`` and the matching input row of the attention's output projection (attn.c_proj) divided by it,
so the attention output carries that channel at about ``--probe-scale`` × its usual size on every token while
the fp32 model computes the same function (attention is linear in V). The int4 files (block 32, round to
nearest) differ only in accuracy_level; both lose that row's small weights to rounding alike, so the difference
between them is the int8 activation quantization. Scored with gpt2onnx eval on the first ``--probe-chars``
characters of the folder's heldout.txt against PyTorch fp32 of the probed checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

OPEN_GATES = {"kl_mean": 1e9, "top1": 1e-9, "top5": 1e-9}


def build(work: Path, name: str, outliers: float, seed: int, log) -> dict[str, Path]:
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.exporters.optimize import optimize
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    base = work / f"{name}-fp32"
    if not (base / "gpt2onnx.json").is_file():
        started = time.perf_counter()
        export(
            "gpt2",
            base,
            random_init=True,
            seed=seed,
            outliers=outliers,
            options=ExportOptions(fusion="ort", validate=False, force=True),
        )
        log(f"exported {base} in {time.perf_counter() - started:.0f} s")
    folders = {"fp32": base}
    for level in (0, 4):
        out = work / f"{name}-int4-acc{level}"
        if not (out / "gpt2onnx.json").is_file():
            started = time.perf_counter()
            optimize(
                base,
                out,
                fusion="none",
                quantization=QuantizeOptions("int4", 32, level),
                gates=OPEN_GATES,
                validate=False,
                force=True,
            )
            log(f"built {out} in {time.perf_counter() - started:.0f} s")
        folders[f"int4-acc{level}"] = out
    return folders


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(folders: dict[str, Path], *, cases: int, length: int, seed: int, threads: int) -> dict:
    import torch

    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.pytorch.reference import reference_model, reference_step
    from gpt2onnx.runtimes.decoder import open_decoder, position_ids_for
    from gpt2onnx.runtimes.providers import ProviderConfig
    from gpt2onnx.verify.parity import reference_checkpoint

    first = open_folder(next(iter(folders.values())))
    model = reference_model(reference_checkpoint(first))
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    sequences = [rng.integers(0, vocab, size=(1, length), dtype=np.int64) for _ in range(cases)]
    torch.set_num_threads(threads)
    references = []
    for ids in sequences:
        mask = np.ones_like(ids)
        logits, _ = reference_step(model, ids, mask, position_ids_for(mask))
        references.append(logits[0])
    torch.set_num_threads(1)  # onnxruntime's threads next
    out = {}
    for name, folder in folders.items():
        decoder = open_decoder(open_folder(folder), ProviderConfig(threads=threads))
        kl, top1, delta = [], [], []
        for ids, ref in zip(sequences, references):
            mask = np.ones_like(ids)
            got, _ = decoder.run(
                ids,
                decoder.prompt_mask(mask),
                position_ids_for(mask),
                decoder.empty_past(1, length + 1),
                last_logits_only=False,
            )
            got = got[0, -length:]
            lr, lg = _log_softmax(ref), _log_softmax(got)
            kl.append(np.einsum("ij,ij->i", np.exp(lr), lr - lg))
            top1.append(ref.argmax(-1) == got.argmax(-1))
            delta.append(np.abs(ref.astype(np.float64) - got).max(-1))
        kl, top1, delta = np.stack(kl), np.stack(top1), np.stack(delta)  # [cases, length]

        def stats(sl):
            k = kl[:, sl].ravel()
            return {
                "positions": int(k.size),
                "kl_mean": float(k.mean()),
                "kl_p99": float(np.percentile(k, 99)),
                "same_top1": float(top1[:, sl].mean()),
                "logits_max_abs_diff": float(delta[:, sl].max()),
            }

        out[name] = {
            "position_0": stats(slice(0, 1)),
            "positions_1_on": stats(slice(1, None)),
            "all": stats(slice(None)),
        }
    return out


def probe_checkpoint(folder: Path, out: Path, *, layers: list[int], scale: float) -> Path:
    """``folder``'s model with one massive value channel in each block of ``layers`` (same function in exact
    arithmetic)."""
    import shutil

    import torch
    from transformers import GPT2LMHeadModel

    if (out / "model.safetensors").is_file():
        return out
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    n_embd = model.config.n_embd
    with torch.no_grad():
        for layer in layers:
            block = model.transformer.h[layer]
            block.attn.c_attn.weight[:, 2 * n_embd] *= scale  # Conv1D: [in, out]; V is the last third of out
            block.attn.c_attn.bias[2 * n_embd] *= scale
            block.attn.c_proj.weight[0, :] /= scale  # input row 0 of the output projection
    model.save_pretrained(out)
    for f in folder.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def probe(folder: Path, work: Path, *, layers: list[int], scale: float, chars: int, threads: int, log) -> dict:
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.exporters.optimize import optimize
    from gpt2onnx.precisions.quantize_options import QuantizeOptions
    from gpt2onnx.runtimes.base import RuntimeOptions
    from gpt2onnx.runtimes.providers import ProviderConfig
    from gpt2onnx.verify.evaluate import evaluate

    tag = f"probe-l{'-'.join(map(str, layers))}-x{scale:g}"
    probed = probe_checkpoint(folder, work / f"{tag}-checkpoint", layers=layers, scale=scale)
    checkpoints = {"trained": folder, "probed": probed}
    text = (folder / "heldout.txt").read_text(encoding="utf-8")[:chars]
    scored = work / "probe-scored.txt"
    scored.write_text(text[: text.rfind("\n") if "\n" in text else len(text)], encoding="utf-8")
    out = {"layers": layers, "scale": scale, "text_chars": len(scored.read_text(encoding="utf-8"))}
    for name, checkpoint in checkpoints.items():
        stem = "probe-trained" if name == "trained" else tag
        base = work / f"{stem}-fp32"
        if not (base / "gpt2onnx.json").is_file():
            export(str(checkpoint), base, options=ExportOptions(fusion="ort", validate=False, force=True))
        folders = []
        for level in (0, 4):
            dst = work / f"{stem}-int4-acc{level}"
            if not (dst / "gpt2onnx.json").is_file():
                optimize(
                    base,
                    dst,
                    fusion="none",
                    quantization=QuantizeOptions("int4", 32, level),
                    gates=OPEN_GATES,
                    validate=False,
                    force=True,
                )
            folders.append(dst)
        log(f"probe {name}: evaluating")
        report = evaluate(
            [base, *folders],
            text=scored,
            runtime=RuntimeOptions(settings=ProviderConfig(threads=threads)),
            greedy_tokens=0,
        )
        rows = {}
        for label, row in zip(("fp32", "int4-acc0", "int4-acc4"), report.rows):
            rows[label] = {
                "ppl": row.ppl,
                "delta_ppl_percent": row.delta_ppl_percent,
                "kl_mean": row.kl.mean if row.kl else None,
                "kl_p99": row.kl.p99 if row.kl else None,
                "same_top1": row.same_top1,
            }
            log(f"probe {name} {label}: KL {rows[label]['kl_mean']:.3e} top-1 {100 * (row.same_top1 or 0):.2f} %")
        out[name] = {"reference_ppl": report.reference.ppl, "tokens": report.protocol.scored_tokens, "rows": rows}
    return out


def residual_activations(folder: Path, chars: int = 20_000) -> dict:
    """The largest |hidden state| of a trained checkpoint on its held-out text, per layer, and against the median."""
    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(folder)
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = tok((folder / "heldout.txt").read_text()[:chars])["input_ids"]
    n = model.config.n_positions
    layers: list[list[float]] = []
    medians: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(ids) - n + 1, n):
            hidden = model(torch.tensor([ids[start : start + n]]), output_hidden_states=True).hidden_states
            layers.append([float(h.abs().max()) for h in hidden])
            medians.append(float(torch.stack([h.abs().median() for h in hidden[1:]]).median()))
    per_layer = np.max(np.array(layers), axis=0)
    return {
        "windows": len(layers),
        "max_abs_per_hidden_state": [round(float(x), 2) for x in per_layer],
        "median_abs": round(float(np.median(medians)), 4),
        "max_over_median": round(float(per_layer[1:].max() / np.median(medians)), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/acc-level"))
    parser.add_argument("--outliers", type=float, default=3000.0, help="magnitude (GPT-2 small: about 3000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-baseline", action="store_true", help="skip the random model without outliers")
    parser.add_argument("--trained", type=Path, help="a trained checkpoint folder with heldout.txt")
    parser.add_argument("--probe", type=Path, help="a trained checkpoint to give one massive activation")
    parser.add_argument("--probe-layers", default="1", help="comma-separated block indices (default 1)")
    parser.add_argument("--probe-scale", type=float, default=1000.0)
    parser.add_argument("--probe-chars", type=int, default=20_000)
    parser.add_argument("--only-probe", action="store_true", help="skip the random 124M models")
    parser.add_argument("--json", dest="json_path", type=Path)
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:6.0f} s, load {os.getloadavg()[0]:.1f}] {message}", flush=True)

    from gpt2onnx.verify.timing import machine_info

    args.work.mkdir(parents=True, exist_ok=True)
    result = {
        "protocol": (
            f"{args.cases} sequences of {args.length} seeded random ids (seed {args.seed}), prompt step from an empty"
            " past, every position's logits against PyTorch fp32; int4 block 32 round to nearest, lm_head and"
            " embeddings int4; onnxruntime cpu"
        ),
        "machine": machine_info(),
        "threads": args.threads,
        "models": {},
    }
    models = [("random124m-outliers", args.outliers)]
    if not args.no_baseline:
        models.append(("random124m", 0.0))
    for name, outliers in [] if args.only_probe else models:
        folders = build(args.work, name, outliers, args.seed, log)
        log(f"comparing {name}")
        figures = compare(folders, cases=args.cases, length=args.length, seed=args.seed, threads=args.threads)
        result["models"][name] = {"outliers": outliers, "figures": figures}
        for variant, f in figures.items():
            log(
                f"{name} {variant}: pos0 KL {f['position_0']['kl_mean']:.3e}"
                f" top-1 {100 * f['position_0']['same_top1']:.1f} %"
                f" max|Δ| {f['position_0']['logits_max_abs_diff']:.3f}; pos1+ KL {f['positions_1_on']['kl_mean']:.3e}"
                f" p99 {f['positions_1_on']['kl_p99']:.3e} top-1 {100 * f['positions_1_on']['same_top1']:.2f} %"
            )
    if args.trained:
        result["trained_residual"] = {"folder": str(args.trained), **residual_activations(args.trained)}
        log(f"trained residual stream: {result['trained_residual']}")
    if args.probe:
        result["probe"] = probe(
            args.probe,
            args.work,
            layers=[int(x) for x in args.probe_layers.split(",")],
            scale=args.probe_scale,
            chars=args.probe_chars,
            threads=args.threads,
            log=log,
        )
    result["loadavg_end"] = os.getloadavg()
    result["seconds"] = round(time.time() - started, 1)
    if args.json_path:
        args.json_path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
