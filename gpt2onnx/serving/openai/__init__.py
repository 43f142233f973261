"""An OpenAI-compatible endpoint over the batching engine, split as vLLM's entrypoints are: :mod:`.protocol` (the
request models and the ``openai`` package's response types), :mod:`.serving` (one request into engine
submissions, events into responses and server-sent events), :mod:`.routes` (the FastAPI app and its routes),
:mod:`.prometheus` (the metrics), :mod:`.server` (uvicorn). Nothing here imports torch or transformers: the
tokenizer is read with the ``tokenizers`` package."""
