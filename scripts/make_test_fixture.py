"""Make the tests' trained model, committed in tests/fixtures/trained-tiny/ so that it is the same on every machine.

    .venv/bin/python -m scripts.make_test_fixture          (about 30 s; rewrites tests/fixtures/trained-tiny)

Training is seeded but not bit-identical across CPUs (the kernels' sum order differs between AVX2 and AVX-512
builds), and a model trained on another machine writes other text: the tests read this folder instead of
training their own. The model: its own 512-token byte-level BPE and 2 layers × 64 (4 heads, 128 positions),
300 steps of 8 rows × 64 tokens on a third of the standard library's docstrings
(scripts/training.py). The folder: config.json, model.safetensors (about 0.6 MB), generation_config.json,
the tokenizer files (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json naming GPT2Tokenizer),
heldout.txt (docstrings of modules it never saw) and train_report.json (its held-out perplexity and median top-1
probability by the sliding-window protocol, and the machine it was trained on). Its eos/bos is <|endoftext|>, the
last id.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "trained-tiny"
BPE_SIZE = 512
CORPUS_PERCENT = 30
RECIPE = dict(n_layer=2, n_head=4, n_embd=64, n_positions=128, block=64, batch=8, steps=300, lr=1e-2, warmup=20)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def make(out: Path) -> Path:
    from gpt2onnx.artifact.tokenizer import build_tokenizer, read_bpe
    from scripts.training import (
        Recipe,
        encode_documents,
        heldout_quality,
        save_folder,
        stdlib_docstrings,
        train_byte_level_bpe,
        train_gpt2,
    )

    with tempfile.TemporaryDirectory(prefix="gpt2onnx-fixture-") as tmp:
        corpus = stdlib_docstrings(train_percent=CORPUS_PERCENT)
        vocab_file, merges_file = train_byte_level_bpe(
            corpus.train_text(), vocab_size=BPE_SIZE, folder=Path(tmp) / "bpe"
        )
        bpe = read_bpe(vocab_file, merges_file)
        tokenizer = build_tokenizer(bpe)
        train_ids = encode_documents(tokenizer, corpus.train, bpe.end_of_text_id)
        recipe = Recipe(**RECIPE)
        result = train_gpt2(train_ids, vocab_size=len(bpe.vocab), eos_id=bpe.end_of_text_id, recipe=recipe)
        heldout = corpus.heldout_text()
        quality = heldout_quality(result.model, tokenizer.encode(heldout).ids)
        report = {
            "made_by": "scripts/make_test_fixture.py",
            "corpus": corpus.source,
            "recipe": RECIPE,
            "bpe_size": BPE_SIZE,
            "train_percent": CORPUS_PERCENT,
            "train_tokens": len(train_ids),
            "train_seconds": round(result.seconds, 1),
            "trained_on": cpu_name(),
            "final_train_loss": result.final_loss,
            "heldout": {
                "perplexity": quality.perplexity,
                "median_top1": quality.median_top1,
                "tokens": quality.tokens,
                "context": quality.context,
                "stride": quality.stride,
            },
        }
        return save_folder(
            result.model,
            out,
            vocab_file=vocab_file,
            merges_file=merges_file,
            extra={"heldout.txt": heldout, "train_report.json": json.dumps(report, indent=2) + "\n"},
            replace=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIXTURE, help=f"the folder to (re)write (default {FIXTURE})")
    args = parser.parse_args()
    folder = make(args.out)
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"wrote {folder} ({size / 1e6:.2f} MB)")
    print((folder / "train_report.json").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
