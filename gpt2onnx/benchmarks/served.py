"""The served model under load (`gpt2onnx bench served`): the folder deployed for Triton (its generation model,
continuous batching) and served by a real tritonserver, asked by concurrent streaming clients, beside gpt2onnx's
own decode loop in this process at batch 1, in the harness's rotating rounds.

requires: an exported folder with tokenizer files, and Triton Inference Server in .venv-triton
(gpt2onnx.targets.triton_server says how to install it). ensures, per run and round: tokens per second (every new
token of the run over its wall time, the first request sent to the last token received), the time to first token
and the gap between a request's tokens (p50 and p99 over every request of the run), each request decoding exactly
``new_tokens`` tokens (``min_new_tokens`` = ``max_new_tokens``) after one of 16 fixed prompts; in-process,
``decode()`` on each prompt alone (its first token: the prompt step and the first pick). The clients share the
machine's cores with the server.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.artifact.paths import check_output_files
from gpt2onnx.benchmarks.harness import Rounds, interleave, process_tree, write_outputs
from gpt2onnx.decoding.prompts import LOAD_PROMPTS as PROMPTS
from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.records import Record

NAME = "bench"
SERVERS = ("triton", "openai")  # bench served --server: Triton's generation model, or gpt2onnx's OpenAI endpoint
IN_PROCESS = "in-process decode(), batch 1"


def _figures(tokens: int, seconds: float, first: list[float], gaps: list[float]) -> dict[str, float]:
    ms = lambda values, q: 1e3 * float(np.percentile(values, q)) if values else float("nan")  # noqa: E731
    return {
        "tokens_per_s": tokens / seconds,
        "first_token_p50_ms": ms(first, 50),
        "first_token_p99_ms": ms(first, 99),
        "per_token_p50_ms": ms(gaps, 50),
        "per_token_p99_ms": ms(gaps, 99),
    }


def _one_request(port: int, prompt: str, new_tokens: int) -> tuple[list[float], int]:
    """One streaming request (HTTP, server-sent events): each event's arrival after sending, and the tokens."""
    body = {
        "text_input": prompt,
        "stream": True,
        "parameters": {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens},
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    arrivals, tokens = [], 0
    try:
        sent = time.perf_counter()
        path = f"/v2/models/{NAME}-generate/generate_stream"
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeUnavailable(f"the served model answered HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if line.startswith(b"data: "):
                arrivals.append(time.perf_counter() - sent)
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeUnavailable(f"the served model failed: {event['error']}")
                tokens += len(np.atleast_1d(event.get("output_ids", [])))
    finally:
        connection.close()
    return arrivals, tokens


def _served(port: int, clients: int, requests: int, new_tokens: int) -> Callable[[], dict]:
    def run() -> dict:
        def client(index: int) -> list:
            picks = [PROMPTS[(index + r * clients) % len(PROMPTS)] for r in range(requests)]
            return [_one_request(port, prompt, new_tokens) for prompt in picks]

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            done = [r for rs in pool.map(client, range(clients)) for r in rs]
        seconds = time.perf_counter() - start
        tokens = sum(t for _, t in done)
        if tokens != clients * requests * new_tokens:
            raise RuntimeUnavailable(f"{tokens} tokens came back, {clients * requests * new_tokens} were asked for")
        gaps = [b - a for arrivals, _ in done for a, b in zip(arrivals, arrivals[1:])]
        return _figures(tokens, seconds, [arrivals[0] for arrivals, _ in done], gaps)

    return run


def _in_process(folder: Path, new_tokens: int, provider) -> tuple[Callable[[], dict], Callable[[], None]]:
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.artifact.generation import read_generation_config
    from gpt2onnx.decoding.generate import decode
    from gpt2onnx.decoding.prompts import load_tokenizer
    from gpt2onnx.generation_options import Decoding
    from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime

    model = open_folder(folder)
    tokenizer = load_tokenizer(folder)
    eos = read_generation_config(folder, vocab_size=model.facts.vocab_size).eos_token_ids
    decoder = open_runtime(model, RuntimeOptions(settings=provider))
    decoding = Decoding(min_new_tokens=new_tokens)
    ids = [np.asarray([tokenizer.encode(p)]) for p in PROMPTS]

    def run() -> dict:
        first, gaps, tokens = [], [], 0
        start = time.perf_counter()
        for prompt in ids:
            t0 = time.perf_counter()
            result = decode(decoder, prompt, max_new_tokens=new_tokens, decoding=decoding, eos_token_id=eos)
            elapsed = time.perf_counter() - t0
            first.append(result.step_seconds[0] + (elapsed - sum(result.step_seconds)) / new_tokens)
            gaps += result.step_seconds[1:]
            tokens += result.tokens.shape[1]
        return _figures(tokens, time.perf_counter() - start, first, gaps)

    return run, decoder.close


@dataclass(frozen=True)
class ServedReport(Record):
    folder: str
    concurrency: tuple[int, ...]
    requests: int
    new_tokens: int
    threads: int | None
    rounds: Rounds

    def markdown(self) -> str:
        return (
            f"{self.folder} served by Triton (its generation model, continuous batching): each client sends"
            f" {self.requests} streaming requests one after another, {self.new_tokens} new tokens each; onnxruntime"
            f" threads: {self.threads or 'all cores'}.\n\n" + self.rounds.markdown()
        )


def bench_served(
    folder: str | Path,
    *,
    concurrency: tuple[int, ...] = (1, 4, 16),
    requests: int = 2,
    new_tokens: int = 64,
    threads: int | None = None,
    warmup: int = 1,
    repeat: int = 2,
    json_path=None,
    markdown_path=None,
    progress: Callable[[], None] | None = None,
    before_writing: Callable[[], None] | None = None,
    server: str = "triton",
    gguf: str | Path | None = None,
    llama_server: str | Path | None = None,
    max_batch: int = 16,
):
    """Serve ``folder`` with Triton and load it with each level of ``concurrency`` beside the in-process loop; with
    ``server`` "openai", behind gpt2onnx's OpenAI endpoint beside llama.cpp's servers on ``gguf`` (its C++
    ``llama_server`` binary too, where given) (gpt2onnx.benchmarks.served_openai)."""
    from gpt2onnx.runtimes.providers import ProviderConfig
    from gpt2onnx.targets.deploy import deploy
    from gpt2onnx.targets.triton_server import TritonServer

    check_output_files({"--json": json_path, "--md": markdown_path}, inputs=(Path(folder),))
    if not concurrency or any(c < 1 for c in concurrency) or len(set(concurrency)) != len(concurrency):
        raise BadInput(f"concurrency (--concurrency) must be distinct client counts of 1 or more, got {concurrency}")
    for name, value in (("requests (--requests)", requests), ("new tokens (--new-tokens)", new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadInput(f"{name} must be a positive integer, got {value!r}")
    if server not in SERVERS:
        raise BadInput(f"--server {server!r} is not one of {', '.join(SERVERS)}: give one of them")
    if server == "openai":
        from gpt2onnx.benchmarks.served_openai import bench_served_openai

        if threads is not None:
            raise BadInput("--threads applies to --server triton (gpt2onnx serve takes all cores): drop it")
        return bench_served_openai(
            folder, gguf=gguf, llama_server=llama_server, concurrency=concurrency, requests=requests,
            new_tokens=new_tokens, max_batch=max_batch, warmup=warmup, repeat=repeat, json_path=json_path,
            markdown_path=markdown_path, progress=progress, before_writing=before_writing,
        )  # fmt: skip
    for flag, given in (("--gguf", gguf), ("--llama-server", llama_server)):
        if given is not None:
            raise BadInput(f"{flag} applies to --server openai (llama.cpp's servers beside ours): drop it, or add that")
    provider = ProviderConfig(threads=threads)
    local, close = _in_process(Path(folder), new_tokens, provider)
    try:
        with tempfile.TemporaryDirectory(prefix="gpt2onnx-served-") as tmp:
            deploy(folder, "triton", out=Path(tmp) / "model", triton_name=NAME)
            config = Path(tmp) / "model" / "triton" / f"{NAME}-generate" / "config.pbtxt"
            if threads:
                config.write_text(
                    config.read_text() + f'parameters: {{ key: "threads" value: {{ string_value: "{threads}" }} }}\n'
                )
            with TritonServer(Path(tmp) / "model" / "triton", models=[f"{NAME}-generate"]) as server:
                port = server.http_port
                variants = {IN_PROCESS: local}
                for clients in concurrency:
                    label = f"Triton, {clients} streaming client{'s' if clients > 1 else ''}"
                    variants[label] = _served(port, clients, requests, new_tokens)
                served_by = server.process.pid  # the server and its backend's stubs: the measurement's own CPU
                rounds = interleave(
                    variants,
                    rounds=repeat,
                    warmup=warmup,
                    baseline=IN_PROCESS,
                    on_run=progress,
                    own_pids=lambda: process_tree(served_by),
                )
    finally:
        close()
    report = ServedReport(str(folder), tuple(concurrency), requests, new_tokens, threads, rounds)
    return write_outputs(report, json_path=json_path, markdown_path=markdown_path, before_writing=before_writing)
