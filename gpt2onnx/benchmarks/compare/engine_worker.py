"""One engine's files and runs, in a worker process: llama.cpp (llama-cpp-python), OpenVINO GenAI, CTranslate2,
gpt2onnx's own folders (and the peer exporter optimum's) on gpt2onnx's runtimes, and PyTorch eager, all answering the
same requests so that `gpt2onnx compare` times them alike.

This file imports the standard library and numpy at the top, and an engine's package only when asked for that
engine: it runs as a script under the engines' Python (``.venv-engines``, scripts/setup-engines.sh), where gpt2onnx
is not installed; the "gpt2onnx", "optimum" and "pytorch" engines run under gpt2onnx's own Python.

Protocol (stdin/stdout, binary), as gpt2onnx.runtimes.genai_worker's: one JSON request per line; each answer one
JSON line, then, when the line has ``"npz": N``, N bytes of an .npz archive. Requests:

- ``{"op": "build", "engine", "checkpoint", "out", "format", "threads"}``: the engine's files from a Hugging Face
  folder;
- ``{"op": "open", "engine", "path", "threads", "cells", "rows"}`` (cells, rows: llama.cpp's cache);
- ``{"op": "generate", "batch": [[ids], ...], "new_tokens"}``: greedy, exactly that many new tokens per row
  (end-of-sequence never ends a row); answers the tokens, the engine call's seconds and ``step_seconds``, each
  decode step after the first token as the engine's own loop times it (new_tokens - 1 of them);
- ``{"op": "logits", "ids"}``: every position's logits, from an empty cache (the engines' only: gpt2onnx's folders
  are scored in gpt2onnx's own process, by eval's code);
- ``{"op": "memory"}``, ``{"op": "close"}``. An error answers ``{"error": "one line"}``.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# llama.cpp's converter with a BPE pre-tokenizer it does not know (any but the public tokenizers', the test
# fixture's 512-token BPE) registered as GPT-2's, whose regex every byte-level BPE of GPT-2's kind uses; harmless
# for the figures: the engines are fed token ids, never text. Run as a script: argv = src folder, converter args.
_CONVERT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as c
try:
    from conversion.base import TextModel
except ImportError:
    TextModel = c.TextModel
original = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError as e:
        print("NOTE: unknown BPE pre-tokenizer, registered as GPT-2's ('gpt-2')", flush=True)
        return "gpt-2"
TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [c.__file__] + sys.argv[2:]
c.main()
"""


