"""The ort-generate runtime: a folder deployed with ``--target ort-generate`` run by onnxruntime's generation ops
(GreedySearch, BeamSearch, Sampling), the whole decoding loop in one ``session.run``.

It takes the decode loop's :class:`~gpt2onnx.generation_options.Sampling` and
:class:`~gpt2onnx.generation_options.Decoding` and refuses, in one line, a setting the op cannot express as
transformers means it: top-k (no op has it), ``early_stopping='never'``, a setting the op takes as an attribute
(no_repeat_ngram_size; early_stopping with beams; temperature and top_p when sampling) other than the deployed one,
a length_penalty other than 0 with beams (BeamSearch divides by the whole length, prompt and padding included,
where transformers divides by the generated length), and stop strings with beams. The op's repetition penalty
counts every id of the sequence, padding included, as transformers 4 does; transformers 5 leaves the padding out,
so by default (``penalize_padding`` off) a row is padded with its own first token, which the penalty counts anyway.
It gives no per-step logits or times: parity, eval and bench run on the folder's model.onnx with onnxruntime.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpt2onnx.artifact.folder import (
    GENERATION_CONFIG_FILE,
    ModelFolder,
    check_deployed_files,
    graph_data_files,
    open_folder,
)
from gpt2onnx.artifact.search_ops import FILES, SUBFOLDER, FixedSettings, deployed_settings
from gpt2onnx.capabilities import Declared, Lacks, Need
from gpt2onnx.errors import BadInput, ContractError, RuntimeUnavailable
from gpt2onnx.files import kind_of
from gpt2onnx.generation_options import (
    BEAMS_WITH_STOP,
    CONSTRAINED,
    EARLY_STOPPING_NEVER,
    TOP_K,
    Decoding,
    Sampling,
    check_pair,
)
from gpt2onnx.params import COUNT_MAX
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.runtimes.decoder import file_shape
from gpt2onnx.runtimes.runtime import Capabilities, Continuations, LoopRuntime, RuntimeSpec, ThreadSettings


@dataclass(frozen=True)
class OrtGenerateSettings(ThreadSettings):
    """The ops' thread count, and whether their repetition penalty counts the left padding (transformers 4) or
    not (transformers 5, the default)."""

    penalize_padding: bool = False


@dataclass
class SearchResult:
    """What one session.run returned: per prompt, per returned sequence, the generated tokens (the prompt and
    the padding after the end-of-sequence token removed; the end-of-sequence token kept, as transformers does)."""

    tokens: list[list[list[int]]]
    sequences: np.ndarray  # the op's own output: [batch, sequences, max_length], prompts left-padded
    scores: np.ndarray | None = None  # beam search: each returned sequence's score
    file: str = ""
    inputs: dict = field(default_factory=dict)
    seconds: float = 0.0


def _refuse(setting: str, reason: str) -> None:
    raise BadInput(f"ort-generate cannot {setting}: {reason}")


class OrtGenerator(LoopRuntime):
    """A deployed ort-generate folder, opened: one onnxruntime session per search kind, made on first use and
    kept, so that a caller generating many times pays the session set-up once."""

    runtime = "ort-generate"
    capabilities = Capabilities(owns_loop=True, presents=False, steps=False)

    def __init__(self, model: ModelFolder, settings: OrtGenerateSettings = OrtGenerateSettings()):
        try:
            import onnxruntime
        except ImportError:
            raise RuntimeUnavailable("onnxruntime is not installed: pip install onnxruntime") from None
        self.folder = model.folder
        _check_files(model)  # before anything reads them
        self.fixed = deployed_settings(self.folder)
        self.settings = settings
        shape = file_shape(model.model_path, model.n_positions)
        self.n_positions, self.n_layer, self.vocab_size = model.n_positions, shape.n_layer, shape.vocab_size
        self.provider, self.version = "cpu", onnxruntime.__version__
        self._sessions: dict[str, object] = {}

    def session(self, kind: str):
        if kind not in self._sessions:
            import onnxruntime as ort

            path = self.folder / SUBFOLDER / FILES[kind]
            if not path.is_file():
                raise ContractError(f"'{path}' is missing: run gpt2onnx deploy {self.folder} --target ort-generate")
            options = ort.SessionOptions()
            if self.settings.threads:
                options.intra_op_num_threads = self.settings.threads
            self._sessions[kind] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return self._sessions[kind]

    def check_settings(self, sampling: Sampling, decoding: Decoding, max_new_tokens: int) -> str:
        """Refuse what the ops cannot do as transformers does; returns the search kind (greedy, beam, sampling)."""
        fixed = self.fixed
        if sampling.seed is not None and sampling.seed > COUNT_MAX:
            raise BadInput(
                f"seed {sampling.seed} (--seed): the Sampling op takes a 32-bit seed; give one up to {COUNT_MAX:,}"
            )
        if decoding.early_stopping == "never":
            _refuse("use early_stopping='never'", "BeamSearch's early_stopping attribute is true or false only")
        attributes = [("no_repeat_ngram_size", decoding.no_repeat_ngram_size)]
        attributes += [("early_stopping", decoding.early_stopping)] if decoding.beams else []
        attributes += [("temperature", sampling.temperature), ("top_p", sampling.top_p)] if sampling.sample else []
        for name, value in attributes:
            if value != getattr(fixed, name):
                _refuse(
                    f"set {name}={value} at run time",
                    f"the op takes it as an attribute, deployed as {getattr(fixed, name)}; set it in"
                    f" {GENERATION_CONFIG_FILE} and deploy again",
                )
        if sampling.top_k:
            _refuse(
                f"use top_k={sampling.top_k}",
                "no onnxruntime generation op has top-k (Sampling has top_p only); pass top_k=0",
            )
        if decoding.beams and decoding.length_penalty != 0:
            # BeamHypotheses::Add: score = sum_logprobs / total_length ** length_penalty, where transformers
            # divides by the generated length: with finished beams of different lengths they rank them otherwise
            _refuse(
                f"apply length_penalty={decoding.length_penalty} as transformers does",
                "BeamSearch divides a beam's score by its whole length (prompt and padding included), transformers by"
                " the generated length; pass length_penalty=0.0 (the same beams and scores), or run the file yourself",
            )
        if decoding.min_new_tokens > max_new_tokens:
            raise BadInput(
                f"min_new_tokens {decoding.min_new_tokens} is more than max_new_tokens {max_new_tokens}: give 0 <= min"
                " <= max"
            )
        return "sampling" if sampling.sample else ("beam" if decoding.beams else "greedy")

    def search(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        decoding: Decoding = Decoding(),
    ) -> SearchResult:
        """One generation in one session.run (settings checked by the caller with check_pair). Prompts of different
        lengths are left-padded and masked (the attention_mask input)."""
        if not prompts or any(not p for p in prompts):
            raise BadInput("give at least one prompt, none of them empty")
        kind = self.check_settings(sampling, decoding, max_new_tokens)
        width = max(len(p) for p in prompts)
        self.check_length(width + max_new_tokens)
        feed = self._feed(prompts, width, max_new_tokens, sampling, decoding, kind)
        start = time.perf_counter()
        results = self.session(kind).run(None, feed)
        seconds = time.perf_counter() - start
        sequences = results[0] if kind == "beam" else results[0][:, None, :]
        tokens = [[_generated(seq[width:], self.fixed) for seq in row] for row in sequences]
        scores = results[1] if kind == "beam" else None
        return SearchResult(tokens, sequences, scores, str(self.folder / SUBFOLDER / FILES[kind]), feed, seconds)

    def _feed(self, prompts, width: int, max_new_tokens: int, sampling: Sampling, decoding: Decoding, kind: str):
        """The op's inputs: the left-padded prompts and their mask, the lengths and the run-time settings."""
        own_padding = decoding.repetition_penalty != 1.0 and not self.settings.penalize_padding
        padded = any(len(p) < width for p in prompts)
        if own_padding and padded and self.fixed.no_repeat_ngram_size:
            _refuse(
                "leave the padding out of repetition_penalty with no_repeat_ngram_size on a padded batch",
                "the ops count the padding in both (transformers 5 in the n-grams only); set penalize_padding"
                " (transformers 4), or give prompts of one length",
            )
        ids = np.full((len(prompts), width), self.fixed.pad_token_id, np.int32)
        mask = np.zeros((len(prompts), width), np.int32)
        for row, prompt in enumerate(prompts):
            if own_padding:
                ids[row] = prompt[0]  # an id the penalty counts anyway: the padding adds none
            ids[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = 1
        feed = {
            "input_ids": ids,
            "attention_mask": mask,
            "max_length": np.array([width + max_new_tokens], np.int32),
            # transformers' min_new_tokens, as the op's min_length: the whole (padded) length, as it counts
            "min_length": np.array([width + decoding.min_new_tokens if decoding.min_new_tokens else 0], np.int32),
            "repetition_penalty": np.array([decoding.repetition_penalty], np.float32),
        }
        if kind == "beam":
            feed["num_beams"] = np.array([decoding.num_beams], np.int32)
            feed["num_return_sequences"] = np.array([decoding.num_return_sequences], np.int32)
            feed["length_penalty"] = np.array([decoding.length_penalty], np.float32)
        if kind == "sampling":
            feed["seed"] = np.array([0 if sampling.seed is None else sampling.seed], np.int32)
        return feed

    def continue_prompts(self, prompts, *, max_new_tokens, sampling, decoding, eos_token_ids) -> Continuations:
        """The batch in one session.run; the beams' scores are transformers' (length_penalty 0: the sum of the
        new tokens' log-probabilities). A stop string cuts a greedy or sampled row where it ends."""
        if decoding.beams and decoding.stop:
            _refuse("stop at --stop strings with beam search", "the op runs every beam to its end; drop --stop")
        if eos_token_ids and eos_token_ids[0] != self.fixed.eos_token_id:
            raise ContractError(
                f"the folder's end-of-sequence id {eos_token_ids[0]} is not the one its ort-generate files were"
                f" deployed with ({self.fixed.eos_token_id}): deploy it again"
            )
        result = self.search(prompts, max_new_tokens=max_new_tokens, sampling=sampling, decoding=decoding)
        scores = result.scores.reshape(-1).astype(np.float64) if result.scores is not None else None
        return Continuations(result.tokens, [result.seconds], scores)


def _check_files(model: ModelFolder) -> None:
    """The ort-generate files: each graph's external data a plain name of a regular file beside it (never
    '../../outside.bin'), and, where the folder's model files were checked, each file with the size and sha256
    the manifest records (another checkpoint's weights.onnx_data, a linked folder: refused)."""
    names = []
    for file in FILES.values():
        path = model.folder / SUBFOLDER / file
        if not (path.exists() or path.is_symlink()):
            continue  # missing: said when its search is asked for
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):  # never opened: a FIFO would block the reader
            raise ContractError(
                f"'{path}' is {kind_of(mode)}, not the graph deploy wrote: run gpt2onnx deploy {model.folder} --target"
                " ort-generate again"
            )
        names += [f"{SUBFOLDER}/{n}" for n in (file, *graph_data_files(path))]
    if model.verified and names:
        check_deployed_files(model.folder, model.manifest, sorted(set(names)))


