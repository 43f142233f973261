"""The options of a precision, typed and checked once: ``--dtype`` (a float precision) and ``--quantize`` with the
options a quantizing precision declares it takes (its ``options``, declared here: option_flags). An option the chosen
precision does not take, or a value outside what it declares, is refused in one line when the options are built."""

from __future__ import annotations

from dataclasses import dataclass

from gpt2onnx.capabilities import Declared, resolve
from gpt2onnx.errors import BadInput
from gpt2onnx.params import flags_of, param
from gpt2onnx.precisions.all_precisions import FP32, NO_QUANTIZATION, QUANTIZED, by_dtype, quantized_names
from gpt2onnx.precisions.precision import FLOAT_LAYER, Precision
from gpt2onnx.precisions.prompt_path import PROMPT_KERNELS

TABLES = ("com.microsoft", "GatherBlockQuantized")  # quantized embedding tables

DEFAULT_BLOCK_SIZE = 32
ALGORITHMS_HELP = "; ".join(
    f"{p.short}: {', '.join(p.algorithms)} \\[default: {p.default_algorithm}]"
    for p in QUANTIZED.values()
    if p.algorithms
)
ACCURACY_WORDS = {0: "fp32 arithmetic", 4: "int8 arithmetic"}


def check_dtype(dtype: str, method: str = NO_QUANTIZATION) -> str:
    """The canonical dtype name; refuses an unknown one and a reduced float dtype with quantized weights."""
    chosen = by_dtype(dtype)
    if chosen is not FP32 and method != NO_QUANTIZATION:
        raise BadInput(f"--dtype {chosen.short} and --quantize {method} do not combine: choose one of them")
    return chosen.dtype


def option_flags() -> dict[str, str]:
    """The options a quantizing precision may take beyond --quantize, by field, with their flags."""
    return {field: flag for field, flag in flags_of(QuantizeOptions).items() if field != "method"}


def _takers(field: str) -> list[str]:
    """The --quantize values whose precision takes the option ``field``."""
    return [method for method, p in QUANTIZED.items() if field in p.options]


