"""``gpt2onnx eval``: quality on real text, for several folders side by side against one reference.

The protocol, stated in every report (``EvalReport.protocol``):

- Perplexity by the sliding-window protocol of transformers' perplexity guide ("Perplexity of fixed-length
  models"): windows of ``context`` tokens (default: the models' position count) every ``stride`` tokens
  (default: half the context), each window scoring only the tokens after the previous window's end, so every
  token but the text's first is scored once, from up to ``context - 1`` tokens before it. The NLL is summed
  per scored token (the guide weights each window's mean loss by its valid labels minus one for the shift,
  which is exact for the first window and one token short for the others). The same tokens, tokenized once,
  are scored for every folder and for the reference. The standard error of the perplexity is PPL × the
  standard error of the mean NLL (tokens taken as independent), as llama.cpp's ``llama-perplexity`` reports.
- Against the reference (PyTorch fp32 rebuilt from the manifest's source, or ``reference``), on every scored
  token, llama.cpp's statistics: ΔPPL % (from the mean paired NLL difference, with its standard error), mean
  KL(reference ‖ folder) with its standard error, 99th percentile (from a log-spaced histogram, 2.3 %
  resolution, so memory stays flat) and maximum, the share of tokens whose top-1 token is the same, and the
  RMS of the change in the probability of the correct token. Then greedy continuation of the text's first
  tokens on both sides, and the first new token where they differ.
- Everything is streamed window by window: one window's logits per model at a time.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from gpt2onnx.artifact.contract import position_ids_for
from gpt2onnx.artifact.folder import MODEL_FILE, TOKENIZER_FILES, ModelFolder, open_folder, read_n_positions
from gpt2onnx.artifact.lora import adapter_declared, adapter_of
from gpt2onnx.artifact.report import (
    CheckReport,
    EvalProtocol,
    EvalReport,
    EvalRow,
    Figures,
    GreedyComparison,
    GreedySettings,
    KlStats,
)
from gpt2onnx.decoding.generate import decode
from gpt2onnx.decoding.prompts import load_tokenizer
from gpt2onnx.errors import BadInput, CheckFailed
from gpt2onnx.files import sha256_file
from gpt2onnx.machine import describe_machine
from gpt2onnx.precisions.all_precisions import FP32, precision_of
from gpt2onnx.pytorch.checkpoint import Checkpoint, load_checkpoint
from gpt2onnx.pytorch.reference import reference_model, reference_step
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, check_combination, open_runtime
from gpt2onnx.runtimes.decoder import file_shape
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.verify.gates import EvalGates
from gpt2onnx.verify.lockstep import reference_greedy
from gpt2onnx.verify.metrics import tokens_before_divergence
from gpt2onnx.verify.text import (
    TextSource,
    TextSummary,
    Window,
    graph_logits_last,
    sliding_windows,
    summarize_text,
    token_pieces,
    window_count,
    window_logits,
)

log = logging.getLogger(__name__)

PROTOCOL = "sliding window (transformers' perplexity guide)"
GREEDY_PROMPT = 32  # tokens of the text's start that prompt the greedy comparison
MAX_GREEDY_TOKENS = 1024
_ROWS = 64  # positions per chunk of the statistics (float64 over the vocabulary)
_KL_DECADES = (-16, 4)  # histogram range of KL values (log10); below lands in the first bin
_KL_PER_DECADE = 100
_KL_BINS = (_KL_DECADES[1] - _KL_DECADES[0]) * _KL_PER_DECADE


@dataclass(frozen=True)
class Windows:
    """The sliding windows: ``context`` tokens each (None: the models' position count) every ``stride`` tokens
    (None: half the context); checked when built, and against the models once they are known (``fit``)."""

    context: int | None = None
    stride: int | None = None

    def __post_init__(self) -> None:  # an invalid one cannot be built
        for name, value, low in (("context", self.context, 2), ("stride", self.stride, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise BadInput(f"{name} (--{name}) must be an integer of at least {low}, got {value!r}")
        if self.context is not None and self.stride is not None and self.stride > self.context:
            raise BadInput(f"stride (--stride) must be 1 to the context ({self.context}), got {self.stride}")

    def fit(self, limit: int) -> "Windows":
        """The windows for models of ``limit`` positions, the defaults filled in."""
        context = limit if self.context is None else self.context
        if context > limit:
            raise BadInput(
                f"context (--context) must be 2 to {limit} tokens (the models' position count), got {context}"
            )
        stride = max(1, context // 2) if self.stride is None else self.stride
        if stride > context:
            raise BadInput(f"stride (--stride) must be 1 to the context ({context}), got {stride}")
        return Windows(context, stride)


def check_greedy_tokens(greedy_tokens: int) -> None:
    if (
        isinstance(greedy_tokens, bool)
        or not isinstance(greedy_tokens, int)
        or not 0 <= greedy_tokens <= MAX_GREEDY_TOKENS
    ):
        raise BadInput(f"greedy tokens (--greedy-tokens) must be 0 to {MAX_GREEDY_TOKENS}, got {greedy_tokens}")


# -- accumulating the figures, chunk by chunk --------------------------------------------------------------
def _softmax(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the logits in float64, the probabilities, the log-sum-exp per row): float64, so that the KL of an fp32
    graph (about 1e-13) is not lost in rounding."""
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    e = np.exp(x - top)
    total = e.sum(-1, keepdims=True)
    e /= total
    return x, e, (top + np.log(total))[:, 0]


def _log_sum_exp(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x, (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))[:, 0]


class _Tally:
    """Running sums over scored tokens (nothing per token is kept)."""

    def __init__(self):
        self.n = self.top1 = self.nonfinite = 0
        self.nll = self.nll_sq = self.diff = self.diff_sq = 0.0
        self.kl = self.kl_sq = self.kl_max = self.dp = self.dp_sq = 0.0
        self.kl_hist = np.zeros(_KL_BINS, np.int64)

    def add_nll(self, nll: np.ndarray) -> None:
        self.n += nll.size
        self.nll += float(nll.sum())
        self.nll_sq += float((nll**2).sum())

    def add_comparison(self, nll, ref_nll, kl, top1, dp) -> None:
        self.add_nll(nll)
        bad = ~(np.isfinite(nll) & np.isfinite(kl))
        self.nonfinite += int(bad.sum())
        diff = nll - ref_nll
        self.diff += float(diff.sum())
        self.diff_sq += float((diff**2).sum())
        self.kl += float(kl.sum())
        self.kl_sq += float((kl**2).sum())
        self.kl_max = max(self.kl_max, float(kl.max())) if not np.isnan(kl).any() else math.nan
        finite = kl[np.isfinite(kl)]
        index = (np.log10(np.maximum(finite, 1e-300)) - _KL_DECADES[0]) * _KL_PER_DECADE
        np.add.at(self.kl_hist, np.clip(np.floor(index), 0, _KL_BINS - 1).astype(np.int64), 1)
        self.kl_hist[-1] += int((kl == np.inf).sum())
        self.top1 += int(top1.sum())
        self.dp += float(dp.sum())
        self.dp_sq += float((dp**2).sum())

    @staticmethod
    def _mean_stderr(total: float, squares: float, n: int) -> tuple[float, float]:
        mean = total / n
        variance = max(squares / n - mean * mean, 0.0) * n / max(n - 1, 1)
        return mean, math.sqrt(variance / n)

    def perplexity(self) -> tuple[float, float, float]:
        """(PPL, its standard error, the mean NLL)."""
        mean, stderr = self._mean_stderr(self.nll, self.nll_sq, self.n)
        ppl = math.exp(mean) if mean < 700 else math.inf
        return ppl, ppl * stderr, mean

    def kl_p99(self) -> float:
        if self.kl_hist.sum() == 0:
            return math.nan
        bin_ = int(np.searchsorted(np.cumsum(self.kl_hist), math.ceil(0.99 * self.kl_hist.sum())))
        upper = 10 ** (_KL_DECADES[0] + (bin_ + 1) / _KL_PER_DECADE)
        return min(upper, self.kl_max) if bin_ < _KL_BINS - 1 else self.kl_max

    def comparison(self) -> dict:
        diff, diff_se = self._mean_stderr(self.diff, self.diff_sq, self.n)
        kl, kl_se = self._mean_stderr(self.kl, self.kl_sq, self.n)
        ratio = math.exp(diff) if diff < 700 else math.inf
        return {
            "delta_ppl_percent": 100 * (ratio - 1),
            "delta_ppl_stderr": 100 * ratio * diff_se,
            "kl": KlStats(kl, kl_se, self.kl_p99(), self.kl_max),
            "same_top1": self.top1 / self.n,
            "rms_dp": math.sqrt(self.dp_sq / self.n),
            "mean_dp": self.dp / self.n,
            "nonfinite": self.nonfinite,
        }


# -- the models: candidates on a runtime, the reference on PyTorch or a runtime ------------------------------
class _RuntimeScorer:
    def __init__(self, label: str, model: ModelFolder, runtime: RuntimeOptions, adapter: str | None = None):
        self.label, self.model = label, model
        self.runner = open_runtime(model, runtime)
        if adapter is not None:  # a switchable LoRA adapter, active (checked before any model was loaded)
            self.runner.activate_adapter(adapter_of(model, adapter))
            self.label = f"{label} (adapter '{adapter}')"
        self.runtime, self.provider = runtime.name, self.runner.provider
        self.precision = precision_of(model.facts).name
        self.vocab_size, self.n_positions = self.runner.vocab_size, model.n_positions
        self.last_logits = graph_logits_last(model)
        self.seconds = 0.0

    def logits(self, window: Window) -> np.ndarray:
        start = time.perf_counter()
        out = window_logits(self.runner, window, last_logits=self.last_logits)
        self.seconds += time.perf_counter() - start
        return out

    def greedy(self, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
        return decode(self.runner, prompt[None], max_new_tokens=new_tokens).tokens[0]

    def close(self) -> None:
        self.runner.close()


class _TorchScorer:
    runtime, provider, precision, last_logits = "torch", "cpu", FP32.name, False

    def __init__(self, label: str, ckpt: Checkpoint):
        self.label, self.ckpt = label, ckpt
        self.model = reference_model(ckpt)
        self.vocab_size, self.n_positions = ckpt.spec.vocab_size, ckpt.spec.n_positions
        self.seconds = 0.0
        import torch

        # onnxruntime's threads spin after each run: torch on the same cores then crawls (10x under load)
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def logits(self, window: Window) -> np.ndarray:
        start = time.perf_counter()
        inputs = window.ids[None, :-1]
        mask = np.ones_like(inputs)
        logits, _ = reference_step(self.model, inputs, mask, position_ids_for(mask))
        self.seconds += time.perf_counter() - start
        return logits[0, window.first - 1 :]

    def greedy(self, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
        return reference_greedy(self.model, prompt[None], np.ones((1, len(prompt)), np.int64), new_tokens)[0]

    def close(self) -> None:
        import torch

        torch.set_num_threads(self.threads)


def _tokenizer_digest(folder: Path) -> str | None:
    names = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    if not names:
        return None
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + sha256_file(folder / name).encode())
    return digest.hexdigest()


def _tokenizer_folder(folders: Sequence[Path], fallback: Path | None, *, required: bool = True) -> Path | None:
    """The folder whose tokenizer tokenizes the text: the first that has tokenizer files; every other folder
    with tokenizer files must have the same ones (the same scored tokens for all)."""
    digests = {f: _tokenizer_digest(f) for f in folders}
    having = [f for f in folders if digests[f] is not None]
    for other in having[1:]:
        if digests[other] != digests[having[0]]:
            raise BadInput(
                f"'{other}' and '{having[0]}' have different tokenizer files: evaluate folders of the same tokenizer"
                " together (each one's perplexity is on its own tokens)"
            )
    if having:
        return having[0]
    if fallback is not None and _tokenizer_digest(fallback) is not None:
        return fallback
    if not required:
        return None
    raise BadInput(
        f"no tokenizer files (tokenizer.json, or vocab.json and merges.txt) in '{folders[0]}': the text needs the"
        " model's tokenizer; copy the checkpoint's tokenizer files into the folder"
    )


def _same_source(models: list[ModelFolder]) -> None:
    """The default reference is the first folder's source: the others must come from the same one."""
    keys = ("kind", "id", "path", "sha256", "architecture", "seed", "spec_sha256", "outliers")

    def key(model):
        source = model.manifest.source if model.manifest else {}
        return tuple(str(source.get(k)) for k in keys)

    for model in models[1:]:
        if key(model) != key(models[0]):
            raise BadInput(
                f"'{model.folder}' and '{models[0].folder}' were exported from different sources: give the"
                " reference to compare them with (--reference)"
            )


def _reference_scorer(
    models: list[ModelFolder], reference: str | None, runtime: RuntimeOptions, verify_files: bool, adapter=None
):
    """The reference the folders are compared with, refused when its architecture (vocabulary, layers, heads,
    head size) is not every folder's: figures against another model mean nothing. ``adapter``: a switchable
    adapter's name, merged by PEFT into the reference checkpoint from the folder the first folder's manifest
    records."""
    from gpt2onnx.verify.parity import check_reference_matches, reference_checkpoint, with_switchable_adapter

    is_folder = reference is not None and (Path(reference) / "model.onnx").is_file()
    if is_folder and adapter is not None:
        raise BadInput("--adapter is compared with PyTorch with the adapter merged: give a checkpoint as --reference")
    if is_folder:
        # a reference folder runs on onnxruntime: the folders' own settings there, else their thread count
        on_ort = (
            runtime
            if runtime.name == "onnxruntime"
            else RuntimeOptions(settings=ProviderConfig(threads=runtime.threads))
        )
        folder = open_folder(reference, verify_files=verify_files)
        ours = _architecture(folder)
        for model in models:
            if _architecture(model) != ours:
                raise BadInput(
                    f"the reference '{reference}' (vocabulary, layers, heads, head size {ours}) does not match the"
                    f" model in '{model.folder}' {_architecture(model)}: give the folder it was made from"
                    " (--reference)"
                )
        return _RuntimeScorer(str(reference), folder, on_ort)
    if reference is None:
        _same_source(models)
        ckpt = reference_checkpoint(models[0])
        label = f"PyTorch fp32 ({ckpt.name}, the manifest's source)"
    else:
        ckpt, label = load_checkpoint(reference, option="--reference"), f"PyTorch fp32 ({reference})"
    if adapter is not None:
        ckpt = with_switchable_adapter(models[0], ckpt, adapter)
        label = f"{label[:-1]}, adapter '{adapter}' merged by PEFT)"
    for model in models:
        check_reference_matches(model, ckpt)
    return _TorchScorer(label, ckpt)


def _architecture(model: ModelFolder) -> tuple:
    shape = file_shape(model.model_path, model.n_positions)
    return (shape.vocab_size, shape.n_layer, shape.n_head, shape.head_dim)


# -- the evaluation --------------------------------------------------------------------------------------------
def evaluate(
    folders: Sequence[str | Path],
    *,
    text: str | Path | None = None,
    dataset: str | None = None,
    context: int | None = None,
    stride: int | None = None,
    reference: str | None = None,
    runtime: RuntimeOptions | None = None,
    gates: EvalGates = EvalGates(),
    greedy_tokens: int = 64,
    verify_files: bool = True,
    on_window: Callable[[int, int], None] | None = None,
    adapter: str | None = None,
) -> EvalReport:
    """Perplexity of exported folders on real text, side by side, and their figures against a reference.

    Args:
        folders: exported decoder folders (any precision, fusion, ``--logits last`` included: those run token by
            token). They share one tokenizer: the first folder's tokenizer files tokenize the text once.
        text: a UTF-8 text file; or
        dataset: NAME[:CONFIG[:SPLIT]] through the ``datasets`` library (split default ``test``), its rows joined
            with blank lines as transformers' guide does (e.g. ``wikitext:wikitext-2-raw-v1``). Give one.
        context: tokens per window (default: the models' position count); ``stride``: tokens between window
            starts (default: half the context).
        reference: a checkpoint (folder or Hub id) or an exported folder to compare with (default: PyTorch fp32
            rebuilt from the first folder's manifest source, which every folder must share).
        runtime: the runtime and provider for the folders (default: onnxruntime on the cpu provider).
        gates: ``max_ppl_increase`` (percent) and ``max_kl`` (mean KL); a failure is in the report, not raised.
        greedy_tokens: new tokens of the greedy comparison from the text's first 32 tokens (0: none).
        verify_files: check the model files against the manifest's sha256 first.
        on_window: called with (windows done, windows in all) after each window, for progress.
        adapter: a switchable LoRA adapter (export --adapters), active in every folder; the reference is the
            checkpoint with it merged by PEFT (from the adapter folder the first folder's manifest records).

    Returns:
        EvalReport: the protocol, the reference's row, one row per folder (with its CheckReport when gated).

    Raises:
        BadInput (folders, text, options, tokenizer, reference), ContractError, IntegrityError,
        RuntimeUnavailable (the runtime, provider or the datasets library).
    """
    if not folders:
        raise BadInput("give at least one exported folder to evaluate")
    if len({Path(f).resolve() for f in folders}) != len(folders):
        raise BadInput("a folder is given twice: give each folder once")
    source = TextSource(Path(text) if text is not None else None, dataset)
    windows = Windows(context, stride)
    check_greedy_tokens(greedy_tokens)
    runtime = runtime or RuntimeOptions()
    runtime.requires("eval")
    models = [open_folder(f, verify_files=verify_files) for f in folders]
    for model in models if adapter is not None else ():  # a name each folder has, on a runtime that binds it
        adapter_of(model, adapter)
        check_combination(model, runtime, adapter_declared(adapter))
    windows = windows.fit(min(m.n_positions for m in models))  # before any model is loaded
    tokenizer_folder = _tokenizer_folder([m.folder for m in models], None, required=False)
    summary = None
    if tokenizer_folder is not None:  # the text is read (and checked) once before any model is loaded
        summary = summarize_text(load_tokenizer(tokenizer_folder), source)
    elif source.dataset is not None:
        next(source.chunks(), None)  # a dataset that cannot be loaded fails before the models load
    scorers: list = []
    try:
        ref = _reference_scorer(models, reference, runtime, verify_files, adapter)
        scorers.append(ref)
        if tokenizer_folder is None:  # folders without tokenizer files (optimum's, say) use the reference's
            fallback = ref.ckpt.companion_dir if isinstance(ref, _TorchScorer) else ref.model.folder
            tokenizer_folder = _tokenizer_folder([m.folder for m in models], fallback)
        for model in models:
            scorers.append(_RuntimeScorer(str(model.folder), model, runtime, adapter))
        text = _Text(load_tokenizer(tokenizer_folder), source, tokenizer_folder, summary)
        return _run(scorers[1:], ref, text, windows, gates=gates, greedy_tokens=greedy_tokens, on_window=on_window)
    finally:
        for scorer in scorers:
            scorer.close()


def folder_scorer(
    label: str, folder: str | Path, threads: int | None = None, runtime: str = "onnxruntime"
) -> _RuntimeScorer:
    """An exported folder as eval scores it, on ``runtime`` (onnxruntime: its cpu provider) with ``threads``."""
    from gpt2onnx.runtimes.all_runtimes import runtime_options

    options = runtime_options([runtime], {"--threads": threads} if threads else {})[0]
    return _RuntimeScorer(label, open_folder(folder), options)


def score_against_checkpoint(
    candidates: list,
    ckpt: Checkpoint,
    text: Path,
    tokenizer_folder: Path,
    *,
    context: int | None = None,
    stride: int | None = None,
    greedy_tokens: int = 64,
) -> EvalReport:
    """eval's protocol for scorers of any origin (gpt2onnx compare: the engines' files beside ours) against PyTorch
    fp32 from ``ckpt``, in windows of ``context`` tokens (default: the model's positions) every ``stride`` (default:
    the context: windows that do not overlap).
    A scorer has ``label``, ``precision``, ``runtime``, ``provider``, ``vocab_size``, ``last_logits``, ``seconds``,
    ``logits(window)`` (the positions from ``window.first - 1``) and ``greedy(prompt, new_tokens)``."""
    limit = ckpt.spec.n_positions
    context = min(context or limit, limit)
    windows = Windows(context, stride or context).fit(limit)
    ref = _TorchScorer("PyTorch fp32", ckpt)
    try:
        source = _Text(load_tokenizer(tokenizer_folder), TextSource(Path(text)), tokenizer_folder)
        return _run(candidates, ref, source, windows, greedy_tokens=greedy_tokens)
    finally:
        ref.close()


def eval_source(eval_text: str | Path | None, gates: EvalGates) -> TextSource | None:
    """export's and optimize's --eval-text with its gates (built, so checked): the text to check the new folder
    on, or None; gates without a text are refused."""
    if gates.active and eval_text is None:
        raise BadInput(
            "max_ppl_increase and max_kl (--max-ppl-increase, --max-kl) gate the quality on real text: give the"
            " text (--eval-text FILE)"
        )
    return TextSource(Path(eval_text)) if eval_text is not None else None


def evaluate_written(
    folder: Path,
    *,
    reference: Checkpoint | ModelFolder,
    text: TextSource,
    gates: EvalGates,
    against: str,
    label: str | None = None,
    precision: str | None = None,
) -> EvalReport:
    """What export and optimize run with ``--eval-text`` on the folder they are writing (staged, before its
    manifest): onnxruntime's cpu provider, the default context and stride, against the checkpoint (export) or
    the source folder (optimize). ``label``: the folder's name in the report (its final path); ``precision``: its
    precision (the staged folder has no manifest yet). A failed gate raises CheckFailed: nothing is written."""
    model = ModelFolder(folder, folder / MODEL_FILE, None, read_n_positions(folder))
    if isinstance(reference, Checkpoint):
        ref = _TorchScorer(against, reference)
    else:
        ref = _RuntimeScorer(against, reference, RuntimeOptions())
    candidate = _RuntimeScorer(label or str(folder), model, RuntimeOptions())
    candidate.precision = precision or candidate.precision
    # the staged folder's tokenizer files are copies: messages name the folder they were copied from
    tokenizer_source = reference.companion_dir if isinstance(reference, Checkpoint) else reference.folder
    tokenizer_source = tokenizer_source or Path(label or folder)
    try:
        windows = Windows().fit(model.n_positions)
        report = _run([candidate], ref, _Text(load_tokenizer(folder), text, tokenizer_source), windows, gates=gates)
    finally:
        candidate.close()
        ref.close()
    log.info("quality on real text: %s", report.summary())
    if not report.passed:
        failing = next(r.check for r in report.rows if r.check and r.check.failures)
        raise CheckFailed(f"quality on real text failed: {'; '.join(report.failures)}; nothing was written", failing)
    return report


@dataclass
class _Text:
    """The text evaluated on: its tokenizer, where it comes from, whose tokenizer files it is, and (when read
    already) its summary."""

    tokenizer: object
    source: TextSource
    tokenizer_folder: Path | None
    summary: TextSummary | None = None


def _run(
    candidates: list[_RuntimeScorer],
    ref,
    text: _Text,
    windows: Windows,
    *,
    gates: EvalGates = EvalGates(),
    greedy_tokens: int = 64,
    on_window: Callable[[int, int], None] | None = None,
) -> EvalReport:
    for scorer in candidates:
        if scorer.vocab_size not in (None, ref.vocab_size):
            raise BadInput(
                f"'{scorer.label}' has a vocabulary of {scorer.vocab_size}, the reference {ref.vocab_size}: give the"
                " reference it was exported from (--reference)"
            )
    if ref.n_positions and ref.n_positions < windows.context:
        raise BadInput(
            f"the reference's context is {ref.n_positions} tokens, the windows' {windows.context}: give --context"
            f" {ref.n_positions} or less"
        )
    summary = text.summary or summarize_text(text.tokenizer, text.source)
    if summary.tokens < 2:
        raise BadInput(f"the text has {summary.tokens} token(s): perplexity needs at least 2; give a longer text")
    if summary.max_id >= ref.vocab_size:
        raise BadInput(
            f"the tokenizer of '{text.tokenizer_folder}' gives token id {summary.max_id}, outside the model's"
            f" vocabulary of {ref.vocab_size}: the tokenizer files do not belong to this model"
        )
    ref_tally, tallies, count = _score(candidates, ref, text, windows, summary.tokens, on_window)
    greedy = _greedy(candidates, ref, summary.head, greedy_tokens=greedy_tokens, context=windows.context)
    ppl, ppl_se, nll = ref_tally.perplexity()
    ref_row = EvalRow(
        ref.label, ref.precision, ref.runtime, ref.provider, ref_tally.n, ppl, ppl_se, nll, seconds=ref.seconds
    )
    rows = [
        _row(scorer, tally, greedy_row, gates, against=ref.label)
        for scorer, tally, greedy_row in zip(candidates, tallies, greedy)
    ]
    protocol = EvalProtocol(
        method=PROTOCOL,
        context=windows.context,
        stride=windows.stride,
        tokens=summary.tokens,
        scored_tokens=ref_tally.n,
        windows=count,
        text={**text.source.describe(), "sha256": summary.sha256},
        tokenizer=str(text.tokenizer_folder) if text.tokenizer_folder else None,
        reference=ref.label,
        greedy=GreedySettings(int(min(GREEDY_PROMPT, len(summary.head))), greedy_tokens),
        gates=gates.as_dict(),
        machine=describe_machine(candidates[0].provider if candidates else "cpu"),
    )
    return EvalReport(protocol, ref_row, tuple(rows))


def _score(candidates, ref, text: _Text, windows: Windows, tokens: int, on_window) -> tuple[_Tally, list[_Tally], int]:
    """The running sums of every window: the reference's NLL, and each candidate against it."""
    count = window_count(tokens, context=windows.context, stride=windows.stride)
    log.info("%d tokens, %d windows of %d (stride %d)", tokens, count, windows.context, windows.stride)
    ref_tally, tallies = _Tally(), [_Tally() for _ in candidates]
    pieces = token_pieces(text.tokenizer, text.source)
    for done, window in enumerate(sliding_windows(pieces, context=windows.context, stride=windows.stride), start=1):
        targets = window.ids[window.first :]
        ref_logits = ref.logits(window)
        for start in range(0, len(targets), _ROWS):
            rows = slice(start, start + _ROWS)
            r, lse = _log_sum_exp(ref_logits[rows])
            ref_tally.add_nll(lse - r[np.arange(len(targets[rows])), targets[rows]])
        for scorer, tally in zip(candidates, tallies):
            _compare(scorer.logits(window), ref_logits, targets, tally)
        if on_window is not None:
            on_window(done, count)
    return ref_tally, tallies, count


def _row(scorer, tally: _Tally, greedy: GreedyComparison | None, gates: EvalGates, *, against: str) -> EvalRow:
    ppl, ppl_se, nll = tally.perplexity()
    row = EvalRow(
        scorer.label,
        scorer.precision,
        scorer.runtime,
        scorer.provider,
        tally.n,
        ppl,
        ppl_se,
        nll,
        **tally.comparison(),
        greedy=greedy,
        token_by_token=scorer.last_logits,
        seconds=scorer.seconds,
    )
    return replace(row, check=_gate(row, gates, against=against)) if gates.active else row


def _compare(logits: np.ndarray, ref_logits: np.ndarray, targets: np.ndarray, tally: _Tally) -> None:
    if logits.shape != ref_logits.shape:
        raise BadInput(f"a model returned logits of shape {logits.shape}, the reference {ref_logits.shape}")
    for start in range(0, len(targets), _ROWS):
        rows = slice(start, start + _ROWS)
        index = np.arange(len(targets[rows])), targets[rows]
        r, ref_p, ref_lse = _softmax(ref_logits[rows])
        o, lse = _log_sum_exp(logits[rows])
        with np.errstate(invalid="ignore", over="ignore"):
            # KL(p_ref ‖ p) = Σ p_ref (r − o) − LSE(r) + LSE(o), with r, o the logits
            kl = np.einsum("ij,ij->i", ref_p, r - o) - ref_lse + lse
        nll, ref_nll = lse - o[index], ref_lse - r[index]
        same = logits[rows].argmax(-1) == ref_logits[rows].argmax(-1)
        tally.add_comparison(nll, ref_nll, kl, same, np.exp(-nll) - np.exp(-ref_nll))


def _greedy(candidates, ref, head: np.ndarray, *, greedy_tokens: int, context: int) -> list[GreedyComparison | None]:
    prompt = head[: min(GREEDY_PROMPT, len(head) - 1)]
    new = min(greedy_tokens, context - len(prompt))
    if new < 1 or len(prompt) < 1:
        return [None for _ in candidates]
    theirs = np.asarray(ref.greedy(prompt, new))
    out = []
    for scorer in candidates:
        ours = np.asarray(scorer.greedy(prompt, new))
        compared = min(len(ours), len(theirs))  # genai stops at end-of-sequence
        matching = tokens_before_divergence(ours[None, :compared], theirs[None, :compared])
        out.append(
            GreedyComparison(
                prompt_tokens=int(len(prompt)),
                new_tokens=int(compared),
                matching_tokens=int(matching),
                first_divergence=None if matching == compared else int(matching),
            )
        )
    return out


def _gate(row: EvalRow, gates: EvalGates, *, against: str) -> CheckReport:
    failures = []
    if gates.max_ppl_increase is not None and not row.delta_ppl_percent <= gates.max_ppl_increase:
        failures.append(f"{row.label}: ΔPPL {row.delta_ppl_percent:+.3g} % > {gates.max_ppl_increase:g} %")
    if gates.max_kl is not None and not row.kl.mean <= gates.max_kl:
        failures.append(f"{row.label}: mean KL {row.kl.mean:.3g} > {gates.max_kl:g}")
    if row.nonfinite:
        failures.append(f"{row.label}: {row.nonfinite} tokens with NaN/Inf figures")
    measured = Figures(
        ppl=row.ppl,
        delta_ppl_percent=row.delta_ppl_percent,
        kl=row.kl,
        same_top1=row.same_top1,
        rms_dp=row.rms_dp,
        tokens=row.tokens,
    )
    return CheckReport(
        row.precision,
        against,
        {
            name: value
            for name, value in (("ppl_increase_percent", gates.max_ppl_increase), ("kl_mean", gates.max_kl))
            if value is not None
        },
        measured,
        tuple(failures),
        provider=row.provider,
        runtime=row.runtime,
        machine=describe_machine(row.provider),
    )


__all__ = ["EvalGates", "EvalReport", "EvalRow", "Windows", "eval_source", "evaluate", "evaluate_written"]
