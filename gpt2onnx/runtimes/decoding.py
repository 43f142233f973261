"""What a decode loop is asked and what it gives back: the sampling and decoding options (transformers'
names and semantics), the result, and the logits processors applied in transformers' order (the functions
themselves: :mod:`gpt2onnx.runtimes.logits`). Shared by the loop (:mod:`gpt2onnx.runtimes.generate`) and
beam search (:mod:`gpt2onnx.runtimes.beam`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from gpt2onnx.artifact.generation import MIN_TEMPERATURE, check_option  # noqa: F401 - MIN_TEMPERATURE re-exported
from gpt2onnx.capabilities import Declared
from gpt2onnx.errors import BadInput
from gpt2onnx.runtimes import logits


def _set(**options) -> list[str]:
    """The names of the options given (True, or a value that is not None): those a mode would ignore."""
    return [name for name, value in options.items() if value is not None and value is not False]


@dataclass(frozen=True)
class Sampling:
    """Greedy unless ``sample`` is set. Checked when built (the rules between it and a Decoding: check_pair)."""

    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None

    def __post_init__(self) -> None:  # an invalid one cannot be built
        if not self.sample:
            ignored = _set(
                temperature=self.temperature != 1.0, top_k=self.top_k != 0, top_p=self.top_p != 1.0, seed=self.seed
            )
            if ignored:
                raise BadInput(
                    f"{', '.join(ignored)} only apply when sampling: turn sampling on (--sample), or drop them"
                )
        # the rules generation_config.json is read by (gpt2onnx.artifact.generation): the same words for both
        check_option("temperature", self.temperature)  # below 1e-6, logits / temperature overflow float64
        check_option("top_k", self.top_k)
        check_option("top_p", self.top_p)
        if self.seed is not None:
            check_option("seed", self.seed)


EARLY_STOPPING = {"true": True, "false": False, "never": "never"}


@dataclass(frozen=True)
class Decoding:
    """transformers' generate() options beyond sampling, with its names, defaults and semantics; checked when built.

    ``num_beams`` > 1 is beam search (:mod:`gpt2onnx.runtimes.beam`); ``early_stopping`` is True, False or
    "never" (also as the words true, false, never); ``stop``: strings that end a row (needs the folder's
    tokenizer)."""

    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # an invalid one cannot be built
        for name in (
            "num_beams",
            "num_return_sequences",
            "length_penalty",
            "repetition_penalty",
            "no_repeat_ngram_size",
            "min_new_tokens",
        ):
            check_option(name, getattr(self, name))
        early = self.early_stopping
        if isinstance(early, str) and not isinstance(early, bool):
            early = EARLY_STOPPING.get(early.lower(), early)
        if early not in (True, False, "never"):
            raise BadInput(
                f"--early-stopping must be true, false or never (early_stopping), got {self.early_stopping!r}"
            )
        object.__setattr__(self, "early_stopping", early)
        object.__setattr__(self, "stop", tuple(self.stop))
        if not self.beams:
            ignored = _set(length_penalty=self.length_penalty != 1.0, early_stopping=self.early_stopping is not False)
            ignored = [f"{name} (--{name.replace('_', '-')})" for name in ignored]
            if ignored:
                raise BadInput(
                    f"{' and '.join(ignored)} only {'apply' if len(ignored) > 1 else 'applies'} to beam search:"
                    " give --num-beams 2 or more"
                )
        if any(not s for s in self.stop):
            raise BadInput("a stop string (--stop) is empty: give some text")

    @property
    def beams(self) -> bool:
        return self.num_beams > 1

    def processors_on(self) -> bool:
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0 or self.min_new_tokens > 0

    @property
    def rows_per_prompt(self) -> int:
        """The rows a prompt takes in the decode loop: its beams, or its returned sequences."""
        return max(self.num_beams, self.num_return_sequences)


# What a request uses, as the decoding features a runtime may lack (gpt2onnx.capabilities' fact "features"); the
# pairs are features of their own where a loop can do each alone but not both (genai's beams with stop strings)
SAMPLING, BEAMS, TOP_K = "sampling", "beam search", "top-k"
NO_REPEAT_NGRAM, MIN_NEW_TOKENS, EARLY_STOPPING_NEVER = "no-repeat n-grams", "min_new_tokens", "early_stopping never"
BEAMS_WITH_STOP, BEAMS_WITH_PENALTY = "stop strings with beam search", "repetition_penalty with beam search"
SAMPLED_SEQUENCES, SEVERAL_SEQUENCES = "several sampled sequences per prompt", "several sequences per prompt"
STOP_STRINGS = "stop strings"


def features_of(sampling: Sampling, decoding: Decoding) -> frozenset[str]:
    """The decoding features a request with these options uses."""
    used = {
        SAMPLING: sampling.sample,
        TOP_K: sampling.sample and sampling.top_k != 0,
        BEAMS: decoding.beams,
        NO_REPEAT_NGRAM: decoding.no_repeat_ngram_size > 0,
        MIN_NEW_TOKENS: decoding.min_new_tokens > 0,
        EARLY_STOPPING_NEVER: decoding.early_stopping == "never",
        STOP_STRINGS: bool(decoding.stop),
        BEAMS_WITH_STOP: decoding.beams and bool(decoding.stop),
        BEAMS_WITH_PENALTY: decoding.beams and decoding.repetition_penalty != 1.0,
        SEVERAL_SEQUENCES: decoding.num_return_sequences > 1,
        SAMPLED_SEQUENCES: sampling.sample and decoding.num_return_sequences > 1,
    }
    return frozenset(name for name, on in used.items() if on)


def request_declared(sampling: Sampling, decoding: Decoding) -> Declared:
    """What a request's options declare: the features it uses (gpt2onnx.capabilities)."""
    return Declared("request", "options", ensures={"features": features_of(sampling, decoding)}, label="the request")


