"""The CLI through Typer's test runner: the happy paths, and every bad input as one line, non-zero, no traceback."""

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from gpt2onnx import __version__
from gpt2onnx.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, pattern):
    text = result.output.strip()
    assert result.exit_code != 0, text
    assert "Traceback" not in text and isinstance(result.exception, SystemExit), text
    assert len(text.splitlines()) == 1 and text.startswith("error: "), text
    assert pattern in text, text


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and __version__ in result.output


def test_export_then_inspect(tmp_path):
    out = tmp_path / "tiny"
    result = run("export", "--model", "tiny", "--random-init", "--seed", 1, "--out", out)
    assert result.exit_code == 0, result.output
    assert "max |Δlogits|" in result.output and (out / "model.onnx").is_file()
    manifest = json.loads((out / "gpt2onnx.json").read_text())
    assert manifest["source"] == {**manifest["source"], "kind": "random", "seed": 1}
    result = run("inspect", out)
    assert result.exit_code == 0, result.output
    assert "past_key_values.1.value" in result.output and "180,480" in result.output
    result = run("inspect", out, "--json")
    assert result.exit_code == 0 and json.loads(result.output)["parameters"]["total"] == 180_480


def test_export_block_and_last_logits(tmp_path, tiny_folder):
    result = run("export", "-m", tiny_folder, "-o", tmp_path / "b", "--block", 1)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "b" / "gpt2onnx.json").read_text())["kind"] == "block"
    result = run("export", "-m", tiny_folder, "-o", tmp_path / "l", "--logits", "last", "--external-data")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "l" / "model.onnx_data").is_file()


def test_force(tmp_path, tiny_folder):
    (tmp_path / "o").mkdir()
    assert_one_line_error(run("export", "-m", tiny_folder, "-o", tmp_path / "o"), "already exists")
    assert run("export", "-m", tiny_folder, "-o", tmp_path / "o", "--force").exit_code == 0


def test_missing_path(tmp_path):
    assert_one_line_error(run("export", "-m", tmp_path / "nope", "-o", tmp_path / "o"), "no such file or folder")


def test_folder_without_config(tmp_path):
    assert_one_line_error(run("export", "-m", tmp_path, "-o", tmp_path / "o"), "has no config.json")


def test_corrupt_weights(tmp_path, tiny_folder):
    folder = shutil.copytree(tiny_folder, tmp_path / "c")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:1000])
    assert_one_line_error(run("export", "-m", folder, "-o", tmp_path / "o"), "corrupt or truncated")
    assert not (tmp_path / "o").exists()


def test_shape_mismatch(tmp_path, tiny_folder):
    folder = shutil.copytree(tiny_folder, tmp_path / "c")
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 1234
    (folder / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run("export", "-m", folder, "-o", tmp_path / "o"), "'transformer.wte.weight' has shape")


def test_unknown_preset(tmp_path):
    assert_one_line_error(
        run("export", "-m", "gpt5", "--random-init", "-o", tmp_path / "o"), "unknown architecture 'gpt5'"
    )


def test_hub_id_that_cannot_be_fetched(tmp_path):
    assert_one_line_error(
        run("export", "-m", "nobody/no-such-model", "-o", tmp_path / "o"),
        "--model PATH for a local folder, or --random-init",
    )


def test_output_folder_exists(tmp_path):
    (tmp_path / "o").mkdir()
    assert_one_line_error(run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "o"), "already exists")


def test_unwritable_output(tmp_path):
    (tmp_path / "f").write_text("x")
    assert_one_line_error(run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "f" / "o"), "cannot write")


@pytest.mark.parametrize("opset, message", [(9, "--opset 9 is not supported"), ("x", "Invalid value for '--opset'")])
def test_invalid_opset(tmp_path, opset, message):
    assert_one_line_error(run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "o", "--opset", opset), message)


def test_block_out_of_range(tmp_path):
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "o", "--block", 5), "block 5 is out of range"
    )


def test_invalid_logits(tmp_path):
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "o", "--logits", "first"),
        "logits 'first' is not valid",
    )


def test_missing_model_option():
    assert_one_line_error(run("export"), "Missing option '--model'")


def test_inspect_not_onnx(tmp_path):
    (tmp_path / "a.onnx").write_text("hello, not onnx")
    assert_one_line_error(run("inspect", tmp_path / "a.onnx"), "is not an ONNX model")
    assert_one_line_error(run("inspect", tmp_path / "missing.onnx"), "no such file or folder")


