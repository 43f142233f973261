"""Every combination works or is refused before any work.

The product of the registered axes (gpt2onnx.preflight.matrix: profile × K/V cache × precision and prompt kernel,
then each export on every runtime and provider, with speculative decoding, in the batching engine, deployed to each
target), pruned only by the resolver's own refusals, on the trained test fixture:

- an export the resolver allows is exported and checked against PyTorch within its precision's gates (export
  validates it), and one it refuses is refused by ``gpt2onnx export`` in one line, with nothing written;
- a run the resolver allows is run: parity within the gates on that runtime (onnxruntime's ort-generate: the
  deployed ops' greedy tokens equal the stepper's), speculative decoding's greedy tokens equal plain greedy's (prompt
  lookup, and a draft), the engine's tokens equal decode()'s alone, each deployed folder loaded and run by its
  runtime (transformers.js in Node, genai, the generation ops; the browser's graphs by onnxruntime, Triton's
  configs by Triton's schema); a GPU provider, which this machine has not, is answered from the folder's graph
  against the kernel table, which must agree with the declarations; a run it refuses is refused in one line;
- and docs/compatibility.md is the resolver's table, generated.

CI runs a seeded sample (GPT2ONNX_COMBINATIONS_SEED, default 0: 6 exports the resolver allows with 5 run questions
each, 4 it refuses, and every seam of issue #45 below); ``bash scripts/test-combinations.sh`` runs the whole product
(every export, each with every run question).
"""

import json
import os
import random
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.cli import app
from gpt2onnx.decoding.generate import generate
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.generation_options import Decoding
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.preflight.check import preflight
from gpt2onnx.preflight.matrix import markdown, plans, run_columns
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions
from gpt2onnx.runtimes.providers import unsupported_nodes
from gpt2onnx.serving.engine import BatchingEngine
from gpt2onnx.verify.parity import parity

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "trained-tiny"
GENAI_PYTHON = ROOT / ".venv-genai" / "bin" / "python"
JS = ROOT / "tests" / "js"
PROMPT = "Return the value of the"
NEW = 16
EVERYTHING = os.environ.get("GPT2ONNX_COMBINATIONS") == "all"
SEED = int(os.environ.get("GPT2ONNX_COMBINATIONS_SEED", "0"))
PLANS = plans()
RUNS = run_columns()
runner = CliRunner()


def _sample(items: list, count: int, salt: int) -> list:
    return items if EVERYTHING else random.Random(SEED * 1000 + salt).sample(items, min(count, len(items)))


def _plan_id(plan) -> str:
    profile, cache, precision, _, _ = plan
    return f"{profile}|{precision.label}|{cache}".replace(" ", "").replace(",", "+")


def _export_args(plan) -> list[str]:
    profile, cache, precision, _, _ = plan
    args = ["--fusion", profile, "--dtype", precision.dtype, "--kv-cache", cache]
    quantization = precision.quantization
    if quantization.method != "none":
        args += ["--quantize", quantization.method]
    if quantization.prompt_kernel:
        args += ["--prompt-kernel", quantization.prompt_kernel]
    return args


