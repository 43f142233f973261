"""Beam search's speed (`gpt2onnx bench beam`): gpt2onnx's beam search (one K/V cache row per beam, reordered
where the cache lives) against transformers' ``GPT2LMHeadModel.generate(num_beams=...)`` on the same weights, in
the harness's rotating rounds.

requires: a folder whose runtime runs beam search (the resolver says, before anything loads), its source
checkpoint (the manifest's) or ``reference``, and torch. ensures: each side's seconds per run and beams × steps
per second, medians with quartiles, gpt2onnx's ratio to transformers round by round, and whether the two searches
gave the same tokens (checked once, untimed). Both sides decode exactly ``new_tokens`` tokens
(``min_new_tokens`` = ``max_new_tokens``: an end-of-sequence cannot end one side's run early) from the same
left-padded batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import Decoding, Sampling, read_generation_config, request_declared
from gpt2onnx.artifact.paths import check_output_files
from gpt2onnx.decoding.generate import decode
from gpt2onnx.errors import BadInput
from gpt2onnx.runtimes.base import RuntimeOptions, open_runtime
from gpt2onnx.verify.harness import Rounds, interleave, write_outputs

OURS, THEIRS = "gpt2onnx", "transformers"


@dataclass(frozen=True)
class BeamReport:
    folder: str
    batch: int
    beams: int
    prompt_len: int
    new_tokens: int
    same_tokens: bool  # gpt2onnx's beams gave transformers' tokens (one untimed run each)
    torch_device: str
    rounds: Rounds  # figures: seconds (per run), beam_steps_per_s (batch × beams × new tokens / seconds)

    def as_dict(self) -> dict:
        return {
            "folder": self.folder,
            "batch": self.batch,
            "beams": self.beams,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens,
            "same_tokens": self.same_tokens,
            "torch_device": self.torch_device,
            "rounds": self.rounds.as_dict(),
        }

    def markdown(self) -> str:
        return (
            f"Beam search, batch {self.batch} × {self.beams} beams, prompt {self.prompt_len} (left-padded),"
            f" {self.new_tokens} new tokens; torch on {self.torch_device}; the same tokens as transformers:"
            f" {'yes' if self.same_tokens else 'NO'}.\n\n" + self.rounds.markdown()
        )


def bench_beams(
    folder: str | Path,
    *,
    runtime: RuntimeOptions | None = None,
    batch: int = 2,
    beams: int = 4,
    prompt_len: int = 32,
    new_tokens: int = 32,
    warmup: int = 1,
    repeat: int = 5,
    reference: str | None = None,
    json_path: str | Path | None = None,
    markdown_path: str | Path | None = None,
    progress: Callable[[], None] | None = None,
    before_writing: Callable[[], None] | None = None,
) -> BeamReport:
    """Time ``folder``'s beam search against transformers' on its source weights, in interleaved rounds."""
    import torch

    from gpt2onnx.pytorch.reference import reference_model
    from gpt2onnx.verify.bench import torch_device
    from gpt2onnx.verify.lockstep import left_padded_batch
    from gpt2onnx.verify.parity import reference_checkpoint

    for name, value, least in (("batch", batch, 1), ("beams", beams, 2), ("prompt length", prompt_len, 1)):
        if value < least:
            raise BadInput(f"{name} must be at least {least}, got {value}")
    if new_tokens < 1:
        raise BadInput(f"new tokens must be a positive integer, got {new_tokens}")
    outputs = {"--json": json_path, "--md": markdown_path}
    check_output_files(outputs, inputs=(Path(folder),))
    model = open_folder(folder)
    decoding = Decoding(num_beams=beams, min_new_tokens=new_tokens)
    options = runtime or RuntimeOptions()
    decoder = open_runtime(model, options, request_declared(Sampling(), decoding))
    checkpoint = reference_checkpoint(model, reference)
    device = torch_device(options.settings) if options.name == "onnxruntime" else "cpu"
    if options.threads:
        torch.set_num_threads(options.threads)
    theirs_model = reference_model(checkpoint, device=device)
    vocab = model.facts.vocab_size
    ids, mask = left_padded_batch(vocab, batch=batch, length=prompt_len, seed=0)
    eos_ids = read_generation_config(model.folder, vocab_size=vocab).eos_token_ids
    eos = eos_ids[0] if eos_ids else vocab - 1

    def ours() -> np.ndarray:
        return decode(decoder, ids, mask, max_new_tokens=new_tokens, decoding=decoding, eos_token_id=eos).tokens

    def theirs() -> np.ndarray:
        with torch.no_grad():
            out = theirs_model.generate(
                torch.tensor(ids, device=device),
                attention_mask=torch.tensor(mask, device=device),
                num_beams=beams,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=eos,
                eos_token_id=eos,
            )
        return out[:, ids.shape[1] :].cpu().numpy()

    same = bool(np.array_equal(ours(), theirs()))
    work = batch * beams * new_tokens

    def timed(run: Callable[[], np.ndarray]) -> Callable[[], dict]:
        def figures() -> dict:
            start = time.perf_counter()
            run()
            seconds = time.perf_counter() - start
            return {"seconds": seconds, "beam_steps_per_s": work / seconds}

        return figures

    rounds = interleave(
        {OURS: timed(ours), THEIRS: timed(theirs)}, rounds=repeat, warmup=warmup, baseline=THEIRS, on_run=progress
    )
    report = BeamReport(str(folder), batch, beams, prompt_len, new_tokens, same, device, rounds)
    return write_outputs(report, json_path=json_path, markdown_path=markdown_path, before_writing=before_writing)