def test_python_dash_m(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "gpt2onnx", "inspect", tmp_path / "x"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and "Traceback" not in proc.stderr


def test_export_with_fusion_and_optimize(tmp_path, tiny_folder):
    result = run("export", "-m", tiny_folder, "-o", tmp_path / "f", "--fusion", "ort")
    assert result.exit_code == 0, result.output
    assert "2 MultiHeadAttention" in re.sub(r"[│\s]+", " ", result.output)  # the table may wrap the row
    assert_one_line_error(
        run("optimize", tmp_path / "f", "--out", tmp_path / "p", "--fusion", "portable"),
        "start from the unfused export",
    )
    assert run("export", "-m", tiny_folder, "-o", tmp_path / "plain").exit_code == 0
    result = run("optimize", tmp_path / "plain", "--out", tmp_path / "p", "--fusion", "portable")
    assert result.exit_code == 0, result.output
    assert "2 of 2" in result.output and "against source ONNX model" in result.output
    result = run("inspect", tmp_path / "p")
    assert "fusion: portable" in result.output and "Gelu" in result.output


def test_fusion_bad_inputs(tmp_path, tiny_folder):
    assert_one_line_error(
        run("export", "-m", tiny_folder, "-o", tmp_path / "f", "--fusion", "max"), "unknown --fusion 'max'"
    )
    assert_one_line_error(run("optimize", tmp_path / "nothing", "--out", tmp_path / "o"), "no such file or folder")
    (tmp_path / "bad.onnx").write_text("nope")
    assert_one_line_error(run("optimize", tmp_path / "bad.onnx", "--out", tmp_path / "o"), "is not an ONNX model")
    assert_one_line_error(run("optimize", tiny_folder, "--out", tmp_path / "o"), "holds no model.onnx")


def test_help_reads_at_80_columns():
    """Every command's --help fits an 80-column terminal, with short metavars (no <list[str]>, <bool>)."""
    from typer.main import get_command

    top = get_command(app)
    commands = sorted(top.commands)
    assert {"export", "optimize", "deploy", "inspect", "generate", "parity", "bench"} <= set(commands)
    groups = [[c, sub] for c in commands for sub in getattr(top.commands[c], "commands", {})]
    assert ["bench", "run"] in groups and ["bench", "memory"] in groups
    for args in [[], *([c] for c in commands), *groups]:
        result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert max(len(line) for line in lines) <= 80, args
        assert not re.search(r"<(list\[|bool|int|float|str|text)", result.output), (args, result.output)
        # an option's help takes at most four lines (its default included)
        rows = [line for line in lines if line.startswith("│ ")]
        starts = [i for i, line in enumerate(rows) if re.match(r"│ [ *] *-", line) or re.match(r"│ --", line)]
        assert all(b - a <= 4 for a, b in zip(starts, starts[1:])), (args, result.output)


def test_a_brand_new_machine_prints_nothing_but_the_tool_output(tiny_export, tmp_path):
    """First-run effects of a new machine (matplotlib's font cache, other lazy caches under HOME) never reach
    stderr: in a process with empty HOME, XDG_CACHE_HOME and MPLCONFIGDIR, a bad input is one line, and a run that
    draws a plot (so matplotlib builds its cache) writes nothing on stderr."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "200"}
    for name in ("HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR"):
        (tmp_path / name).mkdir()
        env[name] = str(tmp_path / name)
    quick = ("--batch", "1", "--prompt-len", "4", "--new-tokens", "2", "--warmup", "0", "--repeat", "1")

    def cli(*args):
        command = [sys.executable, "-m", "gpt2onnx", *map(str, args)]
        return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)

    bad = cli("bench", tiny_export, *quick, "--json", "a.png", "--plot", "a.png")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert bad.stderr.startswith("error: ") and "give each its own file" in bad.stderr
    good = cli("bench", tiny_export, *quick, "--plot", "p.png")
    assert good.returncode == 0, good.stderr
    assert good.stderr.strip() == "" and (tmp_path / "p.png").is_file()
    assert any((tmp_path / "MPLCONFIGDIR").iterdir())  # matplotlib did build its cache there, silently


def test_a_workload_left_out_takes_the_library_default_and_help_says_it():
    """--warmup, --repeat, --new-tokens ... are declared once, default None: a command's --help lists the defaults
    its library function states (bench speculative's --new-tokens 48 beside bench web's 64), read from it."""
    import inspect

    from gpt2onnx.benchmarks.speculation import bench_speculation
    from gpt2onnx.benchmarks.web_speed import bench_web

    for command, function in (("speculative", bench_speculation), ("web", bench_web)):
        defaults = inspect.signature(function).parameters
        result = CliRunner().invoke(app, ["bench", command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        epilog = " ".join(result.output.split("This command's defaults:")[1].split())
        for name in ("new_tokens", "warmup", "repeat"):
            assert f"--{name.replace('_', '-')} {defaults[name].default}" in epilog, (command, epilog)
