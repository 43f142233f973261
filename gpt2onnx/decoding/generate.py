"""The decode loop: prompt step with empty past, then one token per step with presents fed back as past.

Greedy, sampling (temperature, top-k, top-p, a seed) or beam search (:mod:`gpt2onnx.decoding.beam`), with
transformers' logits processors (repetition penalty, no-repeat n-grams, minimum new tokens:
:mod:`gpt2onnx.decoding.processors`) and stop conditions (end-of-sequence ids, stop strings, max_new_tokens), each
as ``GPT2LMHeadModel.generate`` does it; refuses a total length beyond the model's context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.artifact.lora import adapter_declared, adapter_of
from gpt2onnx.decoding.all_strategies import strategy_for
from gpt2onnx.decoding.beam import beam_search_bytes
from gpt2onnx.decoding.constraints import CONSTRAINT_KINDS, Constraint, TokenConstraint, vocabulary_of
from gpt2onnx.decoding.processors import StopStrings
from gpt2onnx.decoding.prompts import (
    TextStream,
    check_prompt_text,
    encode_prompts,
    has_tokenizer,
    load_tokenizer,
    parse_id_prompts,
)
from gpt2onnx.decoding.results import Generation, check_new_tokens, check_request_size
from gpt2onnx.decoding.speculative import Acceptance, Speculation
from gpt2onnx.decoding.strategy import Request
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling, check_pair, request_declared
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, check_combination, open_runtime
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.runtimes.runtime import LoopRuntime, StepRuntime


def _checked(decoder, input_ids, attention_mask, max_new_tokens: int, decoding: Decoding, eos_token_ids):
    """The prompt batch and its mask, refused where no runtime could run it, or this machine could not hold it."""
    input_ids = np.asarray(input_ids, dtype=np.int64)
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise BadInput("the prompt is empty: give at least one token")
    batch, prompt_length = input_ids.shape
    rows = check_request_size(batch, prompt_length, max_new_tokens, decoding)
    mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    if (mask.sum(-1) == 0).any():
        raise BadInput("a prompt row is all padding: every row needs at least one token")
    decoder.check_ids(input_ids, mask)
    total = prompt_length + max_new_tokens
    decoder.check_length(total)
    search = beam_search_bytes(batch, decoding, total, max_new_tokens, decoder.vocab_size, eos_token_ids)
    decoder.check_memory(rows, prompt_length, total, what="prompt batch", extra_bytes=search)
    return input_ids, mask


def as_ids(eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    return (int(eos_token_id),) if np.ndim(eos_token_id) == 0 else tuple(int(i) for i in eos_token_id)


def decode(
    decoder: StepRuntime | LoopRuntime,
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
    speculation: Speculation | None = None,
    draft: StepRuntime | None = None,
    constraint: TokenConstraint | None = None,
) -> Generation:
    """Continue a (left-padded) batch as transformers' generate() would with the same settings.

    ``eos_token_id``: one id or several; ``pad_token_id`` fills rows that stopped (default: the first eos id, as
    transformers does); ``stop(tokens)``: True where a row's real tokens so far end it (stop strings).
    ``on_step(step, ids)`` is called with each step's new ids, for streaming (not with beam search).
    ``speculation``: proposals checked in one step (:mod:`gpt2onnx.decoding.speculative`; greedy: the same
    tokens; sampling: the same distribution), with ``draft`` the opened draft folder where it names one.
    ``constraint``: what every row may write (:mod:`gpt2onnx.decoding.constraints`, bound to the model's tokens);
    the result's ``complete`` says which rows' tokens are a complete match."""
    check_pair(sampling, decoding)
    check_new_tokens(max_new_tokens)
    return _decode(
        decoder,
        input_ids,
        attention_mask,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        decoding=decoding,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        stop=stop,
        on_step=on_step,
        speculation=speculation,
        draft=draft,
        constraint=constraint,
    )


def _decode(
    decoder,
    input_ids,
    attention_mask,
    *,
    max_new_tokens,
    sampling,
    decoding,
    eos_token_id,
    pad_token_id,
    stop,
    on_step,
    speculation=None,
    draft=None,
    constraint=None,
) -> Generation:
    """decode() with its options already checked (the pair, max_new_tokens), run by the strategy that applies
    (gpt2onnx.decoding.all_strategies: speculative decoding, the runtime's own loop, beam search, greedy or
    sampled steps)."""
    eos_ids = as_ids(eos_token_id)
    input_ids, mask = _checked(decoder, input_ids, attention_mask, max_new_tokens, decoding, eos_ids)
    pad = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    if constraint is not None:
        _check_constraint(decoder, constraint, eos_ids)
    request = Request(
        input_ids, mask, max_new_tokens, sampling, decoding, eos_ids, pad, stop, on_step, speculation, draft, constraint
    )
    result = strategy_for(decoder, request).run(decoder, request)
    if constraint is not None:
        lengths = result.lengths if result.lengths is not None else [result.tokens.shape[1]] * len(result.tokens)
        result.complete = np.array([constraint.accepts(row[:n]) for row, n in zip(result.tokens.tolist(), lengths)])
    return result


def _check_constraint(decoder, constraint, eos_ids) -> None:
    """A constraint is a logits processor: a runtime with a loop of its own takes none, and it ends rows with the
    end-of-sequence ids it was bound to."""
    if not isinstance(constraint, TokenConstraint):
        raise BadInput("constraint must be a Constraint bound to the model's tokens (Constraint.bind(vocabulary))")
    if decoder.capabilities.owns_loop:
        raise BadInput(f"the {decoder.runtime} runtime runs its own loop, which takes no constraint: use onnxruntime")
    if tuple(constraint.eos_token_ids) != tuple(eos_ids):
        raise BadInput("the constraint was bound with other end-of-sequence ids than the request's: bind it again")
    if decoder.vocab_size is not None and constraint.vocab_size != decoder.vocab_size:
        raise BadInput(
            f"the constraint was bound to {constraint.vocab_size} tokens, the model has {decoder.vocab_size}"
        )


@dataclass(frozen=True)
class GenerationSettings:
    """What a :func:`generate` call decoded with: its options, the eos and pad ids and the runtime used, the
    speculation and the constraint where given. :meth:`as_dict` is ``generate --json``'s settings object."""

    sampling: Sampling
    decoding: Decoding
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    runtime: str
    speculation: Speculation | None = None
    constraint_kind: str | None = None  # a constraint's kind (gpt2onnx.decoding.constraints.CONSTRAINT_KINDS)
    constraint_source: str | None = None  # where its text came from: a file, or the option that gave it

    def as_dict(self) -> dict:
        out = {
            **asdict(self.decoding),
            **asdict(self.sampling),
            "max_new_tokens": self.max_new_tokens,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "runtime": self.runtime,
            "stop": list(self.decoding.stop),
        }
        if self.speculation is not None:
            out["speculation"] = self.speculation.as_dict()
        if self.constraint_kind is not None:
            out["constraint"] = {"kind": self.constraint_kind, "source": self.constraint_source}
        return out


@dataclass(frozen=True)
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
    settings: GenerationSettings | None = None  # the decoding settings, eos and pad ids used
    speculation: Acceptance | None = None  # speculative decoding: how many proposals the model kept
    complete: list[bool] | None = None  # with a constraint: per row, its text is a complete match

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
                            **({} if self.complete is None else {"complete": self.complete[r]}),
                        }
                        for r in rows
                    ],
                }
            )
        settings = {} if self.settings is None else self.settings.as_dict()
        out = {"settings": settings, "prompts": prompts, "step_seconds": self.step_seconds}
        if self.speculation is not None:
            out["speculation"] = self.speculation.as_dict()
        return out


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
    speculation: Speculation | None = None,
    constraint: Constraint | None = None,
    adapter: str | None = None,
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
        speculation: prompt lookup or a draft folder (:class:`~gpt2onnx.decoding.speculative.Speculation`):
            proposals checked several at a time; greedy gives the same tokens as without, sampling the same
            distribution. The draft is opened on the same runtime and provider, and needs the model's vocabulary
            size. Rows run one at a time. The result's ``speculation`` says how many proposals were kept.
        constraint: what every row may write (:class:`~gpt2onnx.decoding.constraints.Constraint`: a JSON schema,
            a regex, a Lark grammar, a choice), checked against the folder's tokens before the model is opened.
            The result's ``complete`` says, per row, whether its text is a complete match (a row that ran out of
            ``max_new_tokens`` first is not).
        adapter: a switchable LoRA adapter of the folder (exported with ``--adapters``) made active, by name.

    Returns:
        TextGeneration. Raises: BadInput (prompts, options, folder), ContractError, IntegrityError,
        RuntimeUnavailable (the runtime or provider cannot load).
    """
    if bool(prompts) == bool(ids):
        raise BadInput("give the prompt as text (--prompt) or as token ids (--ids 1,2,3), one of them")
    check_pair(sampling, decoding)
    check_new_tokens(max_new_tokens)
    for text in prompts or []:
        check_prompt_text(text)
    model = open_folder(folder, verify_files=verify_files)
    request = _request(model, prompts, ids, decoding)
    bound = None
    if constraint is not None:
        if not isinstance(constraint, Constraint):
            raise BadInput("constraint must be a gpt2onnx Constraint (Constraint.json_schema, .regex, .lark, .choice)")
        vocabulary = vocabulary_of(model.folder, vocab_size=model.facts.vocab_size, eos_token_ids=request.eos_ids)
        bound = constraint.bind(vocabulary)
    options = runtime or RuntimeOptions(settings=provider)
    draft_model = speculation_draft(model, speculation, sampling, decoding, options, verify_files)
    strategy = [speculation.declared] if speculation is not None else []
    strategy += [constraint.declared] if constraint is not None else []
    adapter_path = adapter_of(model, adapter) if adapter is not None else None  # a name the folder has
    strategy += [adapter_declared(adapter)] if adapter is not None else []  # a runtime that binds its factors
    decoder = open_runtime(model, options, request_declared(sampling, decoding), *strategy)
    draft = None
    stream = TextStream(request.tokenizer if prompts else None)

    def step(index: int, new_ids: np.ndarray) -> None:
        if on_text is None or len(new_ids) != 1:
            return
        if index == 0:
            on_text("prompt", request.shown[0])
        on_text("token", stream.push(int(new_ids[0])))

    try:
        if adapter_path is not None:
            decoder.activate_adapter(adapter_path)
        if draft_model is not None:
            draft = open_runtime(draft_model, options)
        result = _decode(
            decoder,
            request.input_ids,
            request.mask,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            decoding=decoding,
            eos_token_id=request.eos_ids,
            pad_token_id=request.pad_id,
            stop=StopStrings(request.tokenizer, decoding.stop) if decoding.stop else None,
            on_step=step,
            speculation=speculation,
            draft=draft,
            constraint=bound,
        )
    finally:
        decoder.close()
        if draft is not None:
            draft.close()
    settings = GenerationSettings(
        sampling,
        decoding,
        max_new_tokens,
        tuple(request.eos_ids),
        request.pad_id,
        decoder.runtime,
        speculation=speculation,
        constraint_kind=None if constraint is None else constraint.kind,
        constraint_source=None if constraint is None else constraint.source or CONSTRAINT_KINDS[constraint.kind].flag,
    )
    return _text_generation(result, request, settings, text=bool(prompts))


def speculation_draft(model, speculation, sampling, decoding, options, verify_files):
    """What speculative decoding needs of the folders, refused in one line before any session is made: what it
    declares (every position's logits, a runtime that checks proposals), and a folder its proposer names (a draft)
    with the model's vocabulary size. Returns that folder, opened (None where the proposer has none)."""
    if speculation is None:
        return None
    check_combination(model, options, request_declared(sampling, decoding), speculation.declared)
    return open_draft(speculation, model, verify_files)


def open_draft(speculation, model=None, verify_files: bool = False):
    """The folder the proposer names (a draft's), opened and refused in one line where it is not one, or where its
    vocabulary size is not the model's (an opened folder; None: no model to compare with). None: no such folder."""
    if speculation.folder is None:
        return None
    try:
        draft = open_folder(speculation.folder, verify_files=verify_files)
    except BadInput as err:  # its subclasses (ContractError, IntegrityError) take one message too
        raise type(err)(f"the {speculation.proposer.name} ({speculation.proposer.switch.flag}): {err}") from None
    ours, theirs = model.facts.vocab_size if model is not None else None, draft.facts.vocab_size
    if ours not in (None, theirs):
        raise BadInput(
            f"the draft '{draft.folder}' has a vocabulary of {theirs} tokens and the model '{model.folder}' one of"
            f" {ours}: a draft must share the model's tokenizer"
        )
    return draft


@dataclass
class _Request:
    """generate's prompts as a left-padded batch, with what it needs to show them and to stop."""

    tokenizer: object
    input_ids: np.ndarray
    mask: np.ndarray
    shown: list[str]  # each prompt as shown: its text, or its ids
    eos_ids: tuple[int, ...]
    pad_id: int


def _request(model, prompts: list[str] | None, ids: list[str] | None, decoding: Decoding) -> _Request:
    """The prompts through the folder's tokenizer (or the ids), padded with the folder's pad id, as transformers
    reads it from generation_config.json (else config.json)."""
    generation = read_generation_config(model.folder, vocab_size=model.facts.vocab_size)  # ids in the vocabulary
    if decoding.stop and not prompts and not has_tokenizer(model.folder):
        raise BadInput(f"stop strings (--stop) need the tokenizer files, and '{model.folder}' has none: drop --stop")
    tokenizer = load_tokenizer(model.folder) if prompts or decoding.stop else None
    eos_ids, pad = generation.eos_token_ids, generation.pad_token_id
    pad_id = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
    input_ids, mask = encode_prompts(tokenizer, prompts, pad_id=pad_id) if prompts else parse_id_prompts(ids, pad_id)
    shown = list(prompts) if prompts else [" ".join(map(str, row[m > 0])) for row, m in zip(input_ids, mask)]
    return _Request(tokenizer, input_ids, mask, shown, tuple(eos_ids), pad_id)


def _text_generation(
    result: Generation, request: _Request, settings: GenerationSettings, *, text: bool
) -> TextGeneration:
    """The decode loop's rows as generate's result: per returned sequence its prompt, new ids, text and score."""
    lengths = result.lengths if result.lengths is not None else [result.tokens.shape[1]] * len(result.tokens)
    new = [row[:length] for row, length in zip(result.tokens.tolist(), lengths)]
    texts = [TextStream(request.tokenizer if text else None).text(row) for row in new]
    index = [r // result.num_return_sequences for r in range(len(new))]
    scores = [None] * len(new) if result.scores is None else [float(v) for v in result.scores]
    return TextGeneration(
        [request.shown[i] for i in index],
        new,
        texts,
        result.finished.tolist(),
        result.step_seconds,
        index,
        [row[m > 0].tolist() for row, m in zip(request.input_ids, request.mask)],
        scores,
        settings,
        speculation=result.speculation,
        complete=None if result.complete is None else result.complete.tolist(),
    )
