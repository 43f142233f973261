"""Beam search speed: gpt2onnx's beam search (one K/V cache row per beam, reordered on the device side) against
transformers' beam search on the same weights, in one run, interleaved round by round.

    python -m scripts.bench_beam models/gpt2 --batch 2 --beams 4 --prompt-len 32 --new-tokens 32

(run from the repository root, so that this checkout of gpt2onnx is the one imported). The reference is the
folder's source (from its manifest; ``--reference`` names another). Both sides decode exactly ``--new-tokens``
tokens (``min_new_tokens`` = ``max_new_tokens``, so end-of-sequence cannot end a run early) and their tokens are
checked equal. A third row reorders the cache through numpy copies instead (OrtValue → numpy → take → OrtValue),
to show what the device-side reorder saves. Figures: median seconds per run and beams × steps per second
(batch × beams × new tokens / seconds).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
import torch

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import Decoding, read_generation_config
from gpt2onnx.decoding.generate import decode
from gpt2onnx.runtimes.decoder import open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.verify.lockstep import left_padded_batch
from gpt2onnx.verify.parity import reference_checkpoint
from gpt2onnx.verify.timing import machine_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--reference", default=None)
    args = parser.parse_args()

    model = open_folder(args.folder)
    decoder = open_decoder(model, ProviderConfig(name=args.provider, threads=args.threads))
    from gpt2onnx.pytorch.reference import reference_model

    reference = reference_model(reference_checkpoint(model, args.reference))
    torch_device = "cuda" if args.provider != "cpu" and torch.cuda.is_available() else "cpu"
    reference = reference.to(torch_device)
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = decoder.vocab_size or 50257
    ids, mask = left_padded_batch(vocab, batch=args.batch, length=args.prompt_len, seed=0)
    decoding = Decoding(num_beams=args.beams, min_new_tokens=args.new_tokens)
    eos_ids = read_generation_config(model.folder, vocab_size=model.facts.vocab_size).eos_token_ids
    eos = eos_ids[0] if eos_ids else vocab - 1

    def ours():
        return decode(decoder, ids, mask, max_new_tokens=args.new_tokens, decoding=decoding, eos_token_id=eos).tokens

    def numpy_reorder(past, rows):  # the alternative: every step's cache through host copies
        return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(p.numpy()[rows])) for p in past]

    def ours_numpy():
        original = decoder.reorder_past
        decoder.reorder_past = lambda past, rows: (
            numpy_reorder(past, rows) if not isinstance(past[0], np.ndarray) else original(past, rows)
        )
        try:
            return ours()
        finally:
            decoder.reorder_past = original

    def theirs():
        with torch.no_grad():
            out = reference.generate(
                torch.tensor(ids, device=torch_device),
                attention_mask=torch.tensor(mask, device=torch_device),
                num_beams=args.beams,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=eos,
                eos_token_id=eos,
            )
        return out[:, ids.shape[1] :].cpu().numpy()

    runs = {"gpt2onnx (reorder on the device side)": ours, "gpt2onnx (reorder through numpy copies)": ours_numpy}
    runs["transformers GPT2LMHeadModel.generate"] = theirs
    equal = np.array_equal(ours(), theirs())
    times = {name: [] for name in runs}
    started = time.time()
    for r in range(args.warmup + args.rounds):
        order = list(runs)[:: 1 if r % 2 == 0 else -1]
        for name in order:
            start = time.perf_counter()
            runs[name]()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - start)
    work = args.batch * args.beams * args.new_tokens
    print(
        f"beam search, batch {args.batch} × {args.beams} beams, prompt {args.prompt_len} (left-padded), "
        f"{args.new_tokens} new tokens; {args.rounds} rounds interleaved after {args.warmup} warm-up, "
        f"{time.time() - started:.0f} s; provider {decoder.provider}, torch on {torch_device} "
        f"({torch.get_num_threads()} threads); tokens equal to transformers: {equal}\n"
        f"machine: {machine_info()}\n"
    )
    print("| run | median s per run | beams × steps / s | vs transformers |\n|---|---|---|---|")
    base = float(np.median(times["transformers GPT2LMHeadModel.generate"]))
    for name, values in times.items():
        median = float(np.median(values))
        print(f"| {name} | {median:.3f} | {work / median:.1f} | {base / median:.2f}× |")


if __name__ == "__main__":
    main()
