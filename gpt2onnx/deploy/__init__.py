"""Deployment targets: an exported folder made ready for the runtimes users deploy on.

``deploy(folder, ["genai", "transformers-js", "triton"])`` writes, next to the plain folder's own files
(which keep working with onnxruntime and optimum as before):

    genai_config.json                      onnxruntime-genai (gpt2onnx.deploy.genai)
    onnx/model[_suffix].onnx, config.json  transformers.js (gpt2onnx.deploy.transformers_js)
    index.html, gpt2onnx-web.js, lib/      a page that generates in the browser (gpt2onnx.deploy.web; it loads
                                           the transformers.js layout, which "web" therefore adds too)
    triton/NAME/config.pbtxt, NAME/1/...   Triton's ONNX Runtime backend (gpt2onnx.deploy.triton), and beside it
    triton/NAME-generate/, NAME-infer/     generation in the server (Python backend, gpt2onnx.deploy.triton_generate)
    kserve/inferenceservice.yaml           KServe's Triton runtime on that repository (gpt2onnx.deploy.kserve)
    tokenizer.json                         genai and transformers.js, which read only this file, when the
                                           folder has only vocab.json + merges.txt (gpt2onnx.artifact.tokenizer)
    ort-generate/*_search.onnx, ...        onnxruntime's generation ops, the loop in the graph
                                           (gpt2onnx.deploy.ort_generate)

It works on any gpt2onnx decoder folder, exported or optimized, in any precision, and leaves export and
optimize alone. The result is written like every folder: staged beside the target and moved into place
whole. In place (no ``out``), everything the manifest does not list (sub-folders such as trt_cache/, links,
other files) is kept as it was; or into a new folder ``out``. The model files are hard-linked, not copied,
where the filesystem allows it (one copy on disk however many targets), else copied. The manifest records
the targets and their files. Each run writes exactly the targets it is given: targets deployed earlier and
not named again are dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from gpt2onnx.artifact.folder import (
    CONFIG_FILE,
    MANIFEST_NAME,
    foreign_entries,
    open_folder,
    staged_folder,
    write_manifest,
)
from gpt2onnx.artifact.manifest import DeployRecord, Manifest, TritonRecord
from gpt2onnx.artifact.paths import check_output_path, real_location
from gpt2onnx.artifact.tokenizer import TOKENIZER_JSON, ensure_tokenizer_json
from gpt2onnx.deploy import genai, kserve, ort_generate, transformers_js, triton, web
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.files import link_or_copy

log = logging.getLogger(__name__)

TARGETS = ("genai", "transformers-js", "triton", "ort-generate", "web")
NEED_TOKENIZER_JSON = {"genai", "transformers-js"}
# what a target adds to the folder: dropped when the folder is deployed again
_TARGET_PATHS = (
    genai.CONFIG_NAME,
    transformers_js.SUBFOLDER,
    triton.SUBFOLDER,
    kserve.SUBFOLDER,
    ort_generate.SUBFOLDER,
    *web.PATHS,
)


@dataclass
class DeployResult:
    """What :func:`deploy` returns: the folder written, its manifest, and per target the files it added."""

    folder: Path
    manifest: Manifest

    @property
    def record(self) -> DeployRecord:
        return self.manifest.deploy

    @property
    def targets(self) -> dict[str, list[str]]:
        return self.manifest.deploy.targets


def parse_targets(value: str | list[str]) -> list[str]:
    """'genai,triton' (or a list) → the targets, checked, in a fixed order."""
    items = value.split(",") if isinstance(value, str) else [p for v in value for p in v.split(",")]
    names = {item.strip().lower().replace("_", "-") for item in items if item.strip()}
    names = {"transformers-js" if n in ("transformers.js", "transformersjs", "tjs") else n for n in names}
    unknown = names - set(TARGETS)
    if unknown or not names:
        raise BadInput(
            f"unknown deploy target {', '.join(sorted(unknown)) or '(none)'}: choose from {', '.join(TARGETS)}"
        )
    if "web" in names:
        names.add("transformers-js")  # the page loads the transformers.js layout
    return [t for t in TARGETS if t in names]


def deploy(
    folder: str | Path,
    targets: str | list[str],
    *,
    out: str | Path | None = None,
    force: bool = False,
    triton_name: str | None = None,
    triton_device: str = "cpu",
    web_lib: str | Path | None = None,
    verify_files: bool = True,
) -> DeployResult:
    """Write the deployment ``targets`` for the exported decoder ``folder``, in place or into ``out``.
    ``web_lib``: the node_modules with transformers.js that the web target copies its library files from
    (default: $GPT2ONNX_WEB_LIB, else this repository's tests/js/node_modules, else ./node_modules).
    Returns the folder and its new manifest, whose ``deploy`` record lists the targets and their files."""
    targets = parse_targets(targets)
    if triton_device not in triton.KINDS:
        raise BadInput(f"unknown Triton instance kind '{triton_device}': choose cpu or gpu")
    opened = open_folder(folder, verify_files=verify_files)  # refuses a single block, checks the sha256
    source = opened.folder
    if opened.manifest is None:
        raise ContractError(
            f"'{source}' has no {MANIFEST_NAME}: deploy a folder written by gpt2onnx export or optimize"
            " (an optimum folder: export the checkpoint with gpt2onnx)"
        )
    in_place = out is None
    if out is not None:  # the one output rule: never a link (it would be replaced), a file, the working directory
        check_output_path(out, option="output (-o)", kind="folder")
        in_place = real_location(out) == source.resolve()
        if not in_place and (
            real_location(out).is_relative_to(source.resolve()) or source.resolve().is_relative_to(real_location(out))
        ):
            raise BadInput(f"output folder '{out}' is inside '{source}' or holds it: choose a folder beside it")
    if in_place:
        if Path(folder).is_symlink():
            raise BadInput(f"'{folder}' is a symbolic link: give the real folder's path to deploy into it")
        check_output_path(source, option="the folder deployed in place", kind="folder")
    target = source if in_place else Path(out)
    name = triton.model_name(triton_name or real_location(target).name) if "triton" in targets else None
    big = set(opened.manifest.model_files)
    writes = {
        genai.CONFIG_NAME: "genai",
        transformers_js.SUBFOLDER: "transformers-js",
        triton.SUBFOLDER: "triton",
        kserve.SUBFOLDER: "triton",  # KServe's InferenceService for the Triton repository
        ort_generate.SUBFOLDER: "ort-generate",
        **{path: "web" for path in web.PATHS},
    }
    foreign = _foreign(source, opened.manifest, writes, targets)
    with staged_folder(target, force=force, protect=(source,), check=not in_place) as staging:
        for path in sorted(source.iterdir()):  # our own files (the model's hard-linked, small ones copied)
            if path.name == MANIFEST_NAME or path.name in _TARGET_PATHS or path.name in foreign:
                continue
            if not path.is_file() or path.is_symlink():
                continue  # a target folder of ours: written again when asked for, else dropped
            if path.name in big:
                link_or_copy(path, staging / path.name)
            else:
                shutil.copyfile(path, staging / path.name)  # small files are written to: never share them
        for rel in foreign:  # what deploy does not own goes along as it was, in place or into -o
            _carry(source / rel, staging / rel)
        _drop_transformers_js_config(staging)
        written: dict[str, list[str]] = {}
        # genai's og.Tokenizer and transformers.js read only tokenizer.json: build it from vocab.json + merges.txt
        made = (
            [TOKENIZER_JSON]
            if set(targets) & NEED_TOKENIZER_JSON and ensure_tokenizer_json(staging, read_from=source)
            else []
        )
        if "genai" in targets:
            genai.write_genai_config(staging, staging)
            written["genai"] = [genai.CONFIG_NAME, *made]
        if "transformers-js" in targets:
            files = transformers_js.write_transformers_js(staging, staging, opened.precision)
            written["transformers-js"] = files + made
        if "web" in targets:
            written["web"] = web.write_web(
                source, staging, opened.precision, name=real_location(target).name, web_lib=web_lib
            )
        if "triton" in targets:
            written["triton"] = triton.write_triton(
                staging, staging, name=name, device=triton_device, manifest=opened.manifest
            )
        fixed = None
        if "ort-generate" in targets:
            written["ort-generate"], fixed = ort_generate.write_ort_generate(staging, staging)
        record = DeployRecord(
            targets=written,
            source=str(source),
            precision=opened.precision,
            # write_manifest records the versions and date of this run; keep those of the export
            source_versions=opened.manifest.versions,
            source_created=opened.manifest.created,
            triton=TritonRecord(name, triton.KINDS[triton_device]) if "triton" in targets else None,
            ort_generate=fixed.as_dict() if fixed is not None else None,
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        manifest = dataclasses.replace(opened.manifest, deploy=record)
        log.info("deployed %s to %s: %s", source, target, ", ".join(targets))
        manifest = write_manifest(staging, manifest, exclude=tuple(f for f in foreign if "/" not in f))
    return DeployResult(target, manifest)


def _foreign(source: Path, manifest: Manifest, writes: dict[str, str], targets: list[str]) -> list[str]:
    """What deploy keeps as it is, beside the files it writes (in place or into -o): every entry its manifest
    does not list (sub-folders such as trt_cache/, links, your files, a file you put into onnx/). A foreign entry
    where a target asked for would write is refused, and so is one that is no file, folder or link."""
    foreign = foreign_entries(source, manifest)
    for rel in foreign:
        path = source / rel
        top = rel.split("/")[0]
        if top in writes and writes[top] in targets:
            raise BadInput(
                f"'{path}' was not written by gpt2onnx deploy, and the {writes[top]} target would replace it:"
                " move it out of the folder, or deploy into a new folder (-o)"
            )
        if not (path.is_symlink() or path.is_dir() or path.is_file()):
            raise BadInput(
                f"'{path}' is not a file, a folder or a link (a FIFO, socket or device): deploy would lose it; move"
                " it out of the folder"
            )
    return foreign


def _carry(path: Path, target: Path) -> None:
    """``path`` into the new folder as it is: a link as the same link, a folder whole, a file hard-linked."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        os.symlink(os.readlink(path), target)
    elif path.is_dir():
        shutil.copytree(path, target, symlinks=True, copy_function=link_or_copy)
    else:
        link_or_copy(path, target)


def _drop_transformers_js_config(staging: Path) -> None:
    """config.json without the transformers.js key a previous deploy added (it is written again when asked)."""
    path = staging / CONFIG_FILE
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if isinstance(config, dict) and transformers_js.CONFIG_KEY in config:
        del config[transformers_js.CONFIG_KEY]
        path.write_text(json.dumps(config, indent=2) + "\n")
