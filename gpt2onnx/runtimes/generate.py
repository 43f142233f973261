"""The decode loop: prompt step with empty past, then one token per step with presents fed back as past.

Greedy, or sampling with temperature, top-k, top-p and a seed; stops at end-of-sequence (per row) or after
max_new_tokens; refuses a total length beyond the model's context.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.artifact.folder import eos_token_id, open_folder
from gpt2onnx.errors import BadInput
from gpt2onnx.runtimes.base import LoopRunner, Runtime, RuntimeOptions, open_runtime
from gpt2onnx.runtimes.decoder import position_ids_for
from gpt2onnx.runtimes.prompts import TextStream, encode_prompts, load_tokenizer, parse_id_prompts
from gpt2onnx.runtimes.providers import ProviderConfig

MAX_BATCH_TOKENS = 1 << 20  # batch × total length: beyond this the logits and cache would not fit in memory


@dataclass(frozen=True)
class Sampling:
    """Greedy unless ``sample`` is set."""

    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None

    def __post_init__(self) -> None:
        self.check()  # an invalid one cannot be built

    def check(self) -> None:
        if not self.sample:
            ignored = [
                name
                for name, on in (
                    ("temperature", self.temperature != 1.0),
                    ("top_k", self.top_k != 0),
                    ("top_p", self.top_p != 1.0),
                    ("seed", self.seed is not None),
                )
                if on
            ]
            if ignored:
                raise BadInput(
                    f"{', '.join(ignored)} only apply when sampling: turn sampling on (--sample), or drop them"
                )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise BadInput(f"temperature (--temperature) must be a positive number, got {self.temperature}")
        if self.top_k < 0:
            raise BadInput(f"top_k (--top-k) must be 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"top_p (--top-p) must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise BadInput(f"seed (--seed) must be 0 to 2**63 - 1, got {self.seed}")


@dataclass
class Generation:
    tokens: np.ndarray  # [batch, steps] new token ids (rows that stopped are padded with eos)
    finished: np.ndarray  # [batch] True where the row produced eos
    step_seconds: list[float] = field(default_factory=list)  # [0] is the prompt step


def next_tokens(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """[batch, vocab] logits of the last position → [batch] token ids."""
    if not sampling.sample:
        return logits.argmax(-1)
    scores = logits.astype(np.float64) / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = np.partition(scores, -sampling.top_k, axis=-1)[:, -sampling.top_k][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if sampling.top_p < 1.0:
        order = np.argsort(-probs, axis=-1)
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the most likely token)
        drop_sorted = np.cumsum(sorted_probs, axis=-1) - sorted_probs >= sampling.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=row) for row in probs])


def _checked(decoder, input_ids, attention_mask, max_new_tokens: int, sampling: Sampling):
    """The prompt batch and its mask, refused where no runtime could run it."""
    input_ids = np.asarray(input_ids, dtype=np.int64)
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise BadInput("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise BadInput(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if input_ids.shape[0] * (input_ids.shape[1] + max_new_tokens) > MAX_BATCH_TOKENS:
        raise BadInput(
            f"batch {input_ids.shape[0]} × {input_ids.shape[1] + max_new_tokens} tokens is more than"
            f" {MAX_BATCH_TOKENS:,} tokens at once: use a smaller batch or fewer tokens"
        )
    mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    if (mask.sum(-1) == 0).any():
        raise BadInput("a prompt row is all padding: every row needs at least one token")
    sampling.check()
    decoder.check_ids(input_ids, mask)
    decoder.check_length(input_ids.shape[1] + max_new_tokens)
    return input_ids, mask


def generate_loop(
    runner: LoopRunner,
    input_ids: np.ndarray,
    mask: np.ndarray,
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_token_id: int | None = None,
    on_step: Callable[[int, np.ndarray], None] | None = None,
) -> Generation:
    """A runtime that owns its loop (genai): each row on its own (genai pads on the right, our batches are
    left-padded), its padding dropped. ``step_seconds[k]`` is the sum over rows of step k. ``on_step`` is
    called after the loop, not while it runs."""
    search = {}
    if sampling.sample:
        search = {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or (runner.vocab_size or 50257),
        }
        if sampling.seed is not None:
            search["random_seed"] = int(sampling.seed % 2**31)
    fill = eos_token_id if eos_token_id is not None else 0
    rows, seconds, finished = [], [], []
    for row, row_mask in zip(input_ids, mask):
        result = runner.run_loop(row[row_mask > 0].tolist(), max_new_tokens=max_new_tokens, search=search)
        tokens = result.tokens
        if eos_token_id is not None and eos_token_id in tokens:
            tokens = tokens[: tokens.index(eos_token_id) + 1]
        finished.append(eos_token_id is not None and eos_token_id in tokens)
        rows.append(tokens)
        seconds += [0.0] * (len(result.step_seconds) - len(seconds))
        for k, value in enumerate(result.step_seconds):
            seconds[k] += value
    width = max(len(r) for r in rows)
    tokens = np.array([r + [fill] * (width - len(r)) for r in rows], dtype=np.int64)
    if on_step is not None:
        for step in range(width):
            on_step(step, tokens[:, step])
    return Generation(tokens, np.array(finished), seconds)


def generate(
    decoder: Runtime,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_token_id: int | None = None,
    on_step: Callable[[int, np.ndarray], None] | None = None,
) -> Generation:
    """Continue a (left-padded) batch. ``on_step(step, ids)`` is called with each step's new ids, for streaming."""
    input_ids, mask = _checked(decoder, input_ids, attention_mask, max_new_tokens, sampling)
    if decoder.capabilities.owns_loop:
        return generate_loop(
            decoder,
            input_ids,
            mask,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos_token_id=eos_token_id,
            on_step=on_step,
        )
    rng = np.random.default_rng(sampling.seed)
    batch = input_ids.shape[0]
    full_mask = decoder.prompt_mask(mask)
    positions = position_ids_for(mask)
    finished = np.zeros(batch, dtype=bool)
    tokens, seconds = [], []
    start = time.perf_counter()
    past = decoder.empty_past(batch, capacity=full_mask.shape[1] + max_new_tokens)
    logits, past = decoder.run(input_ids, full_mask, positions, past)
    seconds.append(time.perf_counter() - start)
    for step in range(max_new_tokens):
        ids = next_tokens(logits[:, -1], sampling, rng)
        if eos_token_id is not None:
            ids = np.where(finished, eos_token_id, ids)
            finished |= ids == eos_token_id
        tokens.append(ids)
        if on_step is not None:
            on_step(step, ids)
        if step == max_new_tokens - 1 or finished.all():
            break
        next_ids = ids[:, None].astype(np.int64)
        full_mask = np.concatenate([full_mask, np.ones((batch, 1), np.int64)], axis=1)
        positions = positions[:, -1:] + 1
        start = time.perf_counter()
        logits, past = decoder.run(next_ids, full_mask, positions, past)
        seconds.append(time.perf_counter() - start)
    return Generation(np.stack(tokens, axis=1), finished, seconds)


