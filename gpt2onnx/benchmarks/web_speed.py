"""Tokens per second in the browser (`gpt2onnx bench web`): the same greedy generation from the same prompt in
headless Chromium (transformers.js on onnxruntime-web's wasm build, the page gpt2onnx's web target writes, served
cross-origin isolated by gpt2onnx's own server), in Node (transformers.js on onnxruntime-node) and in Python
(gpt2onnx's decode loop on onnxruntime), each at every thread count, in the harness's rotating rounds.

requires: an exported folder with tokenizer files (deployed for the web into a temporary folder), Node.js, and
the npm packages of tests/js (transformers.js, playwright-core; scripts/setup.sh installs them from the lock file)
with Chromium for the browser rows. ensures, per run and round: decode tokens per second (new tokens − 1 over the
time from the first to the last new token, as the page's streamer times them) and the time to the first token,
and that every runtime wrote the same tokens (checked on each run).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpt2onnx.artifact.paths import check_output_files
from gpt2onnx.benchmarks.harness import Rounds, interleave, process_tree, write_outputs
from gpt2onnx.errors import BadInput, CheckFailed, RuntimeUnavailable
from gpt2onnx.records import Record, computed

JS = Path(__file__).resolve().parents[2] / "tests" / "js"
PROMPT = "The quick brown fox jumps over the lazy dog. In the browser, the model"
INSTALL = "bash scripts/setup.sh installs Node's packages into tests/js (and Chromium where it runs as root)"


class _Browser:
    """tests/js/browser.mjs: one headless Chromium, a fresh page per request."""

    def __init__(self, url: str):
        self.url = url
        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block the driver
        self.process = subprocess.Popen(
            ["node", "browser.mjs"], cwd=JS, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        if not self.process.stdout.readline():
            raise RuntimeUnavailable(f"the browser did not start ({self._said()}): {INSTALL}")

    def _said(self) -> str:
        self.log.seek(0)
        lines = self.log.read().strip().splitlines()
        return lines[-1][:200] if lines else "it said nothing"

    def run(self, query: dict) -> dict:
        request = {"url": self.url + "?" + urllib.parse.urlencode(query), "timeout_ms": 600_000}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeUnavailable(f"the browser driver exited: {self._said()}")
        result = json.loads(line)
        if result.get("done") != "true":
            raise RuntimeUnavailable(f"the page failed in Chromium: {result.get('error', 'no answer')}")
        stats = result["stats"]
        return {
            "decode_tokens_per_s": float(stats["decodeTokensPerSecond"]),
            "first_token_ms": float(stats["firstTokenMs"]),
            "ids": [int(i) for i in stats["ids"].split(",")],
        }

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def _node(folder: Path, dtype: str, threads: int, new_tokens: int) -> dict:
    """tests/js/speed.mjs: a warm-up and one timed generation in a fresh Node process."""
    args = ["node", "speed.mjs", str(folder), dtype, PROMPT, str(new_tokens), str(threads), "2"]
    done = subprocess.run(args, cwd=JS, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise RuntimeUnavailable(f"transformers.js in Node failed: {lines[-1] if lines else done.returncode}")
    run = json.loads(done.stdout.strip().splitlines()[-1])["runs"][-1]
    return {
        "decode_tokens_per_s": run["decode_tokens_per_s"],
        "first_token_ms": run["first_token_ms"],
        "ids": run["ids"],
    }


def _python(runner, tokenizer, new_tokens: int) -> dict:
    import numpy as np

    from gpt2onnx.decoding.generate import decode

    result = decode(runner, np.asarray([tokenizer.encode(PROMPT)]), max_new_tokens=new_tokens)
    steps = result.step_seconds
    return {
        "decode_tokens_per_s": (len(steps) - 1) / sum(steps[1:]),
        "first_token_ms": 1e3 * steps[0],
        "ids": [int(i) for i in result.tokens[0]],
    }


@dataclass(frozen=True)
class WebReport(Record):
    folder: str
    precision: str
    new_tokens: int
    same_tokens: bool
    rounds: Rounds  # decode_tokens_per_s, first_token_ms

    prompt = PROMPT
    json_computed = (computed("prompt", after="new_tokens"),)

    def markdown(self) -> str:
        return (
            f"{self.folder} ({self.precision}), greedy, {self.new_tokens} new tokens from {PROMPT!r}; the same tokens"
            f" everywhere: {'yes' if self.same_tokens else 'NO'}.\n\n" + self.rounds.markdown()
        )


def bench_web(
    folder: str | Path,
    *,
    threads: tuple[int, ...] = (1, 2),
    new_tokens: int = 64,
    warmup: int = 1,
    repeat: int = 3,
    browser: bool = True,
    json_path=None,
    markdown_path=None,
    progress: Callable[[], None] | None = None,
    before_writing: Callable[[], None] | None = None,
) -> WebReport:
    """The folder deployed for the web and run in Chromium, Node and Python at each thread count, round by round."""
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.decoding.prompts import load_tokenizer
    from gpt2onnx.precisions.all_precisions import precision_of
    from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime
    from gpt2onnx.runtimes.providers import ProviderConfig
    from gpt2onnx.targets.deploy import deploy
    from gpt2onnx.targets.web_server import open_server

    check_output_files({"--json": json_path, "--md": markdown_path}, inputs=(Path(folder),))
    if not threads or any(t < 1 for t in threads):
        raise BadInput(f"threads (--threads) must be counts of 1 or more, got {threads}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise BadInput(f"new tokens (--new-tokens) must be an integer of at least 2, got {new_tokens!r}")
    if shutil.which("node") is None or not (JS / "node_modules" / "@huggingface" / "transformers").is_dir():
        raise RuntimeUnavailable(f"bench web needs Node.js and transformers.js in tests/js: {INSTALL}")
    model = open_folder(folder)
    precision = precision_of(model.facts)
    short = precision.short
    if precision.transformers_js is None:
        raise BadInput(f"'{folder}' is {short}: transformers.js has no dtype for it; bench web runs the others")
    tokenizer = load_tokenizer(model.folder)
    runners = {t: open_runtime(model, RuntimeOptions(settings=ProviderConfig(threads=t))) for t in threads}
    tokens: dict[str, list[int]] = {}

    def keep(name: str, run: Callable[[], dict]) -> Callable[[], dict]:
        def figures() -> dict:
            result = run()
            tokens.setdefault(name, result["ids"])
            if result["ids"] != tokens[name]:
                raise CheckFailed(f"{name} wrote other tokens from one run to the next")
            return {"decode_tokens_per_s": result["decode_tokens_per_s"], "first_token_ms": result["first_token_ms"]}

        return figures

    browser_process = None
    try:
        with tempfile.TemporaryDirectory(prefix="gpt2onnx-web-") as tmp:
            web = Path(tmp) / model.folder.name
            deploy(model.folder, "web", out=web)
            dtype = precision.transformers_js[0]
            with open_server(web, port=0, background=True) as server:
                if browser:
                    browser_process = _Browser(server.url)
                variants = {}
                for t in threads:
                    if browser:
                        query = {"prompt": PROMPT, "max_new_tokens": new_tokens, "backend": "wasm", "threads": t}
                        variants[f"Chromium wasm, {t} thread(s)"] = lambda q=query: browser_process.run(q)
                    variants[f"Node, {t} thread(s)"] = lambda t=t: _node(web, dtype, t, new_tokens)
                    variants[f"Python, {t} thread(s)"] = lambda t=t: _python(runners[t], tokenizer, new_tokens)
                names = list(variants)
                driver = browser_process.process.pid if browser_process else None  # it and its Chromium: ours
                rounds = interleave(
                    {n: keep(n, r) for n, r in variants.items()},
                    rounds=repeat,
                    warmup=warmup,
                    baseline=names[-1],
                    on_run=progress,
                    own_pids=(lambda: process_tree(driver)) if driver else None,
                )
    finally:
        if browser_process is not None:
            browser_process.close()
        for runner in runners.values():
            runner.close()
    same = len({tuple(ids) for ids in tokens.values()}) == 1
    report = WebReport(str(folder), short, new_tokens, same, rounds)
    return write_outputs(report, json_path=json_path, markdown_path=markdown_path, before_writing=before_writing)