def check_pair(sampling: Sampling, decoding: Decoding) -> None:
    """The rules between sampling and decoding, applied where the two meet (generate, decode, a served request)."""
    if decoding.num_return_sequences > max(decoding.num_beams, 2**31 if sampling.sample else 1):
        raise BadInput(
            f"num_return_sequences (--num-return-sequences) {decoding.num_return_sequences} must be 1 to num_beams"
            f" ({decoding.num_beams}) with beam search, 1 with greedy decoding: raise --num-beams, or sample"
        )
    if decoding.beams and sampling.sample:
        raise BadInput("beam sampling (--num-beams with --sample) is not offered: drop one of them")


@dataclass
class Generation:
    """New tokens per returned sequence: rows = batch × num_return_sequences (row r continues prompt
    r // num_return_sequences, best beam first)."""

    tokens: np.ndarray  # [rows, steps] new token ids; a row that stopped is filled with the pad id
    finished: np.ndarray  # [rows] True where the row ended (end-of-sequence or a stop string)
    step_seconds: list[float] = field(default_factory=list)  # [0] is the prompt step
    # [rows] beam search: transformers' sequences_scores (sum of log-probs / new length ** length_penalty);
    # greedy and sampling: the sum of the new tokens' log-probs under the processed distribution; None: not known
    scores: np.ndarray | None = None
    num_return_sequences: int = 1
    lengths: np.ndarray | None = None  # [rows] new tokens in each row, up to and including its last real one
    speculation: object | None = None  # speculative decoding: its Acceptance (gpt2onnx.runtimes.speculative)


def process_scores(
    scores: np.ndarray,
    sequences: np.ndarray,
    *,
    prompt_length: int,
    decoding: Decoding,
    sampling: Sampling,
    eos_token_ids: tuple[int, ...],
    padding: np.ndarray | None = None,
    min_tokens_to_keep: int = 1,
) -> np.ndarray:
    """The logits processors of transformers' generate() in its order, on [rows, vocab] float32 scores and the
    rows' sequences so far (left-padded prompt included; ``padding``: each row's count of left padding, which the
    repetition penalty leaves out); the warpers only when sampling."""
    scores = logits.repetition_penalty(scores, sequences, decoding.repetition_penalty, skip=padding)
    scores = logits.no_repeat_ngram(scores, sequences, decoding.no_repeat_ngram_size)
    scores = logits.min_new_tokens(scores, sequences.shape[1] - prompt_length, decoding.min_new_tokens, eos_token_ids)
    if sampling.sample:
        scores = warp(scores, sampling, min_tokens_to_keep=min_tokens_to_keep)
    return scores


