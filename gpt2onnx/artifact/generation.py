"""Generation settings, typed: one reader for generation_config.json and one rule per setting, shared by the
decoding options of ``generate`` (gpt2onnx.decoding.results), ``deploy`` (genai, ort-generate) and every
runtime, so that the same value is refused with the same words wherever it comes from.

Each setting has transformers' name and one rule: an integer in a range (a token id: inside the vocabulary), a
finite number in a range, a boolean. A value from a file is refused naming the file ("fix or delete the
field"), one from the command line naming the option. JSON's NaN and Infinity (Python's json reads them), 2**64,
1e30, a string "50256" or true where a number belongs: each is refused before anything is built or written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gpt2onnx.artifact.folder import CONFIG_FILE, GENERATION_CONFIG_FILE, MANIFEST_NAME, read_json_file
from gpt2onnx.artifact.paths import file_in_folder
from gpt2onnx.capabilities import Declared
from gpt2onnx.errors import BadInput
from gpt2onnx.params import COUNT_MAX, SEED_MAX, Option, Param, Rule, _shown, options_of, param

MIN_TEMPERATURE = 1e-6  # below this, logits / temperature overflow float64
MAX_FACTOR = 1e6  # temperature and repetition penalty: beyond, scores overflow float32 or all become equal
MAX_LENGTH_PENALTY = 10.0  # new_length ** length_penalty stays finite in float32 for any length a model holds


# every entry point applies these rules, by transformers' names: the declared options of a request (Sampling,
# Decoding below; MAX_NEW_TOKENS) and what generation_config.json and config.json also give
COUNTS = Rule("int", 0, COUNT_MAX)
TOKEN = Rule("int", token=True)
MORE_RULES = {
    "max_length": Rule("int", 1, COUNT_MAX),
    "min_length": COUNTS,
    "eos_token_id": TOKEN,
    "pad_token_id": TOKEN,
    "bos_token_id": TOKEN,
}


def check_option(name: str, value, *, vocab_size: int | None = None):
    """A decoding option from the command line or the Python API (``name``: transformers' name), by its rule."""
    return rules()[name].check(value, name=name, source=f"(--{name.replace('_', '-')})", vocab_size=vocab_size)


@functools.cache  # read for every option of every request
def rules() -> dict[str, Rule]:
    """Every setting's rule by transformers' name: the declared options' and MORE_RULES."""
    declared = [*options_of(Sampling), *options_of(Decoding), MAX_NEW_TOKENS]
    return {**{o.key: o.param.rule for o in declared if o.param.rule is not None}, **MORE_RULES}


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


# -- the options of a generation request: transformers' generate() names and semantics ----------------------------
def _set(**options) -> list[str]:
    """The names of the options given (True, or a value that is not None): those a mode would ignore."""
    return [name for name, value in options.items() if value is not None and value is not False]


SEED_RULE = Rule("int", 0, SEED_MAX)
MAX_NEW_TOKENS = Option(
    "max_new_tokens",
    int,
    32,
    Param("Most new tokens per row.", rule=Rule("int", 1, COUNT_MAX), served=True),
)


@dataclass(frozen=True)
class Sampling:
    """Greedy unless ``sample`` is set. Checked when built (the rules between it and a Decoding: check_pair); each
    option declared once, here (gpt2onnx.params)."""

    sample: bool = param(
        False, "Sample instead of greedy.", name="do_sample", rule=Rule("bool"), served=True, config=True
    )
    temperature: float = param(
        1.0, "Sampling temperature.", rule=Rule("float", MIN_TEMPERATURE, MAX_FACTOR), served=True, config=True
    )
    top_k: int = param(0, "Sample from the top k (0: all).", rule=COUNTS, served=True, config=True)
    top_p: float = param(
        1.0, "Sample from the top-p mass.", rule=Rule("float", 0.0, 1.0, open_low=True), served=True, config=True
    )
    seed: int | None = param(None, "Sampling seed.", rule=SEED_RULE, served=True)

    def __post_init__(self) -> None:  # an invalid one cannot be built
        if not self.sample:
            ignored = _set(
                temperature=self.temperature != 1.0, top_k=self.top_k != 0, top_p=self.top_p != 1.0, seed=self.seed
            )
            if ignored:
                raise BadInput(
                    f"{', '.join(ignored)} only apply when sampling: turn sampling on (--sample), or drop them"
                )
        # each by its declared rule, the one generation_config.json is read by: the same words for both
        for option in options_of(Sampling)[1:]:
            if getattr(self, option.field) is not None:
                check_option(option.key, getattr(self, option.field))


EARLY_STOPPING = {"true": True, "false": False, "never": "never"}


@dataclass(frozen=True)
class Decoding:
    """transformers' generate() options beyond sampling, with its names, defaults and semantics; checked when built.

    ``num_beams`` > 1 is beam search (:mod:`gpt2onnx.decoding.beam`); ``early_stopping`` is True, False or
    "never" (also as the words true, false, never); ``stop``: strings that end a row (needs the folder's
    tokenizer)."""

    num_beams: int = param(
        1, "Beams (1: greedy or sampling).", rule=Rule("int", 1, COUNT_MAX), served=True, config=True
    )
    length_penalty: float = param(
        1.0,
        "Beams: score / new_length ** this.",
        rule=Rule("float", -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
        served=True,
        config=True,
    )
    early_stopping: bool | str = param(False, "Beams: true, false or never.", served=True, cli=(str, "false"))
    num_return_sequences: int = param(1, "Sequences per prompt (≤ beams).", rule=Rule("int", 1, COUNT_MAX))
    repetition_penalty: float = param(
        1.0,
        "Penalise tokens already in the row.",
        rule=Rule("float", 1 / MAX_FACTOR, MAX_FACTOR),
        served=True,
        config=True,
    )
    no_repeat_ngram_size: int = param(
        0, "No n-gram of this size twice (0: off).", rule=COUNTS, served=True, config=True
    )
    min_new_tokens: int = param(0, "No end-of-sequence before this many.", rule=COUNTS, served=True)
    stop: tuple[str, ...] = param((), "Stop a row at this text (repeatable).", cli=(Optional[list[str]], None))

    def __post_init__(self) -> None:  # an invalid one cannot be built
        for option in options_of(Decoding):
            if option.param.rule is not None:
                check_option(option.key, getattr(self, option.field))
        early = self.early_stopping
        if isinstance(early, str) and not isinstance(early, bool):
            early = EARLY_STOPPING.get(early.lower(), early)
        if early not in (True, False, "never"):
            raise BadInput(
                f"--early-stopping must be true, false or never (early_stopping), got {self.early_stopping!r}"
            )
        object.__setattr__(self, "early_stopping", early)
        object.__setattr__(self, "stop", tuple(self.stop))
        if not self.beams:
            ignored = _set(length_penalty=self.length_penalty != 1.0, early_stopping=self.early_stopping is not False)
            ignored = [f"{name} (--{name.replace('_', '-')})" for name in ignored]
            if ignored:
                raise BadInput(
                    f"{' and '.join(ignored)} only {'apply' if len(ignored) > 1 else 'applies'} to beam search:"
                    " give --num-beams 2 or more"
                )
        if any(not s for s in self.stop):
            raise BadInput("a stop string (--stop) is empty: give some text")

    @property
    def beams(self) -> bool:
        return self.num_beams > 1

    def processors_on(self) -> bool:
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0 or self.min_new_tokens > 0

    @property
    def rows_per_prompt(self) -> int:
        """The rows a prompt takes in the decode loop: its beams, or its returned sequences."""
        return max(self.num_beams, self.num_return_sequences)


# What a request uses, as the decoding features a runtime may lack (gpt2onnx.capabilities' fact "features"); the
# pairs are features of their own where a loop can do each alone but not both (genai's beams with stop strings)
SAMPLING, BEAMS, TOP_K = "--sample", "beam search (--num-beams)", "--top-k"
NO_REPEAT_NGRAM, MIN_NEW_TOKENS, EARLY_STOPPING_NEVER = (
    "--no-repeat-ngram-size",
    "--min-new-tokens",
    "--early-stopping never",
)
BEAMS_WITH_STOP, BEAMS_WITH_PENALTY = "--stop with beam search", "--repetition-penalty with beam search"
SAMPLED_SEQUENCES, SEVERAL_SEQUENCES = "--num-return-sequences with sampling", "--num-return-sequences above 1"
STOP_STRINGS = "--stop"
CONSTRAINED = "a constraint (--json-schema, --regex, --grammar, --choice)"  # gpt2onnx.decoding.constraints


def features_of(sampling: Sampling, decoding: Decoding) -> frozenset[str]:
    """The decoding features a request with these options uses."""
    used = {
        SAMPLING: sampling.sample,
        TOP_K: sampling.sample and sampling.top_k != 0,
        BEAMS: decoding.beams,
        NO_REPEAT_NGRAM: decoding.no_repeat_ngram_size > 0,
        MIN_NEW_TOKENS: decoding.min_new_tokens > 0,
        EARLY_STOPPING_NEVER: decoding.early_stopping == "never",
        STOP_STRINGS: bool(decoding.stop),
        BEAMS_WITH_STOP: decoding.beams and bool(decoding.stop),
        BEAMS_WITH_PENALTY: decoding.beams and decoding.repetition_penalty != 1.0,
        SEVERAL_SEQUENCES: decoding.num_return_sequences > 1,
        SAMPLED_SEQUENCES: sampling.sample and decoding.num_return_sequences > 1,
    }
    return frozenset(name for name, on in used.items() if on)


def request_declared(sampling: Sampling, decoding: Decoding) -> Declared:
    """What a request's options declare: the features it uses, and the settings a search op may take as attributes
    (each where it applies: beams', sampling's) (gpt2onnx.capabilities)."""
    settings = {"no_repeat_ngram_size": decoding.no_repeat_ngram_size}
    if decoding.beams:
        settings |= {"early_stopping": decoding.early_stopping, "length_penalty": decoding.length_penalty}
    if sampling.sample:
        settings |= {"temperature": sampling.temperature, "top_p": sampling.top_p}
    features = {"features": features_of(sampling, decoding)}
    says = {name: f"sets {name} to {value}" for name, value in settings.items()}
    return Declared("request", "options", ensures={**features, **settings}, says=says, label="the request")


def check_pair(sampling: Sampling, decoding: Decoding) -> None:
    """The rules between sampling and decoding, applied where the two meet (generate, decode, a served request)."""
    if decoding.num_return_sequences > max(decoding.num_beams, 2**31 if sampling.sample else 1):
        raise BadInput(
            f"num_return_sequences (--num-return-sequences) {decoding.num_return_sequences} must be 1 to num_beams"
            f" ({decoding.num_beams}) with beam search, 1 with greedy decoding: raise --num-beams, or sample"
        )
    if decoding.beams and sampling.sample:
        raise BadInput("beam sampling (--num-beams with --sample) is not offered: drop one of them")
