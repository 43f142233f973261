"""What each precision costs, in one run: every variant of one model built, scored on real text against PyTorch
fp32 and timed, printed as one Markdown table.

    nice -n 10 .venv/bin/python -m scripts.bench_precision models/reference-docstrings \\
        --text models/reference-docstrings/heldout.txt --work /tmp/bench-precision

(run from the repository root, so that this checkout of gpt2onnx is the one imported)

The variants (VARIANTS): fp32 under each fusion profile (none, ort, portable); fp16; int8 (dynamic,
MatMulInteger) with its logits projection (lm_head) and embeddings at 8 bits or fp32; int4 with block sizes 32
and 128, its lm_head and embeddings at 4 bits, 8 bits or fp32, and accuracy_level 0 and 4. fp32 is exported
from the checkpoint (validated against PyTorch); every other variant is `optimize`d from it (fp32-ort is the
source of the reduced precisions, the recommended CPU profile), with its gates opened wide so that a variant
that would fail them is measured all the same (the figures say whether it should).

Per variant:
- quality: `gpt2onnx eval`'s statistics (gpt2onnx.verify.evaluate) on the first ``--max-chars`` characters of
  the text, all folders in one pass, against PyTorch fp32 (the checkpoint): perplexity, ΔPPL %, mean and p99 KL,
  same top-1 %, and the first new token where greedy continuation of the text's first 32 tokens diverges;
- the export gates' own figures (gpt2onnx parity, randomized token ids against PyTorch): mean KL, top-1, top-5;
- the model files' size;
- time on onnxruntime's cpu provider (``--threads``), interleaved over rounds (each round times every folder
  once, in alternating order) so that a loaded machine slows all of them alike: the decode step at batch 1
  with ``--past`` tokens of cache (gpt2onnx.verify.timing.decode_step_at_past), and the prompt step at
  batch 1 × ``--prompt`` tokens with an empty past (all positions' logits); medians over ``--rounds``.
``--json`` writes every figure; the machine and its load (os.getloadavg) are printed beside the table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Variant:
    name: str
    fusion: str = "ort"
    dtype: str = "fp32"
    quantize: str = "none"
    block_size: int | None = None
    accuracy_level: int | None = None
    lm_head: str | None = None
    embeddings: str | None = None
    algorithm: str | None = None  # int4's weight algorithm (gpt2onnx.precisions.algorithms.all_algorithms)
    mixed_int8: float | None = None  # int4: percent of block weights at 8 bits by measured sensitivity
    note: str = ""
    options: dict = field(default_factory=dict)

    def quantization(self, calibration: str | None = None):
        """The variant's QuantizeOptions; ``calibration`` (a text file) is given to those that take one (gptq,
        measured mixed precision) and ignored by the others."""
        import dataclasses

        from gpt2onnx.precisions.quantize_options import QuantizeOptions

        options = QuantizeOptions(
            self.quantize,
            self.block_size,
            self.accuracy_level,
            self.lm_head,
            self.embeddings,
            algorithm=self.algorithm,
            mixed_int8=self.mixed_int8,
        )
        if calibration is not None and options.needs_calibration:
            options = dataclasses.replace(options, calibration_text=calibration)
        return options

    def recipe(self) -> str:
        """What the variant is, in words: the recipe filled in."""
        if self.quantize == "none":
            return f"{self.dtype}, fusion {self.fusion}"
        q = self.quantization().recipe
        text = q.method + (f" bs{q.block_size}" if q.method == "int4" or q.embeddings == "int8" else "")
        if q.accuracy_level is not None:
            text += f" acc{q.accuracy_level}"
        if q.algorithm not in (None, "rtn"):
            text += f" {q.algorithm}"
        if q.mixed_int8 is not None:
            text += f", {q.mixed_int8:g} % measured 8-bit"
        return text + f", lm_head {q.lm_head}, emb {q.embeddings}"


VARIANTS = (
    Variant("fp32", fusion="none"),
    Variant("fp32-ort"),
    Variant("fp32-portable", fusion="portable"),
    Variant("fp16", dtype="fp16"),
    Variant("int8", quantize="int8", lm_head="int8", embeddings="fp32"),
    Variant("int8-head32", quantize="int8", lm_head="fp32", embeddings="fp32"),
    Variant("int8-emb8", quantize="int8", lm_head="int8", embeddings="int8"),
    Variant("int4-bs32", quantize="int4", lm_head="int4", embeddings="int4", accuracy_level=4),
    Variant("int4-bs128", quantize="int4", block_size=128, lm_head="int4", embeddings="int4", accuracy_level=4),
    Variant("int4-acc0", quantize="int4", lm_head="int4", embeddings="int4", accuracy_level=0),
    Variant("int4-head8", quantize="int4", lm_head="int8", embeddings="int4", accuracy_level=4),
    Variant("int4-head32", quantize="int4", lm_head="fp32", embeddings="int4", accuracy_level=4),
    Variant("int4-emb8", quantize="int4", lm_head="int4", embeddings="int8", accuracy_level=4),
    Variant("int4-emb32", quantize="int4", lm_head="int4", embeddings="fp32", accuracy_level=4),
    Variant("int4-head8-emb8", quantize="int4", lm_head="int8", embeddings="int8", accuracy_level=4),
    Variant("int4-head8-acc0", quantize="int4", lm_head="int8", embeddings="int4", accuracy_level=0),
    Variant("int4-bs128-head8", quantize="int4", block_size=128, lm_head="int8", embeddings="int4", accuracy_level=4),
    # int4's weight algorithms beside round to nearest (int4-bs32), each with the recipe's other options
    Variant("int4-hqq", quantize="int4", algorithm="hqq"),
    Variant("int4-kquant", quantize="int4", algorithm="k-quant"),
    Variant("int4-gptq", quantize="int4", algorithm="gptq"),
    Variant("int4-hqq-head8", quantize="int4", algorithm="hqq", lm_head="int8"),
    Variant("int4-kquant-head8", quantize="int4", algorithm="k-quant", lm_head="int8"),
    # measured mixed precision: the most sensitive weights at 8 bits within a budget
    Variant("int4-mixed10", quantize="int4", mixed_int8=10),
    Variant("int4-mixed25", quantize="int4", mixed_int8=25),
    Variant("int4-kquant-mixed10", quantize="int4", algorithm="k-quant", mixed_int8=10),
    # issue 34's table: every algorithm with the recipe's options, block sizes and accuracy levels, mixed and
    # 8-bit lm_head with each algorithm, so that the best one's rows come from the same run
    Variant("int4-bs64", quantize="int4", block_size=64, lm_head="int4", embeddings="int4", accuracy_level=4),
    Variant("int4-bs64-acc0", quantize="int4", block_size=64, lm_head="int4", embeddings="int4", accuracy_level=0),
    Variant("int4-bs128-acc0", quantize="int4", block_size=128, lm_head="int4", embeddings="int4", accuracy_level=0),
    Variant("int4-gptq-head8", quantize="int4", algorithm="gptq", lm_head="int8"),
    Variant("int4-hqq-mixed10", quantize="int4", algorithm="hqq", mixed_int8=10),
    Variant("int4-gptq-mixed10", quantize="int4", algorithm="gptq", mixed_int8=10),
    Variant("int4-hqq-mixed25", quantize="int4", algorithm="hqq", mixed_int8=25),
    Variant("int4-kquant-mixed25", quantize="int4", algorithm="k-quant", mixed_int8=25),
    Variant("int4-gptq-mixed25", quantize="int4", algorithm="gptq", mixed_int8=25),
    Variant("int4-hqq-acc0", quantize="int4", algorithm="hqq", accuracy_level=0),
    Variant("int4-kquant-acc0", quantize="int4", algorithm="k-quant", accuracy_level=0),
    Variant("int4-gptq-acc0", quantize="int4", algorithm="gptq", accuracy_level=0),
)
# Gates wide open while building: the table measures each variant, the gates are recalibrated from it.
OPEN_GATES = {
    "float16": {"kl_mean": 1e9, "top1": 1e-9, "top5": 1e-9},
    "quantized": {"kl_mean": 1e9, "top1": 1e-9, "top5": 1e-9},
}


def build(
    source_model: str, work: Path, variants, *, log, calibration: str | None = None, refused: dict | None = None
) -> dict[str, Path]:
    """Export fp32 from the checkpoint, then optimize every other variant from the right fp32 folder. A variant
    that its own check refuses (gates open, so a file check: a broken file) is left out and its reason put in
    ``refused``."""
    from gpt2onnx.errors import CheckFailed
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.exporters.optimize import optimize

    folders: dict[str, Path] = {}
    base = work / "fp32"
    if not (base / "gpt2onnx.json").is_file():
        export(source_model, base, options=ExportOptions(force=True))
    folders["fp32"] = base
    for variant in variants:
        if variant.name == "fp32":
            continue
        out = work / variant.name
        started = time.perf_counter()
        if not (out / "gpt2onnx.json").is_file():
            quantized = variant.quantize != "none"
            source = folders.get("fp32-ort", base) if (quantized or variant.dtype != "fp32") else base
            fusion = "none" if source != base else variant.fusion
            gates = OPEN_GATES["quantized"] if quantized else OPEN_GATES["float16"] if variant.dtype == "fp16" else None
            try:
                optimize(
                    source,
                    out,
                    fusion=fusion,
                    quantization=variant.quantization(calibration),
                    dtype=variant.dtype,
                    gates=gates,
                    force=True,
                )
            except CheckFailed as failure:
                if refused is None:
                    raise
                refused[variant.name] = str(failure)
                log(f"{variant.name} refused by its own check, left out: {failure}")
                continue
        folders[variant.name] = out
        log(f"built {variant.name} in {time.perf_counter() - started:.1f} s")
    return folders


def calibration_text(choice: str | None, model: Path, work: Path) -> str | None:
    """The calibration file: ``choice`` itself, or (``train-split``) the reference's training docstrings."""
    if choice != "train-split":
        return choice
    from scripts.training import stdlib_docstrings

    report = json.loads((model / "train_report.json").read_text())
    corpus = stdlib_docstrings(heldout_percent=report["heldout_percent"])
    if sorted(corpus.heldout) != report["heldout_modules"]:
        raise SystemExit("the held-out modules differ from the reference's train_report.json: another Python?")
    path = work / "calibration-train-split.txt"
    path.write_text(corpus.train_text(), encoding="utf-8")
    return str(path)


