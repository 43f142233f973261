"""Every int4 weight algorithm, by name: a new one is a module beside this one and a line here."""

from gpt2onnx.precisions.algorithms import gptq, hqq, k_quant, rtn
from gpt2onnx.precisions.algorithms.algorithm import Int4Algorithm

# the first is the recipe's default (chosen by docs/precision.md's table on the GPT-2-shaped reference)
ALGORITHMS: dict[str, Int4Algorithm] = {
    algorithm.name: algorithm
    for algorithm in (
        rtn.ALGORITHM,
        hqq.ALGORITHM,
        k_quant.ALGORITHM,
        gptq.ALGORITHM,
    )
}
DEFAULT_ALGORITHM = next(iter(ALGORITHMS))
