"""An exported model folder as the runtime commands see it: the ONNX file, its config and manifest, a decoder
on the chosen provider, and the PyTorch reference rebuilt from the source the manifest records."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from gpt2onnx.checkpoint import Checkpoint, load_checkpoint
from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.exporters.export import read_manifest
from gpt2onnx.runtimes.decoder import OnnxDecoder, file_shape, read_n_positions
from gpt2onnx.runtimes.providers import ProviderConfig, create_session

log = logging.getLogger(__name__)

DEFAULT_FOLDER = Path("models/gpt2")


@dataclass
class ModelFolder:
    folder: Path
    model_path: Path
    manifest: dict | None
    n_positions: int

    @property
    def dtype(self) -> str:
        return (self.manifest or {}).get("dtype", "float32")

    @property
    def precision(self) -> str:
        """The quantization method if the weights are quantized, else the dtype: the key of the parity gates."""
        method = ((self.manifest or {}).get("quantization") or {}).get("method", "none")
        return self.dtype if method == "none" else method


def open_folder(folder: str | Path) -> ModelFolder:
    folder = Path(folder)
    if not folder.exists():
        raise Gpt2OnnxError(f"model folder '{folder}' does not exist: export one first (gpt2onnx export) or give its path")
    if folder.is_file():
        raise Gpt2OnnxError(f"'{folder}' is a file: give the exported folder that holds model.onnx and config.json")
    model_path = folder / "model.onnx"
    if not model_path.is_file():
        raise Gpt2OnnxError(f"'{folder}' holds no model.onnx: give a folder written by gpt2onnx export (or optimum)")
    manifest = read_manifest(folder)
    if manifest is not None and manifest.get("kind") == "block":
        raise Gpt2OnnxError(f"'{folder}' holds a single-block export: give a whole decoder folder")
    return ModelFolder(folder, model_path, manifest, read_n_positions(folder))


def open_decoder(model: ModelFolder, provider: ProviderConfig) -> OnnxDecoder:
    """A session on the provider (checked: no silent fallback), wrapped as a decoder."""
    # The contract comes from the file first: the TensorRT profile is built from its names and dims.
    shape = file_shape(model.model_path, model.n_positions)
    session = create_session(model.model_path, provider, shape=shape)
    return OnnxDecoder(session, n_positions=model.n_positions, device_id=provider.device_id)


def reference_checkpoint(model: ModelFolder, reference: str | None = None) -> Checkpoint:
    """The checkpoint the folder was exported from (from its manifest), or ``reference`` when given."""
    if reference is not None:
        return load_checkpoint(reference)
    source = (model.manifest or {}).get("source")
    if not source:
        raise Gpt2OnnxError(
            f"'{model.folder}' has no gpt2onnx.json manifest naming its source: pass --reference with the checkpoint"
        )
    kind = source.get("kind")
    if kind == "random":
        outliers = float((source.get("outliers") or {}).get("magnitude", 0.0))
        ckpt = load_checkpoint(source["architecture"], random_init=True, seed=int(source["seed"]), outliers=outliers)
        if ckpt.source.get("spec_sha256") != source.get("spec_sha256"):
            raise Gpt2OnnxError(
                f"the architecture '{source['architecture']}' recorded in the manifest no longer matches the export:"
                " pass --reference"
            )
        return ckpt
    if kind == "local":
        ckpt = load_checkpoint(source["path"])
    elif kind == "hub":
        ckpt = load_checkpoint(source["id"], revision=source.get("commit") or source.get("revision"))
    else:
        raise Gpt2OnnxError(f"manifest source kind '{kind}' is unknown: pass --reference with the checkpoint")
    if source.get("sha256") and ckpt.source.get("sha256") != source["sha256"]:
        raise Gpt2OnnxError(
            "the source checkpoint's weights changed since the export (sha256 differs): pass --reference, or export again"
        )
    return ckpt