def open_generator(model: ModelFolder, settings: OrtGenerateSettings) -> OrtGenerator:
    return OrtGenerator(model, settings)


def generate(
    folder: str | Path,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    decoding: Decoding = Decoding(),
    settings: OrtGenerateSettings = OrtGenerateSettings(),
) -> SearchResult:
    """One generation with a deployed ort-generate folder, the op's own output kept (OrtGenerator.search)."""
    check_pair(sampling, decoding)
    return OrtGenerator(open_folder(folder), settings).search(
        prompts, max_new_tokens=max_new_tokens, sampling=sampling, decoding=decoding
    )


def _generated(tail: np.ndarray, fixed: FixedSettings) -> list[int]:
    """Generated tokens up to and with the first end-of-sequence token (after it the op writes pad ids)."""
    out = []
    for token in tail.tolist():
        out.append(token)
        if token == fixed.eos_token_id:
            break
    return out


# The settings the ops take as attributes, fixed when the folder is deployed (FixedSettings): a request's must be
# the deployed one (None: the request does not use it, greedy's early_stopping)
ATTRIBUTES = ("no_repeat_ngram_size", "early_stopping", "temperature", "top_p")


def deployment(folder: Path) -> list[Declared]:
    """What ``folder``'s deployment declares to this runtime: whether it holds the ops' files (deploy --target
    ort-generate writes them), and the attributes they were deployed with, which a request must keep (read from
    the files, as the runtime reads them)."""
    label = f"'{folder}' (its {SUBFOLDER}/ files)"
    if not all((folder / SUBFOLDER / file).exists() for file in FILES.values()):
        return [
            Declared(
                "deployment",
                SUBFOLDER,
                ensures={"search_files": False},
                says={"search_files": f"has no {SUBFOLDER}/ files (not deployed with --target ort-generate)"},
                origin="folder",
                label=f"'{folder}'",
            )
        ]
    fixed = deployed_settings(folder)
    needs = tuple(
        Need(
            name,
            allowed={getattr(fixed, name), None},
            why=f"has {name} fixed at {getattr(fixed, name)} in its ops (an attribute, set when deployed)",
            fix=f"set {name} in {GENERATION_CONFIG_FILE} and deploy again, or use --runtime onnxruntime",
        )
        for name in ATTRIBUTES
    )
    return [Declared("deployment", SUBFOLDER, ensures={"search_files": True}, requires=needs, label=label)]


