"""Speculative decoding's speed: gpt2onnx's prompt lookup and draft-model decoding against its plain greedy loop,
beside transformers' own ``generate(prompt_lookup_num_tokens=...)`` and ``generate(assistant_model=...)`` on the
same weights, at batch 1, in one run, interleaved round by round.

    python -m scripts.bench_speculative models/target --draft models/draft-int8 --draft models/draft

(run from the repository root, so that this checkout of gpt2onnx is the one imported). transformers' model is the
target folder's source checkpoint (its manifest), and its assistant each draft folder's source. Prompts, each cut
to ``--prompt-tokens`` tokens: standard-library source (``inspect.getsource``), standard-library docstrings
(``inspect.getdoc``) and free text written for this script; greedy, ``--new-tokens`` new tokens at most (a row
stops at end-of-sequence, on both sides alike; transformers 4.57's prompt lookup returned up to 8 tokens more than
``max_new_tokens`` here, cut off before counting and comparing). Figures per kind of prompt: new tokens / seconds
summed over its prompts (median of ``--rounds`` rounds after a warm-up), the speed-up against the same engine's
plain greedy, the new tokens per forward pass of the target (1 for plain decoding), the share of proposals kept
(gpt2onnx's count; transformers does not report its own), and whether the tokens equal gpt2onnx's plain greedy.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import textwrap
import time

import torch

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.decoding.generate import decode
from gpt2onnx.decoding.prompts import load_tokenizer
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.runtimes.decoder import open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.verify.parity import reference_checkpoint
from gpt2onnx.verify.timing import machine_info

FREE_TEXT = [
    "The village stood at the edge of the forest, and every winter the river froze so hard that the children"
    " walked across it to the mill on the other side.",
    "She opened the letter slowly, read the first line twice, and then put it down on the table without a word.",
    "In the morning the market fills with carts of apples, bread and cheese, and by noon the square is empty"
    " again except for the pigeons.",
    "The committee met on Tuesday to discuss the budget for next year, but the meeting ended before any"
    " decision was made.",
]


def stdlib_prompts() -> dict[str, list[str]]:
    import collections
    import functools
    import json as json_module
    import string

    objects = [
        textwrap.dedent,
        json_module.dumps,
        functools.lru_cache,
        collections.Counter.most_common,
        string.capwords,
    ]
    return {
        "stdlib code": [inspect.getsource(o) for o in objects],
        "stdlib docstrings": [inspect.getdoc(o) for o in objects],
        "free text": FREE_TEXT,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the target: an exported folder (all positions' logits)")
    parser.add_argument("--draft", action="append", default=[], help="a draft folder (repeatable)")
    parser.add_argument("--prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--max-ngram", type=int, default=2, help="max_matching_ngram_size")
    parser.add_argument("--draft-tokens", default="adaptive", help="N or adaptive")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()

    from gpt2onnx.pytorch.reference import reference_model

    load_before = os.getloadavg()
    if args.threads:
        torch.set_num_threads(args.threads)
    provider = ProviderConfig(threads=args.threads)
    model = open_folder(args.folder)
    decoder = open_decoder(model, provider)
    drafts = {path: open_decoder(open_folder(path), provider) for path in args.draft}
    tokenizer = load_tokenizer(model.folder)
    eos_ids = read_generation_config(model.folder, vocab_size=model.facts.vocab_size).eos_token_ids
    eos = eos_ids[0] if eos_ids else None
    reference = reference_model(reference_checkpoint(model, None))
    assistants = {path: reference_model(reference_checkpoint(open_folder(path), None)) for path in args.draft}
    forwards = {"count": 0}
    reference.register_forward_pre_hook(lambda module, inputs: forwards.__setitem__("count", forwards["count"] + 1))
    budget = min(args.prompt_tokens, model.n_positions - args.new_tokens)
    prompts = {
        kind: [tokenizer(text)["input_ids"][:budget] for text in texts] for kind, texts in stdlib_prompts().items()
    }

    def ours(speculation=None, draft=None):
        def run(ids):
            out = decode(
                decoder,
                [ids],
                max_new_tokens=args.new_tokens,
                eos_token_id=eos_ids,
                speculation=speculation,
                draft=draft,
            )
            tokens = out.tokens[0][: out.lengths[0]].tolist()
            spec = out.speculation
            steps = spec.rounds + 1 if spec else len(tokens)
            return tokens, steps, (spec.proposed, spec.accepted) if spec else (0, 0)

        return run

    def theirs(**options):
        def run(ids):
            forwards["count"] = 0
            with torch.no_grad():
                out = reference.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=args.new_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=eos,
                    **options,
                )
            tokens = out[0, len(ids) :].tolist()[: args.new_tokens]  # its prompt lookup can run past max_new_tokens
            if eos is not None and eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]
            return tokens, forwards["count"], None

        return run

    lookup = Speculation(prompt_lookup=args.prompt_lookup, max_ngram=args.max_ngram)
    runs = {
        "gpt2onnx greedy": ours(),
        f"gpt2onnx prompt lookup {args.prompt_lookup}": ours(lookup),
    }
    for path, draft in drafts.items():
        runs[f"gpt2onnx draft {path} ({args.draft_tokens})"] = ours(
            Speculation(draft=path, draft_tokens=args.draft_tokens), draft
        )
    runs["transformers greedy"] = theirs()
    runs[f"transformers prompt_lookup_num_tokens={args.prompt_lookup}"] = theirs(
        prompt_lookup_num_tokens=args.prompt_lookup, max_matching_ngram_size=args.max_ngram
    )
    for path, assistant in assistants.items():
        runs[f"transformers assistant_model= {path}'s source"] = theirs(assistant_model=assistant)

    rows = []
    started = time.time()
    for kind, ids_list in prompts.items():
        results = {name: [run(ids) for ids in ids_list] for name, run in runs.items()}
        seconds = {name: [] for name in runs}
        for r in range(args.warmup + args.rounds):
            for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
                start = time.perf_counter()
                for ids in ids_list:
                    runs[name](ids)
                if r >= args.warmup:
                    seconds[name].append(time.perf_counter() - start)
        plain = {"gpt2onnx": results["gpt2onnx greedy"], "transformers": results["transformers greedy"]}
        for name in runs:
            engine = name.split()[0]
            tokens = sum(len(t) for t, _, _ in results[name])
            steps = sum(s for _, s, _ in results[name])
            proposed = sum(p[0] for _, _, p in results[name] if p)
            accepted = sum(p[1] for _, _, p in results[name] if p)
            median = statistics.median(seconds[name])
            base = statistics.median(seconds[f"{engine} greedy"])
            same = [t for t, _, _ in results[name]] == [t for t, _, _ in plain["gpt2onnx"]]
            rows.append(
                {
                    "prompts": kind,
                    "run": name,
                    "tokens": tokens,
                    "tokens_per_s": tokens / median,
                    "speedup": base / median,
                    "tokens_per_target_step": tokens / steps,
                    "acceptance": accepted / proposed if proposed else None,
                    "same_tokens_as_gpt2onnx_greedy": same,
                }
            )
    load_after = os.getloadavg()
    print(
        f"speculative decoding, batch 1, {sum(len(v) for v in prompts.values())} prompts of at most {budget} tokens,"
        f" {args.new_tokens} new tokens at most; {args.rounds} rounds interleaved after {args.warmup} warm-up,"
        f" {time.time() - started:.0f} s; onnxruntime cpu, torch {torch.__version__} ({torch.get_num_threads()}"
        f" threads)\nmachine: {machine_info()}\nload average (1, 5, 15 min): before {load_before}, after"
        f" {load_after}\n"
    )
    print("| prompts | run | new tokens / s | vs same engine's greedy | tokens per target step | kept | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        kept = "-" if row["acceptance"] is None else f"{100 * row['acceptance']:.0f}%"
        print(
            f"| {row['prompts']} | {row['run']} | {row['tokens_per_s']:.0f} | {row['speedup']:.2f}× |"
            f" {row['tokens_per_target_step']:.2f} | {kept} |"
            f" {'yes' if row['same_tokens_as_gpt2onnx_greedy'] else 'no'} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine_info(), "load": [load_before, load_after], "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
