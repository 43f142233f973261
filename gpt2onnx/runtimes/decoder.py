"""A decoder-with-past ONNX graph as a stepper: prompt with empty past, then one token per step.

Input and output names are read from the graph, so any folder that follows the IO contract works, ours or
optimum's. Steps run through IO binding: the presents stay where the provider put them (on the GPU for cuda
and tensorrt) and are bound as the next step's past without a copy; only the last position's logits come
back to the host.

Three steppers, chosen from the graph by :func:`open_decoder`:
- :class:`OnnxDecoder`: present = past + the new K/V, a new tensor every step (every profile but the two below);
- :class:`SharedCacheDecoder`: a graph with GroupQueryAttention (profile ort-shared-kv): one K/V buffer per
  layer, allocated once for the whole sequence (prompt + new tokens) and bound as both past and present, so
  the kernel writes each step's K/V in place and nothing is copied between steps;
- :class:`StaticCacheDecoder`: a graph with TensorScatter (profile onnx-static-kv): one fixed-size K/V buffer
  per layer, bound as past and present, updated in place; outward it keeps the concat contract (its presents
  are views of the buffers' first T columns), so any loop that feeds the presents back runs it unchanged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnxruntime as ort

from gpt2onnx.artifact.contract import ORT_DTYPES, DecoderShape, TensorSpec, decoder_shape, graph_io
from gpt2onnx.artifact.folder import ModelFolder
from gpt2onnx.artifact.graph import (
    PADDING_PERIOD,
    QUANTIZED_CACHE_OP,
    all_nodes,
    cache_scales,
    graph_facts,
    load_graph,
)
from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.files import available_memory
from gpt2onnx.layouts.all_layouts import bound_by
from gpt2onnx.layouts.layout import GROWING, SHARED_BUFFER, STATIC_BUFFER, CacheLayout
from gpt2onnx.precisions.kv_cache import cache_format_of, steps_of
from gpt2onnx.precisions.prompt_path import kernel_of
from gpt2onnx.runtimes.providers import (
    DEVICE_TYPES,
    TRT_CACHE_DIR,
    TRT_DUMMY_PAST,
    ProviderConfig,
    check_kernels,
    create_session,
    host_side_nodes,
    provider_failure,
    session_placement,
    session_provider,
    session_tf32,
)
from gpt2onnx.runtimes.runtime import Capabilities, StepRuntime


def session_shape(session: ort.InferenceSession, n_positions: int) -> DecoderShape:
    def as_spec(v):
        return TensorSpec(v.name, ORT_DTYPES.get(v.type, v.type), tuple(v.shape))

    return decoder_shape(
        [as_spec(i) for i in session.get_inputs()], [as_spec(o) for o in session.get_outputs()], n_positions
    )


def file_shape(model_path: Path, n_positions: int) -> DecoderShape:
    """The contract read from the ONNX file itself, without loading its weights or building a session."""
    return decoder_shape(*graph_io(load_graph(model_path)), n_positions)


def check_host_provider(layout: CacheLayout | None, provider: str) -> None:
    """A buffer layout's stepper binds host buffers: the cpu provider only (the resolver refuses it first; this
    guards a caller that opens a session itself)."""
    if layout is not None and layout.in_place and provider != "cpu":
        raise RuntimeUnavailable(
            f"this model keeps its K/V cache in the {layout.name} layout ({layout.summary}), whose stepper binds host"
            f" buffers: it runs on the cpu provider only, not {provider}; use --provider cpu"
        )


def stepper_for(layout: CacheLayout) -> type:
    """The stepper class that binds a layout's cache (its declared binding)."""
    return STEPPERS[layout.binding]


