"""The typed manifest reads every manifest written so far: fixtures written by the previous release (commit cf4bc05:
an export, its ort optimization, and that deployed to genai and Triton) and the first release's shape; a folder
carrying the previous release's manifest loads, inspects, runs and benches."""

import json
import os
from pathlib import Path

import pytest

from gpt2onnx.artifact.folder import MANIFEST_NAME, open_folder, read_manifest
from gpt2onnx.artifact.manifest import FileRecord, Manifest
from gpt2onnx.errors import BadInput
from gpt2onnx.files import stamp
from gpt2onnx.precisions.all_precisions import precision_of
from gpt2onnx.targets.deploy import deploy

FIXTURES = Path(__file__).parents[1] / "fixtures" / "cf4bc05"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.parametrize("name", ["export", "optimized", "deployed"])
def test_previous_release_manifests_read_and_write_back_unchanged(name):
    data = fixture(name)
    manifest = Manifest.from_dict(data)
    assert manifest.as_dict() == data and list(manifest.as_dict()) == list(data)  # same keys, same order
    assert manifest.check.passed and manifest.precision == "float32" and manifest.cache_layout == "concat"
    assert manifest.io.input_names[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert (
        manifest.model_files.keys() == {"model.onnx"} and manifest.model_bytes == data["files"]["model.onnx"]["bytes"]
    )
    if name != "export":
        assert manifest.fusion.golden["attention"].found == 2 and manifest.optimized_from
    if name == "deployed":
        assert (
            set(manifest.deploy.targets) == {"genai", "triton"}
            and manifest.deploy.records["triton"]["name"] == "deployed"
        )


def test_first_release_manifest_and_unknown_keys():
    """The first release wrote no fusion, precision, kv_cache or deploy records, and a check of another shape:
    they read as absent (the check as unreadable, kept as it was); keys of a newer release are kept too."""
    data = {k: v for k, v in fixture("export").items() if k not in ("fusion", "fp16", "quantization", "kv_cache")}
    data["parity"] = {"passed": True, "max_abs_logits": 3e-7, "max_abs_present": 1e-7, "tolerance": 1e-4}
    data["from_a_newer_release"] = {"x": 1}
    manifest = Manifest.from_dict(data)
    assert manifest.fusion is None and manifest.cache_layout is None and manifest.check is None
    assert manifest.check_summary == "unreadable"
    written = manifest.as_dict()
    assert written["parity"] == data["parity"] and written["from_a_newer_release"] == {"x": 1}
    with pytest.raises(BadInput, match="format version 2, newer than this gpt2onnx reads"):
        Manifest.from_dict({**data, "format_version": 2})
    damaged = Manifest.from_dict({**data, "fusion": {"golden": 3}, "dtype": 16})
    assert damaged.fusion is None and damaged.unreadable == ["dtype", "fusion"] and damaged.dtype == "float32"
    assert damaged.as_dict()["fusion"] == {"golden": 3}  # written back as it was
    with pytest.raises(BadInput, match="no valid 'files'"):
        Manifest.from_dict({**data, "files": []})


@pytest.fixture(scope="module")
def previous_release_folder(tmp_path_factory):
    """The previous release's export of tiny (seed 3), with its manifest as that release wrote it. ONNX files are
    not committed, so the model is exported again by this release; only the model file's size and sha256 in
    the manifest are taken from the new file, every other record is the old one."""
    from gpt2onnx.exporters.export import ExportOptions, export

    folder = export(
        "tiny",
        tmp_path_factory.mktemp("previous") / "tiny",
        random_init=True,
        seed=3,
        options=ExportOptions(validate=False),
    ).folder
    old = fixture("export")
    model = read_manifest(folder).files["model.onnx"]
    old["files"]["model.onnx"] = FileRecord(model.bytes, model.sha256).as_dict()
    (folder / MANIFEST_NAME).write_text(json.dumps(old, indent=2))
    return folder


def test_previous_release_folder_loads_inspects_runs_and_benches(previous_release_folder, tmp_path):
    from typer.testing import CliRunner

    import gpt2onnx
    from gpt2onnx.cli import app

    folder = previous_release_folder
    assert precision_of(open_folder(folder).facts).name == "float32"  # the sha256 check included
    info = gpt2onnx.inspect(folder)
    assert info.manifest.check.passed and info.manifest.check_summary.endswith("— pass")
    shown = CliRunner().invoke(app, ["inspect", str(folder)])
    assert shown.exit_code == 0 and "checked at export: float32 against PyTorch" in shown.output, shown.output
    assert len(gpt2onnx.generate(folder, ids=["1,2,3"], max_new_tokens=3).tokens[0]) <= 3
    assert gpt2onnx.parity(folder, cases=1).passed  # the reference is rebuilt from the old source record
    figures = gpt2onnx.bench(
        folder, config=gpt2onnx.BenchConfig(batches=(1,), prompt_len=4, new_tokens=3, warmup=0, repeat=1)
    )
    assert figures.models[0].precision == "float32" and figures.runs[0].tokens_per_s > 0
    deployed = deploy(folder, "genai", out=tmp_path / "deployed").manifest
    again = deployed.as_dict()
    old = fixture("export")
    for key in ("source", "architecture", "io", "options", "parity", "timings"):
        assert again[key] == old[key], key  # carried over as the old release wrote them
    assert deployed.deploy.source_created == old["created"] and deployed.deploy.targets == {
        "genai": ["genai_config.json"]
    }


def test_the_checks_figures_are_typed_and_read_back_as_written(tmp_path):
    """A check's figures are typed (``Figures``): an int8 export's check (randomized cases, and the file judged by
    its own rounded weights) and a parity report (per case, the K/V path, the prompts) read back with every figure
    typed and write back key for key, in the order read. A figure this release does not know is kept; a damaged
    one makes the whole check unreadable, kept in the manifest as it was, never half read."""
    from gpt2onnx.artifact.report import CheckReport, Figures, KlStats, WeightRounding
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.precisions.quantize_options import QuantizeOptions
    from gpt2onnx.verify.parity import parity

    exported = export(
        "tiny",
        tmp_path / "int8",
        random_init=True,
        options=ExportOptions(quantization=QuantizeOptions("int8")),
    )
    checked = parity(exported.folder, cases=2)
    for report in (exported.check, checked):
        data = json.loads(json.dumps(report.as_dict()))
        again = CheckReport.from_dict(data)
        assert json.dumps(again.as_dict()) == json.dumps(data)
        assert isinstance(again.measured, Figures) and isinstance(again.measured.kl, KlStats)
        assert isinstance(again.rounded.measured.weights, WeightRounding) and again.rounded.measured.weights.tensors
        assert again.measured == report.measured and again.summary() == report.summary()
    assert checked.measured.prompts == "random token ids" and checked.measured.cases == 2
    assert checked.kv_path.checks and checked.kv_path.checks[0].measured.positions_compared > 0

    data = json.loads(json.dumps(checked.as_dict()))
    data["measured"] = {**dict(reversed(data["measured"].items())), "joules_per_token": 0.4}
    assert list(CheckReport.from_dict(data).as_dict()["measured"]) == list(data["measured"])
    assert CheckReport.from_dict(data).measured.extra == {"joules_per_token": 0.4}

    manifest = fixture("export")
    for damage in (
        lambda d: d["measured"]["kl"].update(mean="low"),
        lambda d: d["measured"].update(cases=2.5),
        lambda d: d["measured"]["logits"].update(p95=1.0),
        lambda d: d["rounded"]["measured"]["weights"].update(tensors=True),
        lambda d: d["kv_path"]["checks"][0].update(measured=[]),
    ):
        damaged = json.loads(json.dumps(checked.as_dict()))
        damage(damaged)
        read = Manifest.from_dict({**manifest, "parity": damaged})
        assert read.check is None and read.check_summary == "unreadable"
        assert read.as_dict()["parity"] == damaged


@pytest.mark.parametrize("change", ["swapped", "written"])
def test_a_file_changed_between_its_check_and_the_load_is_refused(tiny_export, tmp_path, monkeypatch, change):
    """The bytes checked are the bytes loaded: a model.onnx replaced (another folder's, renamed into place) or
    written to after its sha256 was checked, while the session is being made, is refused once the runtime has
    loaded it (once it ran the other model, 1 run in 10 in a race)."""
    import shutil

    import gpt2onnx.runtimes.decoder as decoder
    from gpt2onnx.errors import IntegrityError
    from gpt2onnx.runtimes.decoder import open_decoder
    from gpt2onnx.runtimes.providers import ProviderConfig

    folder = Path(shutil.copytree(tiny_export, tmp_path / "m"))
    other = tmp_path / "other.onnx"
    shutil.copyfile(folder / "model.onnx", other)
    real = decoder.create_session

    def racing(model_path, *args, **kwargs):  # model_path: the private folder's link to what was hashed
        if change == "swapped":
            other.replace(folder / "model.onnx")  # a rename: another file, the same bytes here
        else:
            with open(folder / "model.onnx", "r+b") as fh:  # the same file, written to
                fh.write(fh.read(1))
        return real(model_path, *args, **kwargs)

    opened = open_folder(folder)  # checked against the manifest
    monkeypatch.setattr(decoder, "create_session", racing)
    with pytest.raises(IntegrityError, match="was replaced or written to after its sha256 was checked"):
        open_decoder(opened, ProviderConfig())
    monkeypatch.setattr(decoder, "create_session", real)
    open_decoder(open_folder(folder), ProviderConfig())  # untouched since this check: it loads


def test_a_link_or_chmod_between_the_check_and_the_load_is_not_a_change(tiny_export, tmp_path, monkeypatch):
    """A hard link made to a checked file while it is being loaded (deploy links a folder's files into its output)
    or a chmod moves only its change time: the same bytes, hashed again, load; the bench corpus once refused a
    shared folder that a concurrent deploy linked from."""
    import shutil

    import gpt2onnx.runtimes.decoder as decoder
    from gpt2onnx.runtimes.decoder import open_decoder
    from gpt2onnx.runtimes.providers import ProviderConfig

    folder = Path(shutil.copytree(tiny_export, tmp_path / "m"))
    real = decoder.create_session

    def linking(model_path, *args, **kwargs):
        os.link(folder / "model.onnx", tmp_path / "linked.onnx")
        os.chmod(folder / "model.onnx", 0o640)
        return real(model_path, *args, **kwargs)

    opened = open_folder(folder)
    monkeypatch.setattr(decoder, "create_session", linking)
    open_decoder(opened, ProviderConfig())  # loads: the same bytes
    checked, _ = opened.stamps[folder / "model.onnx"]
    assert stamp(os.stat(folder / "model.onnx")) != checked  # its change time moved: the re-hash decided
