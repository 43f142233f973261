"""Every variant the exporter writes is a valid ONNX model by ONNX's own checker, strict shape inference included."""

import onnx
import pytest

from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.precisions.quantize_options import QuantizeOptions

VARIANTS = {
    "fp32": dict(),
    "fp32-ort": dict(fusion="ort"),
    "fp32-portable": dict(fusion="portable"),
    "fp32-tensorrt": dict(fusion="tensorrt"),
    "fp16": dict(dtype="fp16"),
    "int8": dict(quantization=QuantizeOptions("int8")),
    "int4": dict(quantization=QuantizeOptions("int4")),
    "block": dict(block=0),
    "external-data": dict(external_data=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_passes_the_full_onnx_check(variant, tiny_folder, tmp_path):
    folder = export(
        str(tiny_folder), tmp_path / variant, options=ExportOptions(validate=False, **VARIANTS[variant])
    ).folder
    onnx.checker.check_model(str(folder / "model.onnx"), full_check=True)  # by path: external data and all
