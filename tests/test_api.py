"""The public Python API: the names the README shows, usable end to end without the CLI."""

import pytest

import gpt2onnx


def test_public_api_end_to_end(tmp_path):
    for name in gpt2onnx.__all__:
        assert getattr(gpt2onnx, name) is not None, name
    result = gpt2onnx.export("tiny", tmp_path / "m", random_init=True, seed=2)
    assert isinstance(result.check, gpt2onnx.CheckReport) and result.check.passed
    info = gpt2onnx.inspect(result.folder)
    assert info.parameters.total == 180_480 and info.manifest.check.passed
    report = gpt2onnx.parity(result.folder, cases=2)
    assert isinstance(report, gpt2onnx.CheckReport) and report.passed and len(report.cases) == 2
    generated = gpt2onnx.generate(result.folder, ids=["1,2,3"], max_new_tokens=3)
    assert len(generated.tokens[0]) <= 3 and generated.prompts == ["1 2 3"]
    decoder = gpt2onnx.open_decoder(gpt2onnx.open_folder(result.folder), gpt2onnx.ProviderConfig())
    assert gpt2onnx.decode(decoder, [[1, 2, 3]], max_new_tokens=3).tokens.shape == (1, 3)
    figures = gpt2onnx.bench(
        [result.folder], config=gpt2onnx.BenchConfig(batches=(1,), prompt_len=4, new_tokens=3, warmup=0, repeat=1)
    )
    assert [run.batch for run in figures.runs] == [1] and figures.models[0].runs == figures.runs


def test_errors_are_typed_with_exit_codes(tmp_path):
    assert issubclass(gpt2onnx.CheckpointError, gpt2onnx.BadInput) and issubclass(
        gpt2onnx.BadInput, gpt2onnx.Gpt2OnnxError
    )
    assert (gpt2onnx.BadInput.exit_code, gpt2onnx.CheckFailed.exit_code, gpt2onnx.RuntimeUnavailable.exit_code) == (
        2,
        1,
        3,
    )
    with pytest.raises(gpt2onnx.BadInput):
        gpt2onnx.parity(tmp_path / "missing")
    with pytest.raises(gpt2onnx.CheckpointError):
        gpt2onnx.export("no-such-architecture", tmp_path / "x", random_init=True)
    with pytest.raises(gpt2onnx.BadInput):
        gpt2onnx.ProviderConfig(threads=0).check()


def test_deploy_stays_the_command_after_the_targets_are_imported():
    """The command and the package of targets have different names: importing every target leaves gpt2onnx.deploy
    the function."""
    import gpt2onnx.targets.deploy  # noqa: F401
    from gpt2onnx.targets import genai

    assert callable(gpt2onnx.deploy) and gpt2onnx.deploy.__name__ == "deploy"
    assert genai.SPEC.paths == ("genai_config.json",)
