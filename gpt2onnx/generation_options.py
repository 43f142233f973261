"""The options of a generation request and one rule per setting, shared by every layer that takes a request.

:class:`Sampling`, :class:`Decoding` and ``MAX_NEW_TOKENS`` have transformers' generate() names and semantics, each
option declared once (gpt2onnx.params) and checked when built; :func:`check_pair` applies the rules between the two,
:func:`features_of` and :func:`request_declared` say which decoding features a request uses (what a runtime may
lack, gpt2onnx.capabilities), and :func:`rules` gives each setting's rule, by which generation_config.json's reader
(gpt2onnx.artifact.generation) reads the same settings, so that the same value is refused with the same words
wherever it comes from. A leaf, as vLLM's ``sampling_params``: the runtimes that run their own loop and the
artifact's file reader take these, below the decode loop (gpt2onnx.decoding).

Each setting has transformers' name and one rule: an integer in a range (a token id: inside the vocabulary), a
finite number in a range, a boolean. A value from a file is refused naming the file ("fix or delete the
field"), one from the command line naming the option. JSON's NaN and Infinity (Python's json reads them), 2**64,
1e30, a string "50256" or true where a number belongs: each is refused before anything is built or written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from gpt2onnx.capabilities import Declared
from gpt2onnx.errors import BadInput
from gpt2onnx.params import COUNT_MAX, SEED_MAX, Option, Param, Rule, options_of, param

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
