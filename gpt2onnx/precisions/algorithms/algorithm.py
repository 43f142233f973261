"""What an int4 weight algorithm declares (one module per algorithm, listed in all_algorithms.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from gpt2onnx.capabilities import Declared
from gpt2onnx.layouts.layout import PAST_BUFFER


@dataclass(frozen=True)
class Calibration:
    """Token sequences to calibrate on (GPTQ), and where they came from (the manifest's record)."""

    sequences: tuple[np.ndarray, ...]  # each [length] int64
    source: str

    def feeds(self, graph: onnx.GraphProto) -> list[dict[str, np.ndarray]]:
        """One prompt-step feed per sequence for ``graph``'s inputs: the tokens, a full mask, positions from 0, and
        empty past tensors shaped as the graph declares them (batch 1, past length 0; a buffer layout's past, whose
        length is the buffer's, as long as the tokens: its prompt step writes them there)."""
        feeds = []
        for ids in self.sequences:
            tokens = np.asarray(ids, np.int64)[None]
            feed = {}
            for value in graph.input:
                if value.name == "input_ids":
                    feed[value.name] = tokens
                elif value.name == "attention_mask":
                    feed[value.name] = np.ones_like(tokens)
                elif value.name == "position_ids":
                    feed[value.name] = np.arange(tokens.shape[1], dtype=np.int64)[None]
                else:  # a past: [batch, heads, past, head size], the symbolic ones 1 and 0 (a buffer: the tokens')
                    dims = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
                    shape = [1 if i == 0 else (0 if d is None else d) for i, d in enumerate(dims)]
                    if value.type.tensor_type.shape.dim[2].dim_param == PAST_BUFFER:
                        shape[2] = tokens.shape[1]
                    feed[value.name] = np.zeros(shape, np.float32)
            feeds.append(feed)
        return feeds


@dataclass(frozen=True)
class Int4Algorithm:
    """One way of choosing int4 weights.

    name: the value of ``--algorithm``.
    summary: one line for the help and the docs.
    weight_error: how the file check judges its weights. None: round to nearest, every weight within one
        quantization step of its source (the ``weight_steps`` gate). A number: the algorithm moves weights off the
        nearest grid point on purpose (better scales, zero points, error compensation), so each tensor's RMS error
        against its source may be at most this many times round-to-nearest's RMS error at the declared width and
        block size (the ``weight_error`` gate): 2-bit weights declared 4 (about 4.5 times) and wrong scales (far
        more) stay out.
    calibrated: whether it needs calibration text (``Calibration``).
    zero_points: whether its weights have zero points (not symmetric): what the int8 prompt path cannot fold.
    even_blocks: whether each weight's rows need an even number of blocks: onnxruntime 1.31's vendored
        neural-compressor path (k-quant, GPTQ) packs two 4-bit zero points a byte and reshapes them per column
        (``cannot reshape array of size 96 into shape (192, -1)`` on a 64-wide layer in one block).
    build: the onnxruntime quantizer configuration for ``bits``, ``block_size``, the node names to quantize and the
        calibration (None for the quantizer's own default, round to nearest).
    """

    name: str
    summary: str
    weight_error: float | None
    build: Callable[..., object | None]
    calibrated: bool = False
    even_blocks: bool = False
    zero_points: bool = True

    @property
    def declared(self) -> Declared:
        return Declared(
            "algorithm",
            self.name,
            f"--algorithm {self.name}",
            ensures={"zero_points": self.zero_points},
            says={"zero_points": "writes zero points (weights that are not symmetric)"},
        )

    def config(
        self, *, bits: int, block_size: int, nodes: Sequence[str], calibration: Calibration | None, model
    ) -> object | None:
        return self.build(bits=bits, block_size=block_size, nodes=nodes, calibration=calibration, model=model)


def per_node_bits(nodes: Sequence[str], bits: int, block_size: int) -> dict:
    """The per-node configuration of onnxruntime's vendored neural-compressor path (RTN, k-quant, GPTQ), whose
    default is 4 bits whatever the quantizer is asked: each node told its width and block size."""
    return {name: {"bits": bits, "group_size": block_size} for name in nodes}
