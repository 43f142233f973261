"""Export options and the exported folder on disk: opsets, external data, --force, nothing half-written."""

import json

import numpy as np
import onnx
import pytest

from gpt2onnx.artifact import graph as output
from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.exporters import export as export_module
from gpt2onnx.exporters.export import ExportOptions, export


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("opset", [14, 18, 20])
def test_other_opsets_validate(tiny_folder, tmp_path, opset):
    result = export(str(tiny_folder), tmp_path / "m", options=ExportOptions(opset=opset))
    model = onnx.load(str(result.folder / "model.onnx"))
    assert {i.domain or "ai.onnx": i.version for i in model.opset_import}["ai.onnx"] == opset
    assert model.ir_version <= 10 and result.check.passed


@pytest.mark.parametrize("opset", [13, 21, -1])
def test_invalid_opset(tiny_folder, tmp_path, opset):
    with pytest.raises(Gpt2OnnxError, match=f"--opset {opset} is not supported: choose 14 to 20"):
        export(str(tiny_folder), tmp_path / "m", options=ExportOptions(opset=opset))
    assert not (tmp_path / "m").exists()


def test_external_data_on_request(tiny_folder, tmp_path):
    result = export(str(tiny_folder), tmp_path / "ext", options=ExportOptions(external_data=True))
    files = set(result.manifest.files)
    assert {"model.onnx", "model.onnx_data"} <= files and result.manifest.options["external_data"]
    assert (result.folder / "model.onnx").stat().st_size < 100_000  # the graph only
    assert result.check.passed  # validated from the files as written


def test_external_data_chosen_automatically_past_the_protobuf_limit(tiny_folder, tmp_path, monkeypatch):
    # The real limit is 2 GB (gpt2-xl); lower it so the automatic path is exercised on a tiny model.
    monkeypatch.setattr(output, "PROTOBUF_LIMIT", 2**26 + 10_000)
    result = export(str(tiny_folder), tmp_path / "auto")
    assert "model.onnx_data" in result.manifest.files
    small = export(str(tiny_folder), tmp_path / "small", options=ExportOptions(external_data=False))
    assert "model.onnx_data" not in small.manifest.files


