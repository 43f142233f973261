"""PEFT LoRA adapters exported merged: real adapters trained with PEFT on the trained fixture, the export compared
with PEFT's own PeftModel (logits, presents, greedy tokens), the manifest's record, and the math of rsLoRA and
per-module ranks against PEFT's merge_and_unload()."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

peft = pytest.importorskip("peft")

from typer.testing import CliRunner  # noqa: E402

from gpt2onnx.cli.app import app  # noqa: E402
from gpt2onnx.errors import BadInput  # noqa: E402
from gpt2onnx.exporters.adapter_forms import ADAPTER_FORMS, export_adapted  # noqa: E402
from gpt2onnx.exporters.export import ExportOptions, export  # noqa: E402
from gpt2onnx.files import sha256_file  # noqa: E402
from gpt2onnx.verify.gates import TOLERANCES  # noqa: E402

TARGETS = ["c_attn", "c_proj", "c_fc"]
# fp32's own gate (gpt2onnx.precisions.fp32): the ONNX graph and PyTorch differ only by summation order, ~1e-6 here
FP32_GATE = TOLERANCES["float32"]["logits"]


def _base(folder: Path):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()


def _docstring_ids(folder: Path, rows: int, length: int) -> torch.Tensor:
    from transformers import GPT2TokenizerFast

    tokenizer = GPT2TokenizerFast.from_pretrained(folder)
    ids = tokenizer((folder / "heldout.txt").read_text()[:20_000])["input_ids"][: rows * length]
    return torch.tensor(ids).reshape(rows, length)


def _train_and_save(checkpoint: Path, config, folder: Path, *, lr: float) -> None:
    """A PEFT model of ``config`` on the base at ``checkpoint``, trained by 8 steps of SGD on docstrings (4 × 64
    tokens) and saved with save_pretrained to ``folder``."""
    from peft import get_peft_model

    model = get_peft_model(_base(checkpoint), config)
    ids = _docstring_ids(checkpoint, 4, 64)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=lr)
    model.train()
    for _ in range(8):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def lora(trained_checkpoint, tmp_path_factory) -> Path:
    """A real LoRA (rank 4, alpha 8, c_attn, c_proj, c_fc) fine-tuned with PEFT from its own initialization (B = 0)
    by 8 steps of SGD on docstrings, saved with save_pretrained; its config names the base by absolute path."""
    from peft import LoraConfig

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, fan_in_fan_out=True)
    folder = tmp_path_factory.mktemp("lora") / "docstrings-lora"
    _train_and_save(trained_checkpoint, config, folder, lr=2.0)
    config_file = folder / "adapter_config.json"
    settings = json.loads(config_file.read_text())
    settings["base_model_name_or_path"] = str(trained_checkpoint.resolve())
    config_file.write_text(json.dumps(settings))
    return folder


@pytest.fixture(scope="module")
def peft_model(trained_checkpoint, lora):
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(trained_checkpoint), str(lora)).eval()


@pytest.fixture(scope="module")
def merged(trained_checkpoint, lora, tmp_path_factory):
    """The base with the adapter, exported fp32 (its check: against PeftModel), through the adapter forms' registry
    as ``export --adapter`` does."""
    out = tmp_path_factory.mktemp("merged") / "m"
    return export_adapted(str(trained_checkpoint), out, given={"--adapter": str(lora)})


def _onnx_prefill(folder: Path, ids: np.ndarray) -> list[np.ndarray]:
    """logits and presents of one prefill (empty past) through onnxruntime."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, _prefill_feeds(session, ids))


def _prefill_feeds(session, ids: np.ndarray) -> dict[str, np.ndarray]:
    """One prefill's inputs (empty past) for ``session``."""
    batch, length = ids.shape
    feeds = {
        "input_ids": ids.astype(np.int64),
        "attention_mask": np.ones((batch, length), np.int64),
        "position_ids": np.tile(np.arange(length, dtype=np.int64), (batch, 1)),
    }
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values."):
            feeds[spec.name] = np.zeros((batch, spec.shape[1], 0, spec.shape[3]), np.float32)
    return feeds


def test_merged_export_equals_peft(merged, peft_model, trained_checkpoint):
    """The merged ONNX decoder's logits and presents equal PeftModel's within fp32's gate, while the adapter moves
    the logits far beyond it (so a export that dropped the adapter would fail)."""
    assert merged.check.passed and merged.manifest.adapter is not None
    ids = _docstring_ids(trained_checkpoint, 2, 24)
    outputs = _onnx_prefill(merged.folder, ids.numpy())
    with torch.no_grad():
        theirs = peft_model(ids, use_cache=True)
        base = peft_model.get_base_model()
        with peft_model.disable_adapter():
            base_logits = base(ids).logits.numpy()
    logits = theirs.logits.numpy()
    assert np.abs(outputs[0] - logits).max() < FP32_GATE
    cache = theirs.past_key_values
    presents = [t.numpy() for layer in cache.layers for t in (layer.keys, layer.values)]
    for ours, reference in zip(outputs[1:], presents, strict=True):
        assert np.abs(ours - reference).max() < FP32_GATE
    assert np.abs(base_logits - logits).max() > 1000 * FP32_GATE  # the adapter really changes the model


