"""ORT Mobile: the folder as onnxruntime's Android and iOS packages load it, and what a reduced build of them needs.

    mobile/model.ort                            the model in the ORT format (onnxruntime's flatbuffers file),
                                                converted by onnxruntime's own tool at the basic optimization level
    mobile/required_operators.config            the ops it runs: build.py --include_ops_by_config takes it
    mobile/required_operators_and_types.config  the same with the types each op sees (with
                                                --enable_reduced_operator_type_support: a smaller build still)
    mobile/usability.json, usability.md         onnxruntime's mobile usability checker: which nodes NNAPI and CoreML
                                                could take, in how many partitions
    mobile/README.md                            what is here and how to build onnxruntime for it
    mobile/tokenizer.json, config.json, ...     the tokenizer and generation files: mobile/ is what an app bundles

Why the basic level, fixed: basic optimizations are onnxruntime's provider-independent rewrites (constant folding,
redundant nodes removed) and write ONNX ops only; extended and all fuse into com.microsoft ops assigned to the CPU
provider (on the trained fixture's plain fp32 graph: FusedMatMul and FastGelu), which NNAPI and CoreML cannot take
and which a reduced build must then include; 'all' adds layout rewrites for the converting machine. Onnxruntime's
usability checker optimizes to basic before it looks for the same reason. The runtime style (optimizations saved to
replay on the phone) is left out: replaying needs a session option set on every load, for graphs whose ops the
compiling providers do not take anyway (usability.json).

The deploy reads back what it wrote: the ORT file is loaded and run on a prompt step beside the folder's model.onnx
at the same level (one thread each, so both run the same kernels in the same order) and must give the same
outputs.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from gpt2onnx.artifact.folder import COMPANION_FILES, CONFIG_FILE, MODEL_FILE
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.capabilities import Need
from gpt2onnx.errors import ContractError
from gpt2onnx.layouts.layout import PAST_BUFFER
from gpt2onnx.records import Record, field
from gpt2onnx.targets.formats import json_text
from gpt2onnx.targets.target import Deployment, TargetSpec, Written

log = logging.getLogger(__name__)

SUBFOLDER = "mobile"
ORT_FILE = "model.ort"
OPS_CONFIG = "required_operators.config"
TYPES_CONFIG = "required_operators_and_types.config"
USABILITY_JSON, USABILITY_MD, README = "usability.json", "usability.md", "README.md"
LEVEL = "basic"  # onnxruntime's optimization level baked into the ORT file (the module's docstring says why)
READ_BACK_TOKENS = (0, 1, 2, 3)  # the prompt step run on both files
# the same optimized graph and kernels on one thread each: equal outputs; the bound only absorbs a kernel that picks
# its blocking from the session (none seen: measured 0 on the trained fixture's fp32, ort-profile and int4 files)
READ_BACK_TOLERANCE = 1e-6
EPS = {  # onnxruntime's tables of the ops each provider takes (onnxruntime/tools/mobile_helpers/*.md)
    "NNAPI": None,
    "CoreML MLProgram": "coreml_supported_mlprogram_ops.md",
    "CoreML NeuralNetwork": "coreml_supported_neuralnetwork_ops.md",
}

# onnxruntime's reduced mobile package (onnxruntime-mobile for Android, onnxruntime-mobile-c/-objc for iOS; last
# published 1.18.0): the ops of tools/ci_build/github/android/mobile_package.required_operators.config, by domain and
# the op versions it names. Since 1.19 the mobile packages are onnxruntime's full builds (every op and type of the
# ONNX and com.microsoft domains, ONNX and ORT format): onnxruntime-android, onnxruntime-c, onnxruntime-objc.
_TF2ONNX_OPS = (
    "Abs Add And ArgMax ArgMin AveragePool Cast Ceil Clip Concat ConstantOfShape Conv ConvTranspose Cos CumSum"
    " DepthToSpace DequantizeLinear Div DynamicQuantizeLinear Elu Equal Exp Expand Flatten Floor Gather GatherND Gemm"
    " Greater GreaterOrEqual Identity If LRN LeakyRelu Less LessOrEqual Log LogSoftmax Loop MatMul Max MaxPool Mean"
    " Min Mul Neg NonMaxSuppression NonZero Not Or PRelu Pad Pow QuantizeLinear Range Reciprocal ReduceMax ReduceMean"
    " ReduceMin ReduceProd ReduceSum Relu Reshape Resize ReverseSequence Round ScatterND Shape Sigmoid Sin Size Slice"
    " Softmax SpaceToDepth Split Sqrt Squeeze Sub Sum Tanh ThresholdedRelu Tile TopK Transpose Unique Unsqueeze Where"
    " Erf GlobalAveragePool InstanceNormalization MatMulInteger QLinearConv QLinearMatMul Scan"
)
REDUCED_PACKAGE = "onnxruntime-mobile 1.18"
REDUCED_PACKAGE_OPS: dict[str, dict[str, tuple[int, ...]]] = {
    "ai.onnx": {**{op: (12, 13) for op in _TF2ONNX_OPS.split()}, "LayerNormalization": (1,)},
    "com.microsoft": {
        op: (1,)
        for op in (
            "BiasGelu DynamicQuantizeMatMul FusedConv FusedGemm FusedMatMul Gelu MatMulIntegerToFloat NhwcMaxPool"
            " QLinearAdd QLinearAveragePool QLinearConv QLinearGlobalAveragePool QLinearMul QLinearSigmoid"
            " SkipLayerNormalization QLinearLeakyRelu"
        ).split()
    },
}
FULL_PACKAGES = "onnxruntime-android, onnxruntime-c, onnxruntime-objc"


@dataclass(frozen=True)
class Usability(Record):
    """One provider's estimate by onnxruntime's checker: how many nodes it could take, in how many partitions, and
    its verdict (YES, MAYBE, NO), for the graph as exported (dynamic shapes) and with every shape fixed."""

    provider: str
    nodes: int
    supported: int
    partitions: int
    suitability: str
    unsupported_ops: tuple[str, ...]
    dynamic_shape_nodes: int  # nodes refused only because an input's shape is dynamic
    fixed_supported: int
    fixed_partitions: int
    fixed_suitability: str
    caveats: tuple[str, ...]
    # the checker's own words (not written)
    analysis: str = field(default="", compare=False, omit=lambda usability: True)

    def line(self) -> str:
        parts = f"{self.partitions} partition{'s' if self.partitions != 1 else ''}"
        return f"{self.provider} {self.supported}/{self.nodes} nodes in {parts} ({self.suitability})"


# -- conversion -----------------------------------------------------------------------------------------------------
_ENV_LOCK = threading.Lock()  # onnxruntime's converter reads its level from the environment


def convert(model: Path, work: Path) -> tuple[Path, Path]:
    """``model`` (an .onnx file) converted by onnxruntime's convert_onnx_models_to_ort into ``work`` at the basic level,
    fixed style; returns the ORT file and the ONNX file of the same optimized graph (the usability checker reads it)."""
    from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    logging.getLogger("ort_format_model.utils").setLevel(logging.WARNING)  # its logger is set to DEBUG
    printed = io.StringIO()
    key = "ORT_CONVERT_ONNX_MODELS_TO_ORT_OPTIMIZATION_LEVEL"
    with _ENV_LOCK, contextlib.redirect_stdout(printed):  # the tool prints its progress
        before = os.environ.get(key)
        os.environ[key] = LEVEL
        try:
            convert_onnx_models_to_ort(
                model,
                output_dir=work,
                optimization_styles=[OptimizationStyle.Fixed],
                target_platform="arm",
                save_optimized_onnx_model=True,
            )
        except Exception as err:  # onnxruntime raises its own types (Fail, InvalidGraph, ...)
            raise ContractError(f"onnxruntime could not convert '{model}' to the ORT format: {err}") from err
        finally:
            os.environ.pop(key) if before is None else os.environ.__setitem__(key, before)
    log.debug("convert_onnx_models_to_ort: %s", printed.getvalue().strip())
    stem = model.stem
    return work / f"{stem}.{LEVEL}.ort", work / f"{stem}.{LEVEL}.optimized.onnx"


def write_configs(ort_file: Path, target: Path) -> None:
    """The reduced-build configurations of ``ort_file`` into ``target`` (onnxruntime's create_config_from_models),
    naming the file by its name in the folder rather than the path it was made at."""
    from onnxruntime.tools.ort_format_model import create_config_from_models

    for name, types in ((OPS_CONFIG, False), (TYPES_CONFIG, True)):
        create_config_from_models([ort_file], target / name, enable_type_reduction=types)
        lines = (target / name).read_text().splitlines()
        (target / name).write_text(
            "\n".join(f"# - {SUBFOLDER}/{ORT_FILE}" if line.startswith("# - ") else line for line in lines) + "\n"
        )


def config_ops(path: Path) -> dict[str, dict[int, set[str]]]:
    """A reduced-build configuration's ops: domain → op version → op types (onnxruntime's own parser)."""
    from onnxruntime.tools.reduced_build_config_parser import parse_config

    return parse_config(str(path))[0]


def _since(domain: str, op: str, version: int) -> int:
    """The version of ``op`` that a configuration's ``version`` names (an ONNX op keeps its number until it changes)."""
    try:
        return onnx.defs.get_schema(op, version, "" if domain == "ai.onnx" else domain).since_version
    except onnx.defs.SchemaError:
        return version  # not an ONNX schema (com.microsoft, onnxruntime's internal ops): the number itself


