"""Every decoding strategy, in the order they are tried: the first whose ``applies`` is true for a request runs it.
A new one is a module beside this one and a line here."""

from __future__ import annotations

from gpt2onnx.decoding import beam, runtime_loop, sample, speculative
from gpt2onnx.decoding.strategy import Request, Strategy

STRATEGIES: tuple[Strategy, ...] = (speculative.STRATEGY, runtime_loop.STRATEGY, beam.STRATEGY, sample.STRATEGY)


def strategy_for(runtime, request: Request) -> Strategy:
    """The strategy that runs ``request`` on ``runtime`` (the last one applies to every request)."""
    return next(s for s in STRATEGIES if s.applies(runtime, request))
