"""The K/V cache's precision (``--kv-cache``), its own axis apart from the weights' and from the cache's layout: float
(the model's own dtype, the default), int8 or int4, per channel, which onnxruntime's CPU GroupQueryAttention stores
and reads (a layout whose attention op quantizes its cache: gpt2onnx.layouts.shared).

What onnxruntime 1.31.1's CPU kernel does, measured on a one-node graph against numpy
(``tests/precisions/test_kv_cache.py``):
with ``kv_cache_bit_width`` 8, ``k_quant_type``/``v_quant_type`` PER_CHANNEL and float ``k_scale``/``v_scale`` of
[1, kv_heads, 1, head_dim], past and present are int8 and each new K/V value is stored as clip(round(x / scale),
-128, 127); attention then reads scale × the stored value (the prompt step too), within 1e-6 of that computation in
numpy. An int8 buffer bound as both past and present is written in place, as a float one is. uint8 with bit width 8
is refused ("Tensor type mismatch"); bit width 4 stores uint8, two values a byte (head_dim / 2 bytes a row), each
clip(round(x / scale), -8, 7) + 8, low nibble first; float8e4m3fn has no CPU kernel ("Could not find an
implementation"). The CUDA kernel takes fp16/bf16 activations only (NOTES.md), so a quantized cache runs where the
ort-shared-kv profile runs: on the CPU.

The scales are calibrated: per layer, K and V, one per channel (head × head_dim), the largest |x| the fp32 graph
writes to its cache over the calibration text (full-context sequences, so every position's embedding is seen),
divided by 127 (int4: 7), so that nothing seen in calibration is clipped. (onnxruntime-genai's calibration divides a
99.99th percentile by 128 and clips what lies beyond; GPT-2 has no rotary embedding, so its K/V at a position far
from the calibrated ones are not a rotation away from them.) A value beyond the calibrated range is clipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from gpt2onnx.capabilities import Declared, Need
from gpt2onnx.registry import Registry

FLOAT_CACHE = "float"  # --kv-cache's default: the cache in the model's own dtype
FLOAT_DECLARED = Declared("K/V cache", FLOAT_CACHE, f"--kv-cache {FLOAT_CACHE}", ensures={"kv_dtype": FLOAT_CACHE})


@dataclass(frozen=True)
class KvCacheFormat:
    """A quantized K/V cache: its name (``--kv-cache``), the element type of past and present, the kernel's
    attributes, the largest stored magnitude a calibrated scale maps to, and the gates a graph with it is held to
    against its float-cache reference (verify.gates' names)."""

    name: str
    summary: str
    dtype: str  # numpy's name of the cache's element type (the IO contract's)
    onnx_type: int  # onnx.TensorProto's element type
    bit_width: int  # GroupQueryAttention's kv_cache_bit_width
    quant_type: str  # GroupQueryAttention's k_quant_type and v_quant_type
    qmax: int  # a channel's calibrated |x| max is stored as this many steps
    gates: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    values_per_byte: int = 1  # 2: two 4-bit values a byte (head_dim / 2 bytes a row), low nibble first

    @property
    def declared(self) -> Declared:
        """What it needs: a layout whose attention op quantizes the cache, fp32 activations (fp16 ones are not
        checked with a quantized cache)."""
        return Declared(
            "K/V cache",
            self.name,
            f"--kv-cache {self.name}",
            ensures={"kv_dtype": self.name},
            requires=(
                Need("quantizable_cache", allowed={True}, why="is stored by an attention op that quantizes it"),
                Need("activations", allowed={"float32"}, why="takes fp32 activations"),
            ),
            says={"kv_dtype": f"stores the K/V cache as {self.name}"},
        )


INT8 = KvCacheFormat(
    name="int8",
    summary="int8 per channel (onnxruntime's CPU GroupQueryAttention), scales calibrated on text",
    dtype="int8",
    onnx_type=3,  # TensorProto.INT8
    bit_width=8,
    quant_type="PER_CHANNEL",
    qmax=127,
    # On the checks' random prompts against PyTorch: the trained test model measured mean KL 1.9e-5, top-1 98.2 %,
    # top-5 100 %; the GPT-2-shaped reference (6 × 384) 4.6e-6, 100 %, 100 %. Scales 16× too large (about 4 bits
    # per value) give 1.4e-4 on the test model, 64× too large 4.1e-3 and top-1 86 % (tests/precisions/test_kv_cache.py):
    # the gates catch a broken cache (wrong scales, a wrong layout), with 5× room for a sound one.
    gates=MappingProxyType({"kl_mean": 1e-4, "top1": 0.95, "top5": 0.99}),
)

INT4 = KvCacheFormat(
    name="int4",
    summary="int4 per channel, two values a byte (onnxruntime's CPU GroupQueryAttention), scales calibrated on text",
    dtype="uint8",  # the kernel's 4-bit cache: uint8 bytes of two values, each stored as step + 8, low nibble first
    onnx_type=2,  # TensorProto.UINT8
    bit_width=4,
    quant_type="PER_CHANNEL",
    qmax=7,  # the steps run from -8 to 7: the calibrated largest |x| is 7 steps, so it is never clipped
    # On the checks' random prompts against PyTorch: the trained test model 1.8e-4, top-1 98.2 %; the GPT-2-shaped
    # reference 1.15e-3, 97.8 %, top-5 100 % (random token ids reach values calibration on text never saw, which
    # 4 bits clip harder; on held-out text the reference measures 6.5e-5, docs/precision.md)
    gates=MappingProxyType({"kl_mean": 5e-3, "top1": 0.9, "top5": 0.97}),
    values_per_byte=2,
)

KV_CACHES: Registry[KvCacheFormat] = Registry("K/V cache type", (INT8, INT4), option="--kv-cache", extra=(FLOAT_CACHE,))
BY_DTYPE = {fmt.dtype: fmt for fmt in KV_CACHES.values()}


def kv_cache_format(name: str) -> KvCacheFormat | None:
    """The format ``--kv-cache`` names (None for the float cache); BadInput for another name."""
    return None if name == FLOAT_CACHE else KV_CACHES.lookup(name)


def cache_declared(name: str) -> Declared:
    """The declaration of what --kv-cache names (checked)."""
    fmt = kv_cache_format(name)
    return FLOAT_DECLARED if fmt is None else fmt.declared


def steps_of(stored, fmt: KvCacheFormat):
    """The signed steps a cache holds (numpy, [..., head_dim]): int8 as they are; 4-bit bytes unpacked, low nibble
    first, each less the offset 8."""
    import numpy as np

    if fmt.values_per_byte == 1:
        return stored.astype(np.float32)
    pairs = np.stack([stored & 0x0F, stored >> 4], axis=-1).astype(np.float32) - 8
    return pairs.reshape(*stored.shape[:-1], stored.shape[-1] * 2)


def cache_format_of(dtype: str) -> KvCacheFormat | None:
    """The quantized format of a cache of element type ``dtype`` (a graph's past input's), None for a float one."""
    return BY_DTYPE.get(dtype)
