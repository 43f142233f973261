"""The public Python API: the names the README shows, usable end to end without the CLI."""

import gpt2onnx


def test_public_api_end_to_end(tmp_path):
    for name in gpt2onnx.__all__:
        assert getattr(gpt2onnx, name) is not None, name
    result = gpt2onnx.export("tiny", tmp_path / "m", random_init=True, seed=2)
    assert gpt2onnx.inspect_model(result.folder)["parameters"]["total"] == 180_480
    assert gpt2onnx.check_parity(result.folder, cases=2).passed
    decoder = gpt2onnx.open_decoder(gpt2onnx.open_folder(result.folder), gpt2onnx.ProviderConfig())
    assert gpt2onnx.generate(decoder, [[1, 2, 3]], max_new_tokens=3).tokens.shape == (1, 3)