def peak_bytes() -> int:
    """The process's peak resident memory (VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def llama_converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py, from the source scripts/setup-engines.sh built llama-cpp-python from."""
    found = sorted(Path(sys.prefix, "src").glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py is not under the engines' src/")
    return found[-1]


def _run(command: list) -> str:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise RuntimeError(f"{Path(str(command[0])).name} failed: {lines[-1] if lines else done.returncode}")
    return done.stdout + done.stderr


# -- building each engine's files from a Hugging Face folder ---------------------------------------------------
def build(engine: str, checkpoint: str, out: str, format: str, threads: int) -> dict:  # noqa: A002 - the request's key
    """The engine's files in ``format`` written to ``out`` (a file for GGUF, a folder otherwise), through a staging
    name first: an interrupted build leaves nothing that looks finished."""
    out_path = Path(out)
    stage = out_path.with_name(out_path.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True) if stage.is_dir() else stage.unlink(missing_ok=True)
    fmt, notes = format, []
    if engine == "llama.cpp":
        _build_gguf(Path(checkpoint), stage, fmt, threads, notes)
    elif engine == "ctranslate2":
        from ctranslate2.converters import TransformersConverter

        TransformersConverter(checkpoint).convert(str(stage), quantization=None if fmt == "float32" else fmt)
    elif engine == "openvino":
        cli = Path(sys.executable).with_name("optimum-cli")
        base = [cli, "export", "openvino", "--model", checkpoint, "--task", "text-generation-with-past"]
        args = ["--weight-format", fmt]
        try:
            _run([*base, *args, stage])
        except RuntimeError:
            if fmt != "int4":  # optimum-cli's --weight-format value
                raise
            # NNCF refuses a group size that a row's length is not a multiple of (small models): its own fallback
            args += ["--group-size-fallback", "adjust"]
            shutil.rmtree(stage, ignore_errors=True)
            _run([*base, *args, stage])
            notes.append("NNCF int4: a row length is not a multiple of the group size: --group-size-fallback adjust")
        (stage / "export-args.json").write_text(json.dumps(args))
    elif engine == "optimum":  # the peer exporter: optimum-cli beside this (gpt2onnx's) Python
        cli = Path(sys.executable).with_name("optimum-cli")
        args = ["--optimize", fmt] if fmt.startswith("O") else []  # O1 to O4: optimum's optimization levels
        _run([cli, "export", "onnx", "--model", checkpoint, "--task", "text-generation-with-past", *args, stage])
    elif engine == "pytorch":  # the checkpoint itself: its config and safetensors weights, linked
        _link_checkpoint(Path(checkpoint), stage)
    else:
        raise ValueError(f"no engine '{engine}' builds files")
    os.replace(stage, out_path)
    return {"ok": True, "notes": notes}


def _link_checkpoint(checkpoint: Path, out: Path) -> None:
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights:
        raise RuntimeError(f"'{checkpoint}' holds no .safetensors weights: PyTorch eager reads safetensors only")
    out.mkdir(parents=True)
    for source in (checkpoint / "config.json", *weights):
        try:
            os.link(source, out / source.name)
        except OSError:  # another file system
            shutil.copyfile(source, out / source.name)


def _build_gguf(checkpoint: Path, out: Path, fmt: str, threads: int, notes: list[str]) -> None:
    import llama_cpp

    # the quantized formats are made from one F32 file beside them, converted once and kept
    f32 = out.with_name("llama.cpp-F32.gguf")
    if fmt in ("F32", "F16") or not f32.exists():
        # the converter reads n_ctx, which transformers' GPT-2 config leaves out: a staging copy (links) with it
        stage = out.with_name(out.name + ".hf")
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        for item in checkpoint.iterdir():
            if item.is_file() and item.name != "config.json":
                (stage / item.name).symlink_to(item.resolve())
        config = json.loads((checkpoint / "config.json").read_text())
        config.setdefault("n_ctx", config["n_positions"])
        (stage / "config.json").write_text(json.dumps(config))
        script = stage / "convert.py"
        script.write_text(_CONVERT)
        converter = llama_converter()
        outtype = "f16" if fmt == "F16" else "f32"
        target = out if fmt in ("F32", "F16") else f32.with_name(f32.name + ".partial")
        said = _run([sys.executable, script, converter.parent, stage, "--outtype", outtype, "--outfile", target])
        shutil.rmtree(stage, ignore_errors=True)
        if target != out:
            os.replace(target, f32)
        notes += [line.removeprefix("NOTE: ") for line in said.splitlines() if line.startswith("NOTE: ")]
        if fmt in ("F32", "F16"):
            return
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + fmt)
    params.nthread = threads
    code = llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize {fmt} returned {code}")


