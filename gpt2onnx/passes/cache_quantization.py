"""A quantized K/V cache (``--kv-cache int8``) on a graph whose cache layout's attention op quantizes it
(GroupQueryAttention: gpt2onnx.layouts.shared): scales calibrated on text through the graph itself, then every
GroupQueryAttention (those in int4's prompt-path If too) told to store its cache quantized.

    GroupQueryAttention(q, k, v, past_key, past_value, seqlens_k, total_len, -, -, -, bias)
 ⇒ GroupQueryAttention(q, k, v, past_key, past_value, seqlens_k, total_len, -, -, -, bias, -, k_scale, v_scale)
    with kv_cache_bit_width, k_quant_type and v_quant_type; past_key_values.* and present.* of the cache's type.

The calibration runs the float-cache graph (weights as they will be written) on each calibration sequence from an
empty past and takes, per layer and channel, the largest |K| and |V| its presents hold
(gpt2onnx.precisions.kv_cache says why that and not a percentile).
"""

from __future__ import annotations

import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from gpt2onnx.artifact.graph import PROTOBUF_LIMIT, QUANTIZED_CACHE_OP, all_nodes, save_onnx
from gpt2onnx.artifact.manifest import KvCacheRecord
from gpt2onnx.errors import BadInput
from gpt2onnx.precisions.kv_cache import KvCacheFormat

log = logging.getLogger(__name__)

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
_K_SCALE, _V_SCALE = 12, 13  # GroupQueryAttention's input slots (com.microsoft, version 1)
SCALE_FLOOR = 1e-8  # a channel that was zero all through calibration still gets a usable scale


@dataclass(frozen=True)
class CacheRanges:
    """The largest |K| and |V| per layer and channel ([n_head, head_dim] each), and what they were measured on."""

    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    tokens: int
    described: str


def _session(model: onnx.ModelProto, folder: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if model.ByteSize() < PROTOBUF_LIMIT - 2**26:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    path = folder / "calibration.onnx"
    save_onnx(model, path, external_data=True)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def cache_ranges(model: onnx.ModelProto, sequences, described: str) -> CacheRanges:
    """Each layer's largest |K| and |V| per channel on ``sequences`` (1-D int64 token arrays), each run as one
    prompt from an empty past through ``model`` (a float-cache graph)."""
    pasts = [v for v in model.graph.input if _PAST.match(v.name)]
    n_layer = len(pasts) // 2
    heads, head_dim = (pasts[0].type.tensor_type.shape.dim[axis].dim_value for axis in (1, 3))
    keys = [np.zeros((heads, head_dim), np.float32) for _ in range(n_layer)]
    values = [np.zeros((heads, head_dim), np.float32) for _ in range(n_layer)]
    inputs = {v.name for v in model.graph.input}
    tokens = 0
    with tempfile.TemporaryDirectory(prefix="gpt2onnx-kv-") as tmp:
        session = _session(model, Path(tmp))
        presents = [o.name for o in session.get_outputs() if o.name.startswith("present.")]
        for ids in sequences:
            ids = np.asarray(ids, np.int64)[None, :]
            feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
            if "position_ids" in inputs:
                feed["position_ids"] = np.arange(ids.shape[1], dtype=np.int64)[None, :]
            for past in pasts:
                feed[past.name] = np.zeros((1, heads, 0, head_dim), np.float32)
            for name, present in zip(presents, session.run(presents, feed)):
                layer, kind = re.fullmatch(r"present\.(\d+)\.(key|value)", name).groups()
                ranges = (keys if kind == "key" else values)[int(layer)]
                np.maximum(ranges, np.abs(present[0, :, : ids.shape[1]]).max(axis=1), out=ranges)
            tokens += ids.shape[1]
    return CacheRanges(tuple(keys), tuple(values), tokens, described)


def _scale(ranges: np.ndarray, fmt: KvCacheFormat) -> np.ndarray:
    """The per-channel scale, shaped [1, heads, 1, head_dim] as the kernel broadcasts it over present."""
    return np.maximum(ranges / fmt.qmax, SCALE_FLOOR).astype(np.float32)[None, :, None, :]


def _set_elem_type(value: onnx.ValueInfoProto, elem_type: int) -> None:
    value.type.tensor_type.elem_type = elem_type


def quantize_kv_cache(
    model: onnx.ModelProto, fmt: KvCacheFormat, sequences, described: str
) -> tuple[onnx.ModelProto, KvCacheRecord]:
    """``model`` (a shared-cache graph, changed in place) with its cache stored as ``fmt``, the scales calibrated on
    ``sequences`` (described by ``described``); and the manifest's record."""
    attention = [n for n in all_nodes(model.graph, prompt_body=True) if n.op_type == QUANTIZED_CACHE_OP]
    if not attention:
        raise BadInput(
            f"--kv-cache {fmt.name} needs {QUANTIZED_CACHE_OP}, which this graph does not hold: choose a fusion"
            " profile whose cache layout quantizes its cache"
        )
    ranges = cache_ranges(model, sequences, described)
    for node in attention:
        layer = int(_PAST.match(node.input[3]).group(1))
        k_name, v_name = f"kv_cache.{layer}.k_scale", f"kv_cache.{layer}.v_scale"
        model.graph.initializer.extend(
            [
                numpy_helper.from_array(_scale(ranges.keys[layer], fmt), k_name),
                numpy_helper.from_array(_scale(ranges.values[layer], fmt), v_name),
            ]
        )
        inputs = list(node.input) + [""] * (_V_SCALE + 1 - len(node.input))
        inputs[_K_SCALE], inputs[_V_SCALE] = k_name, v_name
        del node.input[:]
        node.input.extend(inputs)
        node.attribute.extend(
            [
                helper.make_attribute("kv_cache_bit_width", fmt.bit_width),
                helper.make_attribute("k_quant_type", fmt.quant_type),
                helper.make_attribute("v_quant_type", fmt.quant_type),
            ]
        )
    # an If's branches (int4's prompt path) output the presents under their own prefix ("prompt/present.0.key")
    branches = [
        o for n in model.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH for o in a.g.output
    ]
    for value in (*model.graph.input, *model.graph.output, *branches):
        if _PAST.match(value.name) or value.name.split("/")[-1].startswith("present."):
            _set_elem_type(value, fmt.onnx_type)
            if fmt.values_per_byte > 1:  # a row of head_dim values in head_dim / values_per_byte bytes
                row = value.type.tensor_type.shape.dim[3]
                row.dim_value = row.dim_value // fmt.values_per_byte
    record = KvCacheRecord(
        dtype=fmt.dtype,
        quant_type=fmt.quant_type,
        calibration=f"{ranges.described} ({ranges.tokens} tokens)",
        largest_key=float(max(r.max() for r in ranges.keys)),
        largest_value=float(max(r.max() for r in ranges.values)),
    )
    log.info(
        "K/V cache stored as %s %s, calibrated on %s: largest |K| %.3g, |V| %.3g",
        fmt.dtype,
        fmt.quant_type,
        record.calibration,
        record.largest_key,
        record.largest_value,
    )
    return model, record
