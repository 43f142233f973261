"""Every int4 weight algorithm, by name: a new one is a module beside this one and a line here."""

from gpt2onnx.precisions.algorithms import gptq, hqq, k_quant, rtn
from gpt2onnx.precisions.algorithms.algorithm import Int4Algorithm
from gpt2onnx.registry import Registry

# the first is the recipe's default (chosen by docs/precision.md's table on the GPT-2-shaped reference)
ALGORITHMS: Registry[Int4Algorithm] = Registry(
    "int4 algorithm", (rtn.ALGORITHM, hqq.ALGORITHM, k_quant.ALGORITHM, gptq.ALGORITHM), option="--algorithm"
)
DEFAULT_ALGORITHM = next(iter(ALGORITHMS))