def cpu_flags() -> list[str]:
    """The CPU features int4/int8 kernels care about, as /proc/cpuinfo lists them."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "amx_bf16")
    try:
        with open("/proc/cpuinfo") as fh:
            have = set(next(line for line in fh if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return []
    return [flag for flag in wanted if flag in have]


def model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("model.onnx"))


def time_folders(folders: dict[str, Path], *, threads: int, past: int, prompt: int, rounds: int, warmup: int):
    """Median ms of one decode step (batch 1, ``past`` cached) and one prompt step (batch 1 × ``prompt``), every
    folder timed once per round, alternating the order."""
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.runtimes.decoder import open_decoder
    from gpt2onnx.runtimes.providers import ProviderConfig
    from gpt2onnx.verify.timing import decode_step_at_past

    provider = ProviderConfig(threads=threads)
    decoders = {name: open_decoder(open_folder(folder), provider) for name, folder in folders.items()}
    names = list(decoders)
    decode: dict[str, list[float]] = {n: [] for n in names}
    prefill: dict[str, list[float]] = {n: [] for n in names}
    rng = np.random.default_rng(0)
    for r in range(warmup + rounds):
        for name in names[:: 1 if r % 2 == 0 else -1]:
            decoder = decoders[name]
            vocab = decoder.vocab_size or 50257
            seconds = decode_step_at_past(decoder, 1, past, vocab_size=vocab, seed=r)
            ids = rng.integers(0, vocab, size=(1, prompt), dtype=np.int64)
            mask = np.ones((1, prompt), np.int64)
            positions = np.arange(prompt, dtype=np.int64)[None]
            started = time.perf_counter()
            decoder.run(ids, decoder.prompt_mask(mask), positions, decoder.empty_past(1, prompt + 1))
            prompt_seconds = time.perf_counter() - started
            if r >= warmup:
                decode[name].append(seconds)
                prefill[name].append(prompt_seconds)
    return (
        {n: float(np.median(v)) * 1e3 for n, v in decode.items()},
        {n: float(np.median(v)) * 1e3 for n, v in prefill.items()},
    )


def gate_figures(folders: dict[str, Path], *, cases: int) -> dict[str, dict]:
    """The export gates' statistics (randomized token ids against PyTorch, as `gpt2onnx parity`), gates open."""
    from gpt2onnx.verify.parity import parity

    figures = {}
    for name, folder in folders.items():
        measured = parity(folder, cases=cases, gates=_open_gates_for(folder)).measured
        figures[name] = {
            "kl_mean": measured.kl.mean,
            "top1": measured.top1_agreement,
            "top5": measured.top5_agreement,
            "logits_max": measured.logits.max,
        }
    return figures