def one_line_refusal(result, code: int = 2) -> str:
    text = result.output.strip()
    assert result.exit_code == code, text
    assert "Traceback" not in text and isinstance(result.exception, SystemExit), text
    assert len(text.splitlines()) == 1 and text.startswith("error: "), text
    return text


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Exports made once per plan, by the CLI (what a user runs), keyed by plan id."""
    root = tmp_path_factory.mktemp("combinations")
    made = {}

    def export(plan) -> Path:
        key = _plan_id(plan)
        if key not in made:
            out = root / key.replace("|", "-")
            result = runner.invoke(app, ["export", "--model", str(FIXTURE), "-o", str(out), *_export_args(plan)])
            assert result.exit_code == 0, result.output[-3000:]
            made[key] = out
        return made[key]

    return export


def test_the_compatibility_page_is_the_resolvers_table():
    assert (ROOT / "docs" / "compatibility.md").read_text() == markdown(), (
        "docs/compatibility.md differs from the resolver's table: gpt2onnx check --matrix > docs/compatibility.md"
    )


SUPPORTED = [p for p in PLANS if p[3] is not None]
REFUSED = [p for p in PLANS if p[3] is None]


@pytest.mark.parametrize("plan", _sample(SUPPORTED, 6, 1) + _sample(REFUSED, 4, 2), ids=_plan_id)
def test_each_export_works_or_is_refused_before_any_work(plan, exports, tmp_path):
    profile, cache, precision, passes, refused = plan
    if passes is None:
        out = tmp_path / "refused"
        result = runner.invoke(app, ["export", "--model", str(FIXTURE), "-o", str(out), *_export_args(plan)])
        assert refused in one_line_refusal(result)
        assert not out.exists() and not list(tmp_path.iterdir()), "a refused export wrote something"
        return
    folder = exports(plan)  # exported and checked against PyTorch within its gates, or the test fails
    manifest = json.loads((folder / "gpt2onnx.json").read_text())
    assert manifest["parity"]["passed"], manifest["parity"]
    assert open_folder(folder).facts.layout.name == passes.profile.layout.name
    for label, question in _sample(RUNS, 5, zlib.crc32(_plan_id(plan).encode())):
        work = tmp_path / label.replace(" ", "-").replace("→", "to")
        work.mkdir()
        asked = _deployed_for(folder, question, work)
        answer = preflight(asked, **question)
        assert answer.ok == preflight(plan=passes, **question).ok, (label, answer.conflicts)  # declared = read back
        RUN_CHECKS[_kind(label)](asked, question, answer, work)


def _deployed_for(folder: Path, question: dict, work: Path) -> Path:
    """The folder a question runs: ort-generate's, the folder deploy writes (the export alone is refused for it,
    a prerequisite the declarations name); else the export."""
    options = question.get("runtime")
    if options is None or options.name != "ort-generate":
        return folder
    assert any("ort-generate/ files" in line for line in preflight(folder, **question).conflicts)
    deployed = work / "ort-generate"
    result = runner.invoke(app, ["deploy", str(folder), "--target", "ort-generate", "-o", str(deployed)])
    return deployed if result.exit_code == 0 else folder


def _kind(label: str) -> str:
    if label.startswith("→"):
        return "target"
    return "speculative" if label.startswith("speculative") else label if label == "batching engine" else "runtime"


# -- the run checks: a supported question is run, a refused one refused in one line -------------------------------
def _greedy(folder: Path, **options) -> list[int]:
    return generate(folder, prompts=[PROMPT], max_new_tokens=NEW, **options).tokens[0]


def _run_runtime(folder: Path, question: dict, answer, work: Path) -> None:
    options: RuntimeOptions = question["runtime"]
    if options.name == "onnxruntime" and options.settings.name != "cpu":
        # no GPU here: the graph's own ops against the provider's kernel table, and the layout's host buffers,
        # must give the declared answer
        layout_on_host = open_folder(folder).facts.layout.in_place
        missing = unsupported_nodes(load_graph(folder / "model.onnx"), options.settings.name)
        assert answer.ok == (not missing and not layout_on_host), (answer.conflicts, missing)
        flags = ["--provider", options.settings.name]
    elif answer.ok and options.name == "ort-generate":  # the deployed folder (_deployed_for)
        assert _greedy(folder, runtime=options) == _greedy(folder)
        return
    elif answer.ok:
        report = parity(folder, runtime=options, cases=2, seed=0)
        assert report.passed, (options.name, report.failures)
        return
    else:
        flags = ["--runtime", options.name]
    if not answer.ok:
        result = runner.invoke(app, ["generate", str(folder), "--prompt", PROMPT, *flags])
        # a provider or a runtime that cannot run the folder's graph: exit code 3, as a runtime that is missing
        assert answer.conflicts[0].split(":")[0] in one_line_refusal(result, code=3), result.output


def _run_speculative(folder: Path, question: dict, answer, work: Path) -> None:
    if not answer.ok:
        result = runner.invoke(app, ["generate", str(folder), "--prompt", PROMPT, "--prompt-lookup", "8"])
        one_line_refusal(result)
        return
    plain = _greedy(folder)
    assert _greedy(folder, speculation=Speculation(prompt_lookup=8)) == plain
    assert _greedy(folder, speculation=Speculation(draft=folder, draft_tokens=20)) == plain


def _run_engine(folder: Path, question: dict, answer, work: Path) -> None:
    if not answer.ok:
        with pytest.raises(Exception, match="batching engine"):
            BatchingEngine.open(folder)
        return
    with BatchingEngine.open(folder, max_batch=4) as engine:
        prompts = [PROMPT, "The", "Return a new"]
        streams = [engine.submit(p, max_new_tokens=NEW) for p in prompts]
        beams = engine.submit(PROMPT, max_new_tokens=8, decoding=Decoding(num_beams=2))
        for prompt, stream in zip(prompts, streams):
            assert stream.result(timeout=300).tokens == _greedy_for(folder, prompt)
        assert (
            beams.result(timeout=300).tokens
            == generate(folder, prompts=[PROMPT], max_new_tokens=8, decoding=Decoding(num_beams=2)).tokens[0]
        )


def _greedy_for(folder: Path, prompt: str) -> list[int]:
    return generate(folder, prompts=[prompt], max_new_tokens=NEW).tokens[0]


def _run_target(folder: Path, question: dict, answer, work: Path) -> None:
    target = question["targets"]
    out = work / "deployed"
    result = runner.invoke(app, ["deploy", str(folder), "--target", target, "-o", str(out)])
    if not answer.ok:
        one_line_refusal(result)
        assert not out.exists(), "a refused deploy wrote its folder"
        return
    assert result.exit_code == 0, result.output[-3000:]
    DEPLOYED[target](out, folder)


def _loads_transformers_js(out: Path, source: Path) -> None:
    """Every onnx/ file: transformers.js in Node where it is installed (its greedy tokens are a sequence of the
    vocabulary), else onnxruntime loads and runs each."""
    for model in sorted((out / "onnx").glob("*.onnx")):
        _runs_a_step(model)
    module = JS / "node_modules" / "@huggingface" / "transformers"
    if not module.exists() or shutil.which("node") is None:
        return
    dtype = json.loads((out / "config.json").read_text())["transformers.js_config"]["dtype"]
    result = out.parent / "tjs.json"
    proc = subprocess.run(
        ["node", "greedy.mjs", str(out), dtype, "5,17,42", "4", str(result)],
        cwd=JS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads(result.read_text())["tokens"]) == 4


def _runs_a_step(model: Path) -> None:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feeds = {}
    for value in session.get_inputs():
        if value.name in ("input_ids", "position_ids"):
            feeds[value.name] = np.arange(3, dtype=np.int64)[None]
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((1, 3), np.int64)
        else:
            kind = {"tensor(float16)": np.float16, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8}
            dims = [1, value.shape[1], 0, value.shape[3]]
            feeds[value.name] = np.zeros(dims, kind.get(value.type, np.float32))
    logits = session.run(["logits"], feeds)[0]
    assert np.isfinite(logits).all(), model


def _loads_web(out: Path, source: Path) -> None:
    for model in sorted((out / "onnx").glob("*.onnx")):
        _runs_a_step(model)
    assert (out / "index.html").is_file()


def _loads_genai(out: Path, source: Path) -> None:
    if not GENAI_PYTHON.exists():
        pytest.skip("onnxruntime-genai is not installed (.venv-genai): run scripts/setup.sh")
    assert len(_greedy(out, runtime=RuntimeOptions("genai"))) > 0


def _loads_ort_generate(out: Path, source: Path) -> None:
    assert _greedy(out, runtime=RuntimeOptions("ort-generate")) == _greedy(source)


def _loads_triton(out: Path, source: Path) -> None:
    if not GENAI_PYTHON.exists():
        pytest.skip("tritonclient is not installed (.venv-genai): run scripts/setup.sh")
    for config in sorted((out / "triton").rglob("config.pbtxt")):
        proc = subprocess.run(
            [str(GENAI_PYTHON), str(ROOT / "tests" / "workers" / "triton_config.py"), str(config)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (config, proc.stderr[-2000:])
    with BatchingEngine.open(out) as engine:  # what the generation models run on the deployed folder
        assert engine.generate(PROMPT, max_new_tokens=4).tokens == _greedy_for(source, PROMPT)[:4]


def _loads_mobile(out: Path, source: Path) -> None:
    _runs_a_step(out / "mobile" / "model.ort")  # onnxruntime reads the ORT format on every platform
    assert (out / "mobile" / "required_operators_and_types.config").is_file()


def _loads_server(out: Path, source: Path) -> None:
    """The image's build files and manifests are written (tests/targets/test_deploy_server.py serves the layout with its
    own CMD and checks them against BuildKit's parser and kserve's classes); its model runs a step."""
    assert (out / "Dockerfile").is_file() and (out / ".dockerignore").is_file()
    assert all((out / "kubernetes" / name).is_file() for name in ("inferenceservice.yaml", "deployment.yaml"))
    _runs_a_step(out / "model.onnx")


RUN_CHECKS = {
    "runtime": _run_runtime,
    "speculative": _run_speculative,
    "batching engine": _run_engine,
    "target": _run_target,
}
DEPLOYED = {
    "transformers-js": _loads_transformers_js,
    "web": _loads_web,
    "genai": _loads_genai,
    "ort-generate": _loads_ort_generate,
    "triton": _loads_triton,
    "mobile": _loads_mobile,
    "server": _loads_server,
}


# -- the seams of issue #45, every one in every run ---------------------------------------------------------------
def _plan(profile: str, label: str, cache: str = FLOAT_CACHE):
    return next(p for p in PLANS if p[0] == profile and p[2].label == label and p[1] == cache)


@pytest.mark.parametrize("profile", ["ort-shared-kv", "onnx-static-kv"])
def test_the_int4_prompt_path_runs_on_the_buffer_layouts(profile, exports):
    """Once exit 70 inside GroupQueryAttention/TensorScatter: the steppers were chosen from the top-level nodes,
    which the prompt path's If hides. Exported (checked against PyTorch), its speculative decoding equal to plain
    greedy, a check step of 21 rows included (prompt lookup 20)."""
    folder = exports(_plan(profile, "int4, --prompt-kernel int8"))
    plain = _greedy(folder)
    assert _greedy(folder, speculation=Speculation(prompt_lookup=20)) == plain
    assert _greedy(folder, speculation=Speculation(draft=folder, draft_tokens=20)) == plain


def test_the_prompt_path_deploys_to_transformers_js_and_the_browser(exports, tmp_path):
    """Once an unloadable model_q4f16.onnx (fp16 fed to DynamicQuantizeLinear) and exit 70 (web): both are made
    from the decode body now."""
    folder = exports(_plan("none", "int4, --prompt-kernel int8"))
    out = tmp_path / "deployed"
    result = runner.invoke(app, ["deploy", str(folder), "--target", "transformers-js,web", "-o", str(out)])
    assert result.exit_code == 0, result.output[-3000:]
    assert (out / "onnx" / "model_q4f16.onnx").is_file()
    _loads_web(out, folder)


@pytest.mark.parametrize(("profile", "cache"), [("onnx-static-kv", FLOAT_CACHE), ("ort-shared-kv", "int8")])
def test_the_engine_serves_the_buffer_layouts_and_a_quantized_cache(profile, cache, exports, tmp_path):
    """Once a beam beside a greedy request failed (one stepper shared by two threads) and every greedy request
    on a quantized cache failed (a float past): 16 requests, beams among them, each equal to decode() alone."""
    folder = exports(_plan(profile, "fp32", cache))
    _run_engine(folder, {}, preflight(folder, runtime=RuntimeOptions(), engine=True), tmp_path)


def test_optimize_refuses_what_it_cannot_make_from_a_folder(exports, tmp_path):
    int4 = exports(_plan("none", "int4"))
    prompt_path = exports(_plan("none", "int4, --prompt-kernel int8"))
    cases = [
        ([str(int4), "--quantize", "int8"], "is made from fp32 weights"),
        ([str(prompt_path), "--fusion", "ort-shared-kv", "--kv-cache", "int8"], "rewrites the top-level graph"),
        ([str(int4), "--dtype", "fp16"], "is made from fp32 weights"),
    ]
    for args, words in cases:
        out = tmp_path / "out"
        assert words in one_line_refusal(runner.invoke(app, ["optimize", *args, "-o", str(out)]))
        assert not out.exists()


# -- issue 53: check answers what the command does, each runtime × each decoding feature ---------------------------
FEATURES = {
    "greedy": [],
    "sample": ["--sample", "--seed", "1"],
    "temperature": ["--sample", "--temperature", "0.7", "--seed", "1"],
    "top-p": ["--sample", "--top-p", "0.9", "--seed", "1"],
    "top-k": ["--sample", "--top-k", "5", "--seed", "1"],
    "beams": ["--num-beams", "2"],
    "beams-length-penalty-0": ["--num-beams", "2", "--length-penalty", "0"],
    "early-stopping": ["--num-beams", "2", "--length-penalty", "0", "--early-stopping", "true"],
    "early-stopping-never": ["--num-beams", "2", "--length-penalty", "0", "--early-stopping", "never"],
    "return-sequences": ["--num-beams", "2", "--length-penalty", "0", "--num-return-sequences", "2"],
    "sampled-sequences": ["--sample", "--seed", "1", "--num-return-sequences", "2"],
    "repetition-penalty": ["--repetition-penalty", "1.3"],
    "beams-repetition-penalty": ["--num-beams", "2", "--length-penalty", "0", "--repetition-penalty", "1.3"],
    "no-repeat-ngram": ["--no-repeat-ngram-size", "2"],
    "min-new-tokens": ["--min-new-tokens", "3"],
    "stop": ["--stop", "e"],
    "beams-stop": ["--num-beams", "2", "--length-penalty", "0", "--stop", "e"],
}
LOOP_RUNTIMES = ("genai",)  # a worker under .venv-genai's Python


@pytest.fixture(scope="module")
def run_folders(exports, tmp_path_factory) -> dict[str, Path]:
    """The fixture's export, and the folder deploy writes from it for ort-generate."""
    folder = exports(_plan("none", "fp32"))
    deployed = tmp_path_factory.mktemp("ort-generate") / "deployed"
    result = runner.invoke(app, ["deploy", str(folder), "--target", "ort-generate", "-o", str(deployed)])
    assert result.exit_code == 0, result.output[-3000:]
    return {"export": folder, "ort-generate": deployed}


