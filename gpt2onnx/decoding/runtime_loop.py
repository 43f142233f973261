"""A runtime's own loop (onnxruntime-genai, onnxruntime's generation ops): the prompts' real tokens handed to it,
its sequences made into the decode loop's result (rows cut at their end-of-sequence or stop string, ``on_step``
called once the loop has finished)."""

from __future__ import annotations

from gpt2onnx.capabilities import Need
from gpt2onnx.decoding.results import Generation, loop_generation
from gpt2onnx.decoding.strategy import Request, Strategy


def _run(runtime, request: Request) -> Generation:
    prompts = [row[m > 0].tolist() for row, m in zip(request.input_ids, request.mask)]
    found = runtime.continue_prompts(
        prompts,
        max_new_tokens=request.max_new_tokens,
        sampling=request.sampling,
        decoding=request.decoding,
        eos_token_ids=request.eos_token_ids,
    )
    generation = loop_generation(
        prompts,
        found.sequences,
        eos_token_ids=request.eos_token_ids,
        pad_token_id=request.pad_token_id,
        stop=request.stop,
        decoding=request.decoding,
        step_seconds=found.step_seconds,
        on_step=request.on_step,
    )
    generation.scores = found.scores
    return generation


STRATEGY = Strategy(
    name="runtime loop",
    summary="the runtime's own generation loop (greedy, sampling and beams as it does them)",
    applies=lambda runtime, request: runtime.capabilities.owns_loop,
    run=_run,
    requires=(Need("owns_loop", allowed={True}, why="hands the whole loop to the runtime"),),
)
