"""The torch side: GPT-2 architectures (architecture), checkpoints in (checkpoint), the export-oriented module
(model) and the transformers reference out (reference). Only this package and its callers import torch;
`architecture` itself does not."""
