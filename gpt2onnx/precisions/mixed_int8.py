"""int4 with 8-bit layers chosen by measurement: each weight's sensitivity is the mean KL divergence of the
model's next-token distributions when that weight alone is rounded to 4 bits (the rest kept fp32), measured on
the calibration sequences; the most sensitive weights get 8 bits until a share of the 4-bit weights' parameters
(the budget) is spent. The manifest records the sensitivities and which layers got what.

The measurement rounds a copy of one weight at a time to nearest on the int4 grid (fp32 values, no MatMulNBits):
it ranks the weights, it does not predict the file's KL. One onnxruntime session per weight: about 1 s each for
a 6-layer model, a few minutes for the 124M model's 48.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from gpt2onnx.precisions.algorithms.algorithm import Calibration

log = logging.getLogger(__name__)

SENSITIVITY_SEQUENCES = 4  # of the calibration's sequences: enough to rank the weights


@dataclass(frozen=True)
class MixedChoice:
    """What the measurement chose: the weights' sensitivities (mean KL, by node name) and the nodes given 8 bits."""

    sensitivity: dict[str, float]
    int8_nodes: tuple[str, ...]
    int8_share: float  # of the candidates' parameters actually given 8 bits (0-1)


def _rounded_int4(weight: np.ndarray, block_size: int) -> np.ndarray:
    """A [K, N] MatMul weight rounded to nearest on the symmetric 4-bit grid, blocks of ``block_size`` along K."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), np.float32)
    padded[:k] = weight
    grouped = padded.reshape(blocks, block_size, n)
    scale = np.abs(grouped).max(axis=1, keepdims=True) / 8
    safe = np.where(scale == 0, 1.0, scale)
    rounded = np.clip(np.rint(grouped / safe), -8, 7) * scale
    return rounded.reshape(-1, n)[:k].astype(np.float32)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _logits(model: onnx.ModelProto, feeds: list[dict]) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(["logits"], feed)[0][0] for feed in feeds])  # [positions, vocab]


def choose_int8_layers(
    model: onnx.ModelProto, candidates: Sequence[str], *, budget: float, block_size: int, calibration: Calibration
) -> MixedChoice:
    """Measure each candidate MatMul's sensitivity and give 8 bits to the most sensitive ones whose parameters fit
    in ``budget`` (a share, 0-1, of all the candidates' parameters)."""
    feeds = calibration.feeds(model.graph)[:SENSITIVITY_SEQUENCES]
    reference = _log_softmax(_logits(model, feeds))
    initializers = {init.name: init for init in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    sizes, sensitivity = {}, {}
    for name in candidates:
        init = initializers[nodes[name].input[1]]
        original = numpy_helper.to_array(init).copy()
        sizes[name] = original.size
        init.CopyFrom(numpy_helper.from_array(_rounded_int4(original, block_size), init.name))
        try:
            logp = _log_softmax(_logits(model, feeds))
        finally:
            init.CopyFrom(numpy_helper.from_array(original, init.name))
        sensitivity[name] = float(np.mean(np.sum(np.exp(reference) * (reference - logp), axis=-1)))
        log.info("sensitivity of %s: mean KL %.3g", name, sensitivity[name])
    total, spent, chosen = sum(sizes.values()), 0, []
    for name in sorted(candidates, key=lambda n: -sensitivity[n]):
        if spent + sizes[name] <= budget * total:
            chosen.append(name)
            spent += sizes[name]
    return MixedChoice(sensitivity, tuple(chosen), spent / total if total else 0.0)