@dataclass(frozen=True)
class QuantizeOptions:
    """Weight quantization: the method (a quantizing precision's --quantize value, or none) and the options its
    precision declares (gpt2onnx.precisions.precision.Precision.options).

    block_size: weights per scale of every block-wise tensor; None: DEFAULT_BLOCK_SIZE.
    accuracy_level: MatMulNBits' arithmetic (the precision's accuracy_levels).
    lm_head: the logits projection's precision (the precision's layer_choices; fp32 keeps the exported Gemm on
        the tied embedding as it is).
    embeddings: the token and position embeddings' precision (GatherBlockQuantized at 4 or 8 bits, or fp32).
    algorithm: how the weights are chosen (the precision's algorithms: int4's rtn, hqq, k-quant, gptq).
    calibration_text: the text a calibrated algorithm (gptq) or --mixed-int8 measures on: a file, or
        'dataset:NAME[:CONFIG][:SPLIT]' (the datasets library); None: the standard library's docstrings.
    mixed_int8: the share (percent, above 0 and at most 100) of the block weights' parameters that may be stored
        at 8 bits, given to the weights measured most sensitive (gpt2onnx.precisions.mixed_int8).
    prompt_kernel: the kernels of a step of many rows (the precision's prompt_kernels; int4's int8: the 4-bit
        weights folded to int8 when a session is created, gpt2onnx.precisions.prompt_path).
    None: the precision's recipe (Precision.recipe).
    """

    method: str = param(NO_QUANTIZATION, f"Weights: {quantized_names()}.", flag="--quantize")
    block_size: int | None = param(None, "Block-wise tensors: weights per scale, 16 to 256 \\[default: recipe].")
    accuracy_level: int | None = param(
        None, "int4 arithmetic: 0 (fp32) or 4 (int8) [default: recipe].", show_default=False
    )
    lm_head: str | None = param(None, "Logits projection: int4, int8, fp32 [default: recipe].")
    embeddings: str | None = param(None, "Embeddings: int4, int8, fp32 [default: recipe].")
    algorithm: str | None = param(None, ALGORITHMS_HELP, metavar="NAME", show_default=False)
    calibration_text: str | None = param(
        None,
        "Calibrate gptq, --mixed-int8 on it (or dataset:NAME).",
        flag="--calibration",
        metavar="FILE",
        show_default=False,
    )
    mixed_int8: float | None = param(
        None, "int4: % of weights at 8 bits, by sensitivity.", metavar="PCT", show_default=False
    )
    prompt_kernel: str | None = param(
        None,
        "int4: a prompt step's matmuls: nbits or int8 (folded at load) [default: nbits].",
        metavar="KERNEL",
        show_default=False,
    )

    def __post_init__(self) -> None:  # an invalid one cannot be built: checked here, and only here
        if self.method != NO_QUANTIZATION:
            QUANTIZED.lookup(self.method)
        flags = option_flags()
        given = {field: getattr(self, field) for field in flags if getattr(self, field) is not None}
        if self.method == NO_QUANTIZATION:
            for field in given:
                raise BadInput(
                    f"{flags[field]} applies to quantized weights: add --quantize"
                    f" {' or '.join(_takers(field))}, or drop it"
                )
            return
        precision = QUANTIZED[self.method]
        for field in given:
            if field not in precision.options:
                takers = _takers(field)
                raise BadInput(
                    f"{flags[field]} applies to {' or '.join(takers)}: drop it, or use --quantize {takers[0]}"
                )
        if self.block_size is not None and self.block_size not in precision.block_sizes:
            raise BadInput(
                f"--block-size {self.block_size} is not supported for {self.method}: choose one of"
                f" {', '.join(map(str, precision.block_sizes))}"
            )
        if self.accuracy_level is not None and self.accuracy_level not in precision.accuracy_levels:
            choices = " or ".join(f"{level} ({ACCURACY_WORDS[level]})" for level in precision.accuracy_levels)
            raise BadInput(f"--accuracy-level {self.accuracy_level} is not supported: choose {choices}")
        if self.algorithm is not None and self.algorithm not in precision.algorithms:
            raise BadInput(f"unknown --algorithm '{self.algorithm}': choose one of {', '.join(precision.algorithms)}")
        if self.mixed_int8 is not None:
            value = self.mixed_int8
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 100:
                raise BadInput(f"--mixed-int8 {value} is out of range: give a percent above 0 and at most 100")
        if self.calibration_text is not None and not self.needs_calibration:
            calibrated = [a.name for a in precision.algorithms.values() if a.calibrated]
            raise BadInput(
                f"--calibration applies to a calibrated {self.method} algorithm ({', '.join(calibrated)}) or to"
                f" --mixed-int8: add --algorithm {calibrated[0]} or --mixed-int8 PERCENT, or drop it"
            )
        if self.prompt_kernel is not None:
            if self.prompt_kernel not in precision.prompt_kernels:
                raise BadInput(
                    f"unknown --prompt-kernel '{self.prompt_kernel}': choose {' or '.join(precision.prompt_kernels)}"
                )
        for flag, value in (("--lm-head", self.lm_head), ("--embeddings", self.embeddings)):
            if value is not None and value not in precision.layer_choices:
                raise BadInput(
                    f"{flag} '{value}' is not valid with --quantize {self.method}: choose"
                    f" {' or '.join(precision.layer_choices)}"
                )
        alternatives = {"algorithm": [a.declared for a in precision.algorithms.values()]}
        resolve(self.choices(), alternatives=alternatives).check()  # the choices' declared needs of each other

    def choices(self) -> list[Declared]:
        """What the options declare (gpt2onnx.capabilities): the precision (with the embedding tables it writes),
        its weight algorithm, its prompt kernel; none for float weights (the dtype's precision declares those)."""
        precision = self.precision
        if precision is None:
            return []
        recipe = self.recipe
        declared = precision.declared
        if recipe.embeddings not in (None, FLOAT_LAYER):
            declared = declared.with_(ensures={"ops": {TABLES}})
        chosen = [declared]
        if self.weight_algorithm is not None:
            chosen.append(self.weight_algorithm.declared)
        if recipe.prompt_kernel is not None:
            chosen.append(PROMPT_KERNELS[recipe.prompt_kernel].declared)
        return chosen

    @property
    def precision(self) -> Precision | None:
        """The quantizing precision; None for float weights (the dtype's precision then)."""
        return QUANTIZED.get(self.method)

    @property
    def weight_algorithm(self):
        """The weight algorithm used (the recipe's where none is given); None where the precision has none."""
        precision = self.precision
        if precision is None or not precision.algorithms:
            return None
        return precision.algorithms[self.algorithm or precision.default_algorithm]

    @property
    def needs_calibration(self) -> bool:
        """Whether quantizing needs calibration text: a calibrated algorithm, or measured 8-bit layers."""
        algorithm = self.weight_algorithm
        return algorithm is not None and (algorithm.calibrated or self.mixed_int8 is not None)

    @property
    def recipe(self) -> "QuantizeRecipe":
        """The options with the precision's recipe filled in where they are None."""
        precision = self.precision
        recipe = precision.recipe if precision is not None else {}
        algorithm = self.weight_algorithm
        return QuantizeRecipe(
            self.method,
            self.block_size or recipe.get("block_size", DEFAULT_BLOCK_SIZE),
            self.accuracy_level if self.accuracy_level is not None else recipe.get("accuracy_level"),
            self.lm_head or recipe.get("lm_head"),
            self.embeddings or recipe.get("embeddings"),
            algorithm.name if algorithm is not None else None,
            self.mixed_int8,
            self.prompt_kernel or (precision.prompt_kernels[0] if precision and precision.prompt_kernels else None),
        )

    @property
    def block_wise(self) -> bool:
        """Whether any tensor is quantized block by block (so that block_size matters)."""
        precision = self.precision
        return precision is not None and (precision.block_wise or self.recipe.embeddings != FLOAT_LAYER)

    def as_dict(self) -> dict:
        if self.method == NO_QUANTIZATION:
            return {"method": NO_QUANTIZATION, "block_size": None}
        recipe = self.recipe
        return {
            "method": recipe.method,
            "block_size": recipe.block_size if self.block_wise else None,
            "accuracy_level": recipe.accuracy_level,
            "lm_head": recipe.lm_head,
            "embeddings": recipe.embeddings,
            **({"algorithm": recipe.algorithm} if recipe.algorithm else {}),
            **({"calibration_text": self.calibration_text} if self.calibration_text else {}),
            **({"mixed_int8": self.mixed_int8} if self.mixed_int8 is not None else {}),
            **({"prompt_kernel": self.prompt_kernel} if self.prompt_kernel is not None else {}),
        }


@dataclass(frozen=True)
class QuantizeRecipe:
    """What a QuantizeOptions (already checked) does, its precision's recipe filled in (QuantizeOptions.recipe)."""

    method: str
    block_size: int
    accuracy_level: int | None
    lm_head: str | None
    embeddings: str | None
    algorithm: str | None = None  # the weight algorithm's name (Precision.algorithms)
    mixed_int8: float | None = None  # the percent of block weights' parameters that may get 8 bits
    prompt_kernel: str | None = None  # the kernels of a step of many rows (Precision.prompt_kernels)