def test_merged_greedy_tokens_equal_peft_generate(merged, peft_model, trained_checkpoint):
    from gpt2onnx.decoding.generate import generate

    ids = _docstring_ids(trained_checkpoint, 1, 12)
    ours = generate(merged.folder, ids=[",".join(map(str, ids[0].tolist()))], max_new_tokens=16)
    with torch.no_grad():
        theirs = peft_model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
        )
    assert ours.tokens[0] == theirs[0, ids.shape[1] :].tolist()


def test_manifest_records_the_adapter(merged, lora):
    record = merged.manifest.adapter
    assert record.files == {name: sha256_file(lora / name) for name in record.files}
    assert set(record.files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert (record.rank, record.alpha, record.rslora, record.form) == (4, 8.0, False, "merged")
    assert record.target_modules == tuple(sorted(TARGETS)) and record.modules == 2 * 4  # 2 layers × 4 modules
    on_disk = json.loads((merged.folder / "gpt2onnx.json").read_text())["adapter"]
    assert on_disk["rank"] == 4 and on_disk["path"] == str(lora.resolve())


def test_peft_folder_alone_int8_and_parity(lora, tmp_path):
    """``--model ADAPTER_DIR`` finds its base; int8 passes its gates against PeftModel; ``parity`` applies the
    recorded adapter again (and refuses once the adapter changed)."""
    runner = CliRunner()
    out = tmp_path / "q"
    result = runner.invoke(app, ["export", "--model", str(lora), "-o", str(out), "--quantize", "int8"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "gpt2onnx.json").read_text())
    assert manifest["adapter"]["rank"] == 4 and manifest["parity"]["passed"]
    assert manifest["quantization"]["method"] == "int8"
    result = runner.invoke(app, ["parity", str(out), "--cases", "2"])
    assert result.exit_code == 0, result.output
    changed = tmp_path / "changed"
    import shutil

    shutil.copytree(lora, changed)
    manifest["adapter"]["path"] = str(changed)
    (out / "gpt2onnx.json").write_text(json.dumps(manifest))
    config = json.loads((changed / "adapter_config.json").read_text())
    (changed / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 16}))
    result = runner.invoke(app, ["parity", str(out), "--cases", "2"])
    assert result.exit_code == 2 and "has changed" in result.output


