"""The folder's manifest (gpt2onnx.json) as one typed record, and the records inside it.

Export, optimize and deploy build a :class:`Manifest`; ``write_manifest`` (artifact.folder) adds the file
hashes, versions and date and writes ``as_dict()``; every reader gets ``Manifest.from_dict`` back. The JSON
is the folder format: ``as_dict`` writes the keys every release so far wrote, and ``from_dict`` reads every
manifest written so far (format version 1 throughout; keys added along the way, such as fusion, fp16,
quantization, kv_cache and deploy, are absent from older ones and read as None). Keys this release does not
know are kept as they are and written back (``extra``), so a newer folder deployed again loses nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gpt2onnx.artifact.contract import IOSpec, TensorSpec
from gpt2onnx.artifact.report import CheckReport, EvalReport
from gpt2onnx.errors import BadInput

MANIFEST_FORMAT_VERSION = 1
MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class Architecture:
    """The numbers that fix a GPT-2 architecture (checked from a config by gpt2onnx.pytorch.architecture)."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float
    tie_word_embeddings: bool
    # Beyond OpenAI's GPT-2 (recorded only where they differ from it, so that older manifests read the same):
    activation: str = "gelu_new"  # the MLP's activation, by its canonical name (pytorch.architecture.ACTIVATIONS)
    scale_attn_weights: bool = True  # scores divided by √head_dim
    scale_attn_by_inverse_layer_idx: bool = False  # and by layer index + 1 (BioMedLM, Mistral's GPT-2 runs)
    reorder_and_upcast_attn: bool = False  # scores computed in fp32 (the same values in an fp32 export)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def attention_divisor(self, layer: int) -> float:
        """What layer ``layer``'s attention scores are divided by (transformers' GPT2Attention)."""
        divisor = self.head_dim**0.5 if self.scale_attn_weights else 1.0
        return divisor * (layer + 1) if self.scale_attn_by_inverse_layer_idx else divisor

    def as_dict(self) -> dict[str, Any]:
        values = asdict(self)
        for name, default in _ARCHITECTURE_EXTRAS.items():
            if values[name] == default:
                del values[name]
        return values

    @classmethod
    def from_dict(cls, data: dict) -> "Architecture":
        ints = {k: data[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner")}
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints.values()):
            raise TypeError("architecture")
        epsilon, tie = data["layer_norm_epsilon"], data["tie_word_embeddings"]
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not isinstance(tie, bool):
            raise TypeError("architecture")
        extras = {k: data[k] for k in _ARCHITECTURE_EXTRAS if k in data}
        if any(type(v) is not type(_ARCHITECTURE_EXTRAS[k]) for k, v in extras.items()):
            raise TypeError("architecture")
        if set(data) != set(ints) | {"layer_norm_epsilon", "tie_word_embeddings"} | set(extras):
            raise KeyError("architecture")  # another shape: kept as it was (unreadable), never rewritten
        return cls(**ints, layer_norm_epsilon=epsilon, tie_word_embeddings=tie, **extras)


_ARCHITECTURE_EXTRAS = {
    "activation": "gelu_new",
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
}


@dataclass(frozen=True)
class FileRecord:
    """One file of the folder, as the manifest records it."""

    bytes: int
    sha256: str

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, data: Any) -> "FileRecord":
        # a damaged entry reads as one that matches no file, so the integrity check names the file
        if not isinstance(data, dict):
            return cls(-1, "")
        size, digest = data.get("bytes"), data.get("sha256")
        return cls(size if isinstance(size, int) else -1, digest if isinstance(digest, str) else "")


@dataclass(frozen=True)
class GoldenCount:
    """One golden check of a fusion profile: the ops expected for a model of L layers, and the ops found."""

    expected: int
    found: int
    ops: list[str]

    def as_dict(self) -> dict:
        return {"expected": self.expected, "found": self.found, "ops": list(self.ops)}


