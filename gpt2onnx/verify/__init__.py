"""Our model beside its reference: gates and metrics, the lockstep comparison with transformers'
GPT2LMHeadModel (or a source ONNX graph), parity checks that end in one CheckReport, fp16 emulation, and
quality on real text (evaluate)."""
