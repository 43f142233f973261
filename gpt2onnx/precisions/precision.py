"""What a precision declares: one :class:`Precision` per module of this package, listed in
:mod:`gpt2onnx.precisions.all_precisions`. Every other layer asks the registry instead of naming a precision."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpt2onnx.capabilities import Declared, Need

# --lm-head and --embeddings' values every quantizing precision shares: a layer left in fp32 (the exported Gemm or
# Gather), and 8-bit GatherBlockQuantized tables (written by precisions.weights: onnxruntime's quantizer writes 4-bit
# ones only)
FLOAT_LAYER = "fp32"
EIGHT_BIT_TABLES = "int8"


FROM_FP32 = "optimize the fp32 folder it was made from"


def _frozen(mapping: Mapping | None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Precision:
    """One precision: how it is asked for, what it writes, how its files are judged, and what it means for each
    runtime and deployment target.

    name: the key in manifests, reports and gates (float32, float16, int8, int4, ...).
    short: how tables and the CLI spell it (fp32, fp16, int8, ...).
    summary: one line for the help and the docs.
    gates: its quality gates against the reference (gpt2onnx.verify.gates: the names of GATES, and tokens_equal).
    file_gates: a quantized file judged by itself (verify.rounding): its weights against its source in steps of the
        declared width, and its activation path; empty where its weights are not quantized.
    dtype: the element type of its activations and K/V cache (float32 or float16).
    method: the value of ``--quantize`` that writes it; None for a float precision (asked for by ``--dtype``).
    weight_bits: the declared width of its quantized weights (the file check's steps); None for float weights.
    marks: the quantized ops that identify a graph of this precision (gpt2onnx.artifact.graph.quantized_op_counts'
        spellings); a float precision has none and is told by ``dtype``.
    writes: the ops its weight pass writes for the block matmuls, (domain, op type): what it ensures of a graph.
    exact: compared value by value with the reference (max |Δlogits| within a tolerance, greedy tokens equal)
        instead of by quality gates.
    emulate_fp16: also checked with fp16 arithmetic as a GPU computes it (the CPU provider computes most fp16
        nodes in fp32, which hides an overflow the graph has on fp16 hardware).
    transformers_js: its transformers.js dtype and the file name suffix that dtype loads; None: no such dtype.
    transformers_js_derived: more transformers.js dtypes made from its file, each (dtype, file name suffix, the
        graph pass that makes it from the folder's model: ModelProto → ModelProto); the target writes them too.
    options: the QuantizeOptions fields it takes (their declarations: quantize_options.option_flags), each refused
        in one line elsewhere.
    recipe: the defaults of those options (lm_head, embeddings, accuracy_level, block_size).
    layer_choices: what ``--lm-head`` and ``--embeddings`` may be under it (names of precisions).
    accuracy_levels: MatMulNBits' arithmetic it allows (0: fp32, 4: int8 activations).
    block_sizes: the block sizes it allows.
    prompt_kernels: what ``--prompt-kernel`` may be under it (the kernels a step of many rows runs on), the
        recipe's first.
    block_wise: its weights are quantized block by block (so that --block-size matters for them).
    algorithms: the weight algorithms it may use (by ``--algorithm``), with the default first; their own bounds
        replace ``weight_steps`` in the file check (gpt2onnx.precisions.algorithms).
    quantize: the weight pass (gpt2onnx.precisions.weights.QuantizeContext → the quantized model), None for a
        float precision.
    selectable: written by the tool (False for a family of gates only, as tf32).
    batch_dependent: what of its arithmetic depends on the other rows of a step (a per-tensor activation scale);
        empty: a row computes the same alone, batched and left-padded (the capability ``batch_invariant``).
    """

    name: str
    short: str
    summary: str
    gates: Mapping[str, float | bool]
    file_gates: Mapping[str, float] = field(default_factory=dict)
    dtype: str = "float32"
    method: str | None = None
    weight_bits: int | None = None
    marks: frozenset[str] = frozenset()
    writes: frozenset[tuple[str, str]] = frozenset()
    exact: bool = False
    emulate_fp16: bool = False
    transformers_js: tuple[str, str] | None = None
    transformers_js_derived: tuple[tuple[str, str, Callable], ...] = ()
    options: frozenset[str] = frozenset()
    recipe: Mapping[str, object] = field(default_factory=dict)
    layer_choices: tuple[str, ...] = ()
    accuracy_levels: tuple[int, ...] = ()
    block_sizes: tuple[int, ...] = ()
    prompt_kernels: tuple[str, ...] = ()
    block_wise: bool = False
    algorithms: Mapping[str, object] = field(default_factory=dict)
    quantize: Callable | None = None
    selectable: bool = True
    batch_dependent: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name in ("gates", "file_gates", "recipe", "algorithms"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def quantized(self) -> bool:
        """Its weights are stored quantized (and judged as a file by verify.rounding)."""
        return self.method is not None

    @property
    def declared(self) -> Declared:
        """Its capabilities: the activations' type, the weights' width, the ops it writes, its transformers.js
        dtype (gpt2onnx.capabilities)."""
        how = f"--quantize {self.method}" if self.method else f"--dtype {self.short}"
        requires = ()
        if not self.exact:  # optimize: a new precision is made from fp32 weights (its source's)
            requires = (
                Need("source_weight_bits", allowed={None}, why="is made from fp32 weights", fix=FROM_FP32),
                Need("source_activations", allowed={"float32"}, why="is made from fp32 weights", fix=FROM_FP32),
            )
        return Declared(
            "precision",
            self.short,
            how,
            requires=requires,
            says={
                "weight_bits": f"stores {self.weight_bits}-bit weights" if self.weight_bits else "stores float weights",
                "activations": f"computes in {self.dtype}",
                "transformers_js_dtype": f"is {self.transformers_js[0]} in transformers.js"
                if self.transformers_js
                else "has no transformers.js dtype",
            },
            ensures={
                "activations": self.dtype,
                "weight_bits": self.weight_bits,
                "ops": self.writes,
                "transformers_js_dtype": self.transformers_js[0] if self.transformers_js else None,
                "batch_dependent": self.batch_dependent,
            },
        )

    @property
    def default_algorithm(self) -> str | None:
        return next(iter(self.algorithms), None)

    def file_gates_for(self, algorithm: str | None) -> dict[str, float]:
        """The file gates of a file written with ``algorithm`` (None: the precision's default): an algorithm that
        moves weights off the nearest grid point on purpose is judged by its RMS error bound (weight_error)
        instead of every weight within a step (weight_steps)."""
        gates = dict(self.file_gates)
        chosen = self.algorithms.get(algorithm or self.default_algorithm) if self.algorithms else None
        bound = getattr(chosen, "weight_error", None)
        if bound is not None:
            gates.pop("weight_steps", None)
            gates = {"weight_error": bound, **gates}
        return gates
