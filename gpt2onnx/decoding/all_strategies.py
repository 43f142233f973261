"""Every decoding strategy, by name, in the order they are tried: the first whose ``applies`` is true for a request
runs it. A new one is a module beside this one and a line here."""

from __future__ import annotations

from gpt2onnx.decoding import beam, runtime_loop, sample, speculative
from gpt2onnx.decoding.strategy import Request, Strategy
from gpt2onnx.registry import Registry

STRATEGIES: Registry[Strategy] = Registry(
    "decoding strategy", (speculative.STRATEGY, runtime_loop.STRATEGY, beam.STRATEGY, sample.STRATEGY)
)


def strategy_for(runtime, request: Request) -> Strategy:
    """The strategy that runs ``request`` on ``runtime`` (the last one applies to every request)."""
    return next(s for s in STRATEGIES.values() if s.applies(runtime, request))