@dataclass
class FusionReport:
    """What a fusion profile did: rewrites per fusion, the fused ops in the result, the golden checks."""

    profile: str
    applied: dict[str, int]  # rewrites per fusion
    op_counts: dict[str, int]  # fused ops in the result, "domain::op"
    golden: dict[str, GoldenCount]  # per check
    partial: list[str] = field(default_factory=list)  # messages for checks below golden

    def as_dict(self) -> dict:
        return {
            "profile": self.profile,
            "applied": self.applied,
            "op_counts": self.op_counts,
            "golden": {name: count.as_dict() for name, count in self.golden.items()},
            "partial": self.partial,
        }

    def summary(self) -> str:
        counts = ", ".join(f"{n} {op.split('::')[-1]}" for op, n in self.op_counts.items()) or "nothing fused"
        return f"{self.profile}: {counts}" + (" (PARTIAL)" if self.partial else "")

    @classmethod
    def from_dict(cls, data: dict) -> "FusionReport":
        golden = {
            name: GoldenCount(int(g["expected"]), int(g["found"]), [str(op) for op in g.get("ops", [])])
            for name, g in data.get("golden", {}).items()
        }
        partial = data.get("partial") or []
        return cls(
            str(data["profile"]),
            dict(data.get("applied", {})),
            dict(data.get("op_counts", {})),
            golden,
            [str(p) for p in partial] if isinstance(partial, list) else ["partial"],
        )


