"""Serving: the batching engine (continuous batching over a stepper), the request reader, the Triton models."""
