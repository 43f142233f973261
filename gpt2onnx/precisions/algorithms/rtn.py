"""Round to nearest: each block's largest magnitude sets its scale, every weight rounded to the nearest step
(onnxruntime's default MatMulNBits quantizer). No calibration; the file check holds every weight within a step."""

from gpt2onnx.precisions.algorithms.algorithm import Int4Algorithm

ALGORITHM = Int4Algorithm(
    name="rtn",
    summary="round to nearest, symmetric, one scale per block (onnxruntime's default quantizer)",
    weight_error=None,
    build=lambda **_: None,
    zero_points=False,
)