def test_existing_folder_is_kept_without_force(tiny_folder, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(Gpt2OnnxError, match="already exists.*--force"):
        export(str(tiny_folder), target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_force_replaces_the_folder(tiny_folder, tmp_path):
    target = tmp_path / "out"
    export(str(tiny_folder), target, options=ExportOptions(validate=False))
    old = (target / "model.onnx").stat().st_ino
    export(str(tiny_folder), target, options=ExportOptions(force=True))
    assert (target / "model.onnx").stat().st_ino != old and _leftovers(tmp_path) == []
    # a file its manifest does not list is never deleted: the replace is refused, naming it
    (target / "old.txt").write_text("old")
    with pytest.raises(Gpt2OnnxError, match="holds 'old.txt'"):
        export(str(tiny_folder), target, options=ExportOptions(force=True, validate=False))
    assert (target / "old.txt").read_text() == "old" and _leftovers(tmp_path) == []


def test_force_never_replaces_a_folder_gpt2onnx_did_not_write(tiny_folder, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "precious.txt").write_text("mine")
    with pytest.raises(Gpt2OnnxError, match="was not written by gpt2onnx"):
        export(str(tiny_folder), target, options=ExportOptions(force=True))
    with pytest.raises(Gpt2OnnxError, match="which --force would delete"):
        export(str(tiny_folder), tiny_folder, options=ExportOptions(force=True))
    assert (target / "precious.txt").read_text() == "mine" and (tiny_folder / "config.json").is_file()


def test_failed_validation_leaves_nothing(tiny_folder, tmp_path):
    with pytest.raises(Gpt2OnnxError, match="validation failed"):
        export(str(tiny_folder), tmp_path / "out", options=ExportOptions(tolerance=1e-12))
    assert list(tmp_path.iterdir()) == []


def test_failed_validation_with_force_keeps_the_old_folder(tiny_folder, tmp_path):
    target = tmp_path / "out"
    export(str(tiny_folder), target, options=ExportOptions(validate=False))
    before = {p.name: p.stat().st_ino for p in target.iterdir()}
    with pytest.raises(Gpt2OnnxError, match="validation failed"):
        export(str(tiny_folder), target, options=ExportOptions(tolerance=1e-12, force=True))
    assert {p.name: p.stat().st_ino for p in target.iterdir()} == before and _leftovers(tmp_path) == []


def test_interrupted_export_leaves_nothing(tiny_folder, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "_write_companions", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export(str(tiny_folder), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output(tiny_folder, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    with pytest.raises(Gpt2OnnxError, match="cannot write to output folder"):
        export(str(tiny_folder), blocker / "out")


def test_block_out_of_range(tiny_folder, tmp_path):
    with pytest.raises(Gpt2OnnxError, match=r"block 2 is out of range: this model has blocks 0 to 1"):
        export(str(tiny_folder), tmp_path / "b", options=ExportOptions(block=2))


def test_no_validate_records_no_parity(tiny_folder, tmp_path):
    result = export(str(tiny_folder), tmp_path / "nv", options=ExportOptions(validate=False))
    assert result.check is None and result.manifest.check is None


def test_random_init_default_output_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = export("tiny", random_init=True, options=ExportOptions(logits="last"))
    assert result.folder == export_module.DEFAULT_OUTPUT_ROOT / "tiny-last-logits"
    manifest = json.loads((tmp_path / result.folder / "gpt2onnx.json").read_text())
    assert manifest["source"]["kind"] == "random" and manifest["io"]["outputs"][0]["dims"] == ["batch_size", 1, 1000]
    config = json.loads((tmp_path / result.folder / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_layer"] == 2


def test_companion_files_are_copied(tiny_folder, tmp_path):
    import shutil

    source = tmp_path / "src"
    shutil.copytree(tiny_folder, source)
    (source / "vocab.json").write_text(json.dumps({"a": 0}))
    (source / "merges.txt").write_text("#version: 0.2\n")
    result = export(str(source), tmp_path / "out")
    assert (result.folder / "vocab.json").read_text() == json.dumps({"a": 0})
    assert (result.folder / "merges.txt").is_file() and (result.folder / "generation_config.json").is_file()
    assert json.loads((result.folder / "config.json").read_text()) == json.loads((source / "config.json").read_text())


def test_logits_last_equals_the_last_row_of_all(tiny_export, tmp_path, tiny_folder):
    # the last-position graph computes the vocabulary projection for one position only
    from gpt2onnx.runtimes.decoder import OnnxDecoder
    from gpt2onnx.runtimes.providers import cpu_session

    last = export(str(tiny_folder), tmp_path / "last", options=ExportOptions(logits="last")).folder
    full_decoder = OnnxDecoder(cpu_session(tiny_export / "model.onnx"))
    last_decoder = OnnxDecoder(cpu_session(last / "model.onnx"))
    ids = np.arange(1, 9, dtype=np.int64)[None]
    mask = np.ones_like(ids)
    pos = np.arange(8)[None]
    full_logits, _ = full_decoder.step(ids, mask, pos, full_decoder.empty_past(1))
    last_logits, _ = last_decoder.step(ids, mask, pos, last_decoder.empty_past(1))
    np.testing.assert_allclose(last_logits[:, 0], full_logits[:, -1], atol=1e-5)


def test_exported_folder_has_ordinary_permissions(tiny_folder, tmp_path):
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    result = export(str(tiny_folder), tmp_path / "perm", options=ExportOptions(external_data=True))
    assert stat.S_IMODE(result.folder.stat().st_mode) == 0o777 & ~umask
    for path in result.folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name


def test_default_output_names_per_variant():
    assert export_module.default_output("gpt2", ExportOptions()) == export_module.DEFAULT_OUTPUT_ROOT / "gpt2"
    assert (
        export_module.default_output("gpt2", ExportOptions(logits="last", fusion="ort")).name == "gpt2-last-logits-ort"
    )
    assert export_module.default_output("gpt2", ExportOptions(block=3)).name == "gpt2-block3"
