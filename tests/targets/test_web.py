"""The web target in a real browser: headless Chromium (Debian's, driven by playwright-core from tests/js) opens
the page that `gpt2onnx deploy --target web` writes, served by gpt2onnx's own server, and generates greedily with
transformers.js (onnxruntime-web's wasm build; WebGPU on SwiftShader's software adapter). The text and token ids
must equal onnxruntime's (Python, `gpt2onnx generate`) on the same folder. One browser serves every test; the
model is conftest's trained tiny GPT-2 (2 layers × 64, a 512-token byte-level BPE). Where Chromium, Node or
tests/js/node_modules is missing the browser tests skip with the reason; under CI=1 they fail (scripts/setup.sh
installs them)."""

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.targets.deploy import deploy
from gpt2onnx.targets.web_server import ISOLATION_HEADERS, open_server

ROOT = Path(__file__).resolve().parents[2]
JS = ROOT / "tests" / "js"
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
PROMPT = "Return the number of"
NEW = 12


def need(ok: bool, what: str):
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{what}: run scripts/setup.sh (as root it installs Chromium)")
        pytest.skip(f"{what}: run scripts/setup.sh (as root it installs Chromium)")


def need_node_modules():
    need(shutil.which("node") is not None, "node is not installed (Node.js 20+)")
    for package in ("@huggingface/transformers", "playwright-core"):
        need((JS / "node_modules" / package / "package.json").is_file(), f"{package} is not in tests/js/node_modules")


class Browser:
    """tests/js/browser.mjs: one Chromium, one JSON request and answer per line."""

    def __init__(self, *flags: str):
        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block the driver
        self.proc = subprocess.Popen(
            ["node", "browser.mjs", *flags],
            cwd=JS,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the browser did not start: {self.stderr()}")
        self.info = json.loads(line)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]

    def visit(self, url: str, *, screenshot: Path | None = None, timeout_s: float = 300) -> dict:
        """Open ``url`` and wait for data-done; the limit is generous: a page takes 5-10 s on 2 quiet cores, but
        several times that when the cores are shared (SwiftShader's WebGPU most)."""
        request = {"url": url, "screenshot": str(screenshot) if screenshot else None, "timeout_ms": timeout_s * 1000}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:  # the driver died: say why
            raise RuntimeError(f"tests/js/browser.mjs exited: {self.stderr()}")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _browser(request, *flags):
    need(CHROMIUM.is_file(), f"Chromium is not installed ({CHROMIUM} is absent; apt-get install chromium)")
    need_node_modules()
    browser = Browser(*flags)
    request.addfinalizer(browser.close)
    return browser


@pytest.fixture(scope="session")
def browser(request):
    return _browser(request)


@pytest.fixture(scope="session")
def webgpu_browser(request):
    return _browser(request, "--webgpu")


def page_url(server, **query) -> str:
    return server.url + "?" + urllib.parse.urlencode(query)


@pytest.fixture(scope="module")
def checkpoint(trained_checkpoint):
    """conftest's trained tiny GPT-2 (2 layers × 64, its own 512-token byte-level BPE, trained on docstrings):
    a small head keeps the pages fast, and a model that learned something has few near ties for greedy."""
    return trained_checkpoint


VARIANTS = {
    "fp32": {},
    "fp32-ort": {"fusion": "ort"},
    "int8": {"quantization": QuantizeOptions("int8")},
    "int4": {"quantization": QuantizeOptions("int4")},
    "fp16": {"dtype": "fp16"},
    "fp32-external": {"external_data": True},
}


@pytest.fixture(scope="module")
def web_folder(checkpoint, tmp_path_factory):
    """variant → the exported folder deployed with --target web (exported once per module, on first use)."""
    from gpt2onnx.exporters.export import ExportOptions, export

    made: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in made:
            base = tmp_path_factory.mktemp(f"web-{variant}")
            options = ExportOptions(validate=False, **VARIANTS[variant])
            folder = export(str(checkpoint), base / "model", options=options).folder
            deploy(folder, "web")
            made[variant] = folder
        return made[variant]

    return make


def page_settings(folder: Path) -> dict:
    html = (folder / "index.html").read_text()
    start = html.index('id="gpt2onnx-settings">') + len('id="gpt2onnx-settings">')
    return json.loads(html[start : html.index("</script>", start)])


