"""parity's K/V-path checks: the model against itself (a past vs recomputed, a batch vs rows alone, chunks vs the
whole prompt), in the report and on the CLI; and each check fails on the bug it is there to catch."""

import numpy as np
import pytest
from typer.testing import CliRunner

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.report import CheckReport
from gpt2onnx.cli import app
from gpt2onnx.runtimes.decoder import open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.verify.gates import TOLERANCES
from gpt2onnx.verify.kv_path import check_kv_path
from gpt2onnx.verify.parity import parity


class Faulty:
    """A real decoder with one deployment bug injected into its logits: ``when(input_ids, past_length)``."""

    def __init__(self, decoder, when):
        self.decoder, self.when = decoder, when

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def run(self, input_ids, attention_mask, position_ids, past, **kwargs):
        logits, presents = self.decoder.run(input_ids, attention_mask, position_ids, past, **kwargs)
        if self.when(input_ids, attention_mask.shape[1] - input_ids.shape[1]):
            logits = logits + np.linspace(0, 0.5, logits.shape[-1], dtype=logits.dtype)  # moves the top tokens
        return logits, presents


@pytest.fixture(scope="module")
def decoder(tiny_export):
    return open_decoder(open_folder(tiny_export), ProviderConfig())


def test_fp32_model_is_consistent_along_the_kv_path(decoder):
    report = check_kv_path(decoder, vocab_size=1000, tolerances=TOLERANCES["float32"])
    assert [c.name for c in report.checks] == ["past", "batch", "chunks"]
    for check in report.checks:
        assert check.passed, check.failures
        assert check.measured.logits.max < 1e-4 and check.measured.positions_compared >= 9
        assert check.gates == {"logits": 1e-4, "top1": 1.0}


@pytest.mark.parametrize(
    "bug, fails",
    [
        (lambda ids, past: ids.shape[1] == 1 and past > 0, "past"),  # a decode step differs from recomputing
        (lambda ids, past: ids.shape[0] > 1, "batch"),  # batches differ from batch 1
        (lambda ids, past: ids.shape[1] > 1 and past > 0, "chunks"),  # a chunk on a past differs
    ],
)
def test_each_check_catches_its_bug(decoder, bug, fails):
    report = check_kv_path(Faulty(decoder, bug), vocab_size=1000, tolerances=TOLERANCES["float32"])
    failed = {c.name for c in report.checks if not c.passed}
    assert fails in failed
    assert any(f.startswith(f"K/V path ({fails}): max |Δlogits|") for f in report.failures)


def test_parity_report_and_cli_show_the_kv_path(tiny_export, tmp_path):
    report = parity(tiny_export, cases=1)
    assert report.passed and report.kv_path is not None and len(report.kv_path.checks) == 3
    again = CheckReport.from_dict(report.as_dict())
    assert again.kv_path.checks[1].measured == report.kv_path.checks[1].measured
    out = CliRunner().invoke(app, ["parity", str(tiny_export), "--cases", "1"])
    assert out.exit_code == 0, out.output
    for text in ("K/V path: decode steps", "K/V path: a left-padded", "K/V path: a prompt fed"):  # rows may wrap
        assert text in out.output


def test_kv_path_on_text_ids_runs_the_same_checks(decoder):
    """With parity's --text, the batch is stretches of the text and the decode steps its next tokens."""
    text_ids = (np.arange(300) * 7919) % 1000
    report = check_kv_path(decoder, vocab_size=1000, tolerances=TOLERANCES["float32"], text_ids=text_ids)
    assert [c.name for c in report.checks] == ["past", "batch", "chunks"] and not report.failures
    assert (
        report.checks[0].measured
        != check_kv_path(decoder, vocab_size=1000, tolerances=TOLERANCES["float32"]).checks[0].measured
    ), "other inputs than the random ids"
