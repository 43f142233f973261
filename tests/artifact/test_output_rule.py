"""The one output rule (gpt2onnx.artifact.paths.check_output_path): a file a command writes is never an input, a
file in a folder read, nor a hard link to either; and the corpus (tests/bad_input/outputs.py, OUTPUT_INPUTS) walks
every input of every command that writes a file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpt2onnx.artifact.paths import check_output_file, check_output_path
from gpt2onnx.errors import BadInput
from tests.bad_input.common import _parameters, path_options
from tests.bad_input.outputs import OUTPUT_INPUTS, output_options

# inputs typed as text (a checkpoint or Hub id, a reference, a calibration file): found by name, not by type
READ_BY_NAME = {"model", "reference", "calibration"}


def test_every_input_of_a_command_that_writes_a_file_is_walked():
    writers = {command for command, _, kind in output_options() if kind == "file"}
    assert writers == set(OUTPUT_INPUTS)
    named = {(command, name) for command, name, *_ in _parameters() if name in READ_BY_NAME}
    read = {key for key, written in path_options().items() if not written} | named
    for command in writers:
        inputs = {name for cmd, name in read if cmd == command}
        assert inputs == set(OUTPUT_INPUTS[command]), f"{command}: the inputs walked differ from those it reads"


def test_a_hard_link_to_an_input_file_is_refused(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("mine")
    os.link(text, tmp_path / "out.json")
    with pytest.raises(BadInput, match="is the input file"):
        check_output_path(tmp_path / "out.json", option="--json", files=[text])
    check_output_path(tmp_path / "new.json", option="--json", files=[text])  # a new file: fine


def test_a_hard_link_to_a_file_in_a_folder_read_is_refused(tmp_path):
    folder = tmp_path / "model"
    (folder / "onnx").mkdir(parents=True)
    (folder / "onnx" / "model.onnx").write_bytes(b"weights")
    os.link(folder / "onnx" / "model.onnx", tmp_path / "out.json")
    with pytest.raises(BadInput, match="hard link to .*model.onnx"):
        check_output_file(tmp_path / "out.json", option="--json", inputs=(folder,))
    (tmp_path / "other.json").write_text("{}")
    check_output_file(tmp_path / "other.json", option="--json", inputs=(folder, "gpt2"))  # a Hub id: skipped


def test_an_input_through_a_link_is_the_file_it_names(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("mine")
    (tmp_path / "link.txt").symlink_to("t.txt")
    with pytest.raises(BadInput, match="is the input file"):
        check_output_file(text, option="--md", files=[Path(tmp_path / "link.txt")])


def test_a_folder_written_never_holds_an_input_file(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "t.txt").write_text("mine")
    with pytest.raises(BadInput, match="holds the input file"):
        check_output_path(tmp_path / "out", option="-o", kind="folder", files=[tmp_path / "out" / "t.txt"])
    # a folder written into, never replaced (a work folder): the text may be kept there
    check_output_path(
        tmp_path / "out", option="--work", kind="folder", files=[tmp_path / "out" / "t.txt"], replaced=False
    )
