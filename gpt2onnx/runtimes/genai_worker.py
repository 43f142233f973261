"""onnxruntime-genai's generation loop on one prompt, in-process or as a worker process.

This file imports only the standard library, numpy and onnxruntime_genai, never gpt2onnx: it runs as a
script under the Python of an isolated environment (``.venv-genai``), because the onnxruntime-genai wheel
installs the CPU onnxruntime over onnxruntime-gpu. gpt2onnx.runtimes.genai imports it directly when
onnxruntime_genai is importable in its own process.

The worker protocol (stdin/stdout, binary): one JSON request per line; each answer is one JSON line, then,
when the line has ``"npz": N``, N bytes of an .npz archive with the arrays (``logits_0``, ``logits_1``, …).
Requests: ``{"op": "open", "folder": F}``, ``{"op": "adapter", "path": P}`` (a LoRA adapter file loaded, once),
``{"op": "run", ...run_loop's arguments, "adapter": P or null...}``, ``{"op": "close"}``.
An error answers ``{"error": "one line"}``.
"""

from __future__ import annotations

import io
import json
import resource
import sys
import time

import numpy as np


def open_model(folder: str):
    import onnxruntime_genai as og

    return og.Model(folder)


class Adapters:
    """genai's Adapters of one model: each LoRA adapter file (onnxruntime's adapter format) loaded once, named by
    its path; a run makes one active on its generator (genai's multi-LoRA)."""

    def __init__(self, model):
        self.model, self.loaded = model, None

    def load(self, path: str) -> None:
        import onnxruntime_genai as og

        if self.loaded is None:
            self.loaded = (og.Adapters(self.model), set())
        adapters, names = self.loaded
        if path not in names:
            adapters.load(path, path)
            names.add(path)

    def activate(self, generator, path: str | None) -> None:
        """Make the adapter file ``path`` (loaded) active on ``generator``; None: the base (the slots' defaults)."""
        if path is not None:
            self.load(path)
            generator.set_active_adapter(self.loaded[0], path)


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_loop(
    model,
    prompt,
    *,
    max_new_tokens,
    forced=None,
    return_logits=False,
    search=None,
    max_length=None,
    adapter=None,
    adapters=None,
) -> dict:
    """Greedy (or ``search``'s sampling) continuation of one prompt on genai's own loop.

    ``forced``: tokens appended one at a time instead of the loop's choices (parity's lockstep): the prompt's
    logits come right after append_tokens, then one decode step per forced token (len(forced) + 1 passes).
    Otherwise the loop runs ``max_new_tokens`` generate_next_token calls (it stops early at end-of-sequence).
    ``max_length``: genai's total length limit (default: what the run needs, plus one).
    ``adapter``: the path of a LoRA adapter file active on this run, from ``adapters`` (:class:`Adapters`).
    Returns {"tokens", "step_seconds" ([0]: prompt step), "logits" (per forward pass, [positions, vocab])}, and
    "sequences" (the returned beams' new tokens, best first) when ``search`` asks for beams.
    """
    import onnxruntime_genai as og

    new = len(forced) if forced is not None else max_new_tokens
    params = og.GeneratorParams(model)
    params.set_search_options(
        **{"do_sample": False, **(search or {}), "max_length": max_length or len(prompt) + new + 1, "batch_size": 1}
    )
    generator = og.Generator(model, params)
    if adapter is not None:
        adapters.activate(generator, adapter)  # before the prompt: every pass runs with its factors
    tokens, seconds, logits = [], [], []

    def keep():
        if return_logits:
            logits.append(np.array(generator.get_output("logits"), dtype=np.float32)[0])

    start = time.perf_counter()
    generator.append_tokens(np.array([prompt], dtype=np.int32))  # runs the prompt
    if forced is not None:
        seconds.append(time.perf_counter() - start)
        keep()
        for token in forced:
            start = time.perf_counter()
            generator.append_tokens(np.array([[token]], dtype=np.int32))  # one decode step on the forced token
            seconds.append(time.perf_counter() - start)
            keep()
        return {"tokens": list(forced), "step_seconds": seconds, "logits": logits}
    beams = int((search or {}).get("num_beams", 1))
    if beams > 1:  # genai's own beam search: run it out, then read the best beams (new tokens only)
        while len(seconds) < max_new_tokens and not generator.is_done():
            generator.generate_next_token()
            seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
        count = int(search.get("num_return_sequences", 1))
        sequences = [[int(t) for t in generator.get_sequence(i)[len(prompt) :]] for i in range(count)]
        return {"tokens": sequences[0], "step_seconds": seconds, "logits": logits, "sequences": sequences}
    while len(tokens) < max_new_tokens and not generator.is_done():
        generator.generate_next_token()  # first call: picks from the prompt's logits; later: one decode step
        seconds.append(time.perf_counter() - start)
        keep()
        tokens.append(int(generator.get_next_tokens()[0]))
        start = time.perf_counter()
    return {"tokens": tokens, "step_seconds": seconds, "logits": logits}


def _answer(out, header: dict, arrays: dict | None = None) -> None:
    blob = b""
    if arrays:
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        blob = buffer.getvalue()
        header["npz"] = len(blob)
    out.write(json.dumps(header).encode() + b"\n" + blob)
    out.flush()


def serve(inp=None, out=None) -> None:
    """Answer requests until "close" or end of input."""
    inp, out = inp or sys.stdin.buffer, out or sys.stdout.buffer
    model = adapters = None
    for line in inp:
        try:
            request = json.loads(line)
            op = request.pop("op")
            if op == "open":
                import onnxruntime_genai as og

                model = open_model(request["folder"])
                adapters = Adapters(model)
                _answer(out, {"ok": True, "version": og.__version__, "peak_bytes": peak_bytes()})
            elif op == "adapter":
                adapters.load(request["path"])
                _answer(out, {"ok": True})
            elif op == "run":
                result = run_loop(model, request.pop("prompt"), adapters=adapters, **request)
                arrays = {f"logits_{i}": a for i, a in enumerate(result.pop("logits"))}
                _answer(out, {**result, "peak_bytes": peak_bytes()}, arrays)
            elif op == "close":
                _answer(out, {"ok": True})
                return
            else:
                _answer(out, {"error": f"unknown request '{op}'"})
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller as one line
            text = str(exc).strip().splitlines()
            _answer(out, {"error": f"{type(exc).__name__}: {text[0] if text else ''}"})


if __name__ == "__main__":
    serve()