# -- running them ---------------------------------------------------------------------------------------------
class _Llama:
    """llama.cpp through llama-cpp-python's C API: a sampler chain of end-of-sequence bias -inf and greedy, as
    llama-cli runs it; flash attention on; one sequence per row of a batch, decoded together."""

    def __init__(self, path: str, threads: int, cells: int = 4096, rows: int = 8):
        import llama_cpp
        from llama_cpp import Llama

        self.ll = llama_cpp
        # the model through Llama (its own context kept tiny); the context ours: `rows` sequences in one unified
        # cache of `cells` tokens (Llama() takes no sequence count)
        self.llm = Llama(
            model_path=path,
            n_ctx=32,
            n_batch=32,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=True,
            logits_all=False,
            verbose=False,
        )
        params = self.llm.context_params
        params.n_ctx, params.n_batch, params.n_ubatch = cells, cells, min(cells, 512)
        params.n_seq_max, params.kv_unified = rows, True
        self.model = self.llm.model
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {cells} cells for {rows} sequences")
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.eos = llama_cpp.llama_vocab_eos(vocab)
        self.version = llama_cpp.__version__
        self.info = {
            "flash_attn": True,
            "cells": cells,
            "sequences": rows,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        }

    def _clear(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def _decode(self, rows: list[list[int]], positions: list[int], want_logits: str) -> None:
        """One llama_decode of each row's tokens (row r is sequence r) from position ``positions[r]``; logits
        for every token (``"all"``) or each row's last (``"last"``)."""
        ll = self.ll
        count = sum(len(r) for r in rows)
        batch = ll.llama_batch_init(count, 0, len(rows))
        try:
            i = 0
            for seq, row in enumerate(rows):
                for j, token in enumerate(row):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, positions[seq] + j, 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = want_logits == "all" or j == len(row) - 1
                    i += 1
            batch.n_tokens = count
            code = ll.llama_decode(self.ctx, batch)
            if code != 0:
                raise RuntimeError(f"llama_decode returned {code}")
        finally:
            ll.llama_batch_free(batch)

    def _row_logits(self, index: int) -> np.ndarray:
        pointer = self.ll.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    def generate(self, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
        self._clear()
        out, steps = [[] for _ in batch], []
        rows, positions = [list(r) for r in batch], [0] * len(batch)
        ends = np.cumsum([len(r) for r in rows]) - 1
        for step in range(new_tokens):
            start = time.perf_counter()
            self._decode(rows, positions, "last")
            for seq, end in enumerate(ends):
                logits = self._row_logits(int(end))
                logits[self.eos] = -np.inf
                out[seq].append(int(logits.argmax()))
            if step > 0:  # step 0 is the prompt's
                steps.append(time.perf_counter() - start)
            if step == new_tokens - 1:
                break
            positions = [p + len(r) for p, r in zip(positions, rows)]
            rows, ends = [[o[-1]] for o in out], np.arange(len(out))
        return out, steps

    def logits(self, ids: list[int]) -> np.ndarray:
        self._clear()
        self._decode([list(ids)], [0], "all")
        return np.stack([self._row_logits(i) for i in range(len(ids))])


class _CTranslate2:
    def __init__(self, path: str, threads: int, **_):
        import ctranslate2

        self.vocab = json.loads((Path(path) / "vocabulary.json").read_text())
        self.generator = ctranslate2.Generator(path, device="cpu", intra_threads=threads, inter_threads=1)
        self.version = ctranslate2.__version__
        self.info = {"compute_type": self.generator.compute_type}

    def generate(self, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
        tokens = [[self.vocab[i] for i in row] for row in batch]
        seen: dict[int, float] = {}  # step → when its first token came out of the token stream

        def on_token(result) -> bool:
            seen.setdefault(result.step, time.perf_counter())
            return False  # go on

        results = self.generator.generate_batch(
            tokens,
            max_length=new_tokens,
            min_length=new_tokens,
            include_prompt_in_result=False,
            sampling_topk=1,
            callback=on_token,
        )
        times = [seen[k] for k in sorted(seen)]
        return [list(r.sequences_ids[0]) for r in results], [b - a for a, b in zip(times, times[1:])]

    def logits(self, ids: list[int]) -> np.ndarray:
        tokens = [[self.vocab[i] for i in ids]]
        return np.array(self.generator.forward_batch(tokens), dtype=np.float32)[0]


class _OpenVino:
    """OpenVINO GenAI's LLMPipeline (SDPA backend) for generation; the IR compiled by OpenVINO itself for logits."""

    def __init__(self, path: str, threads: int, **_):
        import openvino as ov
        import openvino_genai as og

        self.ov, self.og = ov, og
        self.properties = {"INFERENCE_NUM_THREADS": threads, "ATTENTION_BACKEND": "SDPA"}
        self.pipe = og.LLMPipeline(path, "CPU", **self.properties)
        self.path, self.threads, self.compiled = Path(path), threads, None
        core = ov.Core()
        self.version = f"{ov.__version__.split('-')[0]} (genai {og.__version__})"
        self.info = {
            "properties": self.properties,
            "inference_precision": str(core.get_property("CPU", "INFERENCE_PRECISION_HINT")),
        }

    def _config(self, new_tokens: int):
        config = self.pipe.get_generation_config()
        config.max_new_tokens = config.min_new_tokens = new_tokens
        config.ignore_eos, config.do_sample, config.num_beams = True, False, 1
        config.repetition_penalty = 1.0
        return config

    def generate(self, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
        ids = np.array(batch, dtype=np.int64)
        inputs = self.og.TokenizedInputs(self.ov.Tensor(ids), self.ov.Tensor(np.ones_like(ids)))
        result = self.pipe.generate(inputs, self._config(new_tokens))
        return [[int(t) for t in row][-new_tokens:] for row in result.tokens], self._steps(result.perf_metrics)

    @staticmethod
    def _steps(metrics) -> list[float]:
        """Each decode step's seconds from GenAI's perf metrics (what get_tpot() averages): its durations, in
        microseconds, are per token, a step's time over the rows it made a token for, once per token (or, in
        some versions, once per step): a step's time is the sum of its tokens' durations."""
        raw = metrics.raw_metrics
        durations, sizes = [float(d) * 1e-6 for d in raw.m_durations], [int(b) for b in raw.m_batch_sizes][1:]
        if len(durations) == len(sizes):  # one a step
            return [d * b for d, b in zip(durations, sizes)]
        steps, start = [], 0
        for b in sizes:
            steps.append(sum(durations[start : start + b]))
            start += b
        return steps

    def logits(self, ids: list[int]) -> np.ndarray:
        if self.compiled is None:
            core = self.ov.Core()
            model = core.read_model(self.path / "openvino_model.xml")
            self.compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": self.threads})
        request = self.compiled.create_infer_request()
        request.reset_state()
        n = len(ids)
        names = {port.get_any_name() for port in self.compiled.inputs}
        feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64)}
        if "position_ids" in names:
            feed["position_ids"] = np.arange(n, dtype=np.int64)[None]
        if "beam_idx" in names:
            feed["beam_idx"] = np.zeros(1, np.int32)
        request.infer(feed)
        return np.array(request.get_tensor("logits").data, dtype=np.float32)[0]


class _Gpt2onnx:
    """An exported folder on gpt2onnx's own onnxruntime runtime and decode loop (under gpt2onnx's Python)."""

    def __init__(self, path: str, threads: int, runtime: str = "onnxruntime", **_):
        from importlib.metadata import version

        from gpt2onnx.artifact.folder import open_folder
        from gpt2onnx.runtimes.all_runtimes import open_runtime, runtime_options

        self.runner = open_runtime(open_folder(path), runtime_options([runtime], {"--threads": threads})[0])
        self.version = version("onnxruntime-gpu" if runtime == "onnxruntime" else runtime)
        self.info = {"runtime": runtime, "provider": self.runner.provider}

    def generate(self, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
        from gpt2onnx.decoding.generate import decode

        # no end-of-sequence id: every row runs all its steps, as the engines with theirs suppressed
        done = decode(self.runner, np.array(batch, np.int64), max_new_tokens=new_tokens)
        return done.tokens.tolist(), list(done.step_seconds[1:])  # [0]: the prompt step


class _PyTorch:
    """The reference itself: transformers' GPT2LMHeadModel (its default attention) and its greedy generate()."""

    def __init__(self, path: str, threads: int, **_):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.GPT2LMHeadModel.from_pretrained(path, use_safetensors=True, local_files_only=True)
        self.model.eval()
        self.version = f"transformers {transformers.__version__}, torch {torch.__version__}"
        self.info = {"attention": self.model.config._attn_implementation}

    def generate(self, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
        ids = self.torch.tensor(batch)
        times = _Stamps()
        with self.torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=self.torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # every row runs all its steps, as the engines with theirs suppressed
                pad_token_id=self.model.config.eos_token_id,
                streamer=times,
            )
        new = times.stamps[1:]  # [0]: the prompt, handed over before the first step
        return out[:, ids.shape[1] :].tolist(), [b - a for a, b in zip(new, new[1:])]

    def logits(self, ids: list[int]) -> np.ndarray:
        with self.torch.inference_mode():
            return self.model(self.torch.tensor([ids])).logits[0].float().numpy()


class _Stamps:
    """A streamer for transformers' generate(): when each step's tokens came out (put is called with the prompt,
    then once a step)."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


ENGINES = {
    "llama.cpp": _Llama,
    "ctranslate2": _CTranslate2,
    "openvino": _OpenVino,
    "gpt2onnx": _Gpt2onnx,
    "pytorch": _PyTorch,
}


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
    engine = None
    for line in inp:
        try:
            request = json.loads(line)
            op = request.pop("op")
            if op == "build":
                _answer(out, build(**request))
            elif op == "open":
                engine = ENGINES[request.pop("engine")](**request)
                _answer(out, {"ok": True, "version": engine.version, "info": engine.info})
            elif op == "generate":
                start = time.perf_counter()
                tokens, steps = engine.generate(request["batch"], int(request["new_tokens"]))
                seconds = time.perf_counter() - start
                _answer(out, {"tokens": tokens, "seconds": seconds, "step_seconds": steps})
            elif op == "logits":
                _answer(out, {"ok": True}, {"logits": engine.logits(request["ids"])})
            elif op == "memory":
                _answer(out, {"peak_bytes": peak_bytes()})
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