_FLOAT_TYPES = ("MLFloat16", "BFloat16")  # the reduced package's types are float, int8_t and uint8_t


def missing_from_reduced_package(ops: dict[str, dict[int, set[str]]], types_config: str = "") -> list[str]:
    """The ops (domain:op:version) that the reduced onnxruntime-mobile package has no kernel for, and the float types
    it was built without that ``types_config`` (a required_operators_and_types.config's text) names."""
    missing = [f"type:{name}" for name in _FLOAT_TYPES if f'"{name}"' in types_config]
    for domain, versions in sorted(ops.items()):
        for version, names in sorted(versions.items()):
            for op in sorted(names):
                has = REDUCED_PACKAGE_OPS.get(domain, {}).get(op, ())
                if not any(_since(domain, op, v) == version for v in has):
                    missing.append(f"{domain}:{op}:{version}")
    return missing


# -- onnxruntime's mobile usability checker ---------------------------------------------------------------------------
def usability(optimized: Path) -> tuple[list[Usability], list[str]]:
    """onnxruntime's usability checker (mobile_helpers.usability_checker) on the optimized graph: per provider, the
    partitions as exported and with fixed shapes; and the graph inputs whose shapes are dynamic."""
    from onnxruntime.tools.mobile_helpers import usability_checker as checker
    from onnxruntime.tools.onnx_model_utils import ModelProtoWithShapeInfo

    model = ModelProtoWithShapeInfo(optimized).model_with_shape_info
    dynamic, _ = checker.check_shapes(model.graph)
    results = []
    for provider, table in EPS.items():

        def check(fixed: bool, table=table):
            if table is None:
                return checker.check_nnapi_partitions(model, require_fixed_input_sizes=fixed)
            return checker.check_coreml_partitions(model, require_fixed_input_sizes=fixed, config_filename=table)

        exported, fixed = check(True), check(False)
        results.append(
            Usability(
                provider=provider,
                nodes=exported.num_nodes,
                supported=exported.num_supported_nodes,
                partitions=exported.num_partitions,
                suitability=exported.suitability().name,
                unsupported_ops=tuple(sorted(exported.unsupported_ops)),
                dynamic_shape_nodes=exported.nodes_unsupported_due_to_dynamic_input,
                fixed_supported=fixed.num_supported_nodes,
                fixed_partitions=fixed.num_partitions,
                fixed_suitability=fixed.suitability().name,
                caveats=tuple(exported.supported_ops_checker.get_caveats()),
                analysis=_analysis(exported, provider),
            )
        )
    return results, [value.name for value in dynamic]