@dataclass
class TextGeneration:
    """What :func:`generate_text` returns: per row, the prompt as shown, the new token ids and the new text."""

    prompts: list[str]
    tokens: list[list[int]]  # new ids per row, up to and including end-of-sequence
    texts: list[str]  # the new text per row (token ids joined by commas when the folder has no tokenizer)
    finished: list[bool]  # the row produced end-of-sequence
    step_seconds: list[float]


def generate_text(
    folder: str | Path,
    *,
    prompts: list[str] | None = None,
    ids: list[str] | None = None,
    max_new_tokens: int = 32,
    sampling: Sampling = Sampling(),
    provider: ProviderConfig = ProviderConfig(),
    runtime: RuntimeOptions | None = None,
    verify_files: bool = True,
    on_text: Callable[[str, str], None] | None = None,
) -> TextGeneration:
    """Continue prompts with an exported folder: text through the folder's tokenizer, or token ids.

    Args:
        folder: an exported decoder folder.
        prompts: prompt texts, one per row (needs the folder's tokenizer files); or
        ids: prompt token ids, one comma-separated string per row. Give exactly one of the two.
        max_new_tokens: the most tokens to generate per row; rows stop early at end-of-sequence.
        sampling: greedy by default; temperature, top-k, top-p and seed when ``sample`` is set.
        provider: onnxruntime's execution provider and its options.
        runtime: the runtime and its options (default: onnxruntime on ``provider``). genai runs the rows one
            at a time and streams only once its loop has finished.
        verify_files: check the model files against the manifest's sha256 first.
        on_text: streaming, for a single row: called with ("prompt", text) once every check has passed, then
            ("token", new text) per step.

    Returns:
        TextGeneration. Raises: BadInput (prompts, options, folder), ContractError, IntegrityError,
        RuntimeUnavailable (the runtime or provider cannot load).
    """
    if bool(prompts) == bool(ids):
        raise BadInput("give the prompt as text (--prompt) or as token ids (--ids 1,2,3), one of them")
    sampling.check()
    model = open_folder(folder, verify_files=verify_files)
    tokenizer = load_tokenizer(model.folder) if prompts else None
    input_ids, mask = encode_prompts(tokenizer, prompts) if prompts else parse_id_prompts(ids)
    shown = list(prompts) if prompts else [" ".join(map(str, row[m > 0])) for row, m in zip(input_ids, mask)]
    decoder = open_runtime(model, runtime or RuntimeOptions(provider=provider))
    decoder.check_memory(
        input_ids.shape[0], input_ids.shape[1], input_ids.shape[1] + max_new_tokens, what="prompt batch"
    )
    eos = eos_token_id(model.folder)
    stream = TextStream(tokenizer)

    def step(index: int, new_ids: np.ndarray) -> None:
        if on_text is None or len(new_ids) != 1:
            return
        if index == 0:
            on_text("prompt", shown[0])
        on_text("token", stream.push(int(new_ids[0])))

    try:
        result = generate(
            decoder, input_ids, mask, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_id=eos, on_step=step
        )
    finally:
        decoder.close()
    rows = []
    for tokens in result.tokens.tolist():
        rows.append(tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens)
    texts = [TextStream(tokenizer).text(row) for row in rows]
    return TextGeneration(shown, rows, texts, result.finished.tolist(), result.step_seconds)
