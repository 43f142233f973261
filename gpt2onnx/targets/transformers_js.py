"""transformers.js: the layout ``AutoModelForCausalLM.from_pretrained`` loads, local or from a web server.

    config.json             the folder's config, plus "transformers.js_config" (the dtype to load, external data)
    generation_config.json, tokenizer files (already in the folder)
    onnx/model.onnx         fp32;  onnx/model_fp16.onnx, onnx/model_quantized.onnx (int8), onnx/model_q4.onnx (int4)
    onnx/model_q4f16.onnx   from an int4 folder also: its graph with the float parts in fp16 (a precision's
                            transformers_js_derived: dtypes made from its file, written beside its own)

transformers.js picks the file by its dtype suffix, and the external data file by the model file's name
(``<file>_data``), so a renamed model with external data gets a new (small) graph file whose data location
names ``<file>_data``; the data itself is hard-linked.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import onnx

from gpt2onnx.artifact.contract import graph_io
from gpt2onnx.artifact.folder import CONFIG_FILE, MODEL_FILE, read_json_file
from gpt2onnx.artifact.graph import DATA_FILE_SUFFIX, external_data_files, load_graph, load_model, save_onnx
from gpt2onnx.capabilities import Need
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.files import link_or_copy
from gpt2onnx.precisions.all_precisions import PRECISIONS, precision_of
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE, cache_format_of
from gpt2onnx.targets.formats import json_text
from gpt2onnx.targets.target import Deployment, TargetSpec, Written

log = logging.getLogger(__name__)

SUBFOLDER = "onnx"
CONFIG_KEY = "transformers.js_config"


def dtype_for(precision: str) -> tuple[str, str]:
    """The transformers.js dtype and its file name for a folder's precision (its Precision.transformers_js)."""
    declared = PRECISIONS.get(precision)
    if declared is None or declared.transformers_js is None:
        loadable = ", ".join(p.short for p in PRECISIONS.values() if p.transformers_js)
        raise ContractError(f"transformers.js has no dtype for a {precision} model: export {loadable}")
    dtype, suffix = declared.transformers_js
    return dtype, f"model{suffix}.onnx"


def refuse_a_quantized_cache(graph: onnx.ModelProto, who: str) -> None:
    """A runtime that allocates the cache itself, in the model's float dtype, cannot feed an int8 one."""
    past = next((t for t in graph_io(graph)[0] if t.name.startswith("past_key_values.")), None)
    if past is not None and cache_format_of(past.dtype) is not None:
        raise ContractError(
            f"the model's K/V cache is {past.dtype} (--kv-cache), which {who} does not feed: deploy the float-cache"
            " folder"
        )


def write_transformers_js(folder: Path, out: Path, precision: str, *, upcast_attention: bool = False) -> list[str]:
    """Write the onnx/ layout into ``out`` (a staging copy of ``folder`` that already holds its config files);
    returns the files written, relative to ``out``."""
    dtype, name = dtype_for(precision)
    target = out / SUBFOLDER
    target.mkdir()
    graph = load_graph(folder / MODEL_FILE)
    refuse_a_quantized_cache(graph, "transformers.js")
    data_files = external_data_files(graph)
    if len(data_files) > 1:
        raise ContractError(
            f"'{folder / MODEL_FILE}' has {len(data_files)} external data files: transformers.js loads one"
        )
    written = [f"{SUBFOLDER}/{name}"]
    if data_files and name != MODEL_FILE:
        data_name = name + DATA_FILE_SUFFIX
        for init in graph.graph.initializer:
            for entry in init.external_data:
                if entry.key == "location":
                    entry.value = data_name
        onnx.save_model(graph, str(target / name))  # the graph only: its weights stay in the data file
        link_or_copy(folder / data_files[0], target / data_name)
        written.append(f"{SUBFOLDER}/{data_name}")
    else:
        link_or_copy(folder / MODEL_FILE, target / name)
        for data in data_files:
            link_or_copy(folder / data, target / data)
            written.append(f"{SUBFOLDER}/{data}")
    external = {name: 1} if data_files else {}
    for derived, files in write_derived(folder, target, precision, upcast_attention=upcast_attention):
        written += [f"{SUBFOLDER}/{f}" for f in files]
        external.update({derived: 1} if len(files) > 1 else {})
    config = read_json_file(out / CONFIG_FILE, "config")
    config[CONFIG_KEY] = {"dtype": dtype, **({"use_external_data_format": external} if external else {})}
    (out / CONFIG_FILE).unlink()  # a new file: never write through a link
    (out / CONFIG_FILE).write_text(json_text(config))
    return written + [CONFIG_FILE]


