"""Prompt lookup (transformers' ``prompt_lookup_num_tokens``, ``max_matching_ngram_size``;
PromptLookupCandidateGenerator): the sequence's last n-gram (the longest first, ``max_ngram`` down to 1) is looked
for earlier in the sequence, left to right; the first match with tokens after it proposes up to ``num_tokens`` of
them, cut before an end-of-sequence id. No match: a plain step. It has no distribution of its own."""

from __future__ import annotations

from dataclasses import dataclass

from gpt2onnx.decoding.proposers.proposer import Proposer, ProposerSpec, count
from gpt2onnx.params import param

PROMPT_LOOKUP_NGRAM = 2  # transformers' max_matching_ngram_size default


@dataclass(frozen=True)
class PromptLookupOptions:
    """Tokens per round, and the longest n-gram looked up (checked when built)."""

    prompt_lookup: int | None = param(
        None, "Propose N tokens from n-grams.", metavar="N", name="prompt_lookup_num_tokens", show_default=False
    )
    max_ngram: int | None = param(
        None, "Prompt lookup: longest n-gram \\[2].", metavar="M", name="max_matching_ngram_size", show_default=False
    )

    def __post_init__(self) -> None:
        count("prompt_lookup_num_tokens", "--prompt-lookup", self.prompt_lookup)
        ngram = PROMPT_LOOKUP_NGRAM if self.max_ngram is None else self.max_ngram
        object.__setattr__(self, "max_ngram", count("max_matching_ngram_size", "--max-ngram", ngram))


def lookup(sequence: list[int], num_tokens: int, max_ngram: int, eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """transformers' PromptLookupCandidateGenerator.get_candidates on one row: the sequence's last n-gram (longest
    first) found earlier in it, left to right; the first match followed by any token proposes up to ``num_tokens``
    of what followed, cut before an end-of-sequence id. [] where nothing matches."""
    length = len(sequence)
    for size in range(min(max_ngram, length - 1), 0, -1):
        tail = sequence[-size:]
        for start in range(length - size + 1):
            if sequence[start : start + size] != tail:
                continue
            begin = start + size
            end = min(begin + num_tokens, length)
            if begin < end:
                chosen = sequence[begin:end]
                for i, token in enumerate(chosen):
                    if token in eos_token_ids:
                        return chosen[:i]
                return chosen
    return []


class PromptLookup(Proposer):
    """Proposals copied from the sequence itself; no distribution of its own (``probs`` stays None)."""

    probs = None

    def __init__(self, num_tokens: int, max_ngram: int, eos_token_ids: tuple[int, ...]):
        self.num_tokens, self.max_ngram, self.eos_token_ids = num_tokens, max_ngram, eos_token_ids
        self.steps = 0

    def start(self, prompt: list[int], capacity: int) -> None:
        """A new row."""

    def propose(self, sequence: list[int], limit: int) -> list[int]:
        return lookup(sequence, min(self.num_tokens, limit), self.max_ngram, self.eos_token_ids)[:limit]

    def update(self, sequence: list[int], proposed: int, accepted: int) -> None:
        """After a round: ``sequence`` with its kept tokens."""


PROPOSER = ProposerSpec(
    name="prompt-lookup",
    says="prompt lookup",
    summary="n-grams of the sequence itself propose what followed them (no model)",
    options=PromptLookupOptions,
    make=lambda options, context: PromptLookup(options.prompt_lookup, options.max_ngram, context.eos_token_ids),
    label=lambda options: f"prompt-lookup {options.prompt_lookup}",
)
