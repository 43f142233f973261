"""Continuous batching: many generation requests decoded together by one engine thread, each streaming its tokens.

A request joins the running batch at the next decode step (its prompt runs first, together with the other
requests that arrived since the last step), leaves it the step it finishes (end-of-sequence, a stop string,
``max_new_tokens``, or cancelled), and keeps its own K/V rows all the while. The cache is a padded one over the
concat graph (:class:`~gpt2onnx.runtimes.decoder.OnnxDecoder`, every profile): one [rows, heads, P, head_dim]
tensor per layer K and V, each row left-padded to the longest row's length P, with the attention mask and
position ids saying which columns are real (the IO contract's left padding). Between joins and leaves the
presents of a step are bound as the next step's past as they are; a join pads the shorter side on the left and
stacks the rows, a leave picks the remaining rows, and both drop the leading columns no row uses any more. The
shared-cache graph (ort-shared-kv) is run the same way (its GroupQueryAttention also concatenates a growing
past): its preallocated buffer has one length for every row (``seqlens_k`` comes from the mask's width), which a
batch whose rows come and go does not have. The static-cache graph (onnx-static-kv) keeps its own stepper
(:class:`~gpt2onnx.runtimes.decoder.StaticCacheDecoder`): its buffers, of the model's context, hold the padded
cache; a join, leave or trim hands it a new past, which it copies in, and the steps in between write in place.
Its presents are views of those buffers, so the joining prompts run on a second stepper (its twin, buffers of the
prompts' width): run on the batch's own, a prompt would write over the running rows' K/V before they join.

Each request is decoded as :func:`gpt2onnx.decoding.generate.decode` decodes a batch of one: the same logits
processors (:func:`~gpt2onnx.decoding.processors.process_scores`) on its own sequence, its own random generator
seeded as ``Sampling.seed`` says, the same stop conditions. Its greedy tokens are therefore those that
``gpt2onnx generate`` writes for it alone, and its logits the same floats: a row's arithmetic does not depend on
its batch (:mod:`gpt2onnx.passes.batch_invariance` aligns the attention of every export against its padding),
except where attention is a fused kernel whose sums follow the padding (the stepper's ``padding_period``): then
a step runs its rows in groups whose lengths agree modulo the period, each group's padding cut to whole periods
(:meth:`_run_groups`; tests/serving/test_batch_invariance.py checks tokens and log-probabilities bitwise). Beam search
(``num_beams`` > 1) is not batched: each beam request runs alone through
:func:`~gpt2onnx.decoding.beam.beam_search` on a second thread, one at a time, beside the batch, and returns
its best beam in one event. ``num_return_sequences`` > 1 is refused: send one request per sequence.

A folder exported with switchable LoRA adapters (``export --adapters``) serves each request with the adapter it
names (``submit(..., adapter=NAME)``; None: the base). The factors are inputs bound per run
(:meth:`~gpt2onnx.runtimes.decoder.OnnxDecoder.adapter_factors`), so a step whose rows use several adapters runs
once per adapter on those rows (their rows of the padded past picked on the host, the presents and logits put back
in row order), and the joining prompts are grouped by adapter too. A step whose rows all use one adapter (every
step of a folder without adapters) runs once, as before, with nothing copied.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.artifact.contract import position_ids_for
from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.capabilities import Declared, Lacks, Need, resolve
from gpt2onnx.decoding.constraints import Constraint, vocabulary_of
from gpt2onnx.decoding.generate import decode
from gpt2onnx.decoding.processors import Bias, StopStrings, draw, process_scores, top_logprobs
from gpt2onnx.decoding.prompts import TextStream, has_tokenizer, left_pad
from gpt2onnx.decoding.results import check_new_tokens, check_request_size
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.errors import BadInput, Gpt2OnnxError
from gpt2onnx.generation_options import SEVERAL_SEQUENCES, Decoding, Sampling, check_pair, request_declared
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime, runtime_spec
from gpt2onnx.runtimes.decoder import OnnxDecoder, SharedCacheDecoder
from gpt2onnx.runtimes.heap import release_freed_memory
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.runtimes.runtime import StepRuntime
from gpt2onnx.serving.requests import NOT_SPECULATIVE, PromptReader, whole_number

log = logging.getLogger(__name__)
ONE_SEQUENCE = "send one request per sequence (with seeds)"

MAX_ROWS = 256  # the most requests decoded together
PREFILL_TOKENS = 128  # the most padded prompt tokens one joining step runs (more: several steps; _prefill)
MAX_LOGPROBS = 20  # the most top tokens a request may ask the log-probabilities of (vLLM's default limit)
# What the engine needs: a stepper whose rows can join and leave a running batch; one sequence per request
ENGINE = Declared(
    "engine",
    "batching",
    requires=(
        Need("batches_rows", allowed={True}, why="decodes rows that join and leave a running batch"),
        Need(
            "batch_separable",
            allowed={True},
            why="gives each request the tokens it gets alone, whatever its batch",
            fix="export the folder again (this gpt2onnx writes graphs whose rows do not depend on their batch)",
        ),
        Lacks("features", {SEVERAL_SEQUENCES: "serves one sequence per request, not"}, fix=ONE_SEQUENCE),
    ),
    ensures={"adapter_per_request": True},  # binds each run's LoRA factors itself (module docstring)
    label="the batching engine",
)
# A request that names a switchable adapter: a server whose rows may each use another adapter
ADAPTER_REQUEST = Declared(
    "request",
    "adapter",
    requires=(Need("adapter_per_request", allowed={True}, why="names a LoRA adapter of its own"),),
    label="a request with an adapter",
)
FINISH_REASONS = ("eos", "stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class TokenEvent:
    """What a request gets after each of its steps: the new token ids (one per step; a beam request's whole
    sequence at once), the text they add (empty while a character is incomplete), and on the last event why it
    ended; ``error`` when the engine could not finish it."""

    request_id: int
    token_ids: tuple[int, ...]
    text: str
    index: int  # how many new tokens came before these
    finish_reason: str | None = None  # set on the last event: eos, stop, length, cancelled or error
    error: Gpt2OnnxError | None = None
    # per token, where the request asked for them: its log-probability and the top tokens' (id, log-probability)
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
    # on the request's first event, where it asked for them (prompt_logprobs): per prompt token, the same given the
    # tokens before it (None for the first token, which has none before it)
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]] | None, ...] | None = None

    @property
    def last(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    """A finished request: its prompt ids, its new token ids (end-of-sequence included, as generate returns
    them), the new text, why it ended, and when its first token and its end came (seconds after submit)."""

    request_id: int
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    finish_reason: str
    first_token_seconds: float | None = None
    seconds: float | None = None
    error: Gpt2OnnxError | None = None
    complete: bool | None = None  # with a constraint: its tokens are a complete match (None: no constraint)
    prompt_logprobs: tuple | None = None  # as the first TokenEvent's, where the request asked for them


class GenerationStream:
    """The handle :meth:`BatchingEngine.submit` returns: iterate it for its :class:`TokenEvent` (unless the
    request was given ``on_event``), wait for its :class:`Completion` with :meth:`result`, or :meth:`cancel` it."""

    def __init__(self, request_id: int, on_event: Callable[[TokenEvent], None] | None):
        self.request_id = request_id
        self._on_event = on_event
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._done = threading.Event()
        self._cancelled = threading.Event()
        self._completion: Completion | None = None

    def __iter__(self):
        if self._on_event is not None:
            raise BadInput("this request delivers its events to on_event: wait for result() instead")
        while True:
            event = self._events.get()
            yield event
            if event.last:
                return

    def cancel(self) -> None:
        """Stop the request at the engine's next step (its last event says ``cancelled``)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Completion:
        """The completion, once the request has ended; raises its error where the engine failed it, and
        TimeoutError after ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._completion.error is not None:
            raise self._completion.error
        return self._completion

    # -- engine side ------------------------------------------------------------------------------------------
    def _emit(self, event: TokenEvent) -> None:
        if self._on_event is None:
            self._events.put(event)
            return
        try:
            self._on_event(event)
        except Exception:  # a caller's callback must not stop the engine: the request is cancelled instead
            log.exception("on_event of request %s failed: the request is cancelled", self.request_id)
            self._cancelled.set()

    def _finish(self, completion: Completion) -> None:
        self._completion = completion
        self._done.set()


@dataclass
class _Request:
    """A checked request and its decoding state."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    decoding: Decoding
    stream: GenerationStream
    stop: StopStrings | None
    text: TextStream
    submitted: float
    rng: np.random.Generator = field(init=False)
    tokens: list[int] = field(default_factory=list)
    first_token: float | None = None
    bias: Bias = Bias()
    logprobs: int | None = None  # the top tokens' log-probabilities wanted (None: none, not even the chosen's)
    prompt_logprobs: int | None = None  # the same for each prompt token (None: the prompt's are not computed)
    prompt_scores: tuple | None = None  # those, computed by the prompt step
    prompt_sent: bool = False  # whether an event carried them
    pending: tuple | None = None  # the chosen token's log-probabilities until its event
    constraint: object = None  # gpt2onnx.decoding.constraints.TokenConstraint
    matcher: object = None  # its matcher for this request's row
    adapter: str | None = None  # its switchable LoRA adapter (None: the base)
    factors: dict = field(default_factory=dict)  # that adapter's factors, bound to every run of its rows

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.sampling.seed)  # as decode() seeds a batch of one
        if self.constraint is not None and not self.decoding.beams:
            self.matcher = self.constraint.start(1)

    @property
    def processed(self) -> bool:
        return self.sampling.sample or self.decoding.processors_on() or self.bias.on or self.matcher is not None


