"""The folder's manifest (gpt2onnx.json) as one typed record, and the records inside it.

Export, optimize and deploy build a :class:`Manifest`; ``write_manifest`` (artifact.folder) adds the file
hashes, versions and date and writes ``as_dict()`` (gpt2onnx.records' one serializer, with the rules below
said on the fields); every reader gets ``Manifest.from_dict`` back. The JSON is the folder format: it has the
keys every release so far wrote, and every manifest written so far reads back (format version 1 throughout;
keys added along the way, such as fusion, fp16, quantization, kv_cache and deploy, are absent from older ones
and read as None). Keys this release does not know are kept as they are and written back (``extra``), so a
newer folder deployed again loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpt2onnx.artifact.contract import IOSpec
from gpt2onnx.artifact.report import CheckReport, EvalReport
from gpt2onnx.errors import BadInput
from gpt2onnx.records import OMIT_DEFAULT, OtherShape, Record, RecordError, field, from_json

MANIFEST_FORMAT_VERSION = 1
MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class Architecture(Record):
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
    # the MLP's activation, by its canonical name (pytorch.architecture.ACTIVATIONS)
    activation: str = field(default="gelu_new", omit=OMIT_DEFAULT)
    scale_attn_weights: bool = field(default=True, omit=OMIT_DEFAULT)  # scores divided by √head_dim
    # and by layer index + 1 (BioMedLM, Mistral's GPT-2 runs)
    scale_attn_by_inverse_layer_idx: bool = field(default=False, omit=OMIT_DEFAULT)
    # scores computed in fp32 (the same values in an fp32 export)
    reorder_and_upcast_attn: bool = field(default=False, omit=OMIT_DEFAULT)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def attention_divisor(self, layer: int) -> float:
        """What layer ``layer``'s attention scores are divided by (transformers' GPT2Attention)."""
        divisor = self.head_dim**0.5 if self.scale_attn_weights else 1.0
        return divisor * (layer + 1) if self.scale_attn_by_inverse_layer_idx else divisor


@dataclass(frozen=True)
class FileRecord(Record):
    """One file of the folder, as the manifest records it."""

    bytes: int
    sha256: str


def _files_from_json(data: Any) -> dict[str, FileRecord]:
    """The manifest's files; a damaged entry reads as one that matches no file, so the integrity check names it."""
    if not isinstance(data, dict):
        raise RecordError(f"files: not an object: {data!r}")
    files = {}
    for name, info in data.items():
        try:
            files[str(name)] = from_json(FileRecord, info)
        except RecordError:
            files[str(name)] = FileRecord(-1, "")
    return files


@dataclass(frozen=True)
class GoldenCount(Record):
    """One golden check of a fusion profile: the ops expected for a model of L layers, and the ops found."""

    expected: int
    found: int
    ops: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FusionReport(Record):
    """What a fusion profile did: rewrites per fusion, the fused ops in the result, the golden checks."""

    profile: str
    applied: dict[str, int]  # rewrites per fusion
    op_counts: dict[str, int]  # fused ops in the result, "domain::op"
    golden: dict[str, GoldenCount]  # per check
    partial: list[str] = field(default_factory=list)  # messages for checks below golden

    def summary(self) -> str:
        counts = ", ".join(f"{n} {op.split('::')[-1]}" for op, n in self.op_counts.items()) or "nothing fused"
        return f"{self.profile}: {counts}" + (" (PARTIAL)" if self.partial else "")


@dataclass(frozen=True)
class Fp16Record(Record):
    """What the fp16 conversion kept in fp32: the groups asked for, the nodes and the graph outputs."""

    kept_fp32: list[str]
    kept_fp32_nodes: dict[str, int]
    kept_fp32_io: list[str]
    dtype: str = "float16"


@dataclass(frozen=True)
class KvCacheRecord(Record):
    """A quantized K/V cache (--kv-cache): its element type, the kernel's scale granularity, the text its scales
    were calibrated on, and the largest |K| and |V| calibration saw (what the widest channel's scale maps to the
    largest stored step)."""

    dtype: str
    quant_type: str
    calibration: str
    largest_key: float
    largest_value: float


@dataclass(frozen=True)
class QuantizationRecord(Record):
    """The weight quantization: method (int8, int4), the block size of block-wise tensors, the quantized ops per
    type, and the recipe (int4's accuracy level; the logits projection's and the embeddings' precision).
    Manifests from before the recipe options have only the first three."""

    method: str
    block_size: int | None = None
    ops: dict[str, int] = field(default_factory=dict)
    # the recipe, written together where it was chosen
    accuracy_level: int | None = field(default=None, omit=lambda r: r.lm_head is None)
    lm_head: str | None = field(default=None, omit=lambda r: r.lm_head is None)
    embeddings: str | None = field(default=None, omit=lambda r: r.lm_head is None)
    # int8: how MatMulInteger's weights are stored (precision.Int8Scheme.name)
    int8_weights: str | None = field(default=None, omit=OMIT_DEFAULT)
    # int4: how its weights were chosen (passes.int4.registry); None before it existed: rtn
    algorithm: str | None = field(default=None, omit=OMIT_DEFAULT)
    # a calibrated algorithm's text (where it came from, how many tokens)
    calibration: str | None = field(default=None, omit=OMIT_DEFAULT)
    # int4 --mixed-int8: the weights given 8 bits, every candidate's measured sensitivity (mean KL when it alone is
    # rounded to 4 bits) and the share of the candidates' parameters at 8 bits (passes.mixed_precision)
    int8_layers: list[str] | None = field(default=None, omit=lambda r: r.int8_layers is None)
    sensitivity: dict[str, float] | None = field(default=None, omit=lambda r: r.int8_layers is None)
    int8_share: float | None = field(default=None, omit=lambda r: r.int8_layers is None)
    # the tied embedding stored once: the token Gather reads the head's MatMulNBits weights (its source name)
    shared_embedding: str | None = field(default=None, omit=OMIT_DEFAULT)
    # int4 --prompt-kernel int8: a step of many rows runs on int8 kernels (gpt2onnx.precisions.prompt_path)
    prompt_kernel: str | None = field(default=None, omit=OMIT_DEFAULT)

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