SPEC = RuntimeSpec(
    name="ort-generate",
    summary="onnxruntime's generation ops on a folder deployed with --target ort-generate: the loop in the graph",
    settings=OrtGenerateSettings,
    open=open_generator,
    capabilities=OrtGenerator.capabilities,
    declare_folder=deployment,
    requires=(
        Need("kv_dtype", allowed={FLOAT_CACHE}, why="runs generation ops that take a float K/V cache"),
        Need("cache_grows", allowed={True}, why="runs generation ops that feed a growing past"),
        Lacks(
            "features",
            {
                TOP_K: "has no top-k in any of its ops (Sampling has top_p only):",
                EARLY_STOPPING_NEVER: "has only true or false in BeamSearch's attribute, not",
                BEAMS_WITH_STOP: "runs every beam to its end in the op, which cannot stop at",
                CONSTRAINED: "chooses every token inside the op, which takes no logits processor for",
            },
            fix="use --runtime onnxruntime, or drop it",
        ),
        # last: a graph it cannot run is the first conflict (exit code 3), a folder not yet deployed after it
        Need(
            "search_files",
            refused={False},
            why="runs the generation ops that deploy --target ort-generate writes",
            fix="deploy it first (gpt2onnx deploy FOLDER --target ort-generate -o OUT) and run OUT",
        ),
        Need(
            "length_penalty",
            allowed={0.0, None},
            why="divides a beam's score by its whole length in BeamSearch (prompt and padding included), where"
            " transformers divides by the generated length",
            fix="pass --length-penalty 0 (the same beams and scores), or use --runtime onnxruntime",
        ),
    ),
)
