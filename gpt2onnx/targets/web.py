"""The web page: a static page that generates text from the folder in the browser, with transformers.js.

    index.html              the page: a prompt, the text streamed in, tokens/s and the backend (wasm or WebGPU)
    gpt2onnx-web.js         its script (an ES module)
    lib/transformers.min.js, lib/ort-wasm-simd-threaded.asyncify.{mjs,wasm}, lib/LICENSE-*
                            transformers.js (it bundles onnxruntime-web's JavaScript) and onnxruntime-web's wasm
                            build, copied (hard-linked) from an npm install: the page fetches nothing from a CDN
    onnx/..., config.json   the transformers-js target's layout, which the page loads (written with it)

An int4 or int8 graph is rewritten for the browser, in a new graph file under onnx/ (the int4 weights are unchanged and
shared; the folder's own model.onnx is left as it is; onnxruntime and onnxruntime-node run the new file too):
- onnxruntime-web's wasm build has no kernel for com.microsoft's ``GatherBlockQuantized`` (the int4 embeddings):
  each becomes ``DequantizeLinear`` (opset 21, blocked int4: the same ``q * scale``) and ``Gather``;
- its ``MatMulNBits`` computes in fp32 whatever ``accuracy_level`` says (x86 onnxruntime quantizes the
  activations to int8 at level 4, and its greedy text then parts from the browser's on near ties): the graph
  says level 1 (fp32), what the browser computes, so that onnxruntime on that file writes the browser's text
  (and WebGPU takes its fp32 path, not its int8 dot-product one).

The folder is self-contained: any static server works, `gpt2onnx serve FOLDER` adds the cross-origin isolation
headers that the wasm thread pool needs. The library files come from an npm install of @huggingface/transformers
(``web_lib`` / ``--web-lib``, else ``$GPT2ONNX_WEB_LIB``, else this repository's tests/js/node_modules, else
./node_modules). Its bundled onnxruntime-web JavaScript must be the version of the wasm files, so the version
transformers.js depends on is checked against the onnxruntime-web package found beside it.

The page's automation contract: ``index.html?prompt=TEXT&max_new_tokens=N`` starts greedy generation at once; the
new text goes into ``#output``, and ``document.body.dataset.done`` becomes "true" ("error", with the message in
``#error``, when it fails). ``&backend=wasm|webgpu`` (default: WebGPU where the browser grants an adapter) and
``&threads=N`` choose how it runs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from gpt2onnx.artifact.contract import graph_io
from gpt2onnx.artifact.folder import CONFIG_FILE, read_json_file
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.files import link_or_copy, read_regular_text
from gpt2onnx.precisions.all_precisions import precision_of
from gpt2onnx.precisions.prompt_path import without_prompt_path
from gpt2onnx.targets import transformers_js
from gpt2onnx.targets.formats import html_text, script_json
from gpt2onnx.targets.target import Deployment, TargetSpec, Written

PAGE = "index.html"
SCRIPT = "gpt2onnx-web.js"
LIB = "lib"
PATHS = (PAGE, SCRIPT, LIB)  # what the target adds to a folder (dropped when it is deployed again)
TESTED_TRANSFORMERS_JS = "4.3.2"
# transformers.js picks the asyncify build everywhere but on Safari < 26 without WebGPU; it runs wasm and WebGPU
WASM_FILES = ("ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
# the tokenizer transformers.js reads (it cannot build one from vocab.json + merges.txt)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_PACKAGE_JSON = 1 << 20
_REPO_NODE_MODULES = Path(__file__).resolve().parents[2] / "tests" / "js" / "node_modules"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WebLibrary:
    """An npm install of transformers.js and the onnxruntime-web wasm build that matches it."""

    transformers_js: Path  # node_modules/@huggingface/transformers
    onnxruntime_web: Path  # the onnxruntime-web package its bundle was built with
    transformers_js_version: str
    onnxruntime_web_version: str

    def files(self) -> dict[str, Path]:
        """lib/ name → file in the npm install."""
        files = {"transformers.min.js": self.transformers_js / "dist" / "transformers.min.js"}
        files.update({name: self.onnxruntime_web / "dist" / name for name in WASM_FILES})
        for name, package in (("transformers.js", self.transformers_js), ("onnxruntime-web", self.onnxruntime_web)):
            if (package / "LICENSE").is_file():
                files[f"LICENSE-{name}"] = package / "LICENSE"
        return files


def _package_json(folder: Path) -> dict | None:
    """An npm package's package.json, or None where there is none. Read as a regular file only (a FIFO in an
    npm folder given with --web-lib would block an ordinary open forever)."""
    path = folder / "package.json"
    if not path.exists():
        return None
    try:
        data = json.loads(read_regular_text(path, "package.json", limit=MAX_PACKAGE_JSON))
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def find_web_library(web_lib: str | Path | None = None) -> WebLibrary:
    """The transformers.js install the page is built from: ``web_lib`` (a node_modules folder, a folder holding
    one, or the @huggingface/transformers package itself), else $GPT2ONNX_WEB_LIB, else this repository's
    tests/js/node_modules, else ./node_modules."""
    given = web_lib if web_lib is not None else os.environ.get("GPT2ONNX_WEB_LIB")
    candidates = [Path(given)] if given else [_REPO_NODE_MODULES, Path.cwd() / "node_modules"]
    install = "npm install @huggingface/transformers@" + TESTED_TRANSFORMERS_JS
    for base in candidates:
        for package in (
            base,
            base / "@huggingface" / "transformers",
            base / "node_modules" / "@huggingface" / "transformers",
        ):
            meta = _package_json(package)
            if meta and meta.get("name") == "@huggingface/transformers":
                return _checked_library(package, meta, install)
    where = f"'{given}'" if given else " or ".join(f"'{c}'" for c in candidates)
    raise BadInput(
        f"transformers.js is not installed in {where}: {install} there (scripts/setup.sh does it in tests/js),"
        " or give its node_modules with --web-lib"
    )


def _checked_library(package: Path, meta: dict, install: str) -> WebLibrary:
    version = str(meta.get("version", "?"))
    if version.split(".")[0] != TESTED_TRANSFORMERS_JS.split(".")[0]:
        raise BadInput(f"'{package}' is transformers.js {version}; the page is written for 4.x: {install}")
    if version != TESTED_TRANSFORMERS_JS:
        log.warning("transformers.js %s in '%s'; the page is tested with %s", version, package, TESTED_TRANSFORMERS_JS)
    wanted = str(meta.get("dependencies", {}).get("onnxruntime-web", ""))
    # npm puts a dependency beside the package, or inside it when versions clash
    for ort in (package / "node_modules" / "onnxruntime-web", package.parents[1] / "onnxruntime-web"):
        ort_meta = _package_json(ort)
        if ort_meta is None:
            continue
        found = str(ort_meta.get("version", "?"))
        if wanted and found != wanted:
            raise BadInput(
                f"'{ort}' is onnxruntime-web {found}, but transformers.js {version} bundles {wanted}: the wasm"
                f" files must match it ({install} with its own dependencies)"
            )
        library = WebLibrary(package, ort, version, found)
        missing = [str(p) for p in library.files().values() if not p.is_file()]
        if missing:
            raise BadInput(f"the npm install is incomplete, {', '.join(missing)} missing: {install} again")
        return library
    raise BadInput(f"onnxruntime-web is not installed beside '{package}': {install} (with its dependencies)")


def _dequantized_8bit_table(node, attrs: dict, inits: dict) -> np.ndarray | None:
    """The float table an 8-bit GatherBlockQuantized reads ((q − zero point) × scale, blocks along each row), or
    None where the node is not one (int4 data, another layout). Blocked uint8 DequantizeLinear would need opset 21,
    which an int8 graph does not have."""
    inputs = [i for i in node.input if i]
    if attrs.get("bits") != 8 or len(inputs) != 4 or attrs.get("gather_axis", 0) != 0:
        return None
    if attrs.get("quantize_axis", 1) != 1 or not all(name in inits for name in inputs[:1] + inputs[2:]):
        return None
    data = numpy_helper.to_array(inits[inputs[0]])
    stored = numpy_helper.to_array(inits[inputs[2]])  # the table comes out in the scales' type (fp16 in q4f16)
    scales = stored.astype(np.float32)
    zero_points = numpy_helper.to_array(inits[inputs[3]]).astype(np.float32)
    if data.dtype != np.uint8 or data.ndim != 2 or scales.shape != zero_points.shape or scales.ndim != 2:
        return None
    block = np.arange(data.shape[1]) // int(attrs.get("block_size", 128))
    if block[-1] >= scales.shape[1]:
        return None
    return ((data.astype(np.float32) - zero_points[:, block]) * scales[:, block]).astype(stored.dtype)


def _own_table(model: onnx.ModelProto, node, attrs: dict, inits: dict):
    """A GatherBlockQuantized that reads the logits projection's MatMulNBits weights ([vocab, blocks, bytes],
    quantize_axis 2) rewritten to read a table of its own in the layout the rewrite below takes: int4 data and
    [vocab, blocks] scales (4 bits), or uint8 data with zero points (8 bits); the same values. The browser's copy
    holds the table twice, as every file did before it was shared."""
    data = numpy_helper.to_array(inits[node.input[0]])
    scales = numpy_helper.to_array(inits[node.input[2]])  # float32, or float16 in a q4f16 graph: kept as they are
    bits, block = int(attrs.get("bits", 4)), int(attrs["block_size"])
    head = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and n.input[1] == node.input[0])
    width = next(onnx.helper.get_attribute_value(a) for a in head.attribute if a.name == "K")
    rows = data.shape[0]
    if bits == 4:
        values = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(rows, -1)[:, :width].astype(np.int8) - 8
    else:
        values = data.reshape(rows, -1)[:, :width]
    name = f"{node.input[0]}_table"
    if bits == 4:
        table = onnx.helper.make_tensor(name, onnx.TensorProto.INT4, [rows, width], values.flatten().tolist())
        extra = [table, numpy_helper.from_array(scales.reshape(rows, -1), f"{name}_scales")]
        inputs = [name, node.input[1], f"{name}_scales"]
    else:
        extra = [
            numpy_helper.from_array(values.astype(np.uint8), name),
            numpy_helper.from_array(scales.reshape(rows, -1), f"{name}_scales"),
            numpy_helper.from_array(np.full((rows, scales.size // rows), 128, np.uint8), f"{name}_zero_points"),
        ]
        inputs = [name, node.input[1], f"{name}_scales", f"{name}_zero_points"]
    model.graph.initializer.extend(extra)
    inits.update({t.name: t for t in extra})
    own = onnx.helper.make_node(
        "GatherBlockQuantized",
        inputs,
        list(node.output),
        name=node.name,
        domain="com.microsoft",
        bits=bits,
        block_size=block,
        gather_axis=0,
        quantize_axis=1,
    )
    return own


def without_gather_block_quantized(model: onnx.ModelProto) -> int:
    """Rewrite every GatherBlockQuantized (int4 data, no zero points) into DequantizeLinear + Gather, in place;
    returns how many. Anything else it cannot express in standard ops is refused, naming the node."""
    inits = {init.name: init for init in model.graph.initializer}
    nodes, count = [], 0
    for node in model.graph.node:
        if node.op_type != "GatherBlockQuantized" or node.domain != "com.microsoft":
            nodes.append(node)
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("quantize_axis", 1) == 2:  # the tied embedding stored once (the head's MatMulNBits weights)
            node = _own_table(model, node, attrs, inits)
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        data = inits.get(node.input[0])
        table = _dequantized_8bit_table(node, attrs, inits)
        if table is not None:  # 8-bit embeddings (the int8 recipe): an fp32 table, read by a plain Gather
            name = f"{node.input[0]}_dequantized"
            model.graph.initializer.append(numpy_helper.from_array(table, name))
            nodes.append(onnx.helper.make_node("Gather", [name, node.input[1]], list(node.output), name=node.name))
            count += 1
            continue
        if (
            len([i for i in node.input if i]) != 3
            or data is None
            or data.data_type != onnx.TensorProto.INT4
            or attrs.get("bits", 4) != 4
            or attrs.get("gather_axis", 0) != 0
        ):
            raise ContractError(
                f"node '{node.name}' (GatherBlockQuantized) has zero points, non-int4 data or another gather axis:"
                " onnxruntime-web has no kernel for it and the web target cannot rewrite it; export the embeddings"
                " unquantized"
            )
        dequantized = f"{node.name}/dequantized"
        nodes.append(
            onnx.helper.make_node(
                "DequantizeLinear",
                [node.input[0], node.input[2]],
                [dequantized],
                name=f"{node.name}/DequantizeLinear",
                axis=attrs.get("quantize_axis", 1),
                block_size=attrs.get("block_size", 128),
            )
        )
        nodes.append(
            onnx.helper.make_node("Gather", [dequantized, node.input[1]], list(node.output), name=node.name, axis=0)
        )
        count += 1
    if count:
        blocked = any(n.op_type == "DequantizeLinear" and n.name.endswith("/DequantizeLinear") for n in nodes)
        if blocked and max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0) < 21:
            raise ContractError("blocked int4 DequantizeLinear needs opset 21: the graph has an older one")
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        used = {name for node in nodes for name in node.input}
        kept = [init for init in model.graph.initializer if init.name in used]  # the 8-bit tables' inputs go
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    return count


def with_fp32_matmul_nbits(model: onnx.ModelProto) -> int:
    """Set every MatMulNBits to accuracy_level 1 (fp32 activations), in place; returns how many changed."""
    changed = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        levels = [a for a in node.attribute if a.name == "accuracy_level"]
        if levels and levels[0].i == 1:
            continue
        for a in levels:
            node.attribute.remove(a)
        node.attribute.append(onnx.helper.make_attribute("accuracy_level", 1))
        changed += 1
    return changed


def _is_past(name: str) -> bool:
    return name.startswith("past_key_values.")


def _rewrite_for_the_browser(graph_file: Path) -> dict[str, int]:
    """The graph file rewritten in place for onnxruntime-web (a new file, never written through a hard link; its
    weights stay where they were); returns what was rewritten, by kind."""
    graph = load_graph(graph_file)
    rewritten = {
        "int4 prompt path → its decode body": int(without_prompt_path(graph)),
        "GatherBlockQuantized → DequantizeLinear + Gather": without_gather_block_quantized(graph),
        "MatMulNBits accuracy_level → 1 (fp32)": with_fp32_matmul_nbits(graph),
    }
    rewritten = {what: n for what, n in rewritten.items() if n}
    if rewritten:
        graph_file.unlink()  # a hard link to the folder's model: write a new file, never through the link
        onnx.save_model(graph, str(graph_file))  # the graph only: its weights stay where they were
        log.info("web graph %s: %s", graph_file.name, ", ".join(f"{n} {what}" for what, n in rewritten.items()))
    return rewritten


def settings(folder: Path, precision: str, library: WebLibrary, *, name: str) -> dict:
    """What the page needs to know about the folder (written into index.html); ``name`` is its title."""
    config = read_json_file(folder / CONFIG_FILE, "config")
    dtype, model_file = transformers_js.dtype_for(precision)
    tjs = config.get(transformers_js.CONFIG_KEY, {})
    written = {
        d: f
        for d, f in transformers_js.derived_dtypes(precision).items()
        if (folder / transformers_js.SUBFOLDER / f).is_file()
    }
    files = {dtype: model_file, **written}
    dtypes = {}
    for choice, file in files.items():  # what the page may load (?dtype=): the file, and whether it computes in fp16
        past = next(t for t in graph_io(load_graph(folder / transformers_js.SUBFOLDER / file))[0] if _is_past(t.name))
        dtypes[choice] = {"file": f"{transformers_js.SUBFOLDER}/{file}", "f16": past.dtype == "float16"}
    return {
        "name": name,
        "precision": precision,
        "dtype": dtype,
        "model_file": f"{transformers_js.SUBFOLDER}/{model_file}",
        "dtypes": dtypes,
        "external_data": bool(tjs.get("use_external_data_format")),
        "n_positions": config.get("n_positions"),
        "transformers_js": library.transformers_js_version,
        "onnxruntime_web": library.onnxruntime_web_version,
        "wasm": {"mjs": f"{LIB}/{WASM_FILES[0]}", "wasm": f"{LIB}/{WASM_FILES[1]}"},
    }


class _PageWriter(HTMLParser):
    """index.html re-emitted element by element from its parse, with the title's and the heading's text and the
    settings block's content written by a structured writer: the title escaped as HTML text, the settings as
    JSON. Nothing is found or replaced by searching the text, so no value (a folder named 'x"<b>' or
    '</script>') can end up outside its element."""

    def __init__(self, title: str, settings_json: str):
        super().__init__(convert_charrefs=False)
        self.fill = {"title": None, "h1": None, "script": None}
        self.title, self.settings_json = title, settings_json
        self.out: list[str] = []
        self.filling: str | None = None

    def handle_starttag(self, tag, attrs):
        self.out.append(self.get_starttag_text())
        values = dict(attrs)
        if tag == "title":
            self.filling = html_text(f"{self.title} · gpt2onnx in the browser")
        elif tag == "h1" and values.get("id") == "title":
            self.filling = html_text(self.title)
        elif tag == "script" and values.get("id") == "gpt2onnx-settings":
            self.filling = self.settings_json
        if self.filling is not None:
            self.out.append(self.filling)

    def handle_endtag(self, tag):
        self.filling = None
        self.out.append(f"</{tag}>")

    def handle_data(self, data):
        if self.filling is None:  # the template's own text (a filled element's is replaced as a whole)
            self.out.append(data)

    def handle_startendtag(self, tag, attrs):
        self.out.append(self.get_starttag_text())

    def handle_comment(self, data):
        self.out.append(f"<!--{data}-->")

    def handle_decl(self, decl):
        self.out.append(f"<!{decl}>")

    def handle_entityref(self, name):
        self.out.append(f"&{name};")

    def handle_charref(self, name):
        self.out.append(f"&#{name};")


def render_page(page_settings: dict) -> str:
    """index.html with the settings inlined as JSON data (never code: every '<' is written \\u003c, so no
    '</script>' can end the block early) and the folder's name as the title, escaped as HTML text."""
    template = resources.files("gpt2onnx.targets").joinpath("web_page", PAGE).read_text()
    data = script_json(page_settings)
    writer = _PageWriter(str(page_settings["name"]), f"\n{data}\n")
    writer.feed(template)
    writer.close()
    return "".join(writer.out)