def _runtime_folder(runtime: str, run_folders: dict) -> Path:
    if runtime in LOOP_RUNTIMES and not GENAI_PYTHON.exists():
        pytest.skip("onnxruntime-genai is not installed (.venv-genai): run scripts/setup.sh")
    return run_folders.get(runtime, run_folders["export"])


def _verdict(args: list[str], tmp_path: Path) -> dict:
    """check's answer (exit 0 supported, 1 a conflict, the --json report written either way)."""
    report = tmp_path / "check.json"
    report.unlink(missing_ok=True)
    result = runner.invoke(app, ["check", *args, "--json", str(report)])
    verdict = json.loads(report.read_text())
    assert result.exit_code == (0 if verdict["supported"] else 1), result.output
    return verdict


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino", "genai", "ort-generate"])
def test_check_answers_what_generate_does_for_each_decoding_feature(runtime, run_folders, tmp_path):
    """Once `check --runtime ort-generate` said supported with beams, no_repeat_ngram_size or a temperature, and
    generate refused them: each feature is asked of check and run by generate, which must agree (a refusal in one
    line: the check's first conflict)."""
    folder = _runtime_folder(runtime, run_folders)
    for name, args in FEATURES.items():
        verdict = _verdict([str(folder), "--runtime", runtime, *args], tmp_path)
        ran = runner.invoke(
            app, ["generate", str(folder), "--runtime", runtime, "--prompt", PROMPT, "--max-new-tokens", "4", *args]
        )
        if verdict["supported"]:
            assert ran.exit_code == 0, (name, ran.output[-2000:])
        else:
            line = one_line_refusal(ran, code=ran.exit_code if ran.exit_code in (2, 3) else 2)
            assert verdict["conflicts"][0] in line, (name, verdict["conflicts"], line)


