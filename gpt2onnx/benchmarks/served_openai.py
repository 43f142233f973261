"""`gpt2onnx bench served --server openai`: the folder behind gpt2onnx's OpenAI endpoint (``gpt2onnx serve``, the
batching engine) beside llama.cpp's own OpenAI servers on a GGUF of the same weights: ``llama_cpp.server`` (from
llama-cpp-python in .venv-engines; one request at a time) and, given its binary, llama.cpp's C++ ``llama-server``
with ``--parallel`` slots (continuous batching, as ours), all loaded by the same concurrent streaming clients of
``/v1/completions`` in the harness's rotating rounds (modelled on vLLM's serving benchmark).

requires: an exported folder with tokenizer files; for llama.cpp's rows, a GGUF file (``--gguf``; ``gpt2onnx compare
--only llama.cpp:Q8_0`` builds one from the checkpoint) and llama-cpp-python with its server's packages in
.venv-engines (scripts/setup-engines.sh, ENGINES_LLAMA=1); for llama-server's, its binary (``--llama-server``;
ENGINES_LLAMA_SERVER=1 builds it from the same llama.cpp sources). llama-server gets ``--parallel`` = ``max_batch``
slots of the folder's whole context each (the promise ours makes: any request up to the context), its K/V cache
f16 and allocated at load, its prompt caches off (``--cache-ram 0``, and ``cache_prompt: false`` in every request:
the rounds repeat the same prompts, which a slot's cache would hold whole; ours keeps none).

ensures, per server, concurrency and round: requests per second and output tokens per second (the first request
sent to the last token received), time to first token, inter-token latency (the gaps between a request's streamed
chunks) and end-to-end latency, p50 and p99 over every request of the run, and the server's peak resident memory
during the run (its process tree, sampled); per server, its resident memory at rest (loaded, before any request)
and after the rounds (VmRSS, and VmHWM, the peak). Every request is one of 16 fixed prompts, greedy (temperature
0), ``max_tokens`` = ``new_tokens`` with end-of-sequence barred by ``logit_bias`` so each decodes exactly that many
tokens (``finish_reason`` "length", checked). The clients share the machine's cores with the servers; every server
stays up through the rounds, idle while another runs.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.artifact.paths import check_output_files
from gpt2onnx.benchmarks.harness import Rounds, Spread, interleave, process_tree, write_outputs
from gpt2onnx.decoding.prompts import LOAD_PROMPTS as PROMPTS
from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.records import Record, computed
from gpt2onnx.targets.triton_server import free_port

log = logging.getLogger(__name__)

OURS, LLAMA, LLAMA_CPP = "gpt2onnx serve", "llama.cpp server", "llama-server"
LLAMAS = (LLAMA, LLAMA_CPP)  # llama_cpp.server (Python), llama.cpp's C++ server
START_SECONDS = 300  # a server's load, at most
INSTALL_LLAMA_SERVER = "ENGINES_LLAMA=1 bash scripts/setup-engines.sh (llama-cpp-python and its server's packages)"


def label(server: str, clients: int) -> str:
    return f"{server}, {clients} client{'s' if clients > 1 else ''}"


# -- the servers -------------------------------------------------------------------------------------------------
def _tree_kib(pid: int, key: str, pids: list[int] | None = None) -> int:
    """``key`` (VmRSS, VmHWM) summed over ``pid`` and its descendants, KiB (/proc; a process gone counts 0).
    ``pids``: the tree as read before (walking /proc reads every process's stat: 1 to 2 ms of the clients' process
    each time, under the GIL the clients time their chunks with)."""
    total = 0
    for each in pids if pids is not None else process_tree(pid):
        try:
            with open(f"/proc/{each}/status") as fh:
                total += next((int(line.split()[1]) for line in fh if line.startswith(key + ":")), 0)
        except OSError:
            continue
    return total


def _mb(kib: int) -> float:
    return kib * 1024 / 1e6


class _Server:
    """A server process on 127.0.0.1, its port and readiness; its standard error kept in a file for the error."""

    def __init__(
        self, name: str, command: list[str], log_path: Path, ready_path: str, port: int | None = None, extra=None
    ):
        self.name, self.ready_path, self.log_path = name, ready_path, log_path
        self.extra = extra or {}  # fields every request to it carries beside OpenAI's
        with open(log_path, "w") as stderr:
            self.process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True
            )
        self.port = port if port is not None else self._read_port()
        self._wait_ready()

    def _failed(self, what: str) -> RuntimeUnavailable:
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        return RuntimeUnavailable(f"{self.name} {what}: {lines[-1].strip()[:300] if lines else 'no message'}")

    def _read_port(self) -> int:
        line = self.process.stdout.readline()  # `gpt2onnx serve` prints one flushed line with its address
        found = re.search(r" at http://[^\s:]+:(\d+)", line)
        if not found:
            self.close()
            raise self._failed("did not start")
        return int(found.group(1))

    def _get(self, path: str) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._failed(f"exited ({self.process.returncode}) while loading")
            try:
                if self._get(self.ready_path)[0] == 200:
                    self.model = json.loads(self._get("/v1/models")[1])["data"][0]["id"]  # the name it answers to
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.close()
        raise self._failed(f"was not ready within {START_SECONDS} s")

    def memory(self) -> dict[str, float]:
        pid = self.process.pid
        return {"rss_mb": _mb(_tree_kib(pid, "VmRSS")), "hwm_mb": _mb(_tree_kib(pid, "VmHWM"))}

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()


def _ours(folder: Path, max_batch: int, tmp: Path) -> _Server:
    command = [sys.executable, "-m", "gpt2onnx", "serve", str(folder), "--endpoint", "openai", "--host", "127.0.0.1"]
    command += ["--port", "0", "--max-batch", str(max_batch), "--max-queue", "1024"]
    return _Server(OURS, command, tmp / "gpt2onnx-serve.log", "/ready")


def llama_server_python() -> str:
    """The engines' Python, where llama_cpp.server imports (RuntimeUnavailable, with how to install, where not)."""
    from gpt2onnx.runtimes.worker_process import ENGINES_PYTHON_ENV as PYTHON_ENV
    from gpt2onnx.runtimes.worker_process import engines_python

    python = engines_python()
    if python is None:
        raise RuntimeUnavailable(f"llama.cpp's server needs .venv-engines (or {PYTHON_ENV}): {INSTALL_LLAMA_SERVER}")
    probe = subprocess.run([python, "-I", "-c", "import llama_cpp.server.app"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeUnavailable(f"llama_cpp.server does not import in '{python}' ({why}): {INSTALL_LLAMA_SERVER}")
    return python


def _llama(python: str, gguf: Path, n_ctx: int, threads: int, tmp: Path) -> _Server:
    port = free_port()
    command = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    # one request at a time is this server's own way (a lock around its one context); a new request must not
    # interrupt the stream in flight (interrupt_requests, on by default)
    command += ["--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads)]
    command += ["--interrupt_requests", "False", "--verbose", "False"]
    return _Server(LLAMA, command, tmp / "llama-server.log", "/v1/models", port=port)


def _python_server(llama_server: Path | None) -> str | None:
    """The Python for llama_cpp.server; where it is missing beside a given llama-server binary, None (that row is
    left out, logged)."""
    try:
        return llama_server_python()
    except RuntimeUnavailable as err:
        if llama_server is None:
            raise
        log.warning("llama_cpp.server left out: %s", err)
        return None


def llama_server_binary(path: Path) -> Path:
    """llama.cpp's C++ server binary (--llama-server), checked: an executable regular file."""
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BadInput(
            f"--llama-server '{path}' is not an executable file: give llama.cpp's llama-server binary"
            " (ENGINES_LLAMA_SERVER=1 bash scripts/setup-engines.sh builds one)"
        )
    return path


def _llama_cpp(binary: Path, gguf: Path, n_ctx: int, parallel: int, threads: int, tmp: Path) -> _Server:
    port = free_port()
    command = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    # a slot per batch row, each the whole context; every core for decoding and prompts; no prompt cache in RAM
    command += ["--parallel", str(parallel), "--ctx-size", str(n_ctx * parallel), "--no-kv-unified"]
    command += ["--threads", str(threads), "--threads-batch", str(threads), "--cache-ram", "0"]
    # each slot keeps its last prompt's cache and reuses its longest common prefix (cache_prompt): the rounds repeat
    # the same 16 prompts, so a request would find its whole prompt cached; ours caches none: off, per request
    extra = {"cache_prompt": False}
    return _Server(LLAMA_CPP, command, tmp / "llama-cpp-server.log", "/health", port=port, extra=extra)


# -- the clients -------------------------------------------------------------------------------------------------
def completion_stream(
    port: int, model: str, prompt: str, new_tokens: int, eos: tuple[int, ...], extra: dict | None = None
) -> tuple[float, list[float]]:
    """One streaming /v1/completions request: its end-to-end seconds and each text chunk's arrival after sending;
    RuntimeUnavailable unless it ended with finish_reason "length" (exactly ``new_tokens`` tokens). ``extra``: a
    server's own fields beside OpenAI's."""
    body = {
        **(extra or {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "logit_bias": {str(t): -100 for t in eos},  # end-of-sequence barred: every request its full length
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    arrivals, reason = [], None
    try:
        sent = time.perf_counter()
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeUnavailable(f"the server answered HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter() - sent
            if line[6:].strip() == b"[DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeUnavailable(f"the server failed: {event['error']}")
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    arrivals.append(now)
                reason = choice.get("finish_reason") or reason
        end = time.perf_counter() - sent
    finally:
        connection.close()
    if reason != "length" or not arrivals:
        raise RuntimeUnavailable(f"a request ended with finish_reason {reason!r}, not 'length' after {new_tokens}")
    return end, arrivals


def _ms(values: list[float], q: float) -> float:
    return 1e3 * float(np.percentile(values, q)) if values else 0.0


def _load(server: _Server, clients: int, requests: int, new_tokens: int, eos) -> Callable[[], dict]:
    def run() -> dict:
        def client(index: int) -> list:
            picks = [PROMPTS[(index + r * clients) % len(PROMPTS)] for r in range(requests)]
            return [
                completion_stream(server.port, server.model, prompt, new_tokens, eos, server.extra) for prompt in picks
            ]

        peak, stop = [0], threading.Event()
        tree = process_tree(server.process.pid)  # a server starts no process under load: read once

        def sample() -> None:  # the server's resident memory under the load, every 20 ms
            while not stop.wait(0.02):
                peak[0] = max(peak[0], _tree_kib(server.process.pid, "VmRSS", tree))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.perf_counter()
        try:
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                done = [r for rs in pool.map(client, range(clients)) for r in rs]
        finally:
            seconds = time.perf_counter() - start
            stop.set()
            sampler.join()
        first = [arrivals[0] for _, arrivals in done]
        gaps = [b - a for _, arrivals in done for a, b in zip(arrivals, arrivals[1:])]
        ends = [end for end, _ in done]
        return {
            "requests_per_s": len(done) / seconds,
            "tokens_per_s": len(done) * new_tokens / seconds,
            "first_token_p50_ms": _ms(first, 50),
            "first_token_p99_ms": _ms(first, 99),
            "per_token_p50_ms": _ms(gaps, 50),
            "per_token_p99_ms": _ms(gaps, 99),
            "end_to_end_p50_ms": _ms(ends, 50),
            "end_to_end_p99_ms": _ms(ends, 99),
            "peak_rss_mb": _mb(max(peak[0], _tree_kib(server.process.pid, "VmRSS"))),
        }

    return run


# -- the report --------------------------------------------------------------------------------------------------
RATIO_FIGURES = ("tokens_per_s", "first_token_p99_ms", "per_token_p99_ms", "peak_rss_mb")


@dataclass(frozen=True)
class OpenAIServedReport(Record):
    folder: str
    gguf: str | None
    concurrency: tuple[int, ...]
    requests: int
    new_tokens: int
    max_batch: int
    servers: tuple[str, ...]
    memory: dict  # server -> {"at_rest": {rss_mb, hwm_mb}, "after": {rss_mb, hwm_mb}}
    rounds: Rounds

    json_computed = (computed("ratios", after="memory"),)

    @property
    def llamas(self) -> tuple[str, ...]:
        return tuple(s for s in self.servers if s in LLAMAS)

    def ratio(self, clients: int, figure: str, against: str = LLAMA) -> Spread | None:
        """gpt2onnx's figure over ``against``'s (a llama.cpp server) at ``clients``, round by round (both ran in
        each round)."""
        if against not in self.servers:
            return None
        ours = np.asarray(self.rounds.values(label(OURS, clients), figure))
        theirs = np.asarray(self.rounds.values(label(against, clients), figure))
        with np.errstate(divide="ignore", invalid="ignore"):
            return Spread.of(ours / theirs)

    def ratios(self) -> dict[str, dict[str, dict[str, Spread]]]:
        """Per llama.cpp server, per client count, gpt2onnx's figures over its (--json's "ratios")."""
        return {
            llama: {str(c): {f: self.ratio(c, f, llama) for f in RATIO_FIGURES} for c in self.concurrency}
            for llama in self.llamas
        }

    def table(self) -> str:
        """A row per concurrency and server: medians over the rounds."""
        head = ["clients", "server", "req/s", "output tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "peak RSS MB"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for clients in self.concurrency:
            for server in self.servers:
                name = label(server, clients)
                m = lambda f: self.rounds.spread(name, f).median  # noqa: E731
                lines.append(
                    f"| {clients} | {server} | {m('requests_per_s'):.2f} | {m('tokens_per_s'):.1f}"
                    f" | {m('first_token_p50_ms'):.0f} / {m('first_token_p99_ms'):.0f}"
                    f" | {m('per_token_p50_ms'):.1f} / {m('per_token_p99_ms'):.1f} | {m('peak_rss_mb'):.0f} |"
                )
        return "\n".join(lines) + "\n"

    def memory_lines(self) -> list[str]:
        return [
            f"{server}: at rest {m['at_rest']['rss_mb']:.0f} MB resident (peak {m['at_rest']['hwm_mb']:.0f}),"
            f" after the rounds {m['after']['rss_mb']:.0f} MB (peak {m['after']['hwm_mb']:.0f})"
            for server, m in self.memory.items()
        ]

    def ratio_lines(self) -> list[str]:
        """Per llama.cpp server and concurrency: ours over theirs, medians of the round-by-round ratios."""
        lines = []
        for llama in self.llamas:
            for c in self.concurrency:
                tps, ttft = self.ratio(c, "tokens_per_s", llama), self.ratio(c, "first_token_p99_ms", llama)
                itl, peak = self.ratio(c, "per_token_p99_ms", llama), self.ratio(c, "peak_rss_mb", llama)
                lines.append(
                    f"{c} client{'s' if c > 1 else ''}, beside {llama}: gpt2onnx's tokens/s ×{tps.median:.2f},"
                    f" TTFT p99 ×{ttft.median:.2f}, ITL p99 ×{itl.median:.2f}, peak memory ×{peak.median:.2f}"
                )
        return lines

    def markdown(self) -> str:
        against = f" beside llama.cpp's servers on {Path(self.gguf).name}" if self.gguf else ""
        lines = [
            f"{self.folder} behind gpt2onnx's OpenAI endpoint (--max-batch {self.max_batch}){against}: each client"
            f" sends {self.requests} streaming /v1/completions requests one after another, {self.new_tokens}"
            " tokens each, greedy.",
            "",
            self.table(),
            *[f"- {line}" for line in self.memory_lines()],
        ]
        lines += [f"- {line} (round by round)" for line in self.ratio_lines()]
        return "\n".join(lines) + "\n\nEvery figure, median (quartiles) over the rounds:\n\n" + self.rounds.markdown()


def bench_served_openai(
    folder: str | Path,
    *,
    gguf: str | Path | None = None,
    llama_server: str | Path | None = None,
    concurrency: tuple[int, ...] = (1, 4, 16),
    requests: int = 2,
    new_tokens: int = 64,
    max_batch: int = 16,
    warmup: int = 1,
    repeat: int = 2,
    json_path=None,
    markdown_path=None,
    progress: Callable[[], None] | None = None,
    before_writing: Callable[[], None] | None = None,
) -> OpenAIServedReport:
    """Serve ``folder`` with ``gpt2onnx serve`` (and ``gguf`` with llama.cpp's Python server, and with its C++
    ``llama_server`` binary where given) and load each with every level of ``concurrency``, in rotating rounds."""
    import tempfile

    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.artifact.generation import read_generation_config

    folder = Path(folder)
    check_output_files({"--json": json_path, "--md": markdown_path}, inputs=(folder,), files=(gguf, llama_server))
    if gguf is not None:
        gguf = Path(gguf)
        if not gguf.is_file():
            raise BadInput(f"--gguf '{gguf}' is not a file: give a GGUF of the folder's weights")
        with open(gguf, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise BadInput(f"--gguf '{gguf}' is not a GGUF file (no GGUF magic): give one llama.cpp reads")
    if llama_server is not None:
        if gguf is None:
            raise BadInput("--llama-server serves the --gguf file beside ours: give --gguf too")
        llama_server = llama_server_binary(Path(llama_server))
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= 256:
        raise BadInput(f"--max-batch {max_batch!r} is not an integer from 1 to 256: give one")
    model = open_folder(folder)
    eos = tuple(read_generation_config(folder, vocab_size=model.facts.vocab_size).eos_token_ids or ())
    python = _python_server(llama_server) if gguf is not None else None
    threads = os.cpu_count() or 1  # every core, as onnxruntime takes
    servers: dict[str, _Server] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="gpt2onnx-served-openai-") as tmp:
            servers[OURS] = _ours(folder, max_batch, Path(tmp))
            if python is not None:
                servers[LLAMA] = _llama(python, gguf, model.n_positions, threads, Path(tmp))
            if llama_server is not None:
                servers[LLAMA_CPP] = _llama_cpp(llama_server, gguf, model.n_positions, max_batch, threads, Path(tmp))
            at_rest = {name: server.memory() for name, server in servers.items()}
            log.info("at rest: %s", at_rest)
            variants = {}
            for clients in concurrency:
                for name, server in servers.items():
                    variants[label(name, clients)] = _load(server, clients, requests, new_tokens, eos)
            pids = [s.process.pid for s in servers.values()]
            rounds = interleave(
                variants,
                rounds=repeat,
                warmup=warmup,
                on_run=progress,
                own_pids=lambda: [p for pid in pids for p in process_tree(pid)],
            )
            after = {name: server.memory() for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.close()
    memory = {name: {"at_rest": at_rest[name], "after": after[name]} for name in servers}
    report = OpenAIServedReport(
        str(folder),
        None if gguf is None else str(gguf),
        tuple(concurrency),
        requests,
        new_tokens,
        max_batch,
        tuple(servers),
        memory,
        rounds,
    )
    return write_outputs(report, json_path=json_path, markdown_path=markdown_path, before_writing=before_writing)