def test_rslora_and_rank_pattern_merge_as_peft_does(trained_checkpoint, tmp_path):
    """rsLoRA scaling (alpha/√r), a per-module rank and alpha: the merged weights equal PEFT's merge_and_unload()
    (both in fp32; merge order differs only by rounding, 1e-6 of weights of ~0.1), and the export passes its check
    against PeftModel."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from gpt2onnx.pytorch.checkpoint import load_checkpoint, to_export_names

    torch.manual_seed(1)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=TARGETS,
        use_rslora=True,
        rank_pattern={"c_fc": 2},
        alpha_pattern={"h.1.attn.c_proj": 3},
        init_lora_weights=False,  # B random, not 0: every module moves
        fan_in_fan_out=True,
    )
    adapter = tmp_path / "rs"
    get_peft_model(_base(trained_checkpoint), config).save_pretrained(adapter)
    ckpt = load_checkpoint(str(trained_checkpoint), adapter=adapter)
    assert ckpt.adapter.record.rslora
    reference = PeftModel.from_pretrained(_base(trained_checkpoint), str(adapter)).merge_and_unload()
    theirs = to_export_names(reference.state_dict(), ckpt.spec)
    for name, tensor in ckpt.state_dict.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-6)
    result = export(str(trained_checkpoint), tmp_path / "out", adapter=adapter, options=ExportOptions(fusion="ort"))
    assert result.check.passed


# -- switchable: one base graph, one onnxruntime adapter file per name ------------------------------------------
@pytest.fixture(scope="module")
def second_lora(trained_checkpoint, tmp_path_factory) -> Path:
    """Another real PEFT adapter, of another shape: rank 2, rsLoRA, c_attn and c_fc only, B initialized non-zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)
    config = LoraConfig(r=2, lora_alpha=2, target_modules=["c_attn", "c_fc"], use_rslora=True, init_lora_weights=False)
    folder = tmp_path_factory.mktemp("lora2") / "rs"
    get_peft_model(_base(trained_checkpoint), config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def switchable(trained_checkpoint, lora, second_lora, tmp_path_factory):
    """Adapters docs and rs, switchable, through the adapter forms' registry as ``export --adapters`` does."""
    out = tmp_path_factory.mktemp("switchable") / "m"
    return export_adapted(str(trained_checkpoint), out, given={"--adapters": f"docs={lora},rs={second_lora}"})


def test_switchable_export_checked_per_adapter(switchable):
    """The base alone passed against the base; each adapter, active, against PEFT with it (fp32 gates); the
    manifest lists each adapter file, hashed; the graph has one slot pair per adapted weight (8 + 4 share 8)."""
    import onnx

    from gpt2onnx.artifact.lora import slot_inputs

    manifest = switchable.manifest
    assert switchable.check.passed and switchable.check.against == "PyTorch"
    assert set(manifest.adapters) == {"docs", "rs"}
    for name, record in manifest.adapters.items():
        assert record.form == "switchable" and record.check.endswith("— pass") and f"'{name}'" in record.check
        assert f"{name}.onnx_adapter" in manifest.files
    assert manifest.adapters["rs"].rslora and manifest.adapters["rs"].rank == 2
    assert len(slot_inputs(onnx.load(switchable.folder / "model.onnx"))) == 2 * 8


def _ids_arg(ids: torch.Tensor) -> list[str]:
    return [",".join(map(str, row.tolist())) for row in ids]


def test_switchable_generate_equals_merged_and_base(switchable, merged, peft_model, trained_checkpoint):
    """generate --adapter docs gives the merged export's greedy tokens; no adapter gives the base's
    (transformers' generate with the adapter disabled); --adapter rs other tokens."""
    from gpt2onnx.decoding.generate import generate

    ids = _docstring_ids(trained_checkpoint, 2, 10)
    with_adapter = generate(switchable.folder, ids=_ids_arg(ids), max_new_tokens=12, adapter="docs")
    assert with_adapter.tokens == generate(merged.folder, ids=_ids_arg(ids), max_new_tokens=12).tokens
    alone = generate(switchable.folder, ids=_ids_arg(ids[:1]), max_new_tokens=12)
    with torch.no_grad(), peft_model.disable_adapter():
        theirs = peft_model.generate(
            input_ids=ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=12, do_sample=False
        )
    assert alone.tokens[0] == theirs[0, ids.shape[1] :].tolist()
    other = generate(switchable.folder, ids=_ids_arg(ids[:1]), max_new_tokens=12, adapter="rs")
    assert other.tokens[0] != alone.tokens[0]  # an adapter is really active (rs moves every module far)


def test_switchable_refusals(switchable, merged):
    runner = CliRunner()
    result = runner.invoke(app, ["generate", str(merged.folder), "--ids", "1,2", "--adapter", "docs"])
    assert result.exit_code == 2 and "has no adapter 'docs'" in result.output
    result = runner.invoke(app, ["generate", str(switchable.folder), "--ids", "1,2", "--adapter", "other"])
    assert result.exit_code == 2 and "its adapters: docs, rs" in result.output


def test_adapter_forms_are_registry_entries_that_export_reaches(merged, switchable, lora, tmp_path):
    """Each form is an ADAPTER_FORMS entry pointing at its module's export function and selected by its own flag of
    ``gpt2onnx export``; the two fixtures above were exported through the registry (export_adapted, as the command
    does) and their manifests name their form; what a form refuses is refused through it, before any export."""
    from typer.main import get_command

    from gpt2onnx.artifact.lora import adapter_files_choice
    from gpt2onnx.exporters.switchable import export_switchable

    assert list(ADAPTER_FORMS) == ["merged", "switchable"]
    assert ADAPTER_FORMS["merged"].export is export and ADAPTER_FORMS["switchable"].export is export_switchable
    flags = {flag for param in get_command(app).commands["export"].params for flag in param.opts}
    assert {form.option for form in ADAPTER_FORMS.values()} <= flags
    assert merged.manifest.adapter.form == "merged" and not merged.manifest.adapters
    assert switchable.manifest.adapter is None
    assert {record.form for record in switchable.manifest.adapters.values()} == {"switchable"}
    # what the switchable form declares is what check and deploy read from the folder it writes
    assert dict(ADAPTER_FORMS["switchable"].declared.ensures) == dict(adapter_files_choice("F", ("x",)).ensures)
    with pytest.raises(BadInput, match="as a whole decoder and checked per adapter: drop --block"):  # switchable's
        export_adapted("tiny", tmp_path / "s", given={"--adapters": f"x={lora}"}, options=ExportOptions(block=0))
    with pytest.raises(BadInput, match="no such folder"):  # merged's: the base loaded, the adapter folder missing
        export_adapted("tiny", tmp_path / "m", given={"--adapter": tmp_path / "nope"}, random_init=True)
    runner = CliRunner()
    for other in (["--random-init"], ["--adapter", str(lora)]):
        argv = ["export", "--model", "tiny", "--adapters", f"x={lora}", *other, "-o", str(tmp_path / "x")]
        result = runner.invoke(app, argv)
        assert result.exit_code == 2 and "over a checkpoint: drop --adapter/--random-init" in result.output
    assert not any(tmp_path.iterdir())  # nothing written


# -- parity, eval, bench, check and deploy with a switchable adapter -------------------------------------------
def test_switchable_parity_with_each_adapter(switchable):
    """parity --adapter NAME: the folder with NAME active against PEFT's merge of the folder the manifest records,
    under fp32's gates. Not vacuous: 'rs' moves every module far beyond fp32's gate (see generate above), so an
    adapter missing on either side (the slots left at the base, the reference without the merge) fails it."""
    from gpt2onnx.verify.parity import parity

    for name in ("docs", "rs"):
        report = parity(switchable.folder, adapter=name, cases=2, max_batch=2)
        assert report.passed, report.failures
        assert report.against == f"PyTorch with adapter '{name}' (PEFT, merged)"


def test_switchable_eval_and_bench_with_an_adapter(switchable, merged, trained_checkpoint, tmp_path):
    """eval --adapter docs scores what the merged export of the same adapter scores (fp32 both, graphs that differ
    only by summation order: perplexities within 1e-4 relative, KL to PEFT's model under 1e-6), and not what the
    base scores (more than 1e-3 apart); bench --adapter measures the base and +docs in the same rounds."""
    from gpt2onnx.verify.evaluate import evaluate

    text = tmp_path / "heldout.txt"
    text.write_text((trained_checkpoint / "heldout.txt").read_text()[:3000])
    runner = CliRunner()
    out = tmp_path / "eval.json"
    argv = ["eval", str(switchable.folder), "--adapter", "docs", "--text", str(text), "--greedy-tokens", "8"]
    result = runner.invoke(app, [*argv, "--json", str(out)])
    assert result.exit_code == 0, result.output
    ours = json.loads(out.read_text())
    row = ours["rows"][0]
    assert "adapter 'docs'" in row["label"] and "adapter 'docs' merged by PEFT" in ours["protocol"]["reference"]
    assert row["kl"]["mean"] < 1e-6  # logits ~1e-6 apart give a KL ~1e-12; the adapter off would give ~1e-2
    merged_ppl = evaluate([merged.folder], text=text, greedy_tokens=0).rows[0].ppl
    base_ppl = evaluate([switchable.folder], text=text, greedy_tokens=0).rows[0].ppl
    assert row["ppl"] == pytest.approx(merged_ppl, rel=1e-4)
    assert abs(base_ppl - row["ppl"]) > 1e-3 * row["ppl"]

    out = tmp_path / "bench.json"
    argv = ["bench", str(switchable.folder), "--adapter", "docs", "--batch", "1", "--prompt-len", "8"]
    argv += ["--new-tokens", "4", "--warmup", "0", "--repeat", "2", "--json", str(out)]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [run["label"] for run in runs] == ["m", "m +docs"]
    assert "decode_ms" in runs[1]["extra"]["rounds"]["ratio_to_baseline"]  # the adapter's cost, round by round


def test_switchable_adapter_runtimes_and_targets_declared(switchable):
    """Declared, answered before any work: a runtime that binds no adapter is refused (check's verdict, generate's
    one line); a target that would drop the adapter files refuses the folder, nothing written. genai binds and
    carries them: tests/runtimes/test_genai_adapters.py."""
    runner = CliRunner()
    folder = str(switchable.folder)
    result = runner.invoke(app, ["check", folder, "--adapter", "docs", "--runtime", "openvino"])
    assert result.exit_code == 1 and "binds no LoRA adapter's factors" in result.output
    result = runner.invoke(app, ["check", folder, "--adapter", "docs"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["generate", folder, "--ids", "1,2", "--adapter", "docs", "--runtime", "openvino"])
    assert result.exit_code == 2 and "the adapter 'docs' (--adapter) needs a runtime that binds" in result.output
    for target in ("transformers-js", "triton"):
        out = switchable.folder.parent / f"deployed-{target}"
        result = runner.invoke(app, ["deploy", folder, "--target", target, "-o", str(out)])
        assert result.exit_code == 2 and "without its switchable LoRA adapters" in result.output
        assert not out.exists()


def test_adapters_page_holds_the_generated_table():
    """docs/adapters.md's runtime/target table is gpt2onnx.preflight.adapter_support.markdown() (the declarations),
    and it says what the declarations say today: onnxruntime, genai and the engine take an adapter, OpenVINO does
    not; the genai and server targets carry the adapter files, Triton's does not."""
    from gpt2onnx.preflight.adapter_support import markdown

    table = markdown()
    assert table in (Path(__file__).parents[2] / "docs" / "adapters.md").read_text()
    assert "| runtime onnxruntime | yes |" in table
    assert "| the batching engine (an adapter per request) | yes |" in table
    assert "| runtime genai | yes |" in table and "| deploy --target genai | yes |" in table
    assert "| runtime openvino | no: " in table and "| deploy --target triton | no: " in table


# -- switchable on a quantized base: the slots fp32 beside the quantized MatMuls (QLoRA's shape) ---------------
@pytest.fixture(scope="module")
def switchable_int8(trained_checkpoint, second_lora, tmp_path_factory):
    from gpt2onnx.exporters.switchable import export_switchable
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    out = tmp_path_factory.mktemp("switchable-int8") / "m"
    options = ExportOptions(quantization=QuantizeOptions("int8"))
    return export_switchable(str(trained_checkpoint), out, adapters={"rs": second_lora}, options=options)


def _prefill_logits(folder: Path, ids: np.ndarray, adapter: Path | None) -> torch.Tensor:
    """The logits of one prefill through onnxruntime, with ``adapter``'s factors fed to the slots (None: the
    slots' rank-0 defaults, the base)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = _prefill_feeds(session, ids)
    if adapter is not None:
        factors = ort.AdapterFormat.read_adapter(str(adapter)).get_parameters()
        feeds.update({name: value.numpy() for name, value in factors.items()})
    return torch.from_numpy(session.run(["logits"], feeds)[0])


def test_switchable_int8_keeps_fp32_slots_and_passes_against_peft(switchable_int8, second_lora, trained_checkpoint):
    """--adapters with --quantize int8: the base's MatMuls quantized (MatMulInteger), each slot's two MatMuls fp32
    beside them; the base alone passed int8's gates against the base, and 'rs' active against PEFT with 'rs', each
    also judged against its own rounded reference (the base's rounded weights with PEFT's fp32 adapter on top: the
    merged weights rounded would be another model). Compared independently here, on held-out docstrings
    (teacher-forced, 2 × 48): the mean KL to PEFT's next-token distribution within int8's own gate (7e-4; the
    export's check measured ~2e-5) and its argmax agreeing at int8's top-1 gate (0.92); the same file without the
    adapter is more than 5× that gate away (the slots really carry it). Greedy tokens are not demanded equal to
    the merged int8 export's: that file rounds the merged weights, this one the base's, so a near-tie may go
    either way."""
    import onnx
    from peft import PeftModel

    from gpt2onnx.artifact.lora import slot_inputs

    result = switchable_int8
    assert result.check.passed and result.manifest.quantization.method == "int8"
    record = result.manifest.adapters["rs"]
    assert record.check.endswith("— pass") and "against PEFT with adapter 'rs'" in record.check
    assert "own rounded weights" in record.check
    graph = onnx.load(result.folder / "model.onnx").graph
    slots = set(slot_inputs(onnx.load(result.folder / "model.onnx")))
    assert len(slots) == 2 * 4  # c_attn and c_fc of 2 layers
    readers = [n for n in graph.node if slots & set(n.input)]
    assert len(readers) == len(slots) and {n.op_type for n in readers} == {"MatMul"}
    assert sum(n.op_type == "MatMulInteger" for n in graph.node) == 9  # 8 block weights and the head

    ids = _docstring_ids(trained_checkpoint, 2, 48)
    theirs = PeftModel.from_pretrained(_base(trained_checkpoint), str(second_lora)).eval()
    with torch.no_grad():
        expected = theirs(ids).logits.log_softmax(-1)

    def kl(logits: torch.Tensor) -> float:  # KL(PEFT ‖ ours), mean over positions
        return float((expected.exp() * (expected - logits.log_softmax(-1))).sum(-1).mean())

    with_rs = _prefill_logits(result.folder, ids.numpy(), result.folder / "rs.onnx_adapter")
    alone = _prefill_logits(result.folder, ids.numpy(), None)
    assert kl(with_rs) < 7e-4, kl(with_rs)
    assert (with_rs.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.92
    assert kl(alone) > 5 * 7e-4, kl(alone)  # measured ~1e-2


# -- the batching engine and the OpenAI server: an adapter per request -----------------------------------------
@pytest.fixture(scope="module")
def served(trained_checkpoint, lora, tmp_path_factory):
    """A switchable folder for serving: 'docs' (the trained adapter, merged above) and 'hot', a PEFT adapter with
    random non-zero factors scaled 16 (alpha 64, rank 4) on every module, so that each decode step's logits move by
    whole units under it: an adapter bound to the wrong rows at any step changes the greedy tokens."""
    from peft import LoraConfig, get_peft_model

    from gpt2onnx.exporters.switchable import export_switchable

    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=64, target_modules=TARGETS, init_lora_weights=False, fan_in_fan_out=True)
    hot = tmp_path_factory.mktemp("hot") / "hot"
    get_peft_model(_base(trained_checkpoint), config).save_pretrained(hot)
    out = tmp_path_factory.mktemp("served") / "m"
    return export_switchable(str(trained_checkpoint), out, adapters={"docs": lora, "hot": hot}).folder


def _alone(folder: Path, ids: torch.Tensor, new: int, adapter: str | None, **options) -> list[int]:
    from gpt2onnx.decoding.generate import generate

    return generate(
        folder, ids=_ids_arg(ids), max_new_tokens=new, adapter=adapter, verify_files=False, **options
    ).tokens[0]


def test_engine_serves_an_adapter_per_request_in_one_batch(served, merged, trained_checkpoint):
    """The base, 'docs' and 'hot' on one prompt, and the base and 'hot' on a shorter one, admitted in one turn
    (queued under the engine's lock): one prompt step per adapter, then decode steps with one run per adapter on its
    rows (interleaved in the batch); the rows leave at different steps (max_new_tokens 6 to 12), so later steps run
    fewer groups, and the last ones one. Each request's greedy tokens are generate(adapter=...)'s for it alone,
    docs' the merged export's; the three give three different continuations of one prompt, so an adapter left
    bound for another group's rows, or not bound at all, fails the test. A beam request with 'hot' (run beside the
    batch) gets generate's beams with hot, which differ from the base's."""
    from gpt2onnx.generation_options import Decoding
    from gpt2onnx.serving.engine import BatchingEngine

    ids = _docstring_ids(trained_checkpoint, 2, 10)
    short = ids[1:, :6]
    asks = [(ids[:1], "docs", 12), (ids[:1], None, 10), (short, "hot", 6), (ids[:1], "hot", 8), (short, None, 9)]
    expected = [_alone(served, row, new, name) for row, name, new in asks]
    assert len({tuple(expected[i]) for i in (0, 1, 3)}) == 3  # the prompt's base, docs and hot continuations differ
    assert expected[0] == _alone(merged.folder, ids[:1], 12, None)
    beams = Decoding(num_beams=2)
    hot_beams = _alone(served, ids[:1], 8, "hot", decoding=beams)
    assert hot_beams != _alone(served, ids[:1], 8, None, decoding=beams)
    with BatchingEngine.open(served, max_batch=8, verify_files=False, tokenizer=None) as engine:
        assert engine.adapters == ("docs", "hot")
        with engine._lock:  # the engine thread waits on the lock: all four join in one turn
            streams = [engine.submit(row[0].tolist(), max_new_tokens=new, adapter=name) for row, name, new in asks]
            beam = engine.submit(ids[0].tolist(), max_new_tokens=8, adapter="hot", decoding=beams)
        got = [stream.result(timeout=60).tokens for stream in streams]
        assert beam.result(timeout=60).tokens == hot_beams
        assert engine.prompt_steps == 3  # one prompt step per adapter (docs, base, hot)
        with pytest.raises(BadInput, match="has no adapter 'other'; its adapters: docs, hot"):
            engine.submit(ids[0].tolist(), adapter="other")
    assert got == expected


def test_openai_server_serves_adapters_by_model_name(served, trained_checkpoint):
    """In-process: /v1/models lists the base and BASE:NAME per adapter; a completion for 'm:hot' has the greedy
    tokens of generate with hot alone, its response names the model asked for; an unknown adapter or model is
    OpenAI's 404 model_not_found."""
    from fastapi.testclient import TestClient

    from gpt2onnx.serving.engine import BatchingEngine
    from gpt2onnx.serving.openai.routes import ServerSettings, build_app

    ids = _docstring_ids(trained_checkpoint, 1, 10)
    expected = _alone(served, ids, 8, "hot")
    app = build_app(
        ServerSettings(model_id="m", max_batch=4, max_queue=4),
        lambda: BatchingEngine.open(served, max_batch=4, verify_files=False, tokenizer=None),
    )
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        models = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert models == ["m", "m:docs", "m:hot"]
        body = {"prompt": ids[0].tolist(), "max_tokens": 8, "temperature": 0, "logprobs": 0}
        answer = client.post("/v1/completions", json={**body, "model": "m:hot"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "m:hot"
        tokens = [int(t) for t in answer.json()["choices"][0]["logprobs"]["tokens"]]  # no tokenizer: ids as text
        assert tokens == expected
        for unknown in ("m:other", "other", "m:"):
            refused = client.post("/v1/completions", json={**body, "model": unknown})
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
            assert "'m:docs', 'm:hot'" in refused.json()["error"]["message"]


# -- the head: an adapter of lm_head on a base that ties it to the token embedding ------------------------------
@pytest.fixture(scope="module")
def head_lora(trained_checkpoint, tmp_path_factory) -> Path:
    """A real LoRA of c_attn and the head (lm_head), which the trained fixture ties to its token embedding: rank 4,
    alpha 8, trained from PEFT's initialization (B = 0) by 8 steps of SGD at lr 0.8 (2.0 diverges once the head is
    trained too; 0.8 takes the loss from 5.03 to 4.61 and moves the logits by up to ~4). PEFT saves the head's own
    weight beside its factors (save_embedding_layers, with a warning about the tied weights), and gives its config
    fan_in_fan_out False (the head is an nn.Linear) while c_attn is a Conv1D."""
    from peft import LoraConfig

    torch.manual_seed(4)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "lm_head"], lora_dropout=0.0)
    folder = tmp_path_factory.mktemp("head-lora") / "head"
    _train_and_save(trained_checkpoint, config, folder, lr=0.8)
    return folder


@pytest.fixture(scope="module")
def head_peft(trained_checkpoint, head_lora):
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(trained_checkpoint), str(head_lora)).eval()


@pytest.fixture(scope="module")
def merged_head(trained_checkpoint, head_lora, tmp_path_factory):
    """The head adapter merged, fp32: the head untied from the embedding (its check: against PeftModel)."""
    return export(str(trained_checkpoint), tmp_path_factory.mktemp("merged-head") / "m", adapter=str(head_lora))


def test_merged_head_adapter_unties_the_head(merged_head, head_lora, head_peft, trained_checkpoint):
    """Merged, a head adapter on a tied base gets a head of its own: the graph's lm_head is the embedding plus PEFT's
    own delta for the head (get_delta_weight; both fp32, a rank-4 product: 1e-6 of weights of ~0.1), the embedding
    the base's, bit for bit (PeftModel adapts the head alone); the manifest's architecture untied. Its logits and
    presents equal PeftModel's within fp32's gate, while the adapter moves them far beyond it."""
    import onnx
    from onnx import numpy_helper
    from safetensors.torch import load_file

    result = merged_head
    assert result.check.passed and not result.manifest.architecture.tie_word_embeddings
    # PEFT saved the head's weight too: the export checked it is the base's (else refused: tests/bad_input/export.py)
    assert "base_model.model.lm_head.base_layer.weight" in load_file(head_lora / "adapter_model.safetensors")
    record = result.manifest.adapter
    assert record.target_modules == ("c_attn", "lm_head") and record.modules == 2 + 1
    weights = {i.name: numpy_helper.to_array(i) for i in onnx.load(result.folder / "model.onnx").graph.initializer}
    embedding = _base(trained_checkpoint).transformer.wte.weight.detach()
    assert np.array_equal(weights["wte.weight"], embedding.numpy())
    with torch.no_grad():
        delta = head_peft.get_base_model().lm_head.get_delta_weight("default")
    assert np.abs(weights["lm_head"] - (embedding + delta).numpy()).max() < 1e-6
    assert delta.abs().max() > 1e-3  # the head really moved

    ids = _docstring_ids(trained_checkpoint, 2, 24)
    outputs = _onnx_prefill(result.folder, ids.numpy())
    with torch.no_grad():
        theirs = head_peft(ids, use_cache=True)
        with head_peft.disable_adapter():
            base_logits = head_peft(ids).logits.numpy()
    assert np.abs(outputs[0] - theirs.logits.numpy()).max() < FP32_GATE
    presents = [t.numpy() for layer in theirs.past_key_values.layers for t in (layer.keys, layer.values)]
    for ours, reference in zip(outputs[1:], presents, strict=True):
        assert np.abs(ours - reference).max() < FP32_GATE
    assert np.abs(base_logits - theirs.logits.numpy()).max() > 1000 * FP32_GATE


def test_switchable_head_greedy_tokens_equal_merged(trained_checkpoint, head_lora, merged_head, tmp_path):
    """Switchable, the head's Gemm (on the tied embedding's matrix) takes a slot: generate --adapter head gives the
    merged export's greedy tokens (fp32 both, graphs that differ only by summation order), and other tokens than
    the base's (no adapter active)."""
    import onnx

    from gpt2onnx.artifact.lora import slot_inputs
    from gpt2onnx.exporters.switchable import export_switchable

    result = export_switchable(str(trained_checkpoint), tmp_path / "m", adapters={"head": head_lora})
    assert result.check.passed and result.manifest.adapters["head"].check.endswith("— pass")
    assert result.manifest.architecture.tie_word_embeddings  # the base stays tied: one matrix, the slot beside it
    assert "lora.lm_head.A" in slot_inputs(onnx.load(result.folder / "model.onnx"))
    ids = _docstring_ids(trained_checkpoint, 1, 12)
    ours = _alone(result.folder, ids, 16, "head")
    assert ours == _alone(merged_head.folder, ids, 16, None)
    assert ours != _alone(result.folder, ids, 16, None)


@pytest.fixture(scope="module")
def switchable_int8_head(trained_checkpoint, lora, head_lora, tmp_path_factory):
    from gpt2onnx.exporters.switchable import export_switchable
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    out = tmp_path_factory.mktemp("switchable-int8-head") / "m"
    options = ExportOptions(quantization=QuantizeOptions("int8"))
    return export_switchable(str(trained_checkpoint), out, adapters={"docs": lora, "head": head_lora}, options=options)


def test_switchable_int8_with_a_head_adapter_passes_against_peft(switchable_int8_head, head_peft, trained_checkpoint):
    """--quantize int8 with 'docs' (blocks) and 'head' (c_attn and the head) in one folder: each passed against
    PEFT with it; the head is still quantized (the quantizer finds it through its slot's Add: 9 MatMulInteger, 8
    block weights and the head), its slot fp32 beside it. Independently, as for 'rs' above (same gates, same
    reasons): with 'head' active the mean KL to PEFT's model within int8's gate (7e-4) and the argmax agreeing at
    int8's top-1 gate (0.92); without it more than 5× that gate away."""
    import onnx

    from gpt2onnx.passes.lora_slots import slot_dtypes

    result = switchable_int8_head
    assert result.check.passed and result.manifest.quantization.method == "int8"
    for name in ("docs", "head"):
        check = result.manifest.adapters[name].check
        assert f"against PEFT with adapter '{name}'" in check and check.endswith("— pass")
    model = onnx.load(result.folder / "model.onnx")
    assert sum(n.op_type == "MatMulInteger" for n in model.graph.node) == 9
    dtypes = slot_dtypes(model)
    assert len(dtypes) == 2 * 9 and {np.dtype(t) for t in dtypes.values()} == {np.dtype(np.float32)}  # 8 + the head

    ids = _docstring_ids(trained_checkpoint, 2, 48)
    with torch.no_grad():
        expected = head_peft(ids).logits.log_softmax(-1)

    def kl(logits: torch.Tensor) -> float:  # KL(PEFT ‖ ours), mean over positions
        return float((expected.exp() * (expected - logits.log_softmax(-1))).sum(-1).mean())

    with_head = _prefill_logits(result.folder, ids.numpy(), result.folder / "head.onnx_adapter")
    alone = _prefill_logits(result.folder, ids.numpy(), None)
    assert kl(with_head) < 7e-4, kl(with_head)
    assert (with_head.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.92
    assert kl(alone) > 5 * 7e-4, kl(alone)


# -- switchable on an fp16 base with a fused profile: fp16 slots and adapter files, the fusions around them ------
@pytest.fixture(scope="module")
def switchable_fp16(trained_checkpoint, lora, head_lora, tmp_path_factory):
    from gpt2onnx.exporters.switchable import export_switchable

    out = tmp_path_factory.mktemp("switchable-fp16") / "m"
    options = ExportOptions(dtype="fp16", fusion="ort")
    return export_switchable(str(trained_checkpoint), out, adapters={"docs": lora, "head": head_lora}, options=options)


def _peft_factors(folder: Path) -> dict[str, np.ndarray]:
    """What a switchable file must hold for PEFT adapter ``folder``, read from its safetensors here: per module,
    lora.MODULE.A = Aᵀ and lora.MODULE.B = (alpha / r) · Bᵀ (fp32; no rsLoRA or patterns in these adapters)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    factors = {}
    for key, tensor in load_file(folder / "adapter_model.safetensors").items():
        module, _, factor = key.removeprefix("base_model.model.").removeprefix("transformer.").rpartition(".lora_")
        if factor == "A.weight":
            factors[f"lora.{module}.A"] = tensor.T.numpy()
        elif factor == "B.weight":
            factors[f"lora.{module}.B"] = (tensor.T * scale).numpy()
    return factors


def test_switchable_fp16_fused_has_fp16_slots_and_files(switchable_fp16, lora, head_lora):
    """--dtype fp16 --fusion ort with 'docs' and 'head': each adapter passed against PEFT with it (fp16's gates,
    the "fp16 as on a GPU" emulation with the adapter bound too); the ort fusions happened around the slots (a
    MultiHeadAttention per layer, SkipLayerNormalization); the graph's slot inputs are fp16, read by MatMuls,
    and each adapter file holds fp16 arrays, PEFT's factors rounded once to fp16 (within half an fp16 ulp,
    2⁻¹¹ relative, of the fp32 factor; B's scale folded in before rounding may add one more fp32 rounding, so
    2⁻¹⁰; 2⁻²⁴ absolute for fp16's subnormals)."""
    import onnx
    import onnxruntime as ort

    from gpt2onnx.passes.lora_slots import slot_dtypes

    result = switchable_fp16
    assert result.check.passed and result.manifest.dtype == "float16"
    for name in ("docs", "head"):
        check = result.manifest.adapters[name].check
        assert check.startswith(f"float16 against PEFT with adapter '{name}'") and check.endswith("— pass")
        assert "fp16 as on a GPU" in check
    ops = result.manifest.fusion.op_counts
    assert ops["com.microsoft::MultiHeadAttention"] == 2 and ops["com.microsoft::SkipLayerNormalization"] >= 2
    model = onnx.load(result.folder / "model.onnx")
    assert sum(n.op_type == "MultiHeadAttention" for n in model.graph.node) == 2
    dtypes = slot_dtypes(model)
    assert len(dtypes) == 2 * 9 and {np.dtype(t) for t in dtypes.values()} == {np.dtype(np.float16)}
    readers = [n for n in model.graph.node if set(dtypes) & set(n.input)]
    assert len(readers) == len(dtypes) and {n.op_type for n in readers} == {"MatMul"}
    for name, folder in (("docs", lora), ("head", head_lora)):
        stored = ort.AdapterFormat.read_adapter(str(result.folder / f"{name}.onnx_adapter")).get_parameters()
        expected = _peft_factors(folder)
        assert set(stored) == set(expected)
        for slot, value in stored.items():
            array = value.numpy()
            assert array.dtype == np.float16, slot
            np.testing.assert_allclose(array.astype(np.float32), expected[slot], rtol=2**-10, atol=2**-24)


# fp16's error on this model's logits: the export's check measures at most ~6e-3 between the fp16 file and PEFT
FP16_LOGITS = 0.025  # 4× that


def test_switchable_fp16_greedy_tokens_equal_peft(switchable_fp16, peft_model, head_peft, trained_checkpoint):
    """With each adapter active, the fp16 fused file's greedy tokens are PEFT's generate (fp32) on a short prompt,
    and not the base's. Exact equality is sound only where no step is a near-tie: at every step PEFT's best logit
    leads its second by more than 2 × FP16_LOGITS (measured: 0.065 for docs, 0.086 for head), so fp16 logits
    within FP16_LOGITS of PEFT's cannot pick another token; checked here first."""
    ids = _docstring_ids(trained_checkpoint, 1, 12)
    for name, reference in (("docs", peft_model), ("head", head_peft)):
        with torch.no_grad():
            theirs = reference.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
            )
            top2 = reference(theirs).logits[0, ids.shape[1] - 1 : -1].topk(2, -1).values
            with reference.disable_adapter():
                base = reference.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
                )
        assert float((top2[:, 0] - top2[:, 1]).min()) > 2 * FP16_LOGITS, name  # no near-tie on this prompt
        expected = theirs[0, ids.shape[1] :].tolist()
        assert _alone(switchable_fp16.folder, ids, 16, name) == expected, name
        assert expected != base[0, ids.shape[1] :].tolist(), name  # the adapter changes the tokens