def test_check_refuses_ort_generate_on_a_folder_not_deployed_for_it(run_folders, tmp_path):
    verdict = _verdict([str(run_folders["export"]), "--runtime", "ort-generate"], tmp_path)
    assert not verdict["supported"] and "has no ort-generate/ files" in verdict["conflicts"][0]
    ran = runner.invoke(app, ["generate", str(run_folders["export"]), "--runtime", "ort-generate", "--prompt", PROMPT])
    assert verdict["conflicts"][0] in one_line_refusal(ran)


@pytest.mark.parametrize("runtime", ["onnxruntime", "genai", "ort-generate"])
def test_bench_generate_does_what_check_answers(runtime, run_folders, tmp_path):
    """Once `bench generate --runtime genai` always exited 2 (it gave genai min_new_tokens, which genai refuses):
    greedy and beams, as check answers them, on each runtime; genai's rows end at their end-of-sequence."""
    folder = _runtime_folder(runtime, run_folders)
    for args in ([], ["--num-beams", "2"]):
        verdict = _verdict([str(folder), "--runtime", runtime, *args], tmp_path)
        out = tmp_path / "bench.json"
        small = ["--batch", "1", "--prompt-len", "4", "--new-tokens", "4", "--warmup", "0", "--repeat", "1"]
        ran = runner.invoke(
            app, ["bench", "generate", str(folder), "--runtime", runtime, *small, *args, "--json", str(out)]
        )
        if verdict["supported"]:
            assert ran.exit_code == 0, (args, ran.output[-2000:])
            report = json.loads(out.read_text())
            assert report["same_tokens"] and report["exact_length"] == (runtime != "genai"), report
        else:
            assert verdict["conflicts"][0] in one_line_refusal(ran)


