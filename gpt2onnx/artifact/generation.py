"""generation_config.json, typed and read: :class:`GenerationConfig` and its one reader, and the special token ids
a folder gives outside the vocabulary.

:func:`read_generation_config` reads generation_config.json (and config.json for the token ids it does not give),
each setting by the rule its request option declares (gpt2onnx.generation_options): a value from the file is
refused with the same words as from the command line, naming the file ("fix or delete the field").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpt2onnx.artifact.folder import CONFIG_FILE, GENERATION_CONFIG_FILE, MANIFEST_NAME, read_json_file
from gpt2onnx.artifact.paths import file_in_folder
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling, rules
from gpt2onnx.params import COUNT_MAX, _shown, options_of


@dataclass(frozen=True)
class GenerationConfig:
    """generation_config.json, typed and checked (transformers' defaults where it says nothing; the token ids
    also from config.json, as transformers reads them). ``eos_token_ids``: one id or several; ``pad_token_id``
    None where neither file names one (transformers then pads with the first eos id). ``max_length`` None: not
    given (each consumer has its own default)."""

    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    max_length: int | None = None
    min_length: int = 0
    where: dict[str, str] = field(default_factory=dict, compare=False)  # setting → the file it came from
    # special token ids outside the vocabulary that the export recorded (the manifest's outside_vocabulary): as in
    # transformers they never come, so they are left out of the ids above (an eos that never fires, no bos or pad)
    outside_vocabulary: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False)


def _search() -> tuple[str, ...]:
    """The search settings generation_config.json gives: the declared options it holds, and the lengths."""
    options = [o.key for o in (*options_of(Sampling), *options_of(Decoding)) if o.param.config]
    return (*options, "max_length", "min_length")


SPECIAL_TOKENS = ("eos_token_id", "pad_token_id", "bos_token_id")


def _special_token_values(folder: Path) -> list[tuple[Path, dict]]:
    sources = []
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        path = folder / name
        if path.exists() or path.is_symlink():  # a regular file of the folder: a link leading out is refused
            path = file_in_folder(folder, name, what=name, where=folder)
            sources.append((path, read_json_file(path, name)))
    return sources


def special_tokens_outside(folder: str | Path, vocab_size: int) -> dict[str, list[int]]:
    """The special token ids (eos, pad, bos) that the folder's generation_config.json and config.json give outside
    a vocabulary of ``vocab_size`` (non-negative integers from ``vocab_size`` up): what export records in the
    manifest (``outside_vocabulary``), so that every reader of the folder accepts them as ids that never come."""
    found: dict[str, list[int]] = {}
    for _, data in _special_token_values(Path(folder)):
        for key in SPECIAL_TOKENS:
            value = data.get(key)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, int) and not isinstance(item, bool) and vocab_size <= item <= COUNT_MAX:
                    if item not in found.setdefault(key, []):
                        found[key].append(item)
    return found


def _recorded_outside(folder: Path) -> dict[str, tuple[int, ...]]:
    """The manifest's outside_vocabulary record (what export found and wrote), {} without one."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return {}
    record = read_json_file(path, "manifest").get("outside_vocabulary")
    if not isinstance(record, dict):
        return {}
    return {
        str(k): tuple(i for i in v if isinstance(i, int) and not isinstance(i, bool))
        for k, v in record.items()
        if isinstance(v, list)
    }


def refuse_eos_outside(generation: GenerationConfig, vocab_size: int, *, needs: str) -> None:
    """A BadInput for a consumer that needs an eos inside the vocabulary (``needs``: who) where the model's is
    outside it: the export recorded it (it never comes), and this consumer cannot represent that."""
    eos = generation.outside_vocabulary.get("eos_token_id")
    if eos and not generation.eos_token_ids:
        raise BadInput(
            f"eos_token_id {'/'.join(map(str, eos))} is outside the model's vocabulary of {vocab_size} tokens (it"
            f" never comes, as the manifest records), which {needs} cannot represent: set an eos_token_id from 0 to"
            f" {vocab_size - 1} in the checkpoint's generation_config.json and export again, or choose another target"
        )


def read_generation_config(
    folder: str | Path, *, vocab_size: int | None, outside_vocabulary: dict | None = None
) -> GenerationConfig:
    """The folder's generation settings, each checked by its rule (token ids inside a vocabulary of
    ``vocab_size``, when known): generation_config.json, and config.json for token ids it does not give. Files
    are read as regular JSON files of the folder (artifact.folder.read_json_file). Special token ids outside the
    vocabulary are accepted where the export recorded them (``outside_vocabulary``, by default the folder's
    manifest's record; a staging copy without one passes its source's), and left out as ids that never come."""
    folder = Path(folder)
    sources = _special_token_values(folder)
    recorded = {} if not vocab_size else outside_vocabulary if outside_vocabulary is not None else None
    recorded = _recorded_outside(folder) if recorded is None else recorded
    outside: dict[str, tuple[int, ...]] = {}
    values: dict = {}
    where: dict[str, str] = {}

    def source_of(key: str):
        for path, data in sources:
            if data.get(key) is not None:
                return path, data[key]
        return None, None

    for key in SPECIAL_TOKENS:
        path, value = source_of(key)
        if path is None:
            continue
        items = value if isinstance(value, list) and key == "eos_token_id" else [value]
        if not items:
            continue
        never = [v for v in items if v in recorded.get(key, ()) and v >= vocab_size]
        if never:  # recorded by the export: outside the vocabulary, so they never come (as in transformers)
            outside[key] = tuple(never)
            items = [v for v in items if v not in never]
            if not items:
                continue
        ids = tuple(rules()[key].check(v, name=key, source=f"in '{path}'", vocab_size=vocab_size) for v in items)
        values["eos_token_ids" if key == "eos_token_id" else key] = ids if key == "eos_token_id" else ids[0]
        where[key] = str(path)
    generation = sources[0] if sources and sources[0][0].name == GENERATION_CONFIG_FILE else None
    if generation is not None:
        path, data = generation
        for key in _search():
            if data.get(key) is not None:
                values[key] = rules()[key].check(data[key], name=key, source=f"in '{path}'")
                where[key] = str(path)
        early = data.get("early_stopping")
        if early is not None:
            if not (isinstance(early, bool) or early == "never"):
                raise BadInput(
                    f"early_stopping {_shown(early)} in '{path}' is not true, false or \"never\": fix or delete the"
                    " field"
                )
            values["early_stopping"] = early
            where["early_stopping"] = str(path)
    return GenerationConfig(**values, where=where, outside_vocabulary=outside)