def _analysis(info, provider: str) -> str:
    """The checker's own analysis of one provider (its print_analysis), as text."""
    captured = io.StringIO()
    logger = logging.getLogger(f"{__name__}.checker")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(captured)
    logger.addHandler(handler)
    try:
        info.print_analysis(logger, provider)
    finally:
        logger.removeHandler(handler)
    return captured.getvalue().strip()


# -- reading back -----------------------------------------------------------------------------------------------------
def prompt_feed(graph: onnx.ModelProto, tokens=READ_BACK_TOKENS) -> dict[str, np.ndarray] | None:
    """A prompt step for ``graph``'s inputs: the tokens, a full mask, positions from 0, empty past tensors (a buffer
    layout's as long as the tokens); None where the graph takes an input this does not know how to fill."""
    ids = np.asarray(tokens, np.int64)[None]
    feed = {}
    for value in graph.graph.input:
        tensor = value.type.tensor_type
        if value.name == "input_ids":
            feed[value.name] = ids
        elif value.name == "attention_mask":
            feed[value.name] = np.ones_like(ids)
        elif value.name == "position_ids":
            feed[value.name] = np.arange(ids.shape[1], dtype=np.int64)[None]
        elif value.name.startswith("past_key_values.") and len(tensor.shape.dim) == 4:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
            shape = [1 if i == 0 else (d or 0) for i, d in enumerate(dims)]
            if tensor.shape.dim[2].dim_param == PAST_BUFFER:
                shape[2] = ids.shape[1]
            feed[value.name] = np.zeros(shape, onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        else:
            return None
    return feed


def _session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def read_back(model: Path, ort_file: Path) -> float | None:
    """Load ``ort_file`` and run a prompt step on it and on ``model`` (the ONNX file it was made from): the largest
    difference of any output (None where the graph's inputs are not ones this can fill: loaded only)."""
    try:
        converted = _session(ort_file)
    except Exception as err:  # onnxruntime's own exception types
        raise ContractError(f"onnxruntime cannot load the ORT file it wrote ({err})") from err
    source = _session(model)
    if [(v.name, v.type) for v in converted.get_inputs()] != [(v.name, v.type) for v in source.get_inputs()]:
        raise ContractError(f"'{ort_file.name}' takes other inputs than '{model.name}'")
    feed = prompt_feed(load_graph(model))
    if feed is None:
        log.warning("mobile: %s loaded; its inputs are not all known here, so no step was compared", ORT_FILE)
        return None
    names = [o.name for o in source.get_outputs()]
    worst = 0.0
    for name, a, b in zip(names, converted.run(names, feed), source.run(names, feed)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            raise ContractError(f"{ORT_FILE} gives {name} of shape {a.shape}, {MODEL_FILE} {b.shape}")
        worst = max(worst, float(np.abs(a - b).max(initial=0.0)))
    if not worst <= READ_BACK_TOLERANCE:
        raise ContractError(
            f"{ORT_FILE} computes other outputs than {MODEL_FILE} (max |Δ| {worst:.3g} > {READ_BACK_TOLERANCE}):"
            " the conversion changed the model"
        )
    return worst


# -- the files --------------------------------------------------------------------------------------------------------
def _markdown(results: list[Usability], dynamic: list[str]) -> str:
    rows = [
        "# onnxruntime's mobile usability checker",
        "",
        f"Graph: {ORT_FILE}'s ({LEVEL} optimizations). Inputs with dynamic shapes: {', '.join(dynamic) or 'none'}.",
        "XNNPACK: not checked (the checker has no table for it).",
        "",
        "| provider | nodes it could take | partitions | verdict | with every shape fixed | unsupported ops |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.provider} | {r.supported} of {r.nodes} | {r.partitions} | {r.suitability} |"
            f" {r.fixed_supported} in {r.fixed_partitions} partitions ({r.fixed_suitability}) |"
            f" {', '.join(r.unsupported_ops) or 'none'} |"
        )
    for r in results:
        rows += ["", f"## {r.provider}", "", "```", r.analysis, "```"]
    return "\n".join(rows) + "\n"


def _readme(record: dict) -> str:
    missing = record["reduced_package_lacks"]
    return "\n".join(
        [
            "# ORT Mobile",
            "",
            f"Written by gpt2onnx deploy --target mobile with onnxruntime {record['onnxruntime']}.",
            "",
            f"- `{ORT_FILE}`: the model in the ORT format ({LEVEL} optimizations, fixed). Load it with an",
            f"  onnxruntime session as any model ({FULL_PACKAGES}: every op).",
            f"- `{OPS_CONFIG}`, `{TYPES_CONFIG}`: the ops (and types) it runs, for a reduced build:",
            "  `./build.sh --config MinSizeRel --minimal_build --include_ops_by_config"
            f" {TYPES_CONFIG} --enable_reduced_operator_type_support --android ...` (or `--ios ...`).",
            f"- `{USABILITY_JSON}`, `{USABILITY_MD}`: onnxruntime's usability checker (NNAPI, CoreML).",
            "- the tokenizer and generation files of the exported folder.",
            "",
            f"{REDUCED_PACKAGE} (the reduced package) lacks: {', '.join(missing) or 'nothing'}.",
            "",
        ]
    )


def write_mobile(folder: Path, out: Path) -> tuple[list[str], dict]:
    """Write mobile/ into ``out`` (a staging copy of ``folder``, or ``folder`` itself); returns the files written,
    relative to ``out``, and the record the manifest keeps."""
    import onnxruntime as ort

    target = out / SUBFOLDER
    target.mkdir()
    with tempfile.TemporaryDirectory(prefix=".mobile-", dir=out) as work:
        ort_made, optimized = convert(folder / MODEL_FILE, Path(work))
        shutil.move(ort_made, target / ORT_FILE)
        results, dynamic = usability(optimized)
    write_configs(target / ORT_FILE, target)
    worst = read_back(folder / MODEL_FILE, target / ORT_FILE)
    ops = config_ops(target / OPS_CONFIG)
    missing = missing_from_reduced_package(ops, (target / TYPES_CONFIG).read_text())
    contrib = sorted({op for names in ops.get("com.microsoft", {}).values() for op in names})
    names = sorted({f"{d}:{op}" for d, versions in ops.items() for v in versions.values() for op in v})
    record = {
        "optimization": f"{LEVEL} (fixed)",
        "onnxruntime": ort.__version__,
        "ops": names,
        "full_packages": FULL_PACKAGES,
        "reduced_package_lacks": missing,
        "read_back_max_diff": worst,
        "usability": {r.provider: r.line() for r in results},
    }
    packages = f"packages: {FULL_PACKAGES} run every op"
    if missing:
        packages += f"; {REDUCED_PACKAGE} lacks {len(missing)} of them: build onnxruntime with --include_ops_by_config"
        packages += f" {SUBFOLDER}/{TYPES_CONFIG}"
    record["summary"] = [
        f"mobile: {SUBFOLDER}/{ORT_FILE} ({LEVEL} optimizations), {len(names)} op types"
        + (f", com.microsoft: {', '.join(contrib)}" if contrib else ", all ONNX"),
        packages,
        "usability (onnxruntime's checker): " + "; ".join(r.line() for r in results) + "; XNNPACK not checked",
    ]
    report = {
        "checker": f"onnxruntime.tools.mobile_helpers.usability_checker (onnxruntime {ort.__version__})",
        "graph": f"{ORT_FILE} ({LEVEL} optimizations)",
        "dynamic_inputs": dynamic,
        "xnnpack": "not checked: onnxruntime's usability checker has no table for it",
        "providers": {r.provider: r.as_dict() for r in results},
    }
    (target / USABILITY_JSON).write_text(json_text(report))
    (target / USABILITY_MD).write_text(_markdown(results, dynamic))
    (target / README).write_text(_readme(record))
    companions = [name for name in (CONFIG_FILE, *COMPANION_FILES) if (out / name).is_file()]
    for name in companions:
        shutil.copyfile(out / name, target / name)
    files = [ORT_FILE, OPS_CONFIG, TYPES_CONFIG, USABILITY_JSON, USABILITY_MD, README, *companions]
    log.info("mobile: %s", "; ".join(record["summary"]))
    return [f"{SUBFOLDER}/{name}" for name in files], record


def _write(deployment: Deployment, options) -> Written:
    files, record = write_mobile(deployment.staging, deployment.staging)
    return Written(files, record)


def load_report(folder: str | Path) -> dict:
    """A deployed folder's usability report (mobile/usability.json)."""
    return json.loads((Path(folder) / SUBFOLDER / USABILITY_JSON).read_text())


SPEC = TargetSpec(
    name="mobile",
    summary="ORT Mobile: mobile/model.ort, its reduced-build op configs and onnxruntime's usability report",
    write=_write,
    paths=(SUBFOLDER,),
    tokenizer_json=True,
    record="mobile",
    aliases=("ort-mobile", "ort-format"),
    requires=(
        # the ORT format is one flatbuffer, whose offsets are 32-bit: no external data, at most 2 GB
        Need(
            "data_files",
            allowed={0},
            why="writes one ORT-format flatbuffer, which holds no external data",
            fix="export it with --no-external-data (a model under 2 GB)",
        ),
    ),
)
