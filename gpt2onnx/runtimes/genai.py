"""The onnxruntime-genai runtime: genai's own C++ generation loop on the folder's genai_config.json.

- The config: always the one the genai deployment target writes (:mod:`gpt2onnx.artifact.genai_config`, from the
  graph and the configs), in a temporary overlay (the model files linked, the config beside them); the folder is
  left untouched, and its own genai_config.json, if any, is never passed to genai.
- Where genai runs: in this process when ``import onnxruntime_genai`` works here; otherwise in a worker
  process (:mod:`gpt2onnx.runtimes.genai_worker`, numpy and onnxruntime_genai only) under the Python named by
  the environment variable ``GPT2ONNX_GENAI_PYTHON``, else ``<repo>/.venv-genai/bin/python`` beside this
  package (scripts/setup.sh creates it). The isolation is on purpose: the onnxruntime-genai wheel installs
  the CPU onnxruntime over onnxruntime-gpu.
- genai runs one prompt at a time here (it pads batches on the right, our contract pads on the left): a batch
  is run row by row. It exposes logits but no presents.
- Its search options: what its loop can do as transformers does (:func:`genai_search`); the rest is refused.
- A switchable LoRA adapter (``--adapter``): its NAME.onnx_adapter file, checked against the graph's slots, loaded
  into genai's ``Adapters`` once and made active on each run's generator (``set_active_adapter``, genai's
  multi-LoRA): genai feeds its factors to the graph's slots as onnxruntime's runtime binds them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from gpt2onnx.artifact import genai_config as config_writer
from gpt2onnx.artifact.folder import ModelFolder
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.artifact.lora import slot_inputs
from gpt2onnx.capabilities import Lacks, Need, resolve
from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.generation_options import (
    BEAMS_WITH_PENALTY,
    BEAMS_WITH_STOP,
    CONSTRAINED,
    EARLY_STOPPING_NEVER,
    MIN_NEW_TOKENS,
    NO_REPEAT_NGRAM,
    SAMPLED_SEQUENCES,
    Decoding,
    Sampling,
    request_declared,
)
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.runtimes.decoder import file_shape, read_adapter
from gpt2onnx.runtimes.runtime import Capabilities, Continuations, LoopResult, LoopRuntime, RuntimeSpec, ThreadSettings
from gpt2onnx.runtimes.worker_process import WorkerProcess

CONFIG_FILE = config_writer.CONFIG_NAME
PYTHON_ENV = "GPT2ONNX_GENAI_PYTHON"
INSTALL = (
    "python3 -m venv .venv-genai && .venv-genai/bin/pip install onnxruntime-genai numpy (or: bash scripts/setup.sh),"
    f" or set {PYTHON_ENV} to a Python that has onnxruntime_genai"
)
WORKER = Path(__file__).with_name("genai_worker.py")
TIMEOUT_ENV = "GPT2ONNX_GENAI_TIMEOUT"
WORKER_TIMEOUT = 900.0  # seconds a worker may take to answer one request (opening the model, or one generation)


def worker_timeout() -> float:
    """How long to wait for the worker's answer: $GPT2ONNX_GENAI_TIMEOUT seconds, else WORKER_TIMEOUT."""
    given = os.environ.get(TIMEOUT_ENV)
    if not given:
        return WORKER_TIMEOUT
    try:
        seconds = float(given)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise BadInput(f"{TIMEOUT_ENV} '{given}' is not a number of seconds above 0: set it to one, or unset it")
    return seconds


class GenaiSettings(ThreadSettings):
    """genai's settings: its intra-op thread count (None: genai's default)."""


def genai_config(model: ModelFolder, *, threads: int | None = None) -> dict:
    """The folder's genai_config.json as the genai deployment target writes it (:mod:`gpt2onnx.artifact.genai_config`),
    with ``threads`` as genai's intra-op thread count."""
    config = config_writer.genai_config(model.folder, filename=model.model_path.name)
    if threads:
        config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    return config


def config_folder(model: ModelFolder, tmp: Path, *, threads: int | None = None) -> tuple[Path, bool]:
    """The folder genai opens: always an overlay in ``tmp`` holding the config we write (from the graph and the
    configs, :mod:`gpt2onnx.artifact.genai_config`) and exactly the files the graph loads (model.onnx and the
    external data it names, checked to lie inside the folder), each a link to the descriptor the folder check
    hashed (:meth:`ModelFolder.place_files`: /proc/PID/fd/N of this process, which genai's worker, run by the same
    user, opens too), so genai loads the bytes checked. The folder's own genai_config.json is never passed to
    genai: its session options could load a library (custom_ops_library), write files (enable_profiling) or run
    another model (decoder.filename). Returns (folder, True)."""
    overlay = tmp / model.folder.name
    overlay.mkdir(parents=True)
    model.place_files(overlay)
    (overlay / CONFIG_FILE).write_text(json.dumps(genai_config(model, threads=threads), indent=2) + "\n")
    return overlay, True


