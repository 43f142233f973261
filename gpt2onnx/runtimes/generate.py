"""The decode loop: prompt step with empty past, then one token per step with presents fed back as past.

Greedy, sampling (temperature, top-k, top-p, a seed) or beam search (:mod:`gpt2onnx.runtimes.beam`), with
transformers' logits processors (repetition penalty, no-repeat n-grams, minimum new tokens:
:mod:`gpt2onnx.runtimes.logits`) and stop conditions (end-of-sequence ids, stop strings, max_new_tokens), each
as ``GPT2LMHeadModel.generate`` does it; refuses a total length beyond the model's context.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.errors import BadInput
from gpt2onnx.runtimes import logits
from gpt2onnx.runtimes.base import LoopRunner, Runtime, RuntimeOptions, open_runtime
from gpt2onnx.runtimes.beam import beam_search, beam_search_bytes
from gpt2onnx.runtimes.decoder import position_ids_for
from gpt2onnx.runtimes.decoding import (  # noqa: F401 - re-exported: the public names live here too
    EARLY_STOPPING,
    Decoding,
    Generation,
    Sampling,
    draw,
    next_tokens,
    process_scores,
    warp,
)
from gpt2onnx.runtimes.logits import StopStrings
from gpt2onnx.runtimes.prompts import (
    TextStream,
    check_prompt_text,
    encode_prompts,
    has_tokenizer,
    load_tokenizer,
    parse_id_prompts,
)
from gpt2onnx.runtimes.providers import ProviderConfig

MAX_BATCH_TOKENS = 1 << 20  # batch × total length: beyond this the logits and cache would not fit in memory


def _checked(decoder, input_ids, attention_mask, max_new_tokens: int, sampling: Sampling, decoding: Decoding):
    """The prompt batch and its mask, refused where no runtime could run it."""
    input_ids = np.asarray(input_ids, dtype=np.int64)
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise BadInput("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise BadInput(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    rows = input_ids.shape[0] * max(decoding.num_beams, decoding.num_return_sequences)
    if rows * (input_ids.shape[1] + max_new_tokens) > MAX_BATCH_TOKENS:
        raise BadInput(
            f"{rows} rows (batch × beams) × {input_ids.shape[1] + max_new_tokens} tokens is more than"
            f" {MAX_BATCH_TOKENS:,} tokens at once: use a smaller batch, fewer beams or fewer tokens"
        )
    mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    if (mask.sum(-1) == 0).any():
        raise BadInput("a prompt row is all padding: every row needs at least one token")
    sampling.check()
    decoding.check(sampling)
    decoder.check_ids(input_ids, mask)
    decoder.check_length(input_ids.shape[1] + max_new_tokens)
    return input_ids, mask


def as_ids(eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    return (int(eos_token_id),) if np.ndim(eos_token_id) == 0 else tuple(int(i) for i in eos_token_id)


def decode(
    decoder: Runtime,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    decoding: Decoding = Decoding(),
    eos_token_id: int | tuple[int, ...] | None = None,
    pad_token_id: int | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    on_step: Callable[[int, np.ndarray], None] | None = None,
) -> Generation:
    """Continue a (left-padded) batch as transformers' generate() would with the same settings.

    ``eos_token_id``: one id or several; ``pad_token_id`` fills rows that stopped (default: the first eos id, as
    transformers does); ``stop(tokens)``: True where a row's real tokens so far end it (stop strings).
    ``on_step(step, ids)`` is called with each step's new ids, for streaming (not with beam search)."""
    input_ids, mask = _checked(decoder, input_ids, attention_mask, max_new_tokens, sampling, decoding)
    eos_ids = as_ids(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    if decoder.capabilities.owns_loop:
        return decode_loop(
            decoder,
            input_ids,
            mask,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            decoding=decoding,
            eos_token_ids=eos_ids,
            pad_token_id=pad,
            stop=stop,
            on_step=on_step,
        )
    if decoding.beams:
        return beam_search(
            decoder,
            input_ids,
            mask,
            max_new_tokens=max_new_tokens,
            decoding=decoding,
            eos_token_ids=eos_ids,
            pad_token_id=pad,
            stop=stop,
        )
    copies = decoding.num_return_sequences
    if copies > 1:  # transformers expands the inputs: each prompt once per returned sequence
        input_ids, mask = np.repeat(input_ids, copies, axis=0), np.repeat(mask, copies, axis=0)
    rng = np.random.default_rng(sampling.seed)
    batch, prompt_length = input_ids.shape
    full_mask = decoder.prompt_mask(mask)
    positions = position_ids_for(mask)
    sequences = input_ids.copy()
    real = [row[m > 0].tolist() for row, m in zip(input_ids, mask)]  # for stop strings
    finished = np.zeros(batch, dtype=bool)
    scores = np.zeros(batch, dtype=np.float64)
    lengths = np.zeros(batch, dtype=np.int64)
    tokens, seconds = [], []
    start = time.perf_counter()
    past = decoder.empty_past(batch, capacity=full_mask.shape[1] + max_new_tokens)
    out, past = decoder.run(input_ids, full_mask, positions, past)
    seconds.append(time.perf_counter() - start)
    processed = sampling.sample or decoding.processors_on()
    padding = (mask == 0).sum(axis=1)  # left padding: transformers 5's (mask != 0).argmax(1)
    for step in range(max_new_tokens):
        last = out[:, -1].astype(np.float32)
        if processed:
            last = process_scores(
                last,
                sequences,
                prompt_length=prompt_length,
                decoding=decoding,
                sampling=sampling,
                eos_token_ids=eos_ids,
                padding=padding,
            )
        ids = draw(last, rng) if sampling.sample else last.argmax(-1)
        chosen = np.take_along_axis(logits.log_softmax(last), ids[:, None], axis=1)[:, 0]
        scores += np.where(finished, 0.0, chosen)
        lengths += ~finished
        if pad is not None:
            ids = np.where(finished, pad, ids)
        sequences = np.concatenate([sequences, ids[:, None]], axis=1)
        ended = np.isin(ids, eos_ids) if eos_ids else np.zeros(batch, dtype=bool)
        if stop is not None:
            for row in np.flatnonzero(~finished):
                real[row].append(int(ids[row]))
                ended[row] |= stop(real[row])
        finished |= ended
        tokens.append(ids)
        if on_step is not None:
            on_step(step, ids)
        if step == max_new_tokens - 1 or finished.all():
            break
        next_ids = ids[:, None].astype(np.int64)
        full_mask = np.concatenate([full_mask, np.ones((batch, 1), np.int64)], axis=1)
        positions = positions[:, -1:] + 1
        start = time.perf_counter()
        out, past = decoder.run(next_ids, full_mask, positions, past)
        seconds.append(time.perf_counter() - start)
    return Generation(np.stack(tokens, axis=1), finished, seconds, scores, copies, lengths)


# what onnxruntime-genai's own loop takes from Decoding: our option → its search option
GENAI_SEARCH = {
    "num_beams": "num_beams",
    "length_penalty": "length_penalty",
    "num_return_sequences": "num_return_sequences",
}


def genai_search(sampling: Sampling, decoding: Decoding, vocab_size: int | None) -> dict:
    """genai's search options for our settings, refusing (one line) what its loop cannot do as transformers."""
    refused = [
        (decoding.no_repeat_ngram_size > 0, "--no-repeat-ngram-size"),
        (decoding.min_new_tokens > 0, "--min-new-tokens"),
        (decoding.early_stopping == "never", "--early-stopping never"),
        (decoding.beams and bool(decoding.stop), "--stop with beam search"),
        # genai penalises the logits before its beam scores' log-softmax; transformers the log-probabilities
        (decoding.beams and decoding.repetition_penalty != 1.0, "--repetition-penalty with beam search"),
        (sampling.sample and decoding.num_return_sequences > 1, "--num-return-sequences with sampling"),
    ]
    for bad, option in refused:
        if bad:
            raise BadInput(
                f"the genai runtime cannot do {option} as transformers does: use --runtime onnxruntime, or drop it"
            )
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


def decode_loop(
    runner: LoopRunner,
    input_ids: np.ndarray,
    mask: np.ndarray,
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    decoding: Decoding = Decoding(),
    eos_token_ids: tuple[int, ...] = (),
    pad_token_id: int | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    on_step: Callable[[int, np.ndarray], None] | None = None,
) -> Generation:
    """A runtime that owns its loop (genai): each row on its own (genai pads on the right, our batches are
    left-padded), its padding dropped. ``step_seconds[k]`` is the sum over rows of step k. ``on_step`` is
    called after the loop, not while it runs. Beam search runs genai's own; its scores are not exposed.
    A stop string cuts a greedy or sampled row where it ends (what stopping there would have given)."""
    search = genai_search(sampling, decoding, runner.vocab_size)
    fill = pad_token_id if pad_token_id is not None else 0
    rows, seconds, finished = [], [], []
    for row, row_mask in zip(input_ids, mask):
        prompt = row[row_mask > 0].tolist()
        result = runner.run_loop(prompt, max_new_tokens=max_new_tokens, search=search)
        sequences = result.sequences or [result.tokens]
        for tokens in sequences[: decoding.num_return_sequences]:
            if (
                result.sequences
                and eos_token_ids
                and len(tokens) < max_new_tokens
                and tokens[-1:] != [eos_token_ids[0]]
            ):
                tokens = tokens + [
                    eos_token_ids[0]
                ]  # genai's finished beams leave out their eos; transformers' end on it
            ended = False
            for i, token in enumerate(tokens):
                if token in eos_token_ids or (stop is not None and stop(prompt + tokens[: i + 1])):
                    tokens, ended = tokens[: i + 1], True
                    break
            finished.append(ended)
            rows.append(tokens)
        seconds += [0.0] * (len(result.step_seconds) - len(seconds))
        for k, value in enumerate(result.step_seconds):
            seconds[k] += value
    width = max(len(r) for r in rows)
    tokens = np.array([r + [fill] * (width - len(r)) for r in rows], dtype=np.int64)
    if on_step is not None and not decoding.beams:
        for step in range(width):
            on_step(step, tokens[:, step])
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    return Generation(tokens, np.array(finished), seconds, None, decoding.num_return_sequences, lengths)


@dataclass
class TextGeneration:
    """What :func:`generate` returns: per returned sequence (``num_return_sequences`` per prompt, best beam
    first), the prompt as shown, the new token ids, the new text and its score."""

    prompts: list[str]  # per row: the prompt it continues
    tokens: list[list[int]]  # new ids per row, up to and including end-of-sequence
    texts: list[str]  # the new text per row (token ids joined by commas when the folder has no tokenizer)
    finished: list[bool]  # the row ended (end-of-sequence or a stop string)
    step_seconds: list[float]
    prompt_index: list[int] = field(default_factory=list)  # per row: which prompt it continues
    prompt_ids: list[list[int]] = field(default_factory=list)  # per prompt: its real token ids
    scores: list[float | None] = field(default_factory=list)  # per row: see Generation.scores
    settings: dict = field(default_factory=dict)  # the decoding settings, eos and pad ids used

    def as_dict(self) -> dict:
        """For --json: per prompt, every returned sequence with its token ids, text and score."""
        prompts = []
        for index, ids in enumerate(self.prompt_ids):
            rows = [r for r, p in enumerate(self.prompt_index) if p == index]
            prompts.append(
                {
                    "prompt": self.prompts[rows[0]],
                    "prompt_ids": ids,
                    "sequences": [
                        {
                            "token_ids": self.tokens[r],
                            "text": self.texts[r],
                            "score": self.scores[r],
                            "finished": self.finished[r],
                        }
                        for r in rows
                    ],
                }
            )
        return {"settings": self.settings, "prompts": prompts, "step_seconds": self.step_seconds}


def generate(
    folder: str | Path,
    *,
    prompts: list[str] | None = None,
    ids: list[str] | None = None,
    max_new_tokens: int = 32,
    sampling: Sampling = Sampling(),
    decoding: Decoding = Decoding(),
    provider: ProviderConfig = ProviderConfig(),
    runtime: RuntimeOptions | None = None,
    verify_files: bool = True,
    on_text: Callable[[str, str], None] | None = None,
) -> TextGeneration:
    """Continue prompts with an exported folder: text through the folder's tokenizer, or token ids.

    Args:
        folder: an exported decoder folder; its generation_config.json (else config.json) gives the
            end-of-sequence ids and the padding id (default: the first eos id), as transformers reads them.
        prompts: prompt texts, one per row (needs the folder's tokenizer files); or
        ids: prompt token ids, one comma-separated string per row. Give exactly one of the two. A batch is
            left-padded with the padding id.
        max_new_tokens: the most tokens to generate per row; rows stop early at end-of-sequence.
        sampling: greedy by default; temperature, top-k, top-p and seed when ``sample`` is set.
        decoding: beam search, penalties, minimum new tokens, stop strings (these need the tokenizer),
            returned sequences per prompt.
        provider: onnxruntime's execution provider and its options.
        runtime: the runtime and its options (default: onnxruntime on ``provider``). genai runs the rows one
            at a time and streams only once its loop has finished.
        verify_files: check the model files against the manifest's sha256 first.
        on_text: streaming, for a single row without beams: called with ("prompt", text) once every check has
            passed, then ("token", new text) per step.

    Returns:
        TextGeneration. Raises: BadInput (prompts, options, folder), ContractError, IntegrityError,
        RuntimeUnavailable (the runtime or provider cannot load).
    """
    if bool(prompts) == bool(ids):
        raise BadInput("give the prompt as text (--prompt) or as token ids (--ids 1,2,3), one of them")
    sampling.check()
    decoding.check(sampling)
    for text in prompts or []:
        check_prompt_text(text)
    model = open_folder(folder, verify_files=verify_files)
    generation = read_generation_config(model.folder, vocab_size=model.facts.vocab_size)  # ids in the vocabulary
    if decoding.stop and not prompts and not has_tokenizer(model.folder):
        raise BadInput(f"stop strings (--stop) need the tokenizer files, and '{model.folder}' has none: drop --stop")
    tokenizer = load_tokenizer(model.folder) if prompts or decoding.stop else None
    eos_ids, pad = generation.eos_token_ids, generation.pad_token_id
    pad_id = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
    input_ids, mask = encode_prompts(tokenizer, prompts, pad_id=pad_id) if prompts else parse_id_prompts(ids, pad_id)
    shown = list(prompts) if prompts else [" ".join(map(str, row[m > 0])) for row, m in zip(input_ids, mask)]
    decoder = open_runtime(model, runtime or RuntimeOptions(provider=provider))
    rows = input_ids.shape[0] * max(decoding.num_beams, decoding.num_return_sequences)
    total = input_ids.shape[1] + max_new_tokens
    search = beam_search_bytes(input_ids.shape[0], decoding, total, max_new_tokens, decoder.vocab_size, eos_ids)
    decoder.check_memory(rows, input_ids.shape[1], total, what="prompt batch", extra_bytes=search)
    stream = TextStream(tokenizer if prompts else None)
    stop = StopStrings(tokenizer, decoding.stop) if decoding.stop else None

    def step(index: int, new_ids: np.ndarray) -> None:
        if on_text is None or len(new_ids) != 1:
            return
        if index == 0:
            on_text("prompt", shown[0])
        on_text("token", stream.push(int(new_ids[0])))

    try:
        result = decode(
            decoder,
            input_ids,
            mask,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            decoding=decoding,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            stop=stop,
            on_step=step,
        )
    finally:
        decoder.close()
    lengths = result.lengths if result.lengths is not None else [result.tokens.shape[1]] * len(result.tokens)
    new = [row[:length] for row, length in zip(result.tokens.tolist(), lengths)]
    texts = [TextStream(tokenizer if prompts else None).text(row) for row in new]
    index = [r // result.num_return_sequences for r in range(len(new))]
    scores = [None] * len(new) if result.scores is None else [float(v) for v in result.scores]
    settings = {
        **{k: v for k, v in asdict(decoding).items()},
        **asdict(sampling),
        "max_new_tokens": max_new_tokens,
        "eos_token_id": list(eos_ids),
        "pad_token_id": pad_id,
        "runtime": decoder.runtime,
    }
    settings["stop"] = list(decoding.stop)
    return TextGeneration(
        [shown[i] for i in index],
        new,
        texts,
        result.finished.tolist(),
        result.step_seconds,
        index,
        [row[m > 0].tolist() for row, m in zip(input_ids, mask)],
        scores,
        settings,
    )
