"""The generation models of deploy --target triton on a real Triton Inference Server: nvidia-pytriton's bundled
tritonserver (Triton 2.51, Python backend) from .venv-triton, started once for the module on 127.0.0.1, driven
over HTTP (the generate endpoints, plain JSON and server-sent events, from this process) and gRPC (tritonclient,
streaming and unary, from tests/workers/triton_client.py under .venv-triton's python).

Skips, saying why, where .venv-triton is missing (scripts/setup.sh creates it); fails under CI=1. About 25 s
beyond the shared fixtures: the server starts in about 5 s and stops in about 3 s."""

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2onnx.decoding.generate import generate
from gpt2onnx.errors import RuntimeUnavailable
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.targets.deploy import deploy
from gpt2onnx.targets.triton_server import TritonServer, triton_python

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "tests" / "workers" / "triton_client.py"
NAME = "docs"
GENERATE, INFER = f"{NAME}-generate", f"{NAME}-infer"
# 16 prompts of different lengths, each with its own count of new tokens: rows join and leave at different steps
PROMPTS = [
    ("Return the", 24),
    ("The file", 9),
    ("If the argument is", 31),
    ("This module provides", 16),
    ("Raise ValueError if the", 12),
    ("A list of", 27),
    ("Open the", 20),
    ("Create a new", 8),
    ("Return True if the object is", 18),
    ("x", 22),
    ("Convert the string to", 14),
    ("The default value is", 26),
    ("Iterate over the items of", 10),
    ("Read data from", 30),
    ("Set the", 17),
    ("Compute the", 11),
]


def need_triton() -> str:
    python = triton_python()
    if python is None:
        message = "no .venv-triton (nvidia-pytriton's tritonserver): run scripts/setup.sh"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    return python


@pytest.fixture(scope="module")
def repository(trained_export, tmp_path_factory) -> Path:
    need_triton()
    out = tmp_path_factory.mktemp("triton") / "model"
    deploy(trained_export, "triton", out=out, triton_name=NAME)
    return out / "triton"


def start(repository: Path) -> TritonServer:
    try:
        return TritonServer(repository, models=[GENERATE, INFER], python=need_triton())
    except RuntimeUnavailable as err:
        pytest.fail(str(err)) if os.environ.get("CI") else pytest.skip(str(err))


@pytest.fixture(scope="module")
def served(repository):
    server = start(repository)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(trained_checkpoint):
    """transformers' greedy generate() for every prompt: (new token ids, up to and including eos; new text)."""
    from transformers import GPT2LMHeadModel

    from gpt2onnx.decoding.prompts import load_tokenizer

    model = GPT2LMHeadModel.from_pretrained(str(trained_checkpoint)).eval()
    tokenizer = load_tokenizer(trained_checkpoint)
    eos = model.config.eos_token_id
    found = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for prompt, new in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=eos, eos_token_id=eos)
            tokens = out[0, ids.shape[1] :].tolist()
            found[prompt] = (tokens, tokenizer.decode(tokens, skip_special_tokens=True))
    finally:
        torch.set_num_threads(threads)
    return found


