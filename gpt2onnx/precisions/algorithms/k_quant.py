"""k-quant (llama.cpp's search for each block's scale and minimum, as onnxruntime's k_quant implements it):
asymmetric blocks with a zero point, the scale chosen by a weighted least-squares search instead of the largest
magnitude; no calibration data. onnxruntime's KQuantWeightOnlyQuantConfig."""

from gpt2onnx.precisions.algorithms.algorithm import Int4Algorithm, per_node_bits


def _build(*, bits: int, block_size: int, nodes, **_):
    from onnxruntime.quantization.matmul_nbits_quantizer import KQuantWeightOnlyQuantConfig

    return KQuantWeightOnlyQuantConfig(customized_weight_config=per_node_bits(nodes, bits, block_size))


# measured on the trained test fixture: tensor RMS error 0.85-0.93 of round-to-nearest's
ALGORITHM = Int4Algorithm(
    name="k-quant",
    summary="k-quant: asymmetric blocks, each scale and minimum found by a least-squares search, no calibration",
    weight_error=1.25,
    build=_build,
    even_blocks=True,
)