@dataclass(frozen=True)
class Fp16Record:
    """What the fp16 conversion kept in fp32: the groups asked for, the nodes and the graph outputs."""

    kept_fp32: list[str]
    kept_fp32_nodes: dict[str, int]
    kept_fp32_io: list[str]
    dtype: str = "float16"

    def as_dict(self) -> dict:
        return {
            "dtype": self.dtype,
            "kept_fp32": self.kept_fp32,
            "kept_fp32_nodes": self.kept_fp32_nodes,
            "kept_fp32_io": self.kept_fp32_io,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Fp16Record":
        return cls(
            [str(g) for g in data.get("kept_fp32", [])],
            dict(data.get("kept_fp32_nodes", {})),
            [str(n) for n in data.get("kept_fp32_io", [])],
            str(data.get("dtype", "float16")),
        )


@dataclass(frozen=True)
class KvCacheRecord:
    """A quantized K/V cache (--kv-cache): its element type, the kernel's scale granularity, the text its scales
    were calibrated on, and the largest |K| and |V| calibration saw (what the widest channel's scale maps to the
    largest stored step)."""

    dtype: str
    quant_type: str
    calibration: str
    largest_key: float
    largest_value: float

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KvCacheRecord":
        return cls(
            str(data["dtype"]),
            str(data["quant_type"]),
            str(data["calibration"]),
            float(data["largest_key"]),
            float(data["largest_value"]),
        )


@dataclass(frozen=True)
class QuantizationRecord:
    """The weight quantization: method (int8, int4), the block size of block-wise tensors, the quantized ops per
    type, and the recipe (int4's accuracy level; the logits projection's and the embeddings' precision).
    Manifests from before the recipe options have only the first three."""

    method: str
    block_size: int | None = None
    ops: dict[str, int] = field(default_factory=dict)
    accuracy_level: int | None = None
    lm_head: str | None = None
    embeddings: str | None = None
    int8_weights: str | None = None  # int8: how MatMulInteger's weights are stored (precision.Int8Scheme.name)
    algorithm: str | None = (
        None  # int4: how its weights were chosen (passes.int4.registry); None before it existed: rtn
    )
    calibration: str | None = None  # a calibrated algorithm's text (where it came from, how many tokens)
    # int4 --mixed-int8: the weights given 8 bits, every candidate's measured sensitivity (mean KL when it alone is
    # rounded to 4 bits) and the share of the candidates' parameters at 8 bits (passes.mixed_precision)
    int8_layers: list[str] | None = None
    sensitivity: dict[str, float] | None = None
    int8_share: float | None = None
    # the tied embedding stored once: the token Gather reads the head's MatMulNBits weights (its source name)
    shared_embedding: str | None = None
    # int4 --prompt-kernel int8: a step of many rows runs on int8 kernels (gpt2onnx.precisions.prompt_path)
    prompt_kernel: str | None = None

    def as_dict(self) -> dict:
        data = {"method": self.method, "block_size": self.block_size, "ops": self.ops}
        if self.lm_head is not None:
            data.update(accuracy_level=self.accuracy_level, lm_head=self.lm_head, embeddings=self.embeddings)
        if self.int8_weights is not None:
            data["int8_weights"] = self.int8_weights
        if self.algorithm is not None:
            data["algorithm"] = self.algorithm
        if self.calibration is not None:
            data["calibration"] = self.calibration
        if self.int8_layers is not None:
            data.update(int8_layers=self.int8_layers, sensitivity=self.sensitivity, int8_share=self.int8_share)
        if self.shared_embedding is not None:
            data["shared_embedding"] = self.shared_embedding
        if self.prompt_kernel is not None:
            data["prompt_kernel"] = self.prompt_kernel
        return data

    def summary(self) -> str:
        text = self.method + (f" {self.algorithm}" if self.algorithm else "")
        text += f", block {self.block_size}" if self.block_size else ""
        if self.int8_weights is not None:
            text += f", {self.int8_weights} weights"
        if self.accuracy_level is not None:
            text += f", accuracy level {self.accuracy_level}"
        if self.lm_head is not None:
            text += f"; lm_head {self.lm_head}, embeddings {self.embeddings}"
        if self.shared_embedding is not None:
            text += "; one copy of the tied embedding"
        if self.prompt_kernel is not None:
            text += f"; prompt steps on {self.prompt_kernel} kernels"
        if self.int8_layers is not None:
            share = 100 * (self.int8_share or 0)
            text += f"; {len(self.int8_layers)} layers at 8 bits by measured sensitivity ({share:.0f} % of weights)"
        return text

    @classmethod
    def from_dict(cls, data: dict) -> "QuantizationRecord":
        block, level = data.get("block_size"), data.get("accuracy_level")
        return cls(
            str(data["method"]),
            int(block) if block is not None else None,
            dict(data.get("ops", {})),
            int(level) if level is not None else None,
            data.get("lm_head"),
            data.get("embeddings"),
            data.get("int8_weights"),
            str(data["algorithm"]) if data.get("algorithm") is not None else None,
            str(data["calibration"]) if data.get("calibration") is not None else None,
            [str(n) for n in data["int8_layers"]] if data.get("int8_layers") is not None else None,
            {str(k): float(v) for k, v in data["sensitivity"].items()} if data.get("sensitivity") is not None else None,
            float(data["int8_share"]) if data.get("int8_share") is not None else None,
            str(data["shared_embedding"]) if data.get("shared_embedding") is not None else None,
            str(data["prompt_kernel"]) if data.get("prompt_kernel") is not None else None,
        )


# the keys of the deploy record itself; every other key is a target's own record, kept in its place
_DEPLOY_KEYS = ("targets", "source", "precision", "source_versions", "source_created", "created")


@dataclass
class DeployRecord:
    """The deployment targets written into the folder (gpt2onnx deploy), and what they were made from.

    ``records``: what the targets keep, by key (triton: the model's name and instance kind; ort_generate: the
    search settings fixed in its graphs), written between ``source_created`` and ``created`` as every release
    has; a key this release does not know reads into it too, and is written back."""

    targets: dict[str, list[str]]  # target → the files it added, relative to the folder
    source: str  # the folder deployed
    precision: str
    source_versions: dict | None = None  # the versions and date of the export (the manifest's are this run's)
    source_created: str | None = None
    records: dict[str, dict] = field(default_factory=dict)
    created: str | None = None

    def as_dict(self) -> dict:
        return {
            "targets": self.targets,
            "source": self.source,
            "precision": self.precision,
            "source_versions": self.source_versions,
            "source_created": self.source_created,
            **self.records,
            "created": self.created,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "DeployRecord":
        return cls(
            targets={str(k): [str(f) for f in v] for k, v in data.get("targets", {}).items()},
            source=str(data.get("source", "")),
            precision=str(data.get("precision", "")),
            source_versions=data.get("source_versions"),
            source_created=data.get("source_created"),
            records={k: v for k, v in data.items() if k not in _DEPLOY_KEYS},
            created=data.get("created"),
        )


def _io_from_dict(data: dict) -> IOSpec:
    def specs(items: list[dict]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(str(t["name"]), str(t["dtype"]), tuple(t["dims"])) for t in items)

    return IOSpec(specs(data["inputs"]), specs(data["outputs"]))


@dataclass(frozen=True)
class AdapterRecord:
    """A PEFT LoRA adapter exported merged into the base weights (gpt2onnx.pytorch.adapters): its folder, the
    sha256 of its files, and the settings that fix its arithmetic."""

    path: str  # the adapter folder, resolved
    files: dict[str, str]  # file name -> sha256 (adapter_config.json, adapter_model.safetensors)
    rank: int  # the config's r (a module's own from rank_pattern where it has one)
    alpha: float  # lora_alpha
    target_modules: tuple[str, ...]  # the module kinds adapted: c_attn, c_proj, c_fc, lm_head
    rslora: bool  # scaling alpha / √r instead of alpha / r
    modules: int  # the adapted modules, all layers
    base: str  # base_model_name_or_path as the adapter's config names it
    form: str = "merged"  # or "switchable": NAME.onnx_adapter, active per run
    check: str | None = None  # switchable: the summary of its check against PEFT with it active

    def as_dict(self) -> dict:
        return {**asdict(self), "target_modules": list(self.target_modules)}

    def summary(self) -> str:
        scaling = "alpha/√r (rsLoRA)" if self.rslora else "alpha/r"
        targets = ", ".join(self.target_modules)
        return (
            f"LoRA {self.form}: rank {self.rank}, alpha {self.alpha:g}, {scaling}, {self.modules} modules ({targets})"
        )

    @classmethod
    def from_dict(cls, data: dict) -> "AdapterRecord":
        files = data["files"]
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise TypeError("adapter")
        return cls(
            str(data["path"]),
            {str(k): v for k, v in files.items()},
            int(data["rank"]),
            float(data["alpha"]),
            tuple(str(m) for m in data["target_modules"]),
            bool(data["rslora"]),
            int(data["modules"]),
            str(data["base"]),
            str(data.get("form", "merged")),
            None if data.get("check") is None else str(data["check"]),
        )


# The JSON keys in the order a manifest has always listed them; "parity" holds the check.
_KEYS = (
    "kind",
    "name",
    "source",
    "optimized_from",
    "architecture",
    "dtype",
    "io",
    "opset",
    "opset_imports",
    "node_count",
    "options",
    "fusion",
    "fp16",
    "quantization",
    "kv_cache",  # the cache layout's record (cache_layout), under the key manifests have always used
    "kv_cache_quantization",
    "parity",
    "eval",
    "timings",
    "format_version",
    "deploy",
    "files",
    "versions",
    "created",
    "outside_vocabulary",
    "adapter",
    "adapters",
)


def _adapters_from_dict(data: dict) -> dict[str, AdapterRecord]:
    return {str(name): AdapterRecord.from_dict(record) for name, record in data.items()}


def _outside_from_dict(data: dict) -> dict[str, list[int]]:
    out = {}
    for key, ids in data.items():
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(key)
        out[str(key)] = list(ids)
    return out


@dataclass
class Manifest:
    """gpt2onnx.json: what the folder holds and how it was made.

    ``check`` is the check the model passed before it was written (the JSON's "parity" key); ``files``,
    ``versions`` and ``created`` are filled in by ``write_manifest``."""

    kind: str  # "decoder" or "block"
    name: str | None = None
    # the checkpoint: kind (random, local, hub, gguf, onnx), id/path, hash, seed; a GGUF's tensor_types and kept_blocks
    source: dict = field(default_factory=dict)
    optimized_from: str | None = None  # optimize: the model file it was made from
    architecture: Architecture | None = None  # the GPT-2 architecture
    dtype: str = "float32"
    io: IOSpec | None = None  # the IO contract (None where optimize could not carry it over)
    opset: int | None = None
    opset_imports: dict[str, int] = field(default_factory=dict)
    node_count: int | None = None
    options: dict = field(default_factory=dict)  # the export's options, with optimize's on top
    fusion: FusionReport | None = None
    fp16: Fp16Record | None = None
    quantization: QuantizationRecord | None = None
    # the K/V cache's layout: "shared" (one buffer, GroupQueryAttention), "static" (TensorScatter) or "concat"
    cache_layout: str | None = None
    kv_cache_quantization: KvCacheRecord | None = None  # a quantized cache (--kv-cache); None: the float cache
    # special token ids the configs give outside the vocabulary ({"eos_token_id": [50256]}): as in transformers
    # they never come; the readers of generation_config.json accept exactly these (artifact.generation)
    outside_vocabulary: dict[str, list[int]] = field(default_factory=dict)
    check: CheckReport | None = None
    eval: EvalReport | None = None  # quality on real text checked before writing (--eval-text)
    adapter: AdapterRecord | None = None  # a PEFT LoRA adapter merged into the weights (--adapter)
    adapters: dict[str, AdapterRecord] = field(default_factory=dict)  # switchable: name -> NAME.onnx_adapter's
    timings: dict[str, float] = field(default_factory=dict)
    deploy: DeployRecord | None = None
    files: dict[str, FileRecord] = field(default_factory=dict)
    versions: dict[str, str | None] = field(default_factory=dict)
    created: str | None = None
    format_version: int = MANIFEST_FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # keys this release does not know, or records it cannot read
    unreadable: list[str] = field(default_factory=list)  # the records read back damaged (their raw value: extra)

    @property
    def precision(self) -> str:
        """The quantization method if the weights are quantized, else the dtype: the key of the parity gates."""
        method = self.quantization.method if self.quantization else "none"
        return self.dtype if method == "none" else method

    @property
    def model_files(self) -> dict[str, FileRecord]:
        """The records of the model's own files (model.onnx and its external data)."""
        return {name: info for name, info in self.files.items() if name.startswith(MODEL_FILE)}

    @property
    def model_bytes(self) -> int:
        return sum(info.bytes for info in self.model_files.values())

    @property
    def check_summary(self) -> str:
        """The check's one line, or why there is none."""
        if self.check is not None:
            return self.check.summary()
        return "unreadable" if self.extra.get("parity") is not None else "not validated"

    def as_dict(self) -> dict:
        values = {
            "kind": self.kind,
            "name": self.name,
            "source": self.source,
            "optimized_from": self.optimized_from,
            "architecture": self.architecture.as_dict() if self.architecture else None,
            "dtype": self.dtype,
            "io": self.io.as_dict() if self.io else None,
            "opset": self.opset,
            "opset_imports": self.opset_imports,
            "node_count": self.node_count,
            "options": self.options,
            "fusion": self.fusion.as_dict() if self.fusion else None,
            "fp16": self.fp16.as_dict() if self.fp16 else None,
            "quantization": self.quantization.as_dict() if self.quantization else None,
            "kv_cache": self.cache_layout,
            "kv_cache_quantization": self.kv_cache_quantization.as_dict() if self.kv_cache_quantization else None,
            "parity": self.check.as_dict() if self.check else None,
            "eval": self.eval.as_dict() if self.eval else None,
            "timings": self.timings,
            "format_version": self.format_version,
            "deploy": self.deploy.as_dict() if self.deploy else None,
            "files": {name: info.as_dict() for name, info in self.files.items()},
            "versions": self.versions,
            "created": self.created,
        }
        if self.optimized_from is None:
            del values["optimized_from"]  # an export never wrote it
        if self.deploy is None:
            del values["deploy"]
        if self.kv_cache_quantization is None:
            del values["kv_cache_quantization"]  # written only for a quantized cache
        if self.eval is None:
            del values["eval"]  # written only by an export or optimize with --eval-text
        if self.outside_vocabulary:  # written only where a special token is outside the vocabulary
            values["outside_vocabulary"] = self.outside_vocabulary
        if self.adapter is not None:  # written only for an export with an adapter
            values["adapter"] = self.adapter.as_dict()
        if self.adapters:  # written only for a switchable export (--adapters)
            values["adapters"] = {name: record.as_dict() for name, record in self.adapters.items()}
        return {**values, **self.extra}

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "manifest") -> "Manifest":
        """A manifest read back from JSON (any release so far). ``where`` names it in errors."""
        for key, kind in (("format_version", int), ("kind", str), ("files", dict)):
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                raise BadInput(f"{where} has no valid '{key}': export the folder again, or delete the manifest")
        if data["format_version"] > MANIFEST_FORMAT_VERSION:
            raise BadInput(
                f"{where} has format version {data['format_version']}, newer than this gpt2onnx reads"
                f" ({MANIFEST_FORMAT_VERSION}): upgrade gpt2onnx, or export the folder again"
            )

        extra = {k: v for k, v in data.items() if k not in _KEYS}
        unreadable: list[str] = []

        def record(key: str, parse, kind=dict):
            """The record, or None when absent; a damaged one (a hand-edited manifest) is None too, listed in
            ``unreadable`` and kept as it was in ``extra``: the model files, not these records, are checked."""
            value = data.get(key)
            if value is None:
                return None
            try:
                if not isinstance(value, kind) or isinstance(value, bool):
                    raise TypeError(key)
                return parse(value)
            except (KeyError, TypeError, ValueError, AttributeError):
                unreadable.append(key)
                extra[key] = value
                return None

        check = CheckReport.from_dict(data.get("parity"))
        if check is None and data.get("parity") is not None:
            extra["parity"] = data["parity"]  # an older release's record, or a damaged one: kept as it was
        manifest = cls(
            kind=data["kind"],
            name=record("name", str, str),
            source=record("source", dict) or {},
            optimized_from=record("optimized_from", str, str),
            architecture=record("architecture", Architecture.from_dict),
            dtype=record("dtype", str, str) or "float32",
            io=record("io", _io_from_dict),
            opset=record("opset", int, int),
            opset_imports=record("opset_imports", dict) or {},
            node_count=record("node_count", int, int),
            options=record("options", dict) or {},
            fusion=record("fusion", FusionReport.from_dict),
            fp16=record("fp16", Fp16Record.from_dict),
            quantization=record("quantization", QuantizationRecord.from_dict),
            cache_layout=record("kv_cache", str, str),
            kv_cache_quantization=record("kv_cache_quantization", KvCacheRecord.from_dict),
            outside_vocabulary=record("outside_vocabulary", _outside_from_dict) or {},
            check=check,
            eval=record("eval", EvalReport.from_dict),
            adapter=record("adapter", AdapterRecord.from_dict),
            adapters=record("adapters", _adapters_from_dict) or {},
            timings=record("timings", dict) or {},
            deploy=record("deploy", DeployRecord.from_dict),
            files={str(name): FileRecord.from_dict(info) for name, info in data["files"].items()},
            versions=record("versions", dict) or {},
            created=record("created", str, str),
            format_version=data["format_version"],
            extra=extra,
            unreadable=unreadable,
        )
        return manifest