def open_decoder(model: ModelFolder, provider: ProviderConfig) -> "OnnxDecoder":
    """A session on the provider (checked: no silent fallback, no compute node on the CPU under cuda or tensorrt),
    wrapped as the decoder its graph needs. The graph, its cache scales and the session are all read from the
    descriptors the folder check hashed (:meth:`ModelFolder.loading`): the bytes checked are the bytes loaded."""
    if provider.name == "tensorrt" and not provider.trt_cache_dir:  # its engines beside the model, as always
        provider = dataclasses.replace(provider, trt_cache_dir=str(model.folder / TRT_CACHE_DIR))
    layout = model.facts.layout  # the graph's ops, not the manifest (open_folder checked the position table)
    check_host_provider(layout, provider.name)
    kind = stepper_for(layout)
    shared = kind is SharedCacheDecoder
    with model.loading() as model_path:
        # The contract comes from the file first (read once): the TensorRT profile is built from its names and dims.
        graph = load_graph(model_path)
        check_kernels(graph, provider)  # ops the provider has no kernel for: refused before any session is made
        shape = decoder_shape(*graph_io(graph), model.n_positions)
        host_side = host_side_nodes(graph) if provider.name != "cpu" else None
        scales = cache_scales(_scales_held(graph, model), model.model_path) if shared else None
        del graph
        session = create_session(model_path, provider, shape=shape, host_side=host_side)
    if kind is SharedCacheDecoder:  # a quantized cache's scales, read from the graph
        decoder = SharedCacheDecoder(session, n_positions=model.n_positions, cache_scales=scales)
    else:
        decoder = kind(session, n_positions=model.n_positions, device_id=provider.device_id)
    decoder.exact_step_rows = exact_rows(model.facts)
    decoder.padding_period = padding_period(model.facts)
    return decoder


def _scales_held(graph, model: ModelFolder):
    """The graph with its cache scales' external bytes read from the data files' hashed descriptors (cache_scales
    reads the rest by path, beside the folder's model)."""
    names = {
        name
        for node in all_nodes(graph.graph, prompt_body=True)
        if node.op_type == QUANTIZED_CACHE_OP
        for name in node.input[12:14]
        if name
    }
    for init in graph.graph.initializer:
        if init.name in names:
            model.fill_external(init)
    return graph


def padding_period(facts) -> int | None:
    """Where a row's sums follow its left padding (a fused attention kernel, or attention the batch-invariance pass
    did not align): the period, in columns, of the padding that leaves them as they are alone; None: any."""
    return PADDING_PERIOD if facts.padding_dependent else None


def exact_rows(facts) -> int | None:
    """The most rows a step of this graph computes on its own weights (None: any), as its prompt kernel declares."""
    return kernel_of(facts.quantized_ops).declared.ensures.get("exact_step_rows")


def read_adapter(path: Path, slots: set[str]) -> dict:
    """An adapter file's factors by slot name (OrtValues), each name one of ``slots`` (the graph's): one line for a
    damaged file or another model's (the onnxruntime and genai runtimes both read it so before binding it)."""
    try:
        values = dict(ort.AdapterFormat.read_adapter(str(path)).get_parameters())
    except Exception as err:  # onnxruntime raises its own types for a damaged file
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise BadInput(f"'{path}' is not an onnxruntime adapter file ({reason}): export the folder again") from None
    unknown = sorted(set(values) - slots)
    if unknown:
        raise BadInput(f"'{path}' fills {unknown[0]}, which this model has no slot for: it belongs to another model")
    return values


def cpu_decoder(model_path: Path, *, n_positions: int | None = None, adapter: Path | None = None) -> "OnnxDecoder":
    """A decoder on the cpu provider for a bare model file (the checks export and optimize run before writing);
    ``adapter``: a LoRA adapter file made active."""
    from gpt2onnx.runtimes.providers import cpu_session

    graph = load_graph(Path(model_path))
    facts = graph_facts(graph)
    kind = stepper_for(facts.layout)
    if kind is SharedCacheDecoder:
        scales = cache_scales(graph, Path(model_path))
        decoder = SharedCacheDecoder(cpu_session(model_path), n_positions=n_positions, cache_scales=scales)
    else:
        decoder = kind(cpu_session(model_path), n_positions=n_positions)
    decoder.exact_step_rows = exact_rows(facts)
    decoder.padding_period = padding_period(facts)
    decoder.activate_adapter(adapter)
    return decoder