def test_mixed_int8_calibrates_the_static_layout(tmp_path):
    """Once exit 70 (TensorScatter: max_sequence_length 0): the sensitivity measurement fed the static buffer a
    past of length 0; its feeds give a buffer the tokens' length now. Exported and checked against PyTorch."""
    out = tmp_path / "mixed"
    args = ["--quantize", "int4", "--mixed-int8", "25", "--fusion", "onnx-static-kv"]
    result = runner.invoke(app, ["export", "--model", str(FIXTURE), "-o", str(out), *args])
    assert result.exit_code == 0, result.output[-3000:]
    assert json.loads((out / "gpt2onnx.json").read_text())["parity"]["passed"]


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino", "genai", "ort-generate"])
def test_bench_run_does_what_check_answers(runtime, run_folders, tmp_path):
    """Once `check --runtime ort-generate` said supported and bench refused (it times each step): `check --command
    bench` answers what bench does, and a refusal is check's first conflict."""
    folder = _runtime_folder(runtime, run_folders)
    verdict = _verdict([str(folder), "--runtime", runtime, "--command", "bench"], tmp_path)
    small = ["--batch", "1", "--prompt-len", "4", "--new-tokens", "2", "--warmup", "0", "--repeat", "1"]
    ran = runner.invoke(app, ["bench", "run", str(folder), "--runtime", runtime, *small])
    if verdict["supported"]:
        assert ran.exit_code == 0, ran.output[-2000:]
    else:
        assert verdict["conflicts"][0] in one_line_refusal(ran, code=ran.exit_code if ran.exit_code in (2, 3) else 2)