class BatchingEngine:
    """Generation requests decoded together by one engine thread (continuous batching; module docstring).

    ``decoder``: a stepper (the onnxruntime runtime: :func:`~gpt2onnx.runtimes.runtime.open_runtime`);
    ``tokenizer``: for text prompts, text out and stop strings (``None``: token ids only);
    ``max_batch``: the most requests decoded together (more wait for a free row).
    Use :meth:`open` for a folder. Close it (or use it as a context manager) to stop its threads."""

    def __init__(
        self,
        decoder: StepRuntime,
        *,
        tokenizer=None,
        eos_token_ids: tuple[int, ...] = (),
        pad_token_id: int | None = None,
        max_batch: int = 16,
    ):
        if decoder.capabilities.owns_loop:
            raise BadInput(f"the {decoder.runtime} runtime runs its own loop: continuous batching needs onnxruntime")
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or not 1 <= max_batch <= MAX_ROWS:
            raise BadInput(f"max_batch must be 1 to {MAX_ROWS}, got {max_batch}")
        self._runtime = runtime_spec(decoder.runtime).declared
        resolve([self._runtime, ENGINE]).check()
        # the batch runs the concat way on every graph (module docstring), beams on a stepper of their own: two
        # threads never share a stepper's buffers (a static cache's are rebound by every step)
        self.decoder = decoder.twin() if isinstance(decoder, OnnxDecoder) else decoder
        self.stepper = decoder
        if isinstance(decoder, SharedCacheDecoder):
            self.stepper = OnnxDecoder(decoder.session, n_positions=decoder.n_positions, device_id=decoder.device_id)
            self.stepper.padding_period = decoder.padding_period  # the same graph's kernels
        # the joining prompts run on a stepper of their own where the batch's presents are views of its stepper's
        # buffers (a static cache): a prompt run on those would write over the running rows' K/V before they join
        self.prompter = self.stepper.twin() if self.stepper.capabilities.preallocates else self.stepper
        self.tokenizer = tokenizer
        self.reader = PromptReader(tokenizer, self.stepper.n_positions, self.stepper.vocab_size)
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (eos_token_ids[0] if eos_token_ids else 0)
        self.max_batch = max_batch
        self.vocabulary = None  # the model's tokens for constraints (gpt2onnx.decoding.constraints.Vocabulary)
        self._folder = None  # the folder open() read: where constraints find the tokenizer
        self._model = None  # that folder, opened: its manifest names its switchable adapters
        self._factors: dict[str, dict] = {}  # each adapter's factors, read on its first request
        self._factors_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._waiting: list[_Request] = []
        self._beams: queue.Queue[_Request | None] = queue.Queue()
        self._closed = False
        self._rows: list[_Request] = []  # the running batch, in cache row order (engine thread only)
        self._past: list | None = None  # per layer K and V: [rows, heads, P, head_dim]
        self._mask: np.ndarray | None = None  # [rows, P]
        self.steps = 0  # decode steps run (each over the whole batch)
        self.rows_stepped = 0  # the sum of their batch sizes: rows_stepped / steps is the mean batch
        self.rows_joined = 0  # requests that joined a batch already decoding (continuous batching at work)
        self.prompt_steps = 0  # prompt steps run (joining requests: PREFILL_TOKENS padded tokens each at most)
        self._thread = threading.Thread(target=self._loop, name="gpt2onnx-batching", daemon=True)
        self._beam_thread = threading.Thread(target=self._beam_loop, name="gpt2onnx-beams", daemon=True)
        self._thread.start()
        self._beam_thread.start()

    @classmethod
    def open(
        cls,
        folder: str | Path,
        *,
        max_batch: int = 16,
        provider: ProviderConfig = ProviderConfig(),
        verify_files: bool = True,
        tokenizer="auto",
    ) -> "BatchingEngine":
        """An engine on an exported folder (onnxruntime on ``provider``): its end-of-sequence and padding ids as
        generate reads them, its tokenizer loaded without transformers
        (:func:`~gpt2onnx.decoding.gpt2_tokenizer.load_gpt2_tokenizer`) where it has one (``tokenizer``: another one,
        or None for token ids only)."""
        model = open_folder(folder, verify_files=verify_files)
        if tokenizer == "auto":
            from gpt2onnx.decoding.gpt2_tokenizer import load_gpt2_tokenizer

            tokenizer = load_gpt2_tokenizer(model.folder) if has_tokenizer(model.folder) else None
        generation = read_generation_config(model.folder, vocab_size=model.facts.vocab_size)
        eos_ids, pad = generation.eos_token_ids, generation.pad_token_id
        decoder = open_runtime(model, RuntimeOptions(settings=provider), ENGINE)
        engine = cls(decoder, tokenizer=tokenizer, eos_token_ids=eos_ids, pad_token_id=pad, max_batch=max_batch)
        engine._folder = model.folder  # constraints bind to its tokens, read on the first constrained request
        engine._model = model
        return engine

    def __enter__(self) -> "BatchingEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the caller's side --------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """A text prompt's token ids, read as every prompt is (:class:`~gpt2onnx.serving.requests.PromptReader`)."""
        if not isinstance(text, str):
            raise BadInput(f"the prompt must be text, got {type(text).__name__}")
        return self.reader.ids(text)

    def submit(
        self,
        prompt: str | list[int],
        *,
        max_new_tokens: int = 32,
        sampling: Sampling = Sampling(),
        decoding: Decoding = Decoding(),
        on_event: Callable[[TokenEvent], None] | None = None,
        speculation: Speculation | None = None,
        bias: Bias = Bias(),
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        adapter: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> GenerationStream:
        """Queue one request: ``prompt`` as text (needs the tokenizer) or token ids; the decoding options of
        generate. Checked here, in the caller's thread (BadInput, one line), before it is queued. ``on_event``:
        called on the engine's thread with each event (it must be quick: the batch waits for it); without it,
        iterate the returned stream. ``speculation`` (generate's :class:`~gpt2onnx.decoding.speculative.Speculation`)
        is refused: the batch checks one token per row per step. ``bias``: OpenAI's logit bias and presence and
        frequency penalties (:class:`~gpt2onnx.decoding.processors.Bias`); ``logprobs``: each event also carries its
        token's log-probability and the ``logprobs`` most likely tokens' (0 to MAX_LOGPROBS), from the model's
        logits before any processor (as vLLM's default). ``constraint``: what this request may write
        (:class:`~gpt2onnx.decoding.constraints.Constraint`; each request its own), its completion's ``complete``
        saying whether the tokens are a complete match. ``adapter``: a switchable LoRA adapter of the folder, by
        name (:attr:`adapters`; None: the base). ``prompt_logprobs``: the first event (and the completion) also
        carries each prompt token's log-probability given the tokens before it and the ``prompt_logprobs`` most
        likely tokens' there (the first token: None); only such a request's prompt step computes every position's
        logits; with it ``max_new_tokens`` may be 0: the prompt step only, ended with ``length``."""
        if speculation is not None:
            raise BadInput(f"{NOT_SPECULATIVE}: drop speculation")
        ids = self.reader.ids(prompt)  # types first: a float or a bytes prompt is no list of ids
        max_new_tokens = whole_number("max_new_tokens", max_new_tokens)
        if max_new_tokens != 0 or decoding.beams or prompt_logprobs is None:  # 0: the prompt's log-probabilities only
            check_new_tokens(max_new_tokens)
        if not isinstance(sampling, Sampling) or not isinstance(decoding, Decoding):
            raise BadInput("sampling and decoding must be gpt2onnx's Sampling and Decoding")
        check_pair(sampling, decoding)
        if not isinstance(bias, Bias):
            raise BadInput("bias must be gpt2onnx's Bias")
        bias.check_vocabulary(self.stepper.vocab_size)
        if logprobs is not None:
            logprobs = whole_number("logprobs", logprobs)
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise BadInput(f"logprobs {logprobs} is not an integer from 0 to {MAX_LOGPROBS}: ask for fewer")
            if decoding.beams:
                raise BadInput("logprobs are not given with beam search: drop one of them")
        if prompt_logprobs is not None:
            prompt_logprobs = whole_number("prompt_logprobs", prompt_logprobs)
            if not 0 <= prompt_logprobs <= MAX_LOGPROBS:
                raise BadInput(
                    f"prompt_logprobs {prompt_logprobs} is not an integer from 0 to {MAX_LOGPROBS}: ask for fewer"
                )
            if decoding.beams:
                raise BadInput("prompt_logprobs are not given with beam search: drop one of them")
            if self._model is not None and self._model.facts.logits_last:
                raise BadInput(
                    "prompt_logprobs need every position's logits, and this folder returns the last only: export it"
                    " with --logits all"
                )
        if bias.on and decoding.beams:
            raise BadInput("logit_bias and presence or frequency penalties are not applied to beam search: drop them")
        resolve([self._runtime, request_declared(sampling, decoding), ENGINE]).check()  # what the engine serves
        if decoding.stop and self.tokenizer is None:
            raise BadInput("stop strings need the model's tokenizer files, and this model has none: drop them")
        self.reader.check_length(len(ids), max_new_tokens)
        if decoding.beams:  # refused here, not on the beam thread
            check_request_size(1, len(ids), max_new_tokens, decoding)
        stop = StopStrings(self.tokenizer, decoding.stop) if decoding.stop else None
        bound = self._bind(constraint) if constraint is not None else None
        factors = self._adapter(adapter) if adapter is not None else {}
        request_id = next(self._ids)
        stream = GenerationStream(request_id, on_event)
        request = _Request(
            request_id,
            ids,
            max_new_tokens,
            sampling,
            decoding,
            stream,
            stop,
            TextStream(self.tokenizer),
            time.perf_counter(),
            bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            constraint=bound,
            adapter=adapter,
            factors=factors,
        )
        with self._lock:
            if self._closed:
                raise BadInput("the engine is closed: open a new one")
            if decoding.beams:
                self._beams.put(request)
            else:
                self._waiting.append(request)
                self._lock.notify()
        return stream

    def _bind(self, constraint: Constraint):
        """The constraint on the model's tokens (its vocabulary read once), refused in one line here."""
        if not isinstance(constraint, Constraint):
            raise BadInput("constraint must be a gpt2onnx Constraint (Constraint.json_schema, .regex, .lark, .choice)")
        if self.vocabulary is None:
            folder = self._folder
            if folder is None:
                raise BadInput("constraints need the model's tokenizer files: open the engine with BatchingEngine.open")
            vocab_size = self.stepper.vocab_size
            self.vocabulary = vocabulary_of(folder, vocab_size=vocab_size, eos_token_ids=self.eos_token_ids)
        return constraint.bind(self.vocabulary)

    @property
    def adapters(self) -> tuple[str, ...]:
        """The names of the folder's switchable LoRA adapters (none where it has none, or was not opened by open())."""
        manifest = self._model.manifest if self._model is not None else None
        return tuple(manifest.adapters) if manifest is not None else ()

    def _adapter(self, name: str) -> dict:
        """Adapter ``name``'s factors (its file checked against the manifest, read once), refused in one line."""
        from gpt2onnx.artifact.lora import adapter_of

        resolve([self._runtime, ENGINE, ADAPTER_REQUEST]).check()
        if self._model is None or not isinstance(self.stepper, OnnxDecoder):
            raise BadInput("adapters need an onnxruntime folder's engine: open it with BatchingEngine.open")
        with self._factors_lock:
            if name not in self._factors:
                self._factors[name] = self.stepper.adapter_factors(adapter_of(self._model, name))
            return self._factors[name]

    @property
    def load(self) -> tuple[int, int]:
        """(requests waiting for a row, requests decoding): for metrics, read without the engine's lock."""
        return len(self._waiting), len(self._rows)

    def generate(self, prompt: str | list[int], **options) -> Completion:
        """Submit one request and wait for its completion (the options of :meth:`submit`)."""
        return self.submit(prompt, **options).result()

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop taking requests, end the waiting and running ones as cancelled, and stop the threads."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._beams.put(None)
        self._thread.join(timeout)
        self._beam_thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._waiting and not self._rows:
                    self._lock.wait()
                if self._closed:
                    waiting, self._waiting = self._waiting, []
                    break
                free = self.max_batch - len(self._rows)
                admitted, self._waiting = self._waiting[:free], self._waiting[free:]
            self._drop_cancelled()
            if admitted:
                try:
                    self._prefill(admitted)
                except Exception as err:  # the new requests fail; the running ones are untouched
                    self._fail([r for r in admitted if r not in self._rows], err)
            if self._rows:
                try:
                    self._step()
                except Exception as err:  # the running rows fail; the engine goes on with the next requests
                    rows, self._rows, self._past, self._mask = self._rows, [], None, None
                    self._fail(rows, err)
                if not self._rows:  # the batch drained: its caches and buffers go back to the system (heap.py)
                    release_freed_memory()
        for request in [*self._rows, *waiting]:
            self._end(request, "cancelled")
        self._rows, self._past, self._mask = [], None, None

    def _fail(self, requests: list[_Request], err: Exception) -> None:
        """End these requests with ``err`` (logged in one line: a refusal or a failure of these requests only)."""
        line = (str(err).splitlines() or [type(err).__name__])[0]
        log.error("generation failed for %d request(s): %s", len(requests), line)
        failure = _failure(err)
        for request in requests:
            try:
                self._end(request, "error", error=failure)
            except Exception as second:  # its callback or its stream failed too: it is finished all the same
                log.error("request %s could not be ended cleanly: %s", request.id, second)
                request.stream._finish(
                    Completion(request.id, request.prompt, list(request.tokens), "", "error", error=failure)
                )

    def _prefill(self, requests: list[_Request]) -> None:
        """The new requests' prompts, in groups of at most PREFILL_TOKENS padded tokens (a request longer than
        that alone): each group one left-padded step (empty past), its first tokens, its rows joined to the batch.
        A prompt step's logits are [rows, tokens, vocabulary]: 16 prompts of 48 tokens in one step held 871 MB at
        its peak in the 124M int8 server (309 MB at rest); groups bound it, and a row's tokens do not depend on
        its group (per-token activations, issue 54)."""
        requests = [r for r in requests if not self._cancelled_now(r)]
        period = self.stepper.padding_period  # where sums follow the padding: prompts padded by multiples of it
        key = (lambda r: (r.adapter, len(r.prompt) % period)) if period else (lambda r: r.adapter)
        for same in _by_adapter(requests, key).values():  # one adapter's factors per run
            group: list[_Request] = []
            for request in same:
                longest = max([len(request.prompt), *(len(r.prompt) for r in group)])
                if group and (len(group) + 1) * longest > PREFILL_TOKENS:
                    self._prefill_group(group)
                    group = []
                group.append(request)
            if group:
                self._prefill_group(group)

    def _prefill_group(self, requests: list[_Request]) -> None:
        ids, mask = left_pad([r.prompt for r in requests], self.pad_token_id)
        self.prompt_steps += 1
        full_mask = self.prompter.prompt_mask(mask)
        empty = self.prompter.empty_past(len(ids), capacity=full_mask.shape[1])  # a static cache: the prompts' width
        _bind_factors(self.prompter, requests[0].factors)  # one adapter per group (_prefill)
        scored = [i for i, r in enumerate(requests) if r.prompt_logprobs is not None]
        logits, presents = self.prompter.run(
            ids, full_mask, position_ids_for(mask), empty, last_logits_only=not scored
        )  # every position's only where a request asks for its prompt's log-probabilities
        if scored:
            if logits.shape[1] != ids.shape[1]:
                raise BadInput("prompt_logprobs need every position's logits: export the folder with --logits all")
            for i in scored:  # a row's real tokens are its last len(prompt) columns (left padding)
                request, rows = requests[i], logits[i, ids.shape[1] - len(requests[i].prompt) :]
                request.prompt_scores = (None,) + tuple(
                    top_logprobs(rows[j - 1], token, request.prompt_logprobs)
                    for j, token in enumerate(request.prompt)
                    if j > 0
                )
        going = []
        for i, request in enumerate(requests):
            if request.max_new_tokens == 0:
                self._end(request, "length")
            else:
                going.append(i)
        if not going:
            return
        keep = [going[k] for k in self._choose([requests[i] for i in going], logits[going, -1])]
        if not keep:
            return
        past = [_host(p)[keep] for p in presents]
        self._join(past, full_mask[keep], [requests[i] for i in keep])

    def _step(self) -> None:
        """One decode step over the running batch, then each row's next token; finished rows leave."""
        rows = self._rows
        ids = np.array([[r.tokens[-1]] for r in rows], dtype=np.int64)
        positions = self._mask.sum(axis=1, keepdims=True).astype(np.int64)  # each row's count of real tokens
        mask = np.concatenate([self._mask, np.ones((len(rows), 1), np.int64)], axis=1)
        period = self.stepper.padding_period
        if period:  # sums that follow the padding: rows whose lengths agree modulo the period run together
            lengths = mask.sum(axis=1)
            groups = list(_by_adapter(range(len(rows)), key=lambda i: (rows[i].adapter, lengths[i] % period)).values())
        else:
            groups = list(_by_adapter(range(len(rows)), key=lambda i: rows[i].adapter).values())
        if len(groups) == 1 and not self._cut(mask, groups[0]):  # one run, its presents bound as they are
            _bind_factors(self.stepper, rows[0].factors)
            logits, self._past = self.stepper.run(ids, mask, positions, self._past)
        else:
            logits, self._past = self._run_groups(groups, ids, mask, positions)
        self._mask = mask
        self.steps += 1
        self.rows_stepped += len(rows)
        keep = self._choose(rows, logits[:, -1])
        if len(keep) < len(rows):
            self._leave(keep)

    def _run_groups(self, groups: list[list[int]], ids, mask, positions) -> tuple[np.ndarray, list[np.ndarray]]:
        """A step whose rows use several adapters, or whose sums follow the padding: one run per group on its rows
        of the padded past (picked on the host), the logits and presents put back in row order (copied out before
        the next run: a static cache's presents are views of buffers the next run writes). Where the stepper has
        a padding period, each group's leading columns are cut so that every row's padding is a multiple of it
        (its rows' lengths agree modulo the period), as alone it has none."""
        past = [_host(p) for p in self._past]
        width = mask.shape[1]
        logits, presents = None, None
        for rows in groups:
            cut = self._cut(mask, rows)
            _bind_factors(self.stepper, self._rows[rows[0]].factors)
            part, values = self.stepper.run(
                ids[rows], mask[rows, cut:], positions[rows], [p[rows][:, :, cut:] for p in past]
            )
            values = [_host(v) for v in values]
            if logits is None:
                logits = np.empty((len(ids), *part.shape[1:]), part.dtype)
                presents = [np.zeros((len(ids), v.shape[1], width, *v.shape[3:]), v.dtype) for v in values]
            logits[rows] = part
            for whole, value in zip(presents, values):
                whole[rows, :, cut:] = value
        return logits, presents

    def _cut(self, mask: np.ndarray, rows: list[int]) -> int:
        """The leading columns a group of rows runs without: its padding past a whole padding period (its rows'
        lengths agree modulo the period); 0 where the stepper's sums do not follow the padding."""
        period = self.stepper.padding_period
        return (mask.shape[1] - int(mask[rows[0]].sum())) % period if period else 0

    def _choose(self, requests: list[_Request], last: np.ndarray) -> list[int]:
        """Each request's next token from its row of the last logits, as decode() picks it for a batch of one;
        emits the events and returns the indices of the requests that go on."""
        plain = [i for i, r in enumerate(requests) if not r.processed]
        chosen = {}
        if plain:
            for i, token in zip(plain, last[plain].argmax(-1)):
                chosen[i] = int(token)
        for i, request in enumerate(requests):
            if i in chosen:
                continue
            sequence = np.asarray([request.prompt + request.tokens], dtype=np.int64)
            raw = last[i : i + 1].astype(np.float32)
            if request.matcher is not None:  # the constraint first, as decode() masks before its processors
                raw = allowed = request.matcher.mask(raw)
            scores = process_scores(
                request.bias(raw, request.tokens),
                sequence,
                prompt_length=len(request.prompt),
                decoding=request.decoding,
                sampling=request.sampling,
                eos_token_ids=self.eos_token_ids,
                padding=np.zeros(1, dtype=np.int64),
            )
            if request.matcher is not None:
                scores = allowed if np.isneginf(scores).all() else scores  # the constraint wins, as in decode()
            token = draw(scores, request.rng)[0] if request.sampling.sample else scores.argmax(-1)[0]
            chosen[i] = int(token)
            if request.matcher is not None:
                request.matcher.advance([chosen[i]])
        for i, request in enumerate(requests):
            if request.logprobs is not None:
                request.pending = top_logprobs(last[i], chosen[i], request.logprobs)
        keep = []
        now = time.perf_counter()
        for i, request in enumerate(requests):
            try:
                if self._advance(request, chosen[i], now):
                    keep.append(i)
            except Exception as err:  # this request's text or stop check failed: it ends, the others go on
                self._fail([request], err)
        return keep

    def _advance(self, request: _Request, token: int, now: float) -> bool:
        """One request's new token: its stop conditions, its text and its event; whether it goes on."""
        request.tokens.append(token)
        if request.first_token is None:
            request.first_token = now - request.submitted
        reason = None
        if token in self.eos_token_ids:
            reason = "eos"
        elif request.stop is not None and request.stop(request.prompt + request.tokens):
            reason = "stop"
        elif len(request.tokens) >= request.max_new_tokens:
            reason = "length"
        piece = request.text.push(token)
        if reason is not None:
            self._end(request, reason, token=token, piece=piece)
            return False
        logprobs = (request.pending,) if request.logprobs is not None else None
        request.stream._emit(
            TokenEvent(
                request.id, (token,), piece, len(request.tokens) - 1, logprobs=logprobs,
                prompt_logprobs=_prompt_once(request),
            )
        )  # fmt: skip
        if request.stream.cancelled:
            self._end(request, "cancelled")
            return False
        return True

    def _end(
        self,
        request: _Request,
        reason: str,
        *,
        token: int | None = None,
        piece: str = "",
        error: Gpt2OnnxError | None = None,
    ) -> None:
        """The last event (with the rest of the text, where a character was waiting for its next byte) and the
        completion."""
        if request.stream.done:
            return
        shown = request.text.shown  # push() has already counted ``piece`` in
        if error is None:
            try:
                text = request.text.text(request.tokens)
            except Exception as err:  # the text cannot be decoded: the request ends with that error
                reason, error = "error", _failure(err)
                log.error("request %s: its text could not be decoded: %s", request.id, err)
                text = shown
        else:
            text = shown  # an ending error: never run the tokenizer again (it may be what failed)
        rest = text[len(shown) :] if text.startswith(shown) else ""
        first = 0 if token is None else len(request.tokens) - 1
        index = len(request.tokens) if token is None else first
        ids = () if token is None else (token,)
        logprobs = None
        if request.logprobs is not None:
            logprobs = () if token is None else (request.pending,)
        request.stream._emit(
            TokenEvent(request.id, ids, piece + rest, index, reason, error, logprobs, _prompt_once(request))
        )
        request.stream._finish(_completion(request, text, reason, error))

    def _cancelled_now(self, request: _Request) -> bool:
        if request.stream.cancelled:
            self._end(request, "cancelled")
            return True
        return False

    def _drop_cancelled(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if not self._cancelled_now(r)]
        if len(keep) < len(self._rows):
            self._leave(keep)

    # -- the padded cache -----------------------------------------------------------------------------------------
    def _join(self, past: list[np.ndarray], mask: np.ndarray, requests: list[_Request]) -> None:
        """New rows (host arrays, their own left padding) stacked under the running ones, the shorter side
        left-padded with masked zero columns."""
        if not self._rows:
            self._past, self._mask, self._rows = past, mask, list(requests)
            self._trim()
            return
        self.rows_joined += len(requests)
        old = [_host(p) for p in self._past]
        width = max(self._mask.shape[1], mask.shape[1])
        self._past = [np.concatenate([_pad_left(a, width), _pad_left(b, width)], axis=0) for a, b in zip(old, past)]
        self._mask = np.concatenate([_pad_left_2d(self._mask, width), _pad_left_2d(mask, width)], axis=0)
        self._rows = self._rows + list(requests)
        self._trim()

    def _leave(self, keep: list[int]) -> None:
        """Only the rows ``keep`` stay (their cache rows picked on the host)."""
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._past, self._mask = None, None
            return
        self._past = [_host(p)[keep] for p in self._past]
        self._mask = self._mask[keep]
        self._trim()

    def _trim(self) -> None:
        """Drop the leading columns that are padding in every row (a long row left, or a join padded)."""
        unused = int((np.cumsum(self._mask, axis=1) == 0).sum(axis=1).min())
        if unused:
            self._past = [np.ascontiguousarray(_host(p)[:, :, unused:]) for p in self._past]
            self._mask = self._mask[:, unused:]

    # -- beam search, one request at a time beside the batch --------------------------------------------------
    def _beam_loop(self) -> None:
        while True:
            request = self._beams.get()
            if request is None:
                break
            if self._cancelled_now(request):
                continue
            if self._closed:
                self._end(request, "cancelled")
                continue
            try:
                _bind_factors(self.decoder, request.factors)  # this thread's own stepper (__init__)
                result = decode(
                    self.decoder,
                    np.asarray([request.prompt], dtype=np.int64),
                    max_new_tokens=request.max_new_tokens,
                    sampling=request.sampling,
                    decoding=request.decoding,
                    eos_token_id=self.eos_token_ids,
                    pad_token_id=self.pad_token_id,
                    stop=request.stop,
                    constraint=request.constraint,
                )
                tokens = result.tokens[0, : int(result.lengths[0])].tolist()
                request.tokens = tokens
                request.first_token = time.perf_counter() - request.submitted
                if not result.finished[0]:
                    reason = "length"
                else:
                    reason = "eos" if tokens and tokens[-1] in self.eos_token_ids else "stop"
                self._end_beams(request, reason)
            except Exception as err:  # this request fails, in one line; the beam thread goes on
                self._fail([request], err)

    def _end_beams(self, request: _Request, reason: str) -> None:
        text = request.text.text(request.tokens)
        request.stream._emit(TokenEvent(request.id, tuple(request.tokens), text, 0, reason))
        request.stream._finish(_completion(request, text, reason, None))


def _completion(request: _Request, text: str, reason: str, error: Gpt2OnnxError | None) -> Completion:
    """The request's completion as it ends now (``complete``: whether its tokens are a complete match of its
    constraint, None without one)."""
    complete = request.constraint.accepts(request.tokens) if request.constraint is not None else None
    seconds = time.perf_counter() - request.submitted
    return Completion(
        request.id, request.prompt, list(request.tokens), text, reason, request.first_token, seconds, error,
        complete, request.prompt_scores,
    )  # fmt: skip


def _prompt_once(request: _Request) -> tuple | None:
    """The request's prompt log-probabilities for its first event (None on the others, or where not asked)."""
    if request.prompt_sent or request.prompt_scores is None:
        return None
    request.prompt_sent = True
    return request.prompt_scores


def _failure(err: Exception) -> Gpt2OnnxError:
    """The error a request ends with: gpt2onnx's own as it is (a refusal stays a BadInput), any other wrapped."""
    return err if isinstance(err, Gpt2OnnxError) else Gpt2OnnxError(f"generation failed: {err}")


def _by_adapter(items, key=lambda request: request.adapter) -> dict:
    """The items grouped by adapter, in the order each adapter first comes, each group in its items' order."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def _bind_factors(stepper: StepRuntime, factors: dict) -> None:
    """The LoRA factors every run of ``stepper`` binds until the next call (empty: the base); set before each run,
    so no adapter stays active for the next rows."""
    if isinstance(stepper, OnnxDecoder):
        stepper.bound = factors


def _host(value) -> np.ndarray:
    """A cache tensor on the host: numpy as it is, an OrtValue copied out."""
    return value if isinstance(value, np.ndarray) else value.numpy()


def _pad_left(array: np.ndarray, width: int) -> np.ndarray:
    extra = width - array.shape[2]
    return array if extra == 0 else np.pad(array, ((0, 0), (0, 0), (extra, 0), (0, 0)))


def _pad_left_2d(mask: np.ndarray, width: int) -> np.ndarray:
    extra = width - mask.shape[1]
    return mask if extra == 0 else np.pad(mask, ((0, 0), (extra, 0)))
