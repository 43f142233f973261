"""fp32: the exported graph as it is, compared value by value with PyTorch; and tf32, the gates of fp32 weights
run with TF32 matmuls (cuda/tensorrt --tf32), a family of gates rather than a precision the tool writes."""

from gpt2onnx.precisions.precision import Precision

# In fp32 the ONNX graph and PyTorch differ only by summation order: ~1e-6 is typical for the 124M model, 1e-4
# leaves headroom.
PRECISION = Precision(
    name="float32",
    short="fp32",
    summary="fp32: the exported graph, compared value by value with PyTorch",
    gates={"logits": 1e-4, "present": 1e-4, "top1": 1.0, "tokens_equal": True},
    exact=True,
    transformers_js=("fp32", ""),
)

# The inputs of each product rounded to a 10-bit mantissa, as fp16 stores them, sums kept in fp32: fp32's 1e-4
# cannot hold, so fp16's gates apply.
TF32 = Precision(
    name="tf32",
    short="tf32",
    summary="fp32 weights with TF32 matmuls (cuda and tensorrt --tf32)",
    gates={"kl_mean": 1e-4, "top1": 0.98, "top5": 0.99},
    selectable=False,
)