def genai_python() -> str | None:
    """The Python the worker runs under: $GPT2ONNX_GENAI_PYTHON, else <repo>/.venv-genai/bin/python if present."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    candidate = Path(__file__).resolve().parents[2] / ".venv-genai" / "bin" / "python"
    return str(candidate) if candidate.exists() else None


def in_process() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def open_runtime(model: ModelFolder, settings: GenaiSettings) -> "GenaiRunner":
    shape = file_shape(model.model_path, model.n_positions)
    if shape.kv_dtype not in ("float32", "float16"):
        raise RuntimeUnavailable(f"onnxruntime-genai cannot run a {shape.kv_dtype} cache")
    tmp = Path(tempfile.mkdtemp(prefix="gpt2onnx-genai-"))
    try:
        folder, overlay = config_folder(model, tmp, threads=settings.threads)
        backend = _InProcess(folder) if in_process() else _Worker(folder)
    except BaseException as err:
        try:
            if isinstance(err, Exception):
                model.check_unchanged()  # the folder changed under the load: that is the reason, said as such
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        model.check_unchanged()  # the bytes checked are the bytes genai loaded
    except BaseException:
        backend.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return GenaiRunner(backend, shape, model, tmp=tmp, overlay=overlay)


class GenaiRunner(LoopRuntime):
    """The :class:`~gpt2onnx.runtimes.runtime.LoopRuntime` interface on onnxruntime-genai."""

    runtime = "genai"
    capabilities = Capabilities(owns_loop=True, presents=False, adapters=True)

    def __init__(self, backend, shape, model: ModelFolder, *, tmp: Path, overlay: bool):
        self.backend, self.shape, self.tmp, self.model_path = backend, shape, tmp, model.model_path
        self.adapter: str | None = None  # the active LoRA adapter file's path (activate_adapter); None: the base
        self._slots: set[str] | None = None  # the graph's LoRA slots, read on the first activate_adapter
        self.n_layer, self.vocab_size, self.n_positions = shape.n_layer, shape.vocab_size, model.n_positions
        self.provider = "cpu"
        self.config_written = overlay  # always True: genai_config.json is written by us for every run
        self.version = backend.version
        self.mode = backend.mode  # "in-process" or "worker (<python>)"

    def activate_adapter(self, path: Path | None) -> None:
        """Make a LoRA adapter file (onnxruntime's adapter format) active on every later run, as the onnxruntime
        runtime binds it: checked against the graph's slots (one line for a damaged file or another model's),
        loaded into genai once, set active on each run's generator; None: the base (the slots' defaults)."""
        if path is not None:
            if self._slots is None:  # the graph read once, without its weights
                self._slots = set(slot_inputs(load_graph(self.model_path)))
            read_adapter(path, self._slots)
            self.backend.load_adapter(str(path))
        self.adapter = None if path is None else str(path)

    def run_loop(self, prompt, *, max_new_tokens, forced=None, return_logits=False, search=None) -> LoopResult:
        """One prompt through genai's loop: greedy (or ``search``, genai's options), or ``forced`` tokens."""
        needed = len(prompt) + (len(forced) if forced is not None else max_new_tokens)
        self.check_length(needed)
        request = {
            "max_length": min(needed + 1, self.n_positions) if self.n_positions else needed + 1,
            "prompt": [int(t) for t in prompt],
            "max_new_tokens": int(max_new_tokens),
            "forced": None if forced is None else [int(t) for t in forced],
            "return_logits": return_logits,
            "search": search or {},
            "adapter": self.adapter,
        }
        out = self.backend.run(request)
        return LoopResult(
            out["tokens"], out["step_seconds"], out.get("logits", []), out.get("peak_bytes"), out.get("sequences", [])
        )

    def continue_prompts(self, prompts, *, max_new_tokens, sampling, decoding, eos_token_ids) -> Continuations:
        """Each prompt on its own (genai pads on the right, our batches are left-padded); ``step_seconds[k]`` is
        the sum over prompts of step k. Beam search runs genai's own; its scores are not exposed."""
        search = genai_search(sampling, decoding, self.vocab_size)
        sequences, seconds = [], []
        for prompt in prompts:
            result = self.run_loop(prompt, max_new_tokens=max_new_tokens, search=search)
            found = result.sequences or [result.tokens]
            if (
                result.sequences and eos_token_ids
            ):  # genai's finished beams leave out their eos; transformers' end on it
                eos = eos_token_ids[0]
                found = [t + [eos] if len(t) < max_new_tokens and t[-1:] != [eos] else t for t in found]
            sequences.append(found)
            seconds += [0.0] * (len(result.step_seconds) - len(seconds))
            for k, value in enumerate(result.step_seconds):
                seconds[k] += value
        return Continuations(sequences, seconds)

    def close(self) -> None:
        self.backend.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _InProcess:
    def __init__(self, folder: Path):
        import onnxruntime_genai as og

        from gpt2onnx.runtimes import genai_worker

        self.worker, self.version, self.mode = genai_worker, og.__version__, "in-process"
        try:
            self.model = genai_worker.open_model(str(folder))
        except Exception as exc:  # noqa: BLE001 - genai raises RuntimeError/ValueError for configs and graphs
            raise RuntimeUnavailable(
                f"onnxruntime-genai cannot open '{folder}': {str(exc).strip().splitlines()[0]}"
            ) from None
        self.adapters = genai_worker.Adapters(self.model)

    def load_adapter(self, path: str) -> None:
        try:
            self.adapters.load(path)
        except Exception as exc:  # noqa: BLE001 - genai raises RuntimeError for a file it cannot load
            raise BadInput(f"onnxruntime-genai cannot load the adapter '{path}': {_first_line(exc)}") from None

    def run(self, request: dict) -> dict:
        return self.worker.run_loop(self.model, request.pop("prompt"), adapters=self.adapters, **request)

    def close(self) -> None:
        self.adapters = self.model = None  # the adapters before the model they were loaded into