def _open_gates_for(folder: Path):
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.precisions.all_precisions import precision_of

    precision = precision_of(open_folder(folder).facts).name
    if precision == "float32":
        return {"logits": 1e9, "present": 1e9}
    return OPEN_GATES["float16" if precision == "float16" else "quantized"]


def excerpt(text: Path, max_chars: int, work: Path) -> tuple[Path, int]:
    """The first ``max_chars`` characters of the text, cut at a line end (the scored text)."""
    content = text.read_text(encoding="utf-8")
    if len(content) > max_chars:
        cut = content.rfind("\n", 0, max_chars)
        content = content[: cut if cut > 0 else max_chars]
    path = work / "scored.txt"
    path.write_text(content, encoding="utf-8")
    return path, len(content)


def _fmt(value, spec: str, missing: str = "–") -> str:
    return missing if value is None else format(value, spec)


def table(variants, rows: dict, sizes: dict, decode: dict, prefill: dict, gates: dict, reference_ppl: float) -> str:
    header = (
        "| variant | recipe | PPL | ΔPPL % | mean KL | p99 KL | same top-1 | greedy diverges at | file |"
        " decode b1 ms | prompt b1 ms | gate KL (random ids) | gate top-5 |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    lines.append(f"| PyTorch fp32 | reference | {reference_ppl:.3f} |" + " – |" * 10)
    for variant in variants:
        row = rows[variant.name]
        greedy = row.greedy
        diverges = greedy.first_divergence if greedy else None
        diverges_text = "never" if diverges is None and greedy else _fmt(diverges, "d")
        if diverges is None and greedy and greedy.new_tokens:
            diverges_text = f"never ({greedy.new_tokens} new)"
        g = gates.get(variant.name, {})
        lines.append(
            "| "
            + " | ".join(
                [
                    variant.name,
                    variant.recipe(),
                    f"{row.ppl:.3f}",
                    _fmt(row.delta_ppl_percent, "+.2f"),
                    _fmt(row.kl.mean if row.kl else None, ".2e"),
                    _fmt(row.kl.p99 if row.kl else None, ".2e"),
                    _fmt(None if row.same_top1 is None else 100 * row.same_top1, ".2f") + " %",
                    diverges_text,
                    f"{sizes[variant.name] / 1e6:.1f} MB",
                    f"{decode[variant.name]:.2f}",
                    f"{prefill[variant.name]:.1f}",
                    _fmt(g.get("kl_mean"), ".2e"),
                    _fmt(None if g.get("top5") is None else 100 * g["top5"], ".1f") + " %",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the checkpoint folder (Hugging Face, with tokenizer files)")
    parser.add_argument("--text", required=True, type=Path, help="held-out text to score (UTF-8)")
    parser.add_argument("--max-chars", type=int, default=60_000, help="score the text's first N characters")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-precision"), help="where variants are built")
    parser.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gate-cases", type=int, default=10, help="randomized cases of the gate figures")
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--json", dest="json_path", type=Path, default=None)
    parser.add_argument(
        "--calibration",
        default=None,
        help="text that gptq and measured mixed precision are calibrated on (a file); 'train-split': the"
        " training split of a reference trained by scripts.train_reference (the standard library's docstrings"
        " less the held-out modules, from its train_report.json), so that no held-out text is calibrated on;"
        " default: gpt2onnx's own (the standard library's module docstrings, held-out modules included)",
    )
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:6.0f} s, load {os.getloadavg()[0]:.1f}] {message}", flush=True)

    from gpt2onnx.runtimes.base import RuntimeOptions
    from gpt2onnx.runtimes.providers import ProviderConfig
    from gpt2onnx.verify.evaluate import evaluate
    from gpt2onnx.verify.timing import machine_info

    variants = VARIANTS
    if args.only:
        wanted = set(args.only.split(","))
        variants = tuple(v for v in VARIANTS if v.name in wanted or v.name == "fp32")
    args.work.mkdir(parents=True, exist_ok=True)
    loads = {"start": os.getloadavg()}
    calibration = calibration_text(args.calibration, Path(args.model), args.work)
    if calibration:
        log(f"calibration text: {calibration}")
    refused: dict[str, str] = {}
    folders = build(args.model, args.work, variants, log=log, calibration=calibration, refused=refused)
    variants = tuple(v for v in variants if v.name not in refused)
    sizes = {name: model_bytes(folder) for name, folder in folders.items()}
    scored, chars = excerpt(args.text, args.max_chars, args.work)
    log(f"evaluating {len(folders)} folders on {chars:,} characters of {args.text}")
    report = evaluate(
        [folders[v.name] for v in variants],
        text=scored,
        runtime=RuntimeOptions(settings=ProviderConfig(threads=args.threads)),
        greedy_tokens=args.greedy_tokens,
        on_window=lambda done, total: (done % 10 == 0 or done == total) and log(f"eval window {done}/{total}"),
    )
    loads["after_eval"] = os.getloadavg()
    if args.json_path:  # the slow part: kept even if what follows fails
        args.json_path.with_suffix(".eval.json").write_text(json.dumps(report.as_dict(), indent=1, default=str))
    rows = {v.name: row for v, row in zip(variants, report.rows)}
    log("gate figures (randomized ids against PyTorch)")
    gates = gate_figures({v.name: folders[v.name] for v in variants}, cases=args.gate_cases)
    n_positions = report.protocol.context or args.past + 1
    args.past, args.prompt = min(args.past, n_positions - 2), min(args.prompt, n_positions - 1)  # within the model
    log(f"timing: {args.rounds} rounds, decode b1 at past {args.past}, prompt b1×{args.prompt}")
    decode, prefill = time_folders(
        {v.name: folders[v.name] for v in variants},
        threads=args.threads,
        past=args.past,
        prompt=args.prompt,
        rounds=args.rounds,
        warmup=args.warmup,
    )
    loads["end"] = os.getloadavg()
    protocol = report.protocol
    print()
    print(
        f"Model {args.model}; text: the first {chars:,} characters of {args.text}, {protocol.scored_tokens}"
        f" scored tokens, context {protocol.context}, stride {protocol.stride}; reference PyTorch fp32"
        f" (PPL {report.reference.ppl:.3f} ± {report.reference.ppl_stderr:.3f}). Greedy: {args.greedy_tokens} new"
        f" tokens from the text's first tokens. Gate figures: {args.gate_cases} randomized cases. Timing:"
        f" onnxruntime cpu, {args.threads} threads, {args.rounds} interleaved rounds (medians). Machine:"
        f" {machine_info()}, flags {' '.join(cpu_flags())}. Load average (1/5/15 min): start {loads['start']},"
        f" after eval {loads['after_eval']},"
        f" end {loads['end']}. Calibration (gptq, mixed): {calibration or 'gpt2onnx default'}."
        f" {time.time() - started:.0f} s in all.\n"
    )
    print(table(variants, rows, sizes, decode, prefill, gates, report.reference.ppl))
    for name, reason in refused.items():
        print(f"\n{name}: refused by its own check, not measured: {reason}")
    if args.json_path:
        args.json_path.write_text(
            json.dumps(
                {
                    "protocol": protocol,
                    "eval": report.as_dict(),
                    "sizes": sizes,
                    "decode_ms": decode,
                    "prompt_ms": prefill,
                    "gate_figures": gates,
                    "variants": {v.name: v.recipe() for v in variants},
                    "calibration": calibration,
                    "refused": refused,
                    "threads": args.threads,
                    "machine": machine_info(),
                    "cpu_flags": cpu_flags(),
                    "loads": loads,
                },
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
