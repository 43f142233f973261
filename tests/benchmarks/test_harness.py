"""The benchmark harness (gpt2onnx.benchmarks.harness): warm-ups each variant's own, rounds in rotating order, medians
with quartiles, ratios taken round by round, the load and the machine; and bench over it, folders interleaved.
The variants here return set figures (no clock), so every assertion is exact."""

import csv
import io
import json

import pytest
from typer.testing import CliRunner

from gpt2onnx.benchmarks.harness import Spread, interleave, rotated
from gpt2onnx.cli import app
from gpt2onnx.errors import BadInput


def _variants(calls: list, windows: list[float], base: dict[str, float], warmup: int):
    """Each variant's figure is its base value times the window's factor, which changes from round to round (a
    machine whose speed drifts); ``calls`` records the order the variants ran in."""

    def variant(name):
        def run():
            calls.append(name)
            timed = len(calls) - 1 - warmup * len(base)  # this call's index among the timed runs (< 0: a warm-up)
            return {"ms": base[name] * windows[min(max(timed, 0) // len(base), len(windows) - 1)]}

        return run

    return {name: variant(name) for name in base}


def test_rounds_rotate_after_each_variant_s_own_warm_ups():
    calls = []
    rounds = interleave(_variants(calls, [1.0], {"a": 1.0, "b": 2.0, "c": 3.0}, 2), rounds=4, warmup=2)
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]  # a variant's warm-ups back to back
    assert rounds.orders == (("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c"))
    assert calls[6:] == [name for order in rounds.orders for name in order]
    assert rotated(("a", "b"), 3) == ("b", "a")


def test_ratios_are_taken_round_by_round():
    """The machine slows 3× in the middle round: b's ratio to a is exactly 2 in every round, so its spread is
    nil; the medians alone would hide nothing here, but the quartiles of each figure show the drift."""
    variants = _variants([], [1.0, 3.0, 1.0], {"a": 10.0, "b": 20.0}, 0)
    rounds = interleave(variants, rounds=3, warmup=0, baseline="a")
    assert rounds.values("a", "ms") == (10.0, 30.0, 10.0) and rounds.values("b", "ms") == (20.0, 60.0, 20.0)
    assert rounds.ratio("b", "ms") == Spread(2.0, 2.0, 2.0, 3)
    assert rounds.ratio("a", "ms").median == 1.0
    assert rounds.spread("a", "ms") == Spread(10.0, 10.0, 20.0, 3)


def test_the_record_reads_as_json_csv_and_markdown():
    variants = _variants([], [1.0, 2.0], {"ours": 4.0, "theirs": 5.0}, 1)
    rounds = interleave(variants, rounds=2, warmup=1, baseline="theirs")
    data = json.loads(json.dumps(rounds.as_dict()))
    assert data["rounds"] == 2 and data["baseline"] == "theirs"
    assert data["orders"] == [["ours", "theirs"], ["theirs", "ours"]]
    assert {"load_before", "load_after", "other_processes_cpu"} <= set(data["load"]) and "cpu" in data["machine"]
    rows = list(csv.DictReader(io.StringIO(rounds.csv())))
    ours = next(r for r in rows if r["variant"] == "ours")
    assert float(ours["ratio"]) == pytest.approx(0.8) and float(ours["median"]) == pytest.approx(6.0)
    table = rounds.markdown()
    assert table.startswith("| variant | ms |") and "×0.8" in table and "2 rounds in rotating order" in table


def test_bad_arguments_are_refused():
    with pytest.raises(BadInput, match="baseline 'x' is not one of the variants"):
        interleave({"a": lambda: {"ms": 1.0}}, rounds=1, baseline="x")
    with pytest.raises(BadInput, match="--repeat must be an integer from 1 to 10,000, got 0"):
        interleave({"a": lambda: {"ms": 1.0}}, rounds=0)
    with pytest.raises(BadInput, match="--warmup must be an integer from 0 to 1,000, got 1001"):
        interleave({"a": lambda: {"ms": 1.0}}, rounds=1, warmup=1001)
    with pytest.raises(BadInput, match="nothing to measure"):
        interleave({}, rounds=1)


def test_bench_interleaves_the_folders_round_by_round(tiny_export, trained_export, tmp_path, monkeypatch):
    """Two folders: each one's warm-ups, then rounds in rotating order (observed through the decode calls), each
    run's ratios to the first folder in the JSON and the tables, and the CSV and Markdown tables written."""
    import gpt2onnx.benchmarks.timing as timing

    seen, real = [], timing.decode
    monkeypatch.setattr(timing, "decode", lambda decoder, *a, **k: seen.append(id(decoder)) or real(decoder, *a, **k))
    out = tmp_path / "b"
    args = ["bench", str(tiny_export), str(trained_export), "--batch", "1", "--prompt-len", "4", "--new-tokens", "3"]
    args += ["--warmup", "1", "--repeat", "4", "--json", f"{out}.json", "--csv", f"{out}.csv", "--md", f"{out}.md"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    first, second = seen[0], seen[1]
    assert first != second and seen == [first, second, first, second, second, first, first, second, second, first]
    runs = json.loads((tmp_path / "b.json").read_text())["runs"]
    ratios = runs[1]["extra"]["rounds"]["ratio_to_baseline"]
    assert runs[1]["extra"]["rounds"]["baseline"] == runs[0]["label"] and set(ratios) >= {"decode_ms", "tokens_per_s"}
    assert ratios["decode_ms"]["low"] <= ratios["decode_ms"]["median"] <= ratios["decode_ms"]["high"]
    assert "4 rounds in rotating order" in result.stdout and f"{runs[1]['label']} batch 1: decode ×" in result.stdout
    rows = list(csv.DictReader(io.StringIO((tmp_path / "b.csv").read_text())))
    assert [r["label"] for r in rows] == [r["label"] for r in runs] and rows[1]["decode_ms_ratio"]
    assert "rounds in rotating order" in (tmp_path / "b.md").read_text()
