"""HQQ (half-quadratic quantization, Badri & Shaji 2023): per block a scale and a real-valued zero point fitted
by a few iterations that minimise a sparsity-promoting norm of the weight error; no calibration data.
onnxruntime's HQQWeightOnlyQuantConfig (it imports torch). MatMulNBits with fp32 zero points."""

from gpt2onnx.precisions.algorithms.algorithm import Int4Algorithm


def _build(*, bits: int, block_size: int, **_):
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig

    return HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits)


# measured on the trained test fixture: tensor RMS error 0.79-0.84 of round-to-nearest's; 1.25 leaves room for
# other weights and stays far below 2-bit weights (about 4.5)
ALGORITHM = Int4Algorithm(
    name="hqq",
    summary="HQQ: scales and zero points fitted per block to the weights, no calibration",
    weight_error=1.25,
    build=_build,
)
