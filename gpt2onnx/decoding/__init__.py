"""Decoding: the strategies that turn a runtime's steps into tokens (greedy and sampling, beam search, speculative
decoding with its proposers, a runtime's own loop), transformers' logits processors, text in and out."""