# -- HTTP, from this process --------------------------------------------------------------------------------------
def post(server, path: str, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def stream(server, body: dict, *, leave_after: int | None = None) -> list[dict]:
    """generate_stream's server-sent events, as JSON objects; ``leave_after``: close the connection after that
    many events, as a client that goes away."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    events = []
    try:
        connection.request(
            "POST", f"/v2/models/{GENERATE}/generate_stream", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.status == 200, response.read()
        for line in response:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
                if leave_after is not None and len(events) >= leave_after:
                    break
    finally:
        connection.close()
    return events


def streamed(events: list[dict]) -> tuple[list[int], str, str | None]:
    ids = [i for e in events for i in np.atleast_1d(e.get("output_ids", [])).tolist()]
    return ids, "".join(e["text_output"] for e in events), events[-1].get("finish_reason")


def body(prompt: str, new: int, **parameters) -> dict:
    return {"text_input": prompt, "stream": True, "parameters": {"max_new_tokens": new, **parameters}}


# -- gRPC, from .venv-triton's python -----------------------------------------------------------------------------
def grpc_jobs(server, jobs: list[dict]) -> subprocess.Popen:
    process = subprocess.Popen(
        [triton_python(), str(CLIENT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    process.stdin.write(json.dumps({"url": server.grpc_url, "jobs": jobs}))
    process.stdin.close()
    return process


def grpc_results(process: subprocess.Popen) -> list[dict]:
    out = process.stdout.read()
    assert process.wait(timeout=180) == 0, process.stderr.read()
    return json.loads(out)


# -- the tests ----------------------------------------------------------------------------------------------------
def test_generate_gives_transformers_text(served, expected):
    for prompt, new in PROMPTS[:4]:
        status, answer = post(
            served, f"/v2/models/{GENERATE}/generate", {"text_input": prompt, "parameters": {"max_new_tokens": new}}
        )
        assert status == 200, answer
        tokens, text = expected[prompt]
        assert np.atleast_1d(answer["output_ids"]).tolist() == tokens
        assert answer["text_output"] == text
        assert answer["finish_reason"] == ("eos" if len(tokens) < new else "length")


def test_sixteen_concurrent_streaming_clients_each_get_their_own_text(served, expected):
    """8 clients over HTTP (server-sent events) and 8 over gRPC streaming, all at once."""
    http_prompts, grpc_prompts = PROMPTS[::2], PROMPTS[1::2]
    process = grpc_jobs(
        served,
        [
            {"kind": "stream", "model": GENERATE, "prompt": p, "parameters": {"max_new_tokens": n}}
            for p, n in grpc_prompts
        ],
    )
    with concurrent.futures.ThreadPoolExecutor(len(http_prompts)) as pool:
        http_results = list(pool.map(lambda item: stream(served, body(*item)), http_prompts))
    for (prompt, new), events in zip(http_prompts, http_results):
        ids, text, reason = streamed(events)
        assert (ids, text) == expected[prompt], prompt
        assert len(events) == len(ids)  # one response per token
        assert reason in ("eos", "length")
    for (prompt, new), result in zip(grpc_prompts, grpc_results(process)):
        assert result["error"] is None, result
        assert (result["ids"], result["text"]) == expected[prompt], prompt
        assert result["responses"] == len(result["ids"])


def test_clients_that_leave_mid_stream_harm_no_other(repository, expected):
    """On a server of its own: Triton 2.51 (nvidia-pytriton 0.7.0's, the newest on PyPI) has known races between a
    gRPC stream's cancellation and the response it is sending, which crash tritonserver itself with SIGSEGV
    (triton-inference-server/server#7840, fixed in r24.12; #8034/#8078, fixed in March 2025); seen once in CI
    (1 in 190 runs here). The model's own code runs in the Python-backend stub, another process, so a SIGSEGV of
    the server is that race: the scenario runs again once on a fresh server, and must then pass."""
    for attempt in (1, 2):
        server = start(repository)
        try:
            leave_mid_stream(server, expected)
            return
        except (AssertionError, OSError, http.client.HTTPException):
            if attempt == 2 or not crashed(server):
                raise
            warnings.warn("tritonserver crashed with SIGSEGV on a cancellation (Triton 2.51's race): run again")
        finally:
            server.stop()


def crashed(server: TritonServer) -> bool:
    try:
        server.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return False
    return server.process.returncode == -signal.SIGSEGV and "Signal (11) received" in server.log_tail(200)


def leave_mid_stream(served, expected):
    long = [(p, n) for p, n in PROMPTS if n >= 20][:4]
    process = grpc_jobs(
        served,
        [
            {
                "kind": "cancel",
                "after": 3,
                "model": GENERATE,
                "prompt": "Return the",
                "parameters": {"max_new_tokens": 60},
            }
        ]
        + [
            {"kind": "stream", "model": GENERATE, "prompt": p, "parameters": {"max_new_tokens": n}} for p, n in long[:2]
        ],
    )
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        gone = pool.submit(stream, served, body("Open the", 60), leave_after=3)
        others = [pool.submit(stream, served, body(p, n)) for p, n in long[2:]]
        assert len(gone.result()) == 3
        for (prompt, _), future in zip(long[2:], others):
            assert streamed(future.result())[:2] == expected[prompt]
    cancelled, *streams = grpc_results(process)
    assert cancelled["finish_reason"] == "client cancelled" and cancelled["error"] is None
    for (prompt, _), result in zip(long[:2], streams):
        assert (result["ids"], result["text"]) == expected[prompt]
    prompt, new = PROMPTS[0]
    assert streamed(stream(served, body(prompt, new)))[:2] == expected[prompt]  # the server goes on serving


BAD_REQUESTS = [
    ({"parameters": {"max_new_tokens": 4}}, "missing required input"),
    ({"text_input": "Return the", "parameters": {"max_new_tokens": 100000}}, "beyond the model's context"),
    ({"text_input": "Return the", "parameters": {"sample": True, "temperature": -1}}, "temperature"),
    ({"text_input": "Return the", "parameters": {"temperature": 0.5}}, "only apply when sampling"),
    ({"text_input": "Return the", "parameters": {"max_new_tokens": "ten"}}, "max_new_tokens must be a whole number"),
    ({"text_input": "Return the", "parameters": {"max_new_token": 5}}, "unknown parameter max_new_token"),
    ({"text_input": "Return the", "parameters": {"num_beams": 0}}, "num_beams"),
    ({"text_input": "", "parameters": {"max_new_tokens": 4}}, "empty"),
    # Triton's own JSON parsing refuses these (its code 500: "Unable to parse ..."), before the model sees them
    ({"text_input": 5, "parameters": {"max_new_tokens": 4}}, "Unable to parse"),  # a number where text goes
    ({"text_input": "Return the", "stream": "yes"}, "Unable to parse"),  # a string where a bool goes
    ({"text_input": "Return the", "stop": [""]}, "stop string"),
]


def test_malformed_requests_get_a_triton_error_and_the_server_keeps_serving(served, expected):
    for request, message in BAD_REQUESTS:
        status, answer = post(served, f"/v2/models/{GENERATE}/generate", request)
        assert status == (500 if message == "Unable to parse" else 400) and message in answer["error"], (
            request,
            answer,
        )
    infer = {"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "INT64", "data": [5]}]}  # wrong type
    status, answer = post(served, f"/v2/models/{INFER}/infer", infer)
    assert status == 400 and "BYTES" in answer["error"], answer
    bad = grpc_jobs(
        served,
        [
            {
                "kind": "stream",
                "model": GENERATE,
                "prompt": "Return the",
                "parameters": {"sample": True, "temperature": -0.5},
            }
        ],
    )
    (result,) = grpc_results(bad)
    assert "temperature" in result["error"]
    prompt, new = PROMPTS[1]
    assert streamed(stream(served, body(prompt, new)))[:2] == expected[prompt]


def test_unary_infer_over_http_and_grpc(served, expected, trained_export):
    (prompt, new), (other, other_new) = PROMPTS[2], PROMPTS[3]
    request = {  # two prompts in one request (its batch dimension), the second with a stop string
        "inputs": [
            {"name": "text_input", "shape": [2, 1], "datatype": "BYTES", "data": [prompt, other]},
            {"name": "stop", "shape": [2, 1], "datatype": "BYTES", "data": ["never in the text", "s."]},
        ],
        "parameters": {"max_new_tokens": new},
    }
    status, answer = post(served, f"/v2/models/{INFER}/infer", request)
    assert status == 200, answer
    outputs = {o["name"]: o["data"] for o in answer["outputs"]}
    stopped = generate(trained_export, prompts=[other], max_new_tokens=new, decoding=Decoding(stop=("s.",)))
    assert outputs["text_output"] == [expected[prompt][1], stopped.texts[0]]
    (result,) = grpc_results(
        grpc_jobs(
            served, [{"kind": "infer", "model": INFER, "prompt": other, "parameters": {"max_new_tokens": other_new}}]
        )
    )
    assert result["error"] is None and result["text"] == expected[other][1]


def test_decoding_options_as_request_parameters(served, trained_export):
    prompt = "Return the"
    cases = [
        (
            dict(sample=True, temperature=0.8, top_k=40, seed=11),
            [],
            Sampling(sample=True, temperature=0.8, top_k=40, seed=11),
            Decoding(),
        ),
        (
            dict(repetition_penalty=1.3, no_repeat_ngram_size=2),
            [],
            Sampling(),
            Decoding(repetition_penalty=1.3, no_repeat_ngram_size=2),
        ),
        ({}, ["\n\n"], Sampling(), Decoding(stop=("\n\n",))),
        (dict(num_beams=3), [], Sampling(), Decoding(num_beams=3)),
    ]
    for parameters, stop, sampling, decoding in cases:
        request = {"text_input": prompt, "parameters": {"max_new_tokens": 20, **parameters}}
        if stop:
            request["stop"] = stop
        status, answer = post(served, f"/v2/models/{GENERATE}/generate", request)
        assert status == 200, answer
        alone = generate(trained_export, prompts=[prompt], max_new_tokens=20, sampling=sampling, decoding=decoding)
        assert np.atleast_1d(answer["output_ids"]).tolist() == alone.tokens[0], parameters
        assert answer["text_output"] == alone.texts[0]


def post_binary_infer(server, model: str, prompt: bytes, stop: bytes) -> tuple[int, dict]:
    """A unary infer whose inputs travel as raw bytes (the binary tensor extension): text that JSON cannot carry."""
    inputs, blob = [], b""
    for name, value in (("text_input", prompt), ("stop", stop)):
        element = len(value).to_bytes(4, "little") + value
        inputs.append(
            {"name": name, "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(element)}}
        )
        blob += element
    header = json.dumps({"inputs": inputs, "parameters": {"max_new_tokens": 4}}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        connection.request(
            "POST",
            f"/v2/models/{model}/infer",
            header + blob,
            {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))},
        )
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def infer_body(prompts: list[str], **parameters) -> dict:
    return {
        "inputs": [{"name": "text_input", "shape": [len(prompts), 1], "datatype": "BYTES", "data": prompts}],
        "parameters": {"max_new_tokens": 8, **parameters},
    }


def test_refusals_are_400s_on_infer_as_on_generate_and_leave_no_traceback(served, expected, trained_export):
    """issue 37: the unary infer reads a request as the generation model does (floats where a number goes, the
    same refusals, 400 each), a huge prompt is refused by its bytes before tokenizing, a stop string that is not
    UTF-8 is a 400, a beam request too big to run is refused without a traceback; a known prompt gives its text
    after each bad request."""
    prompt, new = PROMPTS[1]
    sampled = {"sample": True, "temperature": 0.8, "top_p": 0.9, "seed": 3}
    status, answer = post(served, f"/v2/models/{INFER}/infer", infer_body(["Return the"], **sampled))
    assert status == 200, answer
    alone = generate(trained_export, prompts=["Return the"], max_new_tokens=8, sampling=Sampling(**sampled))
    assert answer["outputs"][0]["data"] == [alone.texts[0]]
    bad = [
        (infer_body([""]), "empty"),
        (infer_body(["Return the"], max_new_tokens=100000), "beyond the model's context"),
        (infer_body(["Return the", ""]), "prompt 2 of 2"),
        (infer_body(["word " * 20000]), "bytes read"),
        (infer_body(["Return the"], temperature=0.5), "only apply when sampling"),
    ]
    for request, message in bad:
        status, answer = post(served, f"/v2/models/{INFER}/infer", request)
        assert status == 400 and message in answer["error"], (request["parameters"], answer)
        assert post(served, f"/v2/models/{INFER}/infer", infer_body([prompt], max_new_tokens=new))[1]["outputs"][0][
            "data"
        ] == [expected[prompt][1]]
    status, answer = post_binary_infer(served, INFER, b"Return the", b"\xff\xfe")
    assert status == 400 and "UTF-8" in answer["error"], answer
    start = time.monotonic()
    status, answer = post(served, f"/v2/models/{GENERATE}/generate", {"text_input": "word " * 2_000_000})
    assert status == 400 and "bytes read" in answer["error"] and time.monotonic() - start < 10, answer
    status, answer = post(
        served, f"/v2/models/{GENERATE}/generate", {"text_input": "Return the", "parameters": {"num_beams": 2**31 - 1}}
    )
    assert status == 400, answer
    assert streamed(stream(served, body(prompt, new)))[:2] == expected[prompt]
    assert "Traceback" not in served.log_tail(10_000)


def test_shutdown_is_clean(served):
    """Last in the module: SIGTERM stops the server (and the engine's threads) with exit code 0."""
    start = time.monotonic()
    assert served.stop() == 0
    assert time.monotonic() - start < 30
    assert "successfully unloaded 'docs-generate'" in served.final_log
    assert "Traceback" not in served.final_log
    with pytest.raises(OSError):  # nothing listens any more
        post(served, f"/v2/models/{GENERATE}/generate", {"text_input": "x"})


# -- the files deploy writes (no server) --------------------------------------------------------------------------
def test_generation_models_run_no_code_from_their_folder(trained_export, tmp_path):
    """model.py is gpt2onnx's fixed text, the only code in the folder, and it takes its own folder off sys.path
    before importing: a module planted beside it (here numpy.py) is never imported."""
    python = need_triton()
    out = tmp_path / "model"
    deploy(trained_export, "triton", out=out, triton_name=NAME)
    version = out / "triton" / GENERATE / "1"
    assert sorted(p.name for p in (out / "triton").rglob("*.py")) == ["model.py", "model.py"]
    assert (version / "model.onnx").stat().st_ino == (out / "model.onnx").stat().st_ino  # hard-linked
    (version / "numpy.py").write_text("raise SystemExit('planted module imported')\n")
    # as the Python backend's stub does: the model's folder on sys.path, then model.py run by its path
    probe = (
        f"import runpy, sys; sys.path.insert(0, {str(version)!r}); "
        f"m = runpy.run_path({str(version / 'model.py')!r}); print(m['TritonPythonModel'].__name__)"
    )
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=version, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "GenerateModel", proc.stderr


def test_a_folder_without_tokenizer_gets_no_generation_models(tiny_export, tmp_path):
    result = deploy(tiny_export, "triton", out=tmp_path / "d", triton_name="t")
    assert sorted(p.name for p in (tmp_path / "d" / "triton").iterdir()) == ["t"]
    assert not any("-generate" in f for f in result.targets["triton"])


def test_kserve_inference_service_is_valid_for_kserves_classes(trained_export, tmp_path):
    """deploy writes the InferenceService for KServe's Triton runtime; kserve's own model classes accept it (no
    Kubernetes here: the classes only), with the repository, the batch and the model size where they belong."""
    python = need_triton()
    check = ROOT / "tests" / "workers" / "kserve_check.py"
    for device in ("cpu", "gpu"):
        out = tmp_path / device
        result = deploy(trained_export, "triton", out=out, triton_name="Docs_Model.v1", triton_device=device)
        assert "kserve/inferenceservice.yaml" in result.targets["triton"]
        proc = subprocess.run(
            [python, str(check), str(out / "kserve" / "inferenceservice.yaml")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr + proc.stdout
        service = json.loads(proc.stdout)
        assert service["name"] == "docs-model-v1"  # a DNS-1123 label
        assert (service["model_format"], service["runtime"], service["protocol"]) == (
            "triton",
            "kserve-tritonserver",
            "v2",
        )
        assert service["storage_uri"] == "pvc://gpt2onnx-models/Docs_Model.v1/triton"
        config = (out / "triton" / "Docs_Model.v1-generate" / "config.pbtxt").read_text()
        assert f'key: "max_batch" value: {{ string_value: "{service["scale_target"]}" }}' in config
        memory = int(service["resources"]["requests"]["memory"].removesuffix("Mi")) << 20
        assert memory >= 2 * (out / "model.onnx").stat().st_size
        assert ("nvidia.com/gpu" in service["resources"]["limits"]) == (device == "gpu")


def test_bench_served_loads_the_served_model_beside_the_in_process_loop(trained_export, tmp_path):
    """`gpt2onnx bench served` on the trained test model: a real tritonserver, 1 and 3 streaming clients, every
    request its exact tokens (the command checks the count), in rotating rounds beside decode() in-process."""
    need_triton()
    out = tmp_path / "served.json"
    args = ["bench", "served", str(trained_export), "--concurrency", "1,3", "--requests", "1", "--new-tokens", "6"]
    proc = subprocess.run(
        [sys.executable, "-m", "gpt2onnx", *args, "--repeat", "2", "--warmup", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rounds = json.loads(out.read_text())["rounds"]
    assert rounds["variants"] == [
        "in-process decode(), batch 1",
        "Triton, 1 streaming client",
        "Triton, 3 streaming clients",
    ]
    assert rounds["baseline"] == "in-process decode(), batch 1" and len(rounds["orders"]) == 2
    for series in rounds["series"]:
        assert len(series["values"]) == 2 and all(v > 0 for v in series["values"]), series
    assert "Triton, 3 streaming clients" in proc.stdout