def write_web(
    folder: Path, out: Path, precision: str, *, name: str | None = None, web_lib: str | Path | None = None
) -> list[str]:
    """Write the page into ``out``, a staging copy of ``folder`` with the transformers-js layout already written;
    ``name``: the page's title (the deployed folder's name). Returns the files written, relative to ``out``."""
    library = find_web_library(web_lib)
    missing = [name for name in TOKENIZER_FILES if not (out / name).is_file()]
    if missing:
        raise ContractError(
            f"'{folder}' has no {' or '.join(missing)}: the page tokenizes in the browser with transformers.js,"
            " which reads tokenizer.json; export from a checkpoint folder with its tokenizer files"
            " (GPT2TokenizerFast's save_pretrained writes both)"
        )
    if not (out / transformers_js.SUBFOLDER).is_dir():
        raise BadInput("the web target needs the transformers-js target: deploy with --target web (it adds both)")
    written = [PAGE, SCRIPT]
    page_settings = settings(out, precision, library, name=name or folder.name)
    for choice in page_settings["dtypes"].values():  # every file the page may load, the default first
        rewritten = _rewrite_for_the_browser(out / choice["file"])
        if rewritten:
            written.append(choice["file"])
        choice["rewritten"] = rewritten
    page_settings["rewritten"] = page_settings["dtypes"][page_settings["dtype"]]["rewritten"]
    (out / PAGE).write_text(render_page(page_settings))
    (out / SCRIPT).write_text(resources.files("gpt2onnx.targets").joinpath("web_page", SCRIPT).read_text())
    (out / LIB).mkdir()
    for name, source in library.files().items():
        link_or_copy(source, out / LIB / name)
        written.append(f"{LIB}/{name}")
    log.info("web page: transformers.js %s from '%s'", library.transformers_js_version, library.transformers_js)
    return written


@dataclass(frozen=True)
class WebOptions:
    """deploy's option for the page: the npm install its library files are copied from (see find_web_library)."""

    web_lib: str | Path | None = None


def _write(deployment: Deployment, options: WebOptions) -> Written:
    source = deployment.source
    files = write_web(
        source.folder,
        deployment.staging,
        precision_of(source.facts).name,
        name=deployment.name,
        web_lib=options.web_lib,
    )
    return Written(files)


SPEC = TargetSpec(
    name="web",
    summary="the browser: a page that generates with transformers.js (onnxruntime-web), served by gpt2onnx serve",
    write=_write,
    paths=PATHS,
    options=WebOptions,
    needs=("transformers-js",),
)