def derived_dtypes(precision: str) -> dict[str, str]:
    """The transformers.js dtypes the target makes from a folder of ``precision`` beside its own, by dtype: the
    file each loads (relative to onnx/)."""
    declared = PRECISIONS.get(precision)
    derived = declared.transformers_js_derived if declared is not None else ()
    return {dtype: f"model{suffix}.onnx" for dtype, suffix, _ in derived}


def write_derived(
    folder: Path, target: Path, precision: str, *, upcast_attention: bool = False
) -> list[tuple[str, list[str]]]:
    """Each derived dtype's graph made from the folder's model (weights and all) and written into ``target``:
    [(file name, the files written: the graph, and its external data where it passes protobuf's limit)]. A dtype
    the folder cannot be made into faithfully (fp16 attention scores of an architecture that computes them in
    fp32, in a graph whose attention op keeps them in its own dtype) is left out, saying why."""
    declared = PRECISIONS.get(precision)
    written = []
    for dtype, suffix, make in declared.transformers_js_derived if declared is not None else ():
        name = f"model{suffix}.onnx"
        try:  # external data is read from beside the file
            model = make(load_model(folder / MODEL_FILE), upcast_attention=upcast_attention)
        except BadInput as err:
            log.warning("transformers.js %s not written: %s", dtype, err)
            continue
        written.append((name, save_onnx(model, target / name, external_data=None)))
        log.info("transformers.js %s: %s", dtype, name)
    return written


def drop_config_key(staging: Path) -> None:
    """config.json without the transformers.js key a previous deploy added (it is written again when asked)."""
    path = staging / CONFIG_FILE
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if isinstance(config, dict) and CONFIG_KEY in config:
        del config[CONFIG_KEY]
        path.write_text(json_text(config))


def upcast_of(deployment: Deployment) -> bool:
    """Whether the deployed folder's architecture computes its attention scores in fp32 (its manifest says)."""
    architecture = deployment.source.manifest.architecture if deployment.source.manifest else None
    return bool(architecture and architecture.reorder_and_upcast_attn)


def _write(deployment: Deployment, options) -> Written:
    precision = precision_of(deployment.source.facts).name
    return Written(
        write_transformers_js(deployment.staging, deployment.staging, precision, upcast_attention=upcast_of(deployment))
    )


SPEC = TargetSpec(
    name="transformers-js",
    summary="transformers.js: onnx/model[_suffix].onnx and config.json, as AutoModelForCausalLM loads them",
    write=_write,
    paths=(SUBFOLDER,),
    tokenizer_json=True,
    aliases=("transformers.js", "transformersjs", "tjs"),
    undo=drop_config_key,
    # measured on the tiny model: transformers.js 4.3 feeds a growing past ("TensorScatter: update sequence_length
    # (3) exceeds max_sequence_length (0)" on a fixed-size buffer) and allocates a float cache itself
    requires=(
        Need("cache_grows", allowed={True}, why="runs a decode loop that feeds a growing past"),
        Need("kv_dtype", allowed={FLOAT_CACHE}, why="allocates a float K/V cache itself"),
        Need("transformers_js_dtype", refused={None}, why="loads fp32, fp16, q8 and q4 files (its dtypes)"),
        Need("data_files", allowed={0, 1}, why="loads one external data file"),
    ),
)