def python_greedy(folder: Path, new: int = NEW, *, dtype: str | None = None) -> dict:
    """onnxruntime (Python) on the file the page loads: what `gpt2onnx generate --prompt PROMPT` writes. That is
    the folder's model.onnx, hard-linked, except for int4, whose web graph is rewritten (gpt2onnx.targets.web):
    then `generate` runs on a copy of the folder with that graph as its model.onnx."""
    import gpt2onnx
    from gpt2onnx.decoding.prompts import load_tokenizer

    settings = page_settings(folder)
    web_graph = folder / settings["dtypes"][dtype or settings["dtype"]]["file"]
    if web_graph.samefile(folder / "model.onnx"):
        result = gpt2onnx.generate(folder, prompts=[PROMPT], max_new_tokens=new)
    else:
        view = folder.parent / f"{folder.name}-web-graph-{dtype or settings['dtype']}"
        if not view.exists():
            shutil.copytree(folder, view, ignore=shutil.ignore_patterns("lib", "onnx", "model.onnx*"))
            os.link(web_graph, view / "model.onnx")
            for data in web_graph.parent.glob(web_graph.name + "_data"):
                os.link(data, view / data.name)
        result = gpt2onnx.generate(view, prompts=[PROMPT], max_new_tokens=new, verify_files=False)
    return {"ids": result.tokens[0], "text": result.texts[0], "prompt_ids": load_tokenizer(folder).encode(PROMPT)}


def ids(value: str) -> list[int]:
    return [int(i) for i in value.split(",")] if value else []


def check_same_as_onnxruntime(
    result: dict, folder: Path, request, backend: str, new: int = NEW, *, dtype: str | None = None
) -> dict:
    assert result["done"] == "true", (result.get("error"), result.get("console"), result.get("failed"))
    expected = python_greedy(folder, new, dtype=dtype)
    record(request, folder, result, backend)
    assert ids(result["stats"]["promptIds"]) == expected["prompt_ids"]
    assert ids(result["stats"]["ids"]) == expected["ids"]
    assert result["output"] == expected["text"]
    assert result["stats"]["backend"] == backend
    return expected


def record(request, folder: Path, result: dict, backend: str):
    """One line per page in <basetemp>/web_runs.jsonl (browser, backend, variant, tokens/s, seconds)."""
    path = Path(request.config._tmp_path_factory.getbasetemp()) / "web_runs.jsonl"
    row = {"test": request.node.name, "folder": folder.parent.name, "backend": backend, "seconds": result["seconds"]}
    row.update({k: result["stats"].get(k) for k in ("newTokens", "tokensPerSecond", "decodeTokensPerSecond")})
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("variant", ["fp32-ort", "int8", "int4", "fp16"])
def test_the_browser_writes_what_onnxruntime_writes(variant, browser, web_folder, request):
    folder = web_folder(variant)
    with open_server(folder, port=0, background=True) as server:
        result = browser.visit(page_url(server, prompt=PROMPT, max_new_tokens=NEW, backend="wasm"))
    check_same_as_onnxruntime(result, folder, request, "wasm")


def test_the_browser_runs_q4f16_from_an_int4_folder(browser, web_folder, request):
    """?dtype=q4f16: the int4 folder's fp16 graph (4-bit MatMulNBits, fp16 activations and scales), on wasm."""
    folder = web_folder("int4")
    with open_server(folder, port=0, background=True) as server:
        result = browser.visit(page_url(server, prompt=PROMPT, max_new_tokens=NEW, backend="wasm", dtype="q4f16"))
        check_same_as_onnxruntime(result, folder, request, "wasm", dtype="q4f16")
        assert result["backend"]["dtype"] == "q4f16" and "int4 as q4f16 (onnx/model_q4f16.onnx)" in result["text"]
        refused = browser.visit(page_url(server, prompt=PROMPT, max_new_tokens=2, dtype="q8"))
    assert refused["done"] == "error"
    assert refused["error"] == "?dtype=q8 is not a dtype this folder holds (q4, q4f16): fix the address"


