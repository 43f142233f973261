"""Every proposer of speculative decoding, by name: a new one is a module beside this one and a line here (its
options become generate's and bench's command-line options, and requests naming them are refused by the engine)."""

from __future__ import annotations

from gpt2onnx.decoding.proposers import draft, prompt_lookup
from gpt2onnx.decoding.proposers.proposer import ProposerSpec
from gpt2onnx.registry import Registry

PROPOSERS: Registry[ProposerSpec] = Registry("proposer", (prompt_lookup.PROPOSER, draft.PROPOSER))
