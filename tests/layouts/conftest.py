"""The exports of the preallocated K/V layouts, shared by this folder's files (the bench at past lengths runs on
both): the tiny checkpoint with one shared buffer per layer (ort-shared-kv) and with one static buffer per layer
written in place (onnx-static-kv)."""

import pytest

from gpt2onnx.exporters.export import ExportOptions, export


@pytest.fixture(scope="session")
def shared_export(tiny_folder, tmp_path_factory):
    return export(
        str(tiny_folder), tmp_path_factory.mktemp("shared") / "skv", options=ExportOptions(fusion="ort-shared-kv")
    ).folder


@pytest.fixture(scope="session")
def static_export(tiny_folder, tmp_path_factory):
    return export(
        str(tiny_folder), tmp_path_factory.mktemp("static") / "skv", options=ExportOptions(fusion="onnx-static-kv")
    ).folder