def test_the_page_streams_shows_speed_and_backend_and_uses_threads(browser, web_folder, request, tmp_path):
    """fp32 on two wasm threads (cross-origin isolated by gpt2onnx's server): the DOM and a screenshot."""
    folder = web_folder("fp32")
    shot = tmp_path / "page.png"
    with open_server(folder, port=0, background=True) as server:
        result = browser.visit(page_url(server, prompt=PROMPT, max_new_tokens=NEW, threads=2), screenshot=shot)
    expected = check_same_as_onnxruntime(result, folder, request, "wasm")
    assert result["crossOriginIsolated"] is True
    assert result["backend"] == {"backend": "wasm", "threads": "2", "crossOriginIsolated": "true", "dtype": "fp32"}
    text = result["text"]
    assert PROMPT + expected["text"] in text  # the prompt, then the new text after it
    assert f"{NEW} new tokens in" in text and "tokens/s" in text
    assert "backend: wasm, 2 thread(s), cross-origin isolated" in text
    assert float(result["stats"]["tokensPerSecond"]) > 0
    assert int(result["stats"]["streamedChunks"]) >= 2  # streamed in while generating, not written once at the end
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # a rendered page, not an empty image


def test_external_data_loads_over_http(browser, web_folder, request):
    folder = web_folder("fp32-external")
    assert (folder / "onnx" / "model.onnx_data").is_file()
    config = json.loads((folder / "config.json").read_text())["transformers.js_config"]
    assert config["use_external_data_format"] == {"model.onnx": 1}
    with open_server(folder, port=0, background=True) as server:
        result = browser.visit(page_url(server, prompt=PROMPT, max_new_tokens=NEW, backend="wasm"))
    check_same_as_onnxruntime(result, folder, request, "wasm")
    assert "+ external data" in result["text"]


def test_a_bad_folder_shows_a_readable_error(browser, web_folder, tmp_path):
    source = web_folder("fp32")
    broken = Path(shutil.copytree(source, tmp_path / "broken"))
    (broken / "onnx" / "model.onnx").unlink()
    (broken / "onnx" / "model.onnx").write_bytes(b"not an onnx file")
    with open_server(broken, port=0, background=True) as server:
        result = browser.visit(page_url(server, prompt=PROMPT, max_new_tokens=4, backend="wasm"))
        assert result["done"] == "error", result
        assert result["error"].startswith("cannot load the model onnx/model.onnx (fp32) from / on wasm:"), result
        assert result["output"] == ""
        # the address is checked too, before anything loads
        result = browser.visit(page_url(server, prompt=PROMPT, max_new_tokens=0))
        assert result["done"] == "error"
        context = page_settings(broken)["n_positions"]
        assert result["error"] == f"?max_new_tokens=0 is not a whole number from 1 to {context}: fix the address"
    shutil.rmtree(broken / "lib")
    with open_server(broken, port=0, background=True) as server:
        result = browser.visit(page_url(server, prompt=PROMPT))
    assert result["done"] == "error" and "cannot load the page script or lib/transformers.min.js" in result["error"]


@pytest.mark.parametrize("variant, dtype", [("fp32", None), ("fp16", None), ("int4", "q4f16")])
def test_webgpu_on_swiftshader_writes_what_onnxruntime_writes(variant, dtype, webgpu_browser, web_folder, request):
    """WebGPU on SwiftShader's software adapter (Vulkan on the CPU: slow, 3 new tokens). It offers no
    shader-f16, so fp16 and q4f16 skip, saying so."""
    folder = web_folder(variant)
    query = {"dtype": dtype} if dtype else {}
    with open_server(folder, port=0, background=True) as server:
        result = webgpu_browser.visit(page_url(server, prompt=PROMPT, max_new_tokens=3, backend="webgpu", **query))
        if result["done"] == "error" and "WebGPU was asked for" in (result["error"] or ""):
            pytest.skip(f"WebGPU cannot run {dtype or variant} in this headless Chromium: {result['error']}")
        check_same_as_onnxruntime(result, folder, request, "webgpu", new=3, dtype=dtype)
        assert "WebGPU (google swiftshader" in result["text"]
        # without ?backend the page does not pick a software adapter: wasm is far faster
        result = webgpu_browser.visit(page_url(server, prompt=PROMPT, max_new_tokens=2))
    assert result["done"] == "true" and result["stats"]["backend"] == "wasm"
    assert "the only WebGPU adapter is a software one (SwiftShader)" in result["text"]


# --- without a browser: the server and the deploy target --------------------------------------------------