def gather_session(count: int, kv_dtype, device: str, device_id: int = 0) -> ort.InferenceSession:
    """A graph of ``count`` Gather(axis 0) nodes sharing one ``rows`` input: past_i → picked_i, on ``device``."""
    import onnx
    from onnx import TensorProto, helper

    elem = TensorProto.FLOAT16 if np.dtype(kv_dtype) == np.float16 else TensorProto.FLOAT
    dims = ["batch", "heads", "length", "head_dim"]
    graph = helper.make_graph(
        [helper.make_node("Gather", [f"past_{i}", "rows"], [f"picked_{i}"], axis=0) for i in range(count)],
        "reorder_cache",
        [helper.make_tensor_value_info("rows", TensorProto.INT64, ["rows"])]
        + [helper.make_tensor_value_info(f"past_{i}", elem, dims) for i in range(count)],
        [helper.make_tensor_value_info(f"picked_{i}", elem, ["rows", *dims[1:]]) for i in range(count)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnxruntime 1.31 reads IR 13 at most; onnx writes a newer one by default
    onnx.checker.check_model(model)
    providers = [("CUDAExecutionProvider", {"device_id": device_id})] if device == "cuda" else ["CPUExecutionProvider"]
    return ort.InferenceSession(model.SerializeToString(), providers=providers)


# A greedy run's host memory grew by 4.0 to 5.4 times its final key/value cache beside the prompt step's logits
# (measured from 16 to 2,000 rows on tiny and on the 124M model: docs/benchmarks.md, "Memory of a run"): each step
# holds the past it was given and the present it makes, and the allocators keep the growing pieces of earlier
# steps. 6 keeps the estimate above every measured peak; the earlier 2 let runs of twice the memory through.
CACHE_COPIES = 6


class OnnxDecoder(StepRuntime):
    """The Stepper on an onnxruntime session: present = past + the new K/V, a new tensor every step."""

    runtime = "onnxruntime"
    version = ort.__version__
    capabilities = Capabilities(past_of_length=True, memory_check=True, proposals=True, batches=True, adapters=True)

    def __init__(self, session: ort.InferenceSession, *, n_positions: int | None = None, device_id: int = 0):
        self.session = session
        self.shape = session_shape(session, n_positions or 0)
        self.past_names = list(self.shape.past_names)
        self.present_names = list(self.shape.present_names)
        self.n_layer = self.shape.n_layer
        self.n_head, self.head_dim = self.shape.n_head, self.shape.head_dim
        self.n_positions = n_positions
        self.vocab_size = self.shape.vocab_size
        # the graph's cache type: float32, float16, or a quantized cache's int8/uint8 (a GroupQueryAttention graph
        # run the concat way by the batching engine), whose rows may pack several values a byte
        self.kv_dtype = np.dtype(self.shape.kv_dtype)
        fmt = cache_format_of(self.shape.kv_dtype)
        self.row_bytes = self.head_dim // (fmt.values_per_byte if fmt else 1)
        self.uses_position_ids = self.shape.uses_position_ids
        self.provider = session_provider(session)
        self.device, self.device_id = DEVICE_TYPES.get(self.provider, "cpu"), device_id
        # TensorRT rejects zero-sized dims: the prompt step gets masked dummy past slots instead of an empty past.
        self.dummy_past = TRT_DUMMY_PAST if self.provider == "tensorrt" else 0
        self.placement = session_placement(session)  # which provider got each node (create_session read it)
        self.tf32 = session_tf32(session)  # fp32 matmuls in TF32 (None on the CPU)
        self._gather = None  # the cache-reorder session, built on first use (beam search)
        self.bound: dict = {}  # inputs bound to every run: an active LoRA adapter's factors (activate_adapter)

    def session_providers(self) -> list[str]:
        return self.session.get_providers()

    def twin(self) -> "OnnxDecoder":
        """A second stepper on the same session, with buffers of its own (another thread's: the batching engine's
        beam requests beside its batch)."""
        twin = type(self)(self.session, n_positions=self.n_positions, device_id=self.device_id)
        twin.exact_step_rows = self.exact_step_rows
        twin.padding_period = self.padding_period
        twin.bound = self.bound
        return twin

    def activate_adapter(self, path: Path | None) -> None:
        """Bind the LoRA factors of an adapter file (onnxruntime's adapter format) to the graph's slots on every
        run, as ``RunOptions.add_active_adapter`` does for ``session.run``; None: the base (the slots' defaults)."""
        self.bound = {} if path is None else self.adapter_factors(path)

    def activate_like(self, other: "OnnxDecoder") -> None:
        """Activate the adapter ``other`` has active, its factors cast to this graph's slot types (the fp32 of an
        fp16 graph's emulation, gpt2onnx.verify.fp16_emulation)."""
        types = {i.name: ORT_DTYPES[i.type] for i in self.session.get_overridable_initializers()}
        self.bound = {
            name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value.numpy(), types[name]))
            for name, value in other.bound.items()
        }

    def adapter_factors(self, path: Path) -> dict:
        """An adapter file's factors by slot name (OrtValues), checked against this graph's slots: what
        activate_adapter binds, and what the batching engine binds per run for each request's adapter."""
        return read_adapter(path, {i.name for i in self.session.get_overridable_initializers()})

    # -- inputs -------------------------------------------------------------------------------------------
    def cache_bytes(self, batch: int, total_len: int) -> int:
        """The key/value cache of ``batch`` rows at ``total_len`` tokens, K and V of every layer, once."""
        return 2 * self.n_layer * batch * self.n_head * total_len * self.row_bytes * self.kv_dtype.itemsize

    def run_bytes(self, batch: int, prompt_len: int, total_len: int) -> int:
        """Host memory a run grows by at its peak, an upper bound: the prompt step's logits (float32, every
        position) and its widest activations, and CACHE_COPIES times the key/value cache at full length."""
        vocab = self.vocab_size or 50257
        logits = batch * prompt_len * vocab * 4
        cache = self.cache_bytes(batch, total_len)
        embd = self.n_head * self.head_dim  # the MLP's 4 × n_embd twice, q/k/v, the scores over the prompt
        activations = batch * prompt_len * (8 * embd + 2 * self.n_head * total_len) * 4
        return logits + CACHE_COPIES * cache + activations

    def check_memory(
        self, batch: int, prompt_len: int, total_len: int, *, what: str = "batch", extra_bytes: int = 0
    ) -> None:
        """Refuse, before anything is allocated, a run that would need more memory than this machine has.
        ``extra_bytes``: what the caller's loop allocates beside the session (beam search's arrays)."""
        needed, available = self.run_bytes(batch, prompt_len, total_len) + extra_bytes, available_memory()
        if available is not None and needed > available:
            raise BadInput(
                f"{what} {batch} × {total_len} tokens needs about {needed / 1e9:.1f} GB (logits and key/value cache"
                f"{', and beam search' if extra_bytes else ''}), but this machine has {available / 1e9:.1f} GB"
                f" available: use a smaller batch{', fewer beams' if extra_bytes else ''} or shorter runs"
            )

    def empty_past(self, batch: int, capacity: int | None = None) -> list[np.ndarray]:
        """The prompt step's past. ``capacity`` (prompt + new tokens) matters to SharedCacheDecoder only."""
        return [np.zeros((batch, self.n_head, self.dummy_past, self.row_bytes), self.kv_dtype) for _ in self.past_names]

    def past_of_length(self, batch: int, length: int, *, capacity: int | None = None) -> list[np.ndarray]:
        """A zero-filled past of ``length`` tokens (for timing a step at that past without a prompt)."""
        return [np.zeros((batch, self.n_head, length, self.row_bytes), self.kv_dtype) for _ in self.past_names]

    def prompt_mask(self, attention_mask: np.ndarray) -> np.ndarray:
        """The prompt's mask, with the dummy past slots (masked out) in front where the provider needs them."""
        mask = attention_mask.astype(np.int64)
        if self.dummy_past:
            mask = np.concatenate([np.zeros((mask.shape[0], self.dummy_past), np.int64), mask], axis=1)
        return mask

    # -- running ------------------------------------------------------------------------------------------
    def run(self, input_ids, attention_mask, position_ids, past, *, last_logits_only: bool = True):
        """One step through IO binding. ``past``: arrays or the OrtValues a previous step returned.
        Returns (logits as numpy: last position only unless asked otherwise, presents as OrtValues)."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=np.int64))
        if self.uses_position_ids:
            binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        for name, value in zip(self.past_names, past):
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            else:
                binding.bind_ortvalue_input(name, value)
        for name, value in self.bound.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for name in self.present_names:
            binding.bind_output(name, self.device, self.device_id)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as err:  # a provider's failure at run time (EPFail, CUDA): exit code 3, onnxruntime's words
            failure = provider_failure(err, self.provider, doing="running a step")
            if failure is None:
                raise
            raise failure from None
        values = binding.get_outputs()
        logits = values[0].numpy()
        return (logits[:, -1:] if last_logits_only else logits), values[1:]

    def reorder_past(self, past, rows: np.ndarray) -> list:
        """The cache with its batch rows picked (``rows``: [new batch] indices, repeats allowed): beam search's
        reorder. Runs a Gather graph on the decoder's own device through IO binding, so a cache on the GPU stays
        there; numpy arrays (a past no step has returned yet) are gathered on the host."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if isinstance(past[0], np.ndarray):
            return [np.ascontiguousarray(p[rows]) for p in past]
        if self._gather is None:
            self._gather = gather_session(len(past), self.kv_dtype, self.device, self.device_id)
        binding = self._gather.io_binding()
        binding.bind_cpu_input("rows", rows)
        for i, value in enumerate(past):
            binding.bind_ortvalue_input(f"past_{i}", value)
            binding.bind_output(f"picked_{i}", self.device, self.device_id)
        self._gather.run_with_iobinding(binding)
        return binding.get_outputs()

    def crop_past(self, past, length: int) -> list:
        """The cache cut back to its first ``length`` columns (speculative decoding's rollback): the presents as
        they are where they have that length already, else their first columns as host arrays (bound as the next
        step's past; on a GPU provider this copies the cache through the host)."""
        if isinstance(past[0], np.ndarray):
            return [p if p.shape[2] == length else np.ascontiguousarray(p[:, :, :length]) for p in past]
        if past[0].shape()[2] == length:
            return past
        return [np.ascontiguousarray(p.numpy()[:, :, :length]) for p in past]

    def step(self, input_ids, attention_mask, position_ids, past):
        """One step with everything on the host: (all logits, presents as numpy arrays)."""
        logits, presents = self.run(input_ids, attention_mask, position_ids, past, last_logits_only=False)
        return logits, [p.numpy() for p in presents]


