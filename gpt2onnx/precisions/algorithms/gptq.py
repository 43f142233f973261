"""GPTQ (Frantar et al. 2022): weights quantized column by column, each column's rounding error compensated in
the columns not yet quantized through the inverse Hessian of the layer's inputs, measured on calibration text;
it minimises the layer's output error, not the weights' own, so its weights lie further from the source than
round-to-nearest's. onnxruntime's GPTQWeightOnlyQuantConfig; the calibration: --calibration.

Asymmetric blocks (with zero points): onnxruntime 1.31 packs GPTQ's result by quantizing it again with scales from
each block's min and max (neural_compressor's quant_tensor). Symmetric, that second grid is not GPTQ's own and
every weight is rounded twice (on the trained test fixture's blocks: mean KL 8.2e-4 against round-to-nearest's
1.9e-4); asymmetric, the grids coincide where a block's extremes reach the ends of its range (2.3e-4)."""

from gpt2onnx.precisions.algorithms.algorithm import Int4Algorithm, per_node_bits


def _build(*, bits: int, block_size: int, nodes, calibration, model, **_):
    from onnxruntime.quantization.calibrate import CalibrationDataReader
    from onnxruntime.quantization.matmul_nbits_quantizer import GPTQWeightOnlyQuantConfig

    feeds = calibration.feeds(model.graph)

    class Reader(CalibrationDataReader):  # the quantizer deep-copies it and iterates once per copy
        def __init__(self) -> None:
            self.rewind()

        def get_next(self):
            return next(self.items, None)

        def rewind(self) -> None:
            self.items = iter(feeds)

    config = GPTQWeightOnlyQuantConfig(calibration_data_reader=Reader(), percdamp=0.01, block_size=128)
    config.customized_weight_config = {  # asymmetric: see above
        name: {**node, "scheme": "asym"} for name, node in per_node_bits(nodes, bits, block_size).items()
    }
    return config


# measured on the trained test fixture: tensor RMS error 0.9-1.45 of round-to-nearest's (the compensation moves
# weights on purpose; symmetric and asymmetric); 2.0 stays far below 2-bit weights (about 4.5)
ALGORITHM = Int4Algorithm(
    name="gptq",
    summary="GPTQ: each column's rounding error compensated in the others, calibrated on text (--calibration)",
    weight_error=2.0,
    build=_build,
    even_blocks=True,
    calibrated=True,
)