def test_serve_sends_isolation_headers_and_refuses_what_is_outside(tmp_path):
    folder = tmp_path / "site"
    (folder / "sub").mkdir(parents=True)
    (folder / "index.html").write_text("<p>hi</p>")
    (folder / "sub" / "a.wasm").write_bytes(b"\0asm")
    (folder / ".hidden").write_text("no")
    (tmp_path / "secret.txt").write_text("no")
    (folder / "link.txt").symlink_to(tmp_path / "secret.txt")
    with open_server(folder, port=0, background=True) as server:
        with urllib.request.urlopen(server.url) as response:
            assert response.read() == b"<p>hi</p>"
            for name, value in ISOLATION_HEADERS.items():
                assert response.headers[name] == value
        with urllib.request.urlopen(server.url + "sub/a.wasm") as response:
            assert response.headers["Content-Type"] == "application/wasm"
        for path, status in (
            ("link.txt", 403),
            (".hidden", 404),
            ("sub/", 404),
            ("nope", 404),
            ("%2e%2e/secret.txt", 403),
            ("sub/a.wasm/", 404),  # a file is no folder (it answered 200)
        ):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(server.url + path)
            assert err.value.code == status, path
        host, port = server.url.split("//")[1].strip("/").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("GET", "/sub")  # a folder without index.html: 404, never a redirect to a listing
        response = connection.getresponse()
        assert response.status == 404 and response.getheader("Location") is None
        connection.close()
    with pytest.raises(BadInput, match="has no index.html"):
        open_server(tmp_path, port=0)
    with pytest.raises(BadInput, match="is not a port number"):
        open_server(folder, port=70000)
    with open_server(folder, port=0) as taken:
        port = int(taken.url.rsplit(":", 1)[1].strip("/"))
        with pytest.raises(BadInput, match=f"port {port} on 127.0.0.1 is already in use"):
            open_server(folder, port=port)


def test_serve_serves_only_what_it_checked(tmp_path, caplog, capsys):
    """The file opened is the file checked: a folder's index.html that leads out is refused like any link; the
    absolute form of a request target maps to the same path as its origin form; the manifest (local paths) is
    not served; a client that resets the connection mid-download is one log line, never a traceback."""
    import logging
    import socket
    import struct

    folder = tmp_path / "site"
    (folder / "sub").mkdir(parents=True)
    (tmp_path / "secret.html").write_text("secret")
    (folder / "index.html").symlink_to(tmp_path / "secret.html")
    (folder / "sub" / "index.html").symlink_to(tmp_path / "secret.html")
    (folder / "ok").mkdir()
    (folder / "ok" / "index.html").write_text("<p>ok</p>")
    (folder / "config.json").write_text("{}")
    (folder / "gpt2onnx.json").write_text(json.dumps({"source": {"path": str(tmp_path)}}))
    (folder / "big.bin").write_bytes(bytes(2 << 20))
    (folder / "http:" / "x").mkdir(parents=True)
    (folder / "http:" / "x" / "config.json").symlink_to(tmp_path / "secret.html")

    def raw(url: str, target: str) -> bytes:
        host, port = url.split("//")[1].strip("/").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(f"GET {target} HTTP/1.0\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(1 << 16):
                data += chunk
        return data

    with caplog.at_level(logging.INFO, logger="gpt2onnx.targets.web_server"):
        (folder / "index.html").unlink()
        (folder / "index.html").write_text("<p>hi</p>")  # the page itself is ours; sub/'s index leads out
        with open_server(folder, port=0, background=True) as server:
            for target, status in (("/sub/", 403), ("/ok/", 200), ("/gpt2onnx.json", 404), ("*", 400)):
                reply = raw(server.url, target)
                assert reply.split(b" ", 2)[1] == str(status).encode() and b"secret" not in reply, (target, reply)
            reply = raw(server.url, "http://x/config.json")
            assert reply.split(b" ", 2)[1] == b"200" and reply.endswith(b"{}"), reply[-200:]
            for _ in range(20):
                with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1].strip("/")))) as sock:
                    sock.sendall(b"GET /big.bin HTTP/1.0\r\n\r\n")
                    sock.recv(1024)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            assert raw(server.url, "/config.json").endswith(b"{}")
    assert "Traceback" not in capsys.readouterr().err
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert 1 <= len(gone) <= 20 and all(r.exc_info is None for r in caplog.records)