def _run_bound(decoder: OnnxDecoder, input_ids, attention_mask, position_ids) -> np.ndarray:
    """One run of a buffer decoder (shared or static cache) on its binding, whose past and present buffers are
    bound already: the step's ids, mask and positions bound from the host, the logits returned as numpy."""
    binding = decoder._binding
    binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
    binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=np.int64))
    if decoder.uses_position_ids:
        binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
    for name, value in decoder.bound.items():  # an active LoRA adapter's factors
        binding.bind_ortvalue_input(name, value)
    binding.bind_output("logits", "cpu")  # re-bound every step: after a run the binding holds the last array
    decoder.session.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()


class SharedCacheDecoder(OnnxDecoder):
    """The stepper of a GroupQueryAttention graph (fusion ort-shared-kv): past and present share one buffer.

    ``empty_past(batch, capacity)`` allocates, once per sequence, one zeroed [batch, n_head, capacity, head_dim]
    buffer per layer K and V (capacity: prompt + new tokens; the model's context when not given) and binds
    each as both past_key_values.{i}.* and present.{i}.*. Every step writes the new K/V at the columns the mask
    adds (buffer column j holds mask column j, so left padding works as in the contract) and reads the columns
    before the mask's width; nothing is copied between steps. The ``past`` that run() takes and returns is a
    token standing for the bound buffers.

    onnxruntime's kernel takes a multi-token step on a non-empty past at batch 1 only: such a step at batch > 1
    (a prompt continued in chunks) runs token by token, with the same result.

    A quantized cache (--kv-cache int8): the buffers are int8, the kernel stores and reads them with the graph's
    per-channel scales (``cache_scales``: by past input name, read from the graph by open_decoder); step() gives
    the cache back dequantized, as the float values attention reads.
    """

    capabilities = Capabilities(
        past_of_length=True, memory_check=True, proposals=True, batches=True, preallocates=True, adapters=True
    )

    def __init__(
        self,
        session: ort.InferenceSession,
        *,
        n_positions: int | None = None,
        device_id: int = 0,
        cache_scales: dict[str, np.ndarray] | None = None,
    ):
        super().__init__(session, n_positions=n_positions, device_id=device_id)
        check_host_provider(bound_by(SHARED_BUFFER), self.provider)
        self.cache_format = cache_format_of(self.shape.kv_dtype)  # None: a float cache
        self.scales = None
        if self.cache_format is not None:
            if cache_scales is None or set(cache_scales) != set(self.past_names):
                raise BadInput(
                    f"this model's K/V cache is {self.kv_dtype} but its graph gives no scale for every past input:"
                    " export it again"
                )
            self.scales = [cache_scales[name] for name in self.past_names]
        logits = next(o for o in session.get_outputs() if o.name == "logits")
        self.last_logits_graph = len(logits.shape) == 3 and logits.shape[1] == 1
        self.capacity = 0
        self.batch = 0
        self._buffers: list[np.ndarray] = []
        self._values: list[ort.OrtValue] = []
        self._binding = None

    def twin(self) -> "SharedCacheDecoder":
        scales = dict(zip(self.past_names, self.scales)) if self.scales is not None else None
        twin = SharedCacheDecoder(self.session, n_positions=self.n_positions, cache_scales=scales)
        twin.exact_step_rows = self.exact_step_rows
        twin.padding_period = self.padding_period
        return twin

    def empty_past(self, batch: int, capacity: int | None = None) -> list[ort.OrtValue]:
        """(Re)allocate the buffers for ``batch`` rows of ``capacity`` tokens and bind them as past and present.
        Old contents need no clearing: a prompt writes columns [0, T), and no step reads beyond its mask."""
        capacity = capacity or self.n_positions
        if not capacity:
            raise BadInput("a shared K/V cache needs its length: give the total tokens (prompt + new tokens)")
        if (batch, capacity) != (self.batch, self.capacity):
            self._values, self._buffers = [], []  # free the old buffers before allocating the new ones
            shape = (batch, self.n_head, capacity, self.row_bytes)  # head_dim values, packed in a 4-bit cache
            # numpy owns the memory; the OrtValues are views of it on the cpu, kept alive together
            self._buffers = [np.zeros(shape, self.kv_dtype) for _ in self.past_names]
            self._values = [ort.OrtValue.ortvalue_from_numpy(b) for b in self._buffers]
            self.batch, self.capacity = batch, capacity
        binding = self.session.io_binding()
        binding.bind_output("logits", "cpu")  # bound first: get_outputs()[0]; binding it again keeps its slot
        for past, present, value in zip(self.past_names, self.present_names, self._values):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        self._binding = binding
        return self._values

    def past_of_length(self, batch: int, length: int, *, capacity: int | None = None) -> list[ort.OrtValue]:
        """Buffers whose first ``length`` columns stand for a past (zeros, or what the last sequence left)."""
        return self.empty_past(batch, capacity or length + 1)

    def run(self, input_ids, attention_mask, position_ids, past=None, *, last_logits_only: bool = True):
        """One step on the bound buffers (``past`` must be what empty_past returned). Returns (logits as numpy:
        last position only unless asked otherwise, the buffers' token)."""
        batch, total = attention_mask.shape
        length = input_ids.shape[1]
        if self._binding is None or batch != self.batch:
            raise BadInput("start each sequence with empty_past(batch, capacity): no buffer is bound for this batch")
        if total > self.capacity:
            raise BadInput(
                f"{total} tokens do not fit the K/V buffer of {self.capacity}: give the total length to empty_past"
            )
        if length > 1 and total > length and batch > 1:  # the kernel's limit: chunk on a past at batch 1 only
            steps = [
                _run_bound(
                    self,
                    input_ids[:, i : i + 1],
                    attention_mask[:, : total - length + i + 1],
                    position_ids[:, i : i + 1],
                )
                for i in range(length)
            ]
            logits = steps[-1] if self.last_logits_graph else np.concatenate(steps, axis=1)
        else:
            logits = _run_bound(self, input_ids, attention_mask, position_ids)
        return (logits[:, -1:] if last_logits_only else logits), self._values

    def reorder_past(self, past, rows: np.ndarray) -> list[ort.OrtValue]:
        """Beam search's reorder, in the shared buffers themselves (they live on the host: cpu provider only);
        a new batch size (the prompt's rows spread over the beams) rebinds buffers of that size."""
        rows = np.asarray(rows, dtype=np.int64)
        picked = [buffer[rows] for buffer in self._buffers]
        if len(rows) != self.batch:
            self.empty_past(len(rows), self.capacity)
        for buffer, values in zip(self._buffers, picked):
            buffer[...] = values
        return self._values

    def crop_past(self, past, length: int) -> list[ort.OrtValue]:
        """Nothing to cut: buffer column j holds mask column j, so the next step's narrower mask leaves the
        columns past ``length`` unread, and writes its own K/V over them."""
        return self._values

    def step(self, input_ids, attention_mask, position_ids, past=None):
        """One step with everything on the host: (all logits, copies of the cache's first T columns, T = the
        mask's width: what present holds in the contract)."""
        logits, _ = self.run(input_ids, attention_mask, position_ids, past, last_logits_only=False)
        total = attention_mask.shape[1]
        if self.scales is not None:  # the values attention reads: stored steps × the channel's scale
            fmt = self.cache_format
            return logits, [steps_of(b[:, :, :total], fmt) * s for b, s in zip(self._buffers, self.scales)]
        return logits, [buffer[:, :, :total].copy() for buffer in self._buffers]


