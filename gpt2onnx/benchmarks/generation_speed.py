"""Generation's speed (`gpt2onnx bench generate`): gpt2onnx's decoding loop on a runtime (greedy, beam search with
one K/V cache row per beam reordered where the cache lives, or the loop a runtime owns: ort-generate's search op,
genai) against transformers' ``GPT2LMHeadModel.generate()`` with the same decoding options on the same weights,
in the harness's rotating rounds.

requires: a folder whose runtime serves those options (the resolver says, before anything loads), its source
checkpoint (the manifest's) or ``reference``, and torch. ensures: each side's seconds per run and beams × steps
per second, medians with quartiles, gpt2onnx's ratio to transformers round by round, and whether the two gave the
same tokens (checked once, untimed). Both sides decode exactly ``new_tokens`` tokens (``min_new_tokens`` =
``max_new_tokens``: an end-of-sequence cannot end one side's run early) from the same left-padded batch, where the
runtime takes min_new_tokens; where it does not (genai: its declarations say), neither side is given it, each row
ends at its end-of-sequence (at most ``new_tokens``) and the work counts the tokens decoded. Each decoding option
goes to generate() under its declared transformers name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.artifact.paths import check_output_files
from gpt2onnx.benchmarks.harness import Rounds, check_runs, interleave, timed, write_outputs
from gpt2onnx.capabilities import resolve
from gpt2onnx.decoding.generate import decode
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling, request_declared
from gpt2onnx.params import options_of
from gpt2onnx.records import Record
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime

THEIRS = "transformers"


@dataclass(frozen=True)
class GenerationReport(Record):
    folder: str
    runtime: str
    batch: int
    beams: int
    prompt_len: int
    new_tokens: int
    options: dict  # the decoding options given, by transformers' names (raw: what generate() was passed)
    same_tokens: bool  # gpt2onnx's loop gave transformers' tokens (one untimed run each)
    torch_device: str
    rounds: Rounds  # figures: seconds (per run), beam_steps_per_s (batch × beams × new tokens / seconds)
    exact_length: bool = True  # both sides decoded new_tokens exactly (False: up to it, each row to its end)

    def markdown(self) -> str:
        return (
            f"Generation on {self.runtime}, batch {self.batch} × {self.beams} beams, prompt {self.prompt_len}"
            f" (left-padded), {self._length()}, {_shown(self.options)}; torch on {self.torch_device};"
            " the same tokens as transformers:"
            f" {'yes' if self.same_tokens else 'NO'}.\n\n" + self.rounds.markdown()
        )

    def _length(self) -> str:
        if self.exact_length:
            return f"{self.new_tokens} new tokens"
        return f"up to {self.new_tokens} new tokens (each row to its end: {self.runtime} takes no min_new_tokens)"


def _shown(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "transformers' defaults"


def generate_options(decoding: Decoding) -> dict:
    """generate()'s arguments for ``decoding``: every option given (not at its default), under its declared
    transformers name; stop strings are refused (generate() needs its tokenizer for them)."""
    if decoding.stop:
        raise BadInput("bench generate takes no --stop: stop strings end rows at different steps on each side")
    return {o.key: getattr(decoding, o.field) for o in options_of(Decoding) if getattr(decoding, o.field) != o.default}


def bench_generation(
    folder: str | Path,
    *,
    runtime: RuntimeOptions | None = None,
    decoding: Decoding = Decoding(num_beams=4),
    batch: int = 2,
    prompt_len: int = 32,
    new_tokens: int = 32,
    warmup: int = 1,
    repeat: int = 5,
    reference: str | None = None,
    json_path: str | Path | None = None,
    markdown_path: str | Path | None = None,
    progress: Callable[[], None] | None = None,
    before_writing: Callable[[], None] | None = None,
) -> GenerationReport:
    """Time ``folder``'s decoding loop against transformers' generate() with the same ``decoding`` options on its
    source weights, in interleaved rounds."""
    import torch

    from gpt2onnx.benchmarks.bench import torch_device
    from gpt2onnx.pytorch.reference import reference_model
    from gpt2onnx.verify.lockstep import left_padded_batch
    from gpt2onnx.verify.parity import reference_checkpoint

    for name, value, least in (("batch", batch, 1), ("prompt length", prompt_len, 1)):
        if value < least:
            raise BadInput(f"{name} must be at least {least}, got {value}")
    if new_tokens < 1:
        raise BadInput(f"new tokens must be a positive integer, got {new_tokens}")
    check_runs(warmup, repeat)
    outputs = {"--json": json_path, "--md": markdown_path}
    check_output_files(outputs, inputs=(folder, reference))  # the reference checkpoint is read too
    given = generate_options(decoding)
    model = open_folder(folder)
    options = runtime or RuntimeOptions()
    exact = forces_length(options, decoding, new_tokens)
    decoding = dataclasses.replace(decoding, min_new_tokens=new_tokens) if exact else decoding
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
                **{**given, "max_new_tokens": new_tokens, **({"min_new_tokens": new_tokens} if exact else {})},
                do_sample=False,
                pad_token_id=eos,
                eos_token_id=eos,
            )
        return out[:, ids.shape[1] :].cpu().numpy()

    mine = ours()
    same = bool(np.array_equal(mine, theirs())) if exact else _rows(mine, eos) == _rows(theirs(), eos)
    work = decoding.num_beams * (batch * new_tokens if exact else sum(len(row) for row in _rows(mine, eos)))
    ours_name = f"gpt2onnx ({options.name})"

    rounds = interleave(
        {ours_name: timed(ours, {"beam_steps_per_s": work}), THEIRS: timed(theirs, {"beam_steps_per_s": work})},
        rounds=repeat,
        warmup=warmup,
        baseline=THEIRS,
        on_run=progress,
    )
    report = GenerationReport(
        str(folder), options.name, batch, decoding.num_beams, prompt_len, new_tokens, given, same, device, rounds, exact
    )
    return write_outputs(report, json_path=json_path, markdown_path=markdown_path, before_writing=before_writing)


def forces_length(options: RuntimeOptions, decoding: Decoding, new_tokens: int) -> bool:
    """Whether bench generate gives both sides min_new_tokens = new_tokens: unless the runtime's declarations refuse
    it where they take the request without it (genai cannot apply min_new_tokens as transformers does)."""
    forced = dataclasses.replace(decoding, min_new_tokens=new_tokens)
    takes = resolve([*options.declared, request_declared(Sampling(), forced)]).ok
    return takes or not resolve([*options.declared, request_declared(Sampling(), decoding)]).ok


def _rows(tokens: np.ndarray, eos: int) -> list[list[int]]:
    """Each row's new tokens up to and with its first end-of-sequence (after it: padding)."""
    rows = []
    for row in np.asarray(tokens).tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows
