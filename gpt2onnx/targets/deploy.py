"""``gpt2onnx deploy``: an exported folder made ready for the runtimes users deploy on, one target at a time
(each a plug-in: :mod:`gpt2onnx.targets.target`).

``deploy(folder, ["genai", "transformers-js", "triton"])`` writes, next to the plain folder's own files
(which keep working with onnxruntime and optimum as before):

    genai_config.json                      onnxruntime-genai (gpt2onnx.targets.genai)
    onnx/model[_suffix].onnx, config.json  transformers.js (gpt2onnx.targets.transformers_js)
    index.html, gpt2onnx-web.js, lib/      a page that generates in the browser (gpt2onnx.targets.web; it loads
                                           the transformers.js layout, which "web" therefore adds too)
    triton/NAME/config.pbtxt, NAME/1/...   Triton's ONNX Runtime backend (gpt2onnx.targets.triton), and beside it
    triton/NAME-generate/, NAME-infer/     generation in the server (Python backend, gpt2onnx.targets.triton_generate)
    kserve/inferenceservice.yaml           KServe's Triton runtime on that repository (gpt2onnx.targets.kserve)
    tokenizer.json                         genai and transformers.js, which read only this file, when the
                                           folder has only vocab.json + merges.txt (gpt2onnx.artifact.tokenizer)
    ort-generate/*_search.onnx, ...        onnxruntime's generation ops, the loop in the graph
                                           (gpt2onnx.targets.ort_generate)
    mobile/model.ort, *.config, usability.*  ORT Mobile: the ORT format, its reduced-build op configurations and
                                           onnxruntime's mobile usability report (gpt2onnx.targets.mobile)

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
import logging
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from gpt2onnx.artifact.folder import (
    MANIFEST_NAME,
    ModelFolder,
    foreign_entries,
    open_folder,
    staged_folder,
    write_manifest,
)
from gpt2onnx.artifact.lora import adapter_files_declared
from gpt2onnx.artifact.manifest import DeployRecord, Manifest
from gpt2onnx.artifact.paths import check_output_path, real_location
from gpt2onnx.artifact.tokenizer import TOKENIZER_JSON, ensure_tokenizer_json
from gpt2onnx.capabilities import resolve
from gpt2onnx.choices.axes import graph_alternatives
from gpt2onnx.choices.of_folder import folder_choices
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.files import link_or_copy
from gpt2onnx.precisions.all_precisions import precision_of
from gpt2onnx.targets.all_targets import owned_paths, parse_targets, target_options, target_specs
from gpt2onnx.targets.target import Deployment, TargetSpec

log = logging.getLogger(__name__)


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


def deploy(
    folder: str | Path,
    targets: str | list[str],
    *,
    out: str | Path | None = None,
    force: bool = False,
    verify_files: bool = True,
    **options,
) -> DeployResult:
    """Write the deployment ``targets`` for the exported decoder ``folder``, in place or into ``out``.

    ``options``: the targets' own, by name (:mod:`gpt2onnx.targets.target`): ``triton_name`` (default: the folder's
    name) and ``triton_device`` (cpu or gpu) for triton; ``web_lib`` for web, the node_modules with transformers.js
    that the page's library files are copied from (default: $GPT2ONNX_WEB_LIB, else this repository's
    tests/js/node_modules, else ./node_modules). Returns the folder and its new manifest, whose ``deploy`` record
    lists the targets and their files.

    Raises: BadInput (targets, options, output folder), ContractError (not a gpt2onnx folder, or one a target cannot
    take), IntegrityError, OutputError."""
    chosen = parse_targets(targets)
    chosen_options = target_options(chosen, options)
    opened = open_folder(folder, verify_files=verify_files)  # refuses a single block, checks the sha256
    if opened.manifest is None:
        raise ContractError(
            f"'{opened.folder}' has no {MANIFEST_NAME}: deploy a folder written by gpt2onnx export or optimize"
            " (an optimum folder: export the checkpoint with gpt2onnx)"
        )
    check_targets(opened, chosen)
    target, in_place = _target_folder(Path(folder), opened.folder, out)
    foreign = _foreign(opened.folder, opened.manifest, chosen)
    with staged_folder(target, force=force, protect=(opened.folder,), check=not in_place) as staging:
        _copy_source(opened, staging, foreign)
        deployment = Deployment(opened, staging, real_location(target).name, owned_paths())
        written, records = _write_targets(deployment, chosen, chosen_options)
        record = DeployRecord(
            targets=written,
            source=str(opened.folder),
            precision=precision_of(opened.facts).name,
            # write_manifest records the versions and date of this run; keep those of the export
            source_versions=opened.manifest.versions,
            source_created=opened.manifest.created,
            records=records,
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        manifest = dataclasses.replace(opened.manifest, deploy=record)
        log.info("deployed %s to %s: %s", opened.folder, target, ", ".join(written))
        manifest = write_manifest(staging, manifest, exclude=tuple(f for f in foreign if "/" not in f))
    return DeployResult(target, manifest)


def check_targets(opened, chosen) -> None:
    """Whether the folder can be deployed to every target asked for (and those they need): Unsupported, in one
    line, before anything is written."""
    folder = [*folder_choices(opened.facts, str(opened.folder)), *adapter_files_declared(opened)]
    alternatives = {**graph_alternatives(), "target": [spec.declared for spec in target_specs()]}
    resolve([*folder, *(spec.declared for spec in chosen)], alternatives=alternatives).check()


def _target_folder(given: Path, source: Path, out: str | Path | None) -> tuple[Path, bool]:
    """The folder written (the source itself, or ``out``) and whether that is in place; the one output rule: never
    a link (it would be replaced), a file, the working directory, a folder inside the source or holding it."""
    in_place = out is None
    if out is not None:
        check_output_path(out, option="output (-o)", kind="folder")
        in_place = real_location(out) == source.resolve()
        if not in_place and (
            real_location(out).is_relative_to(source.resolve()) or source.resolve().is_relative_to(real_location(out))
        ):
            raise BadInput(f"output folder '{out}' is inside '{source}' or holds it: choose a folder beside it")
    if in_place:
        if given.is_symlink():
            raise BadInput(f"'{given}' is a symbolic link: give the real folder's path to deploy into it")
        check_output_path(source, option="the folder deployed in place", kind="folder")
    return (source if in_place else Path(out)), in_place


def _copy_source(opened: ModelFolder, staging: Path, foreign: list[str]) -> None:
    """The source's own files into the staged folder (the model's hard-linked, small ones copied), what deploy
    does not own carried as it was, and what earlier deploys wrote dropped (written again when asked for)."""
    source, big = opened.folder, set(opened.manifest.model_files)
    owned = {path for spec in target_specs() for path in spec.paths}
    for path in sorted(source.iterdir()):
        if path.name == MANIFEST_NAME or path.name in owned or path.name in foreign:
            continue
        if not path.is_file() or path.is_symlink():
            continue  # a target folder of ours: written again when asked for, else dropped
        if path.name in big:
            link_or_copy(path, staging / path.name)
        else:
            shutil.copyfile(path, staging / path.name)  # small files are written to: never share them
    for rel in foreign:  # what deploy does not own goes along as it was, in place or into -o
        _carry(source / rel, staging / rel)
    for spec in target_specs():
        if spec.undo is not None:
            spec.undo(staging)


def _write_targets(deployment: Deployment, chosen: list[TargetSpec], options) -> tuple[dict, dict]:
    """Each chosen target's files (with tokenizer.json where it reads only that file and the folder had to have
    it built from vocab.json + merges.txt), and the records the targets keep, by their keys."""
    staging = deployment.staging
    needs_json = any(spec.tokenizer_json for spec in chosen)
    made = [TOKENIZER_JSON] if needs_json and ensure_tokenizer_json(staging, read_from=deployment.source.folder) else []
    written, records = {}, {}
    for spec in chosen:
        result = spec.write(deployment, options.of(spec))
        written[spec.name] = result.files + (made if spec.tokenizer_json else [])
        if spec.record is not None and result.record is not None:
            records[spec.record] = result.record
    return written, records


def _foreign(source: Path, manifest: Manifest, chosen: list[TargetSpec]) -> list[str]:
    """What deploy keeps as it is, beside the files it writes (in place or into -o): every entry its manifest
    does not list (sub-folders such as trt_cache/, links, your files, a file you put into onnx/). A foreign entry
    where a target asked for would write is refused, and so is one that is no file, folder or link."""
    writes = {path: spec for spec in chosen for path in spec.paths}
    foreign = foreign_entries(source, manifest)
    for rel in foreign:
        path = source / rel
        top = rel.split("/")[0]
        if top in writes:
            raise BadInput(
                f"'{path}' was not written by gpt2onnx deploy, and the {writes[top].name} target would replace it:"
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