class _Worker:
    """genai in a child process under the genai Python, one JSON line per request (see genai_worker)."""

    def __init__(self, folder: Path):
        self.worker: WorkerProcess | None = None
        python = genai_python()
        if python is None:
            raise RuntimeUnavailable(f"onnxruntime-genai is not installed: {INSTALL}")
        try:
            self.worker = WorkerProcess(
                python,
                WORKER,
                name="the genai worker",
                timeout=worker_timeout(),
                python_hint=f"{PYTHON_ENV} must name a Python that has onnxruntime_genai",
                timeout_hint=f"set {TIMEOUT_ENV} to wait longer",
            )
        except OSError as exc:
            raise RuntimeUnavailable(f"the genai Python '{python}' cannot start ({exc.strerror}): {INSTALL}") from None
        self.mode, self.python = f"worker ({python})", python
        try:
            answer = self._ask({"op": "open", "folder": str(folder)})
        except RuntimeUnavailable as exc:
            self.close()
            if str(exc).startswith(f"'{python}' answered") or "gave no answer" in str(exc):
                raise
            if "ModuleNotFoundError" in str(exc):
                raise RuntimeUnavailable(f"onnxruntime-genai is not installed in '{python}': {INSTALL}") from None
            raise RuntimeUnavailable(f"onnxruntime-genai cannot open '{folder}': {exc}") from None
        self.version = answer["version"]

    def _ask(self, request: dict) -> dict:
        answer = self.worker.ask(request)
        arrays = answer.pop("arrays", {})
        if arrays:
            answer["logits"] = [arrays[f"logits_{i}"] for i in range(len(arrays))]
        return answer

    def load_adapter(self, path: str) -> None:
        try:
            self._ask({"op": "adapter", "path": path})
        except RuntimeUnavailable as exc:
            raise BadInput(f"onnxruntime-genai cannot load the adapter '{path}': {exc}") from None

    def run(self, request: dict) -> dict:
        try:
            return self._ask({"op": "run", **request})
        except RuntimeUnavailable as exc:
            raise BadInput(f"onnxruntime-genai refused the run: {exc}") from None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.worker = None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


# what onnxruntime-genai's own loop takes from Decoding: our option → its search option
GENAI_SEARCH = {
    "num_beams": "num_beams",
    "length_penalty": "length_penalty",
    "num_return_sequences": "num_return_sequences",
}


# What genai's loop cannot do as transformers does (its declared need of a request's features). Its beam search
# penalises the logits before the beam scores' log-softmax, where transformers penalises the log-probabilities.
CANNOT = Lacks(
    "features",
    {
        NO_REPEAT_NGRAM: "",
        MIN_NEW_TOKENS: "",
        EARLY_STOPPING_NEVER: "",
        BEAMS_WITH_STOP: "",
        BEAMS_WITH_PENALTY: "",
        SAMPLED_SEQUENCES: "",
        CONSTRAINED: "takes no logits processor in its loop for",
    },
    why="cannot do as transformers does:",
    fix="use --runtime onnxruntime, or drop it",
)


def genai_search(sampling: Sampling, decoding: Decoding, vocab_size: int | None) -> dict:
    """genai's search options for our settings, refusing (one line) what its loop cannot do as transformers."""
    resolve([SPEC.declared, request_declared(sampling, decoding)]).check()
    search = {}
    if sampling.sample:
        search = {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or (vocab_size or 50257),
        }
        if sampling.seed is not None:
            search["random_seed"] = int(sampling.seed % 2**31)
    if decoding.beams:
        search.update({theirs: getattr(decoding, ours) for ours, theirs in GENAI_SEARCH.items()})
        search["early_stopping"] = bool(decoding.early_stopping)
    if decoding.repetition_penalty != 1.0:  # greedy: as transformers 5 on each row alone (tested)
        search["repetition_penalty"] = decoding.repetition_penalty
    return search


SPEC = RuntimeSpec(
    name="genai",
    summary="onnxruntime-genai: its own C++ generation loop on the folder (in .venv-genai's worker where needed)",
    settings=GenaiSettings,
    open=open_runtime,
    capabilities=GenaiRunner.capabilities,
    requires=(
        Need("kv_dtype", allowed={FLOAT_CACHE}, why="has not been checked on a quantized K/V cache"),
        CANNOT,
    ),
)

__all__ = ["GenaiRunner", "GenaiSettings", "config_folder", "genai_config", "genai_python", "genai_search"]
