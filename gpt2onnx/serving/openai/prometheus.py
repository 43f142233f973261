"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own: requests by route and status,
prompt and generated tokens, the engine's queue and running requests, and latency histograms (time to first token,
between tokens, whole request), named as vLLM names its own."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, load: Callable[[], tuple[int, int]]):
        """``load``: the engine's (waiting, running) requests, read when scraped."""
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("gpt2onnx_requests", "HTTP requests answered.", ["route", "status"], registry=registry)
        self.prompt_tokens = Counter("gpt2onnx_prompt_tokens", "Prompt tokens read.", registry=registry)
        self.generation_tokens = Counter("gpt2onnx_generation_tokens", "Tokens generated.", registry=registry)
        self.finished = Counter(
            "gpt2onnx_requests_finished", "Engine requests ended, by reason.", ["reason"], registry=registry
        )
        waiting = Gauge("gpt2onnx_requests_waiting", "Requests queued for a row of the batch.", registry=registry)
        running = Gauge("gpt2onnx_requests_running", "Requests decoding in the batch.", registry=registry)
        waiting.set_function(lambda: load()[0])
        running.set_function(lambda: load()[1])
        self.first_token = Histogram(
            "gpt2onnx_time_to_first_token_seconds", "From the request to its first token.", buckets=LATENCY_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.inter_token = Histogram(
            "gpt2onnx_inter_token_latency_seconds", "Between a request's tokens.", buckets=LATENCY_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.latency = Histogram(
            "gpt2onnx_e2e_request_latency_seconds", "From the request to its last token.", buckets=LATENCY_BUCKETS,
            registry=registry,
        )  # fmt: skip

    def text(self) -> bytes:
        return generate_latest(self.registry)