def test_serve_cli_prints_the_address(tmp_path):
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "index.html").write_text("<p>hi</p>")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpt2onnx", "serve", str(folder), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving ") and "http://127.0.0.1:" in line, (line, proc.stderr.read())
        url = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        with urllib.request.urlopen(url) as response:
            assert response.read() == b"<p>hi</p>"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    result = subprocess.run(
        [sys.executable, "-m", "gpt2onnx", "serve", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1


def test_deploy_web_writes_a_self_contained_page(web_folder, checkpoint, tmp_path):
    folder = web_folder("int4")
    manifest = json.loads((folder / "gpt2onnx.json").read_text())
    assert set(manifest["deploy"]["targets"]) == {"transformers-js", "web"}  # the page loads the transformers.js layout
    lib = {p.name for p in (folder / "lib").iterdir()}
    assert {"transformers.min.js", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm"} <= lib
    html = (folder / "index.html").read_text()
    assert "cdn." not in html and "https://" not in html and "https://" not in (folder / "gpt2onnx-web.js").read_text()
    settings = page_settings(folder)
    assert settings["dtype"] == "q4" and settings["model_file"] == "onnx/model_q4.onnx"
    assert settings["name"] == folder.name and f"<title>{folder.name} ·" in html
    assert settings["transformers_js"] == "4.3.2" and settings["n_positions"] == 128
    assert "index.html" in manifest["files"]
    # the int4 web graph: standard ops for the embeddings, fp32 MatMulNBits (what the wasm kernels compute)
    from gpt2onnx.artifact.graph import load_graph

    assert settings["rewritten"] == {
        "GatherBlockQuantized → DequantizeLinear + Gather": 2,
        "MatMulNBits accuracy_level → 1 (fp32)": 9,
    }
    graph = load_graph(folder / "onnx" / "model_q4.onnx")
    assert not any(n.op_type == "GatherBlockQuantized" for n in graph.graph.node)
    levels = {
        a.i for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"
    }
    assert levels == {1}
    assert any(n.op_type == "GatherBlockQuantized" for n in load_graph(folder / "model.onnx").graph.node)
    # the page may load q4f16 too (?dtype=q4f16): the int4 graph in fp16, rewritten the same way
    q4f16 = settings["dtypes"]["q4f16"]
    assert (q4f16["file"], q4f16["f16"], settings["dtypes"]["q4"]["f16"]) == ("onnx/model_q4f16.onnx", True, False)
    assert q4f16["rewritten"] == settings["rewritten"]
    assert not any(n.op_type == "GatherBlockQuantized" for n in load_graph(folder / q4f16["file"]).graph.node)


def test_deploy_web_refuses_what_it_cannot_serve(tiny_export, tmp_path):
    with pytest.raises(ContractError, match="has no tokenizer.json or tokenizer_config.json"):
        deploy(tiny_export, "web", out=tmp_path / "a")
    with pytest.raises(BadInput, match="transformers.js is not installed in"):
        deploy(tiny_export, "web", out=tmp_path / "b", web_lib=tmp_path)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_deploy_web_cli(web_folder, tmp_path):
    from typer.testing import CliRunner

    from gpt2onnx.cli import app

    source = web_folder("fp32")
    result = CliRunner().invoke(app, ["deploy", str(source), "--target", "web", "-o", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "d" / "index.html").is_file() and (tmp_path / "d" / "onnx" / "model.onnx").is_file()
    assert "gpt2onnx serve" in result.output
    result = CliRunner().invoke(app, ["deploy", str(source), "--target", "triton", "-o", str(tmp_path / "e")])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "e" / "index.html").exists() and not (tmp_path / "e" / "lib").exists()


def test_bench_web_runs_the_browser_node_and_python_in_rounds_on_the_same_tokens(trained_export, tmp_path):
    """`gpt2onnx bench web` on the trained test model: deployed for the web, run in Chromium (wasm), Node and Python,
    each run's tokens checked equal; every figure a positive number, every run once a round."""
    need(CHROMIUM.is_file(), f"Chromium is not installed ({CHROMIUM} is absent; apt-get install chromium)")
    need_node_modules()
    out = tmp_path / "web.json"
    args = ["bench", "web", str(trained_export), "--threads", "1", "--new-tokens", "4", "--repeat", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "gpt2onnx", *args, "--warmup", "0", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["same_tokens"] is True
    rounds = report["rounds"]
    assert rounds["variants"] == ["Chromium wasm, 1 thread(s)", "Node, 1 thread(s)", "Python, 1 thread(s)"]
    for series in rounds["series"]:
        assert len(series["values"]) == 2 and all(v > 0 for v in series["values"]), series
