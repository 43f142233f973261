"""No fusion: the exporter's graph as it is (LayerNorm from torch is already one LayerNormalization op)."""

from gpt2onnx.profiles.profile import Profile

PROFILE = Profile(name="none", summary="no fusion: the exporter's graph as it is")