class StaticCacheDecoder(OnnxDecoder):
    """The stepper of a TensorScatter graph (fusion onnx-static-kv): one fixed-size K/V buffer per layer.

    ``empty_past(batch, capacity)`` allocates one zeroed [rows, n_head, capacity, head_dim] buffer per layer K and
    V (capacity: prompt + new tokens; the model's context when not given) and binds the first ``batch`` rows as
    both past_key_values.{i}.* and present.{i}.*: TensorScatter writes each step's S new K/V at columns
    [T − S, T) (T: the mask's width) in place, and Attention reads all ``capacity`` columns under the mask
    padded to that length. Buffer column j holds mask column j, as in the contract.

    Outward it keeps the concat contract: run() returns as presents numpy views of the buffers' first T columns
    (what a concat graph's presents hold). Fed back as the next past, they are recognised (same memory, same
    layout, T − S columns) and nothing is copied; any other past (a join or leave of the batching engine, a beam
    reorder, a past from elsewhere) is copied into the buffers first. Buffers are reallocated only when a step
    needs more rows or columns than they have.
    """

    capabilities = Capabilities(
        past_of_length=True, memory_check=True, proposals=True, batches=True, preallocates=True, adapters=True
    )

    def __init__(self, session: ort.InferenceSession, *, n_positions: int | None = None, device_id: int = 0):
        super().__init__(session, n_positions=n_positions, device_id=device_id)
        check_host_provider(bound_by(STATIC_BUFFER), self.provider)
        self.capacity = 0
        self.rows = 0  # rows allocated (the bound batch may use fewer)
        self.batch = 0  # rows bound
        self._buffers: list[np.ndarray] = []
        self._binding = None

    def _allocate(self, rows: int, capacity: int) -> None:
        self._buffers = []  # free the old buffers before allocating the new ones
        shape = (rows, self.n_head, capacity, self.head_dim)
        self._buffers = [np.zeros(shape, self.kv_dtype) for _ in self.past_names]
        self.rows, self.capacity, self.batch = rows, capacity, 0

    def _bind(self, batch: int) -> None:
        """Bind the first ``batch`` rows of every buffer (contiguous: rows are the outer axis) as past and present."""
        binding = self.session.io_binding()
        binding.bind_output("logits", "cpu")  # bound first: get_outputs()[0]
        for past, present, buffer in zip(self.past_names, self.present_names, self._buffers):
            value = ort.OrtValue.ortvalue_from_numpy(buffer[:batch])
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        self._binding, self.batch = binding, batch

    def empty_past(self, batch: int, capacity: int | None = None) -> list[np.ndarray]:
        """Buffers for ``batch`` rows of ``capacity`` tokens, bound; returns the empty past (views of 0 columns).
        Old contents need no clearing: a step writes the columns its mask adds, and no step reads past its mask."""
        capacity = capacity or self.n_positions
        if not capacity:
            raise BadInput("a static K/V cache needs its length: give the total tokens (prompt + new tokens)")
        if batch > self.rows or capacity != self.capacity:
            self._allocate(batch, capacity)
        if batch != self.batch or self._binding is None:
            self._bind(batch)
        return self._views(0)

    def past_of_length(self, batch: int, length: int, *, capacity: int | None = None) -> list[np.ndarray]:
        """The buffers' first ``length`` columns as a past (zeros, or what the last sequence left)."""
        self.empty_past(batch, capacity or length + 1)
        return self._views(length)

    def _views(self, length: int) -> list[np.ndarray]:
        return [buffer[: self.batch, :, :length] for buffer in self._buffers]

    def _in_place(self, past, length: int) -> bool:
        """Whether ``past`` is this decoder's own views of ``length`` columns (what run() returned, or a crop)."""
        first = past[0] if past else None
        return (
            isinstance(first, np.ndarray)
            and bool(self._buffers)
            and first.shape == (self.batch, self.n_head, length, self.head_dim)
            and first.strides == self._buffers[0].strides
            and first.ctypes.data == self._buffers[0].ctypes.data
        )

    def _adopt(self, past, batch: int, length: int, total: int) -> None:
        """Copy a past that is not already in the buffers into them (rows and columns [0, length))."""
        arrays = [p if isinstance(p, np.ndarray) else p.numpy() for p in past]
        if batch > self.rows or total > self.capacity:
            self._allocate(batch, max(total, self.capacity, self.n_positions or 0))
        if batch != self.batch or self._binding is None:
            self._bind(batch)
        for buffer, array in zip(self._buffers, arrays):
            buffer[:batch, :, :length] = array

    def run(self, input_ids, attention_mask, position_ids, past, *, last_logits_only: bool = True):
        """One step on the bound buffers. Returns (logits as numpy: last position only unless asked otherwise,
        the presents: views of the buffers' first T columns)."""
        batch, total = attention_mask.shape
        length = total - input_ids.shape[1]
        if past is None or len(past) != len(self.past_names):
            raise BadInput("start each sequence with empty_past(batch, capacity): no K/V buffer was given")
        if past[0].shape[2] != length:
            raise BadInput(f"the past holds {past[0].shape[2]} tokens, but the mask says {length}")
        if not self._in_place(past, length):
            self._adopt(past, batch, length, total)
        if total > self.capacity:
            raise BadInput(
                f"{total} tokens do not fit the K/V buffer of {self.capacity}: give the total length to empty_past"
            )
        logits = _run_bound(self, input_ids, attention_mask, position_ids)
        return (logits[:, -1:] if last_logits_only else logits), self._views(total)

    def reorder_past(self, past, rows: np.ndarray) -> list[np.ndarray]:
        """Beam search's reorder: the rows picked on the host (copies; the next step copies them in)."""
        rows = np.asarray(rows, dtype=np.int64)
        return [np.ascontiguousarray(p[rows]) for p in past]

    def crop_past(self, past, length: int) -> list[np.ndarray]:
        """The first ``length`` columns: views of the buffers, so the next step writes over the rest in place."""
        return [p[:, :, :length] for p in past]

    def step(self, input_ids, attention_mask, position_ids, past):
        """One step with everything on the host: (all logits, copies of the presents)."""
        logits, presents = self.run(input_ids, attention_mask, position_ids, past, last_logits_only=False)
        return logits, [p.copy() for p in presents]


# a layout's binding (gpt2onnx.layouts.layout.BINDINGS) → the stepper that binds it
STEPPERS = {GROWING: OnnxDecoder, SHARED_BUFFER: SharedCacheDecoder, STATIC_BUFFER: StaticCacheDecoder}
