"""Generation settings, typed: one reader for generation_config.json and one rule per setting, shared by the
decoding options of ``generate`` (gpt2onnx.runtimes.decoding), ``deploy`` (genai, ort-generate) and every
runtime, so that the same value is refused with the same words wherever it comes from.

Each setting has transformers' name and one rule: an integer in a range (a token id: inside the vocabulary), a
finite number in a range, a boolean. A value from a file is refused naming the file ("fix or delete the
field"), one from the command line naming the option. JSON's NaN and Infinity (Python's json reads them), 2**64,
1e30, a string "50256" or true where a number belongs: each is refused before anything is built or written.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gpt2onnx.artifact.folder import CONFIG_FILE, GENERATION_CONFIG_FILE, MANIFEST_NAME, read_json_file
from gpt2onnx.artifact.paths import file_in_folder
from gpt2onnx.errors import BadInput

COUNT_MAX = 2**31 - 1  # counts and sizes: what an int32 attribute or config field holds
SEED_MAX = 2**63 - 1
MIN_TEMPERATURE = 1e-6  # below this, logits / temperature overflow float64
MAX_FACTOR = 1e6  # temperature and repetition penalty: beyond, scores overflow float32 or all become equal
MAX_LENGTH_PENALTY = 10.0  # new_length ** length_penalty stays finite in float32 for any length a model holds


@dataclass(frozen=True)
class Rule:
    """One setting's rule: ``kind`` int, float or bool; the closed range [low, high] (``open_low``: low itself
    excluded); ``token``: a token id (the high end is the vocabulary's last id)."""

    kind: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    token: bool = False

    def wanted(self, vocab_size: int | None = None) -> str:
        """The rule in words (the same in every message that applies it)."""
        if self.kind == "bool":
            return "true or false"
        if self.token:
            top = COUNT_MAX if vocab_size is None else vocab_size - 1
            return f"a token id: an integer from 0 to {top}" + (" (the vocabulary)" if vocab_size else "")
        if self.kind == "int":
            return f"an integer from {self.low:,} to {self.high:,}"
        if self.open_low:
            return f"a finite number above {self.low:g} and at most {self.high:g}"
        return f"a finite number from {self.low:g} to {self.high:g}"

    def _within(self, value: float, *, narrow=float) -> bool:
        low, high = narrow(self.low), narrow(self.high)  # the bounds in the same type as the value
        return (value > low if self.open_low else value >= low) and value <= high

    def check(self, value, *, name: str, source: str, vocab_size: int | None = None):
        """``value`` typed (int, float or bool) if it meets the rule, else BadInput: '{name} {value} {source}
        is not {rule}: {what to do}'. ``source``: '(--top-k)' for an option, "in 'FILE'" for a file."""
        if self.kind == "bool":
            ok = isinstance(value, bool)
        elif self.kind == "int":
            low, high = (0, vocab_size - 1 if vocab_size else COUNT_MAX) if self.token else (self.low, self.high)
            ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and self._within(value)
            # and as the runtimes store it (ONNX attributes, float32 scores)
            if ok and not self._within(as_float32(value), narrow=as_float32):
                raise BadInput(
                    f"{name} {_shown(value)} {source} is {as_float32(value):g} as a float32, the type the runtimes"
                    f" store it in, which is not {self.wanted(vocab_size)}: give a value float32 can hold"
                )
        if not ok:
            hint = "fix or delete the field" if source.startswith("in ") else "give another value"
            raise BadInput(f"{name} {_shown(value)} {source} is not {self.wanted(vocab_size)}: {hint}")
        return float(value) if self.kind == "float" else value


def as_float32(value: float) -> float:
    """``value`` rounded to float32, as a runtime that stores it in that type holds it (1e-46 is 0.0)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _shown(value) -> str:
    try:
        text = json.dumps(value)  # as the file has it: NaN, Infinity, "50256", true
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# transformers' names; the rules every entry point applies
RULES = {
    "do_sample": Rule("bool"),
    "temperature": Rule("float", MIN_TEMPERATURE, MAX_FACTOR),
    "top_k": Rule("int", 0, COUNT_MAX),
    "top_p": Rule("float", 0.0, 1.0, open_low=True),
    "repetition_penalty": Rule("float", 1 / MAX_FACTOR, MAX_FACTOR),
    "no_repeat_ngram_size": Rule("int", 0, COUNT_MAX),
    "num_beams": Rule("int", 1, COUNT_MAX),
    "num_return_sequences": Rule("int", 1, COUNT_MAX),
    "length_penalty": Rule("float", -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
    "min_new_tokens": Rule("int", 0, COUNT_MAX),
    "max_new_tokens": Rule("int", 1, COUNT_MAX),
    "max_length": Rule("int", 1, COUNT_MAX),
    "min_length": Rule("int", 0, COUNT_MAX),
    "seed": Rule("int", 0, SEED_MAX),
    "eos_token_id": Rule("int", token=True),
    "pad_token_id": Rule("int", token=True),
    "bos_token_id": Rule("int", token=True),
}


def check_option(name: str, value, *, vocab_size: int | None = None):
    """A decoding option from the command line or the Python API (``name``: transformers' name), by its rule."""
    return RULES[name].check(value, name=name, source=f"(--{name.replace('_', '-')})", vocab_size=vocab_size)


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


_SEARCH = (
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "num_beams",
    "length_penalty",
    "max_length",
    "min_length",
)


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
        ids = tuple(RULES[key].check(v, name=key, source=f"in '{path}'", vocab_size=vocab_size) for v in items)
        values["eos_token_ids" if key == "eos_token_id" else key] = ids if key == "eos_token_id" else ids[0]
        where[key] = str(path)
    generation = sources[0] if sources and sources[0][0].name == GENERATION_CONFIG_FILE else None
    if generation is not None:
        path, data = generation
        for key in _SEARCH:
            if data.get(key) is not None:
                values[key] = RULES[key].check(data[key], name=key, source=f"in '{path}'")
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