def warp(scores: np.ndarray, sampling: Sampling, *, min_tokens_to_keep: int = 1) -> np.ndarray:
    """Temperature, top-k and top-p as transformers' warpers: filtered float32 scores (-inf where dropped)."""
    scores = logits.temperature(scores.astype(np.float32), sampling.temperature)
    scores = logits.top_k(scores, sampling.top_k, min_tokens_to_keep=min_tokens_to_keep)
    return logits.top_p(scores, sampling.top_p, min_tokens_to_keep=min_tokens_to_keep)


def draw(scores: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row from softmax(scores) (float64, so the probabilities sum to 1 for numpy)."""
    probs = logits.softmax(scores.astype(np.float64))
    return np.array([rng.choice(probs.shape[-1], p=row / row.sum()) for row in probs])


def next_tokens(logits_last: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """[batch, vocab] logits of the last position → [batch] token ids (no processors)."""
    if not sampling.sample:
        return logits_last.argmax(-1)
    return draw(warp(logits_last, sampling), rng)


def loop_generation(
    prompts: list[list[int]],
    sequences: list[list[list[int]]],
    *,
    eos_token_ids: tuple[int, ...],
    pad_token_id: int | None,
    stop: Callable[[list[int]], bool] | None,
    decoding: Decoding,
    step_seconds: list[float],
    on_step: Callable[[int, np.ndarray], None] | None = None,
) -> Generation:
    """What a runtime that owns its loop returned (per prompt, the new tokens of its sequences, best first) as the
    decode loop returns it: ``num_return_sequences`` rows per prompt, each cut after its first end-of-sequence id
    or where a stop string ends (what stopping there would have given), padded with the pad id. ``on_step`` is
    called after the loop, not while it runs (not with beam search)."""
    fill = pad_token_id if pad_token_id is not None else 0
    rows, finished = [], []
    for prompt, found in zip(prompts, sequences):
        for tokens in found[: decoding.num_return_sequences]:
            ended = False
            for i, token in enumerate(tokens):
                if token in eos_token_ids or (stop is not None and stop(prompt + tokens[: i + 1])):
                    tokens, ended = tokens[: i + 1], True
                    break
            finished.append(ended)
            rows.append(tokens)
    width = max(len(r) for r in rows)
    tokens = np.array([r + [fill] * (width - len(r)) for r in rows], dtype=np.int64)
    if on_step is not None and not decoding.beams:
        for step in range(width):
            on_step(step, tokens[:, step])
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    return Generation(tokens, np.array(finished), step_seconds, None, decoding.num_return_sequences, lengths)


MAX_BATCH_TOKENS = 1 << 20  # rows × total length: beyond this the logits and cache would not fit in memory


def check_new_tokens(max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise BadInput(f"max_new_tokens must be at least 1 (a whole number), got {max_new_tokens!r}")


def check_request_size(batch: int, prompt_length: int, max_new_tokens: int, decoding: Decoding) -> int:
    """The rows a request takes (prompts × beams or returned sequences), refused past MAX_BATCH_TOKENS tokens at
    once; returns the rows."""
    rows = batch * decoding.rows_per_prompt
    if rows * (prompt_length + max_new_tokens) > MAX_BATCH_TOKENS:
        raise BadInput(
            f"{rows} rows (batch × beams) × {prompt_length + max_new_tokens} tokens is more than"
            f" {MAX_BATCH_TOKENS:,} tokens at once: use a smaller batch, fewer beams or fewer tokens"
        )
    return rows