@dataclass(frozen=True)
class DeployRecord(Record):
    """The deployment targets written into the folder (gpt2onnx deploy), and what they were made from.

    ``records``: what the targets keep, by key (triton: the model's name and instance kind; ort_generate: the
    search settings fixed in its graphs), written between ``source_created`` and ``created`` as every release
    has; a key this release does not know reads into it too, and is written back."""

    targets: dict[str, list[str]]  # target → the files it added, relative to the folder
    source: str  # the folder deployed
    precision: str
    source_versions: dict | None = None  # the versions and date of the export (the manifest's are this run's)
    source_created: str | None = None
    records: dict[str, Any] = field(default_factory=dict, extra=True)  # every other key: a target's own record
    created: str | None = None


@dataclass(frozen=True)
class AdapterRecord(Record):
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

    def summary(self) -> str:
        scaling = "alpha/√r (rsLoRA)" if self.rslora else "alpha/r"
        targets = ", ".join(self.target_modules)
        return (
            f"LoRA {self.form}: rank {self.rank}, alpha {self.alpha:g}, {scaling}, {self.modules} modules ({targets})"
        )


def _check_from_json(value: Any) -> CheckReport | None:
    """The check ("parity"); an older release's record, or a damaged one, is refused (and kept as it was)."""
    check = CheckReport.from_dict(value)
    if check is None and value is not None:
        raise OtherShape("parity: not a check this release reads")
    return check


def _manifest_key():
    """A key written only where it is set: an export, or a release, that never wrote it reads the same."""
    return field(default=None, omit=OMIT_DEFAULT)


@dataclass(frozen=True)
class Manifest(Record):
    """gpt2onnx.json: what the folder holds and how it was made, its fields in the order manifests have always
    listed their keys.

    ``check`` is the check the model passed before it was written (the JSON's "parity" key); ``files``,
    ``versions`` and ``created`` are filled in by ``write_manifest``. A damaged record (a hand-edited manifest)
    reads as absent, listed in ``unreadable`` and kept as it was in ``extra``: the model files, not these
    records, are checked."""

    kind: str  # "decoder" or "block"
    name: str | None = None
    # the checkpoint: kind (random, local, hub, gguf, onnx), id/path, hash, seed; a GGUF's tensor_types and kept_blocks
    source: dict = field(default_factory=dict)
    optimized_from: str | None = _manifest_key()  # optimize: the model file it was made from
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
    # the K/V cache's layout: "shared" (one buffer, GroupQueryAttention), "static" (TensorScatter) or "concat",
    # under the key manifests have always used
    cache_layout: str | None = field(default=None, key="kv_cache")
    kv_cache_quantization: KvCacheRecord | None = _manifest_key()  # a quantized cache (--kv-cache)
    check: CheckReport | None = field(default=None, key="parity", read=_check_from_json)
    eval: EvalReport | None = _manifest_key()  # quality on real text checked before writing (--eval-text)
    timings: dict[str, float] = field(default_factory=dict)
    format_version: int = MANIFEST_FORMAT_VERSION
    deploy: DeployRecord | None = _manifest_key()
    files: dict[str, FileRecord] = field(default_factory=dict, read=_files_from_json)
    versions: dict[str, str | None] = field(default_factory=dict)
    created: str | None = None
    # special token ids the configs give outside the vocabulary ({"eos_token_id": [50256]}): as in transformers
    # they never come; the readers of generation_config.json accept exactly these (artifact.generation)
    outside_vocabulary: dict[str, list[int]] = field(default_factory=dict, omit=OMIT_DEFAULT)
    adapter: AdapterRecord | None = _manifest_key()  # a PEFT LoRA adapter merged into the weights (--adapter)
    # switchable: name -> NAME.onnx_adapter's
    adapters: dict[str, AdapterRecord] = field(default_factory=dict, omit=OMIT_DEFAULT)
    # keys this release does not know, or records it cannot read
    extra: dict = field(default_factory=dict, extra=True)
    # the records read back damaged (their raw value: extra)
    unreadable: list[str] = field(default_factory=list, unreadable=True)

    json_tolerant = True

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

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "manifest") -> Manifest:
        """A manifest read back from JSON (any release so far). ``where`` names it in errors."""
        for key, kind in (("format_version", int), ("kind", str), ("files", dict)):
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                raise BadInput(f"{where} has no valid '{key}': export the folder again, or delete the manifest")
        if data["format_version"] > MANIFEST_FORMAT_VERSION:
            raise BadInput(
                f"{where} has format version {data['format_version']}, newer than this gpt2onnx reads"
                f" ({MANIFEST_FORMAT_VERSION}): upgrade gpt2onnx, or export the folder again"
            )
        return from_json(cls, data, where=where)
