"""A decoder-with-past ONNX graph as a stepper: prompt with empty past, then one token per step.

Input and output names are read from the graph, so any folder that follows the IO contract works, ours or
optimum's. Steps run through IO binding: the presents stay where the provider put them (on the GPU for cuda
and tensorrt) and are bound as the next step's past without a copy; only the last position's logits come
back to the host.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from gpt2onnx.artifact.contract import ORT_DTYPES, DecoderShape, TensorSpec, decoder_shape, graph_io
from gpt2onnx.artifact.folder import ModelFolder
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.errors import BadInput
from gpt2onnx.runtime.providers import DEVICE_TYPES, TRT_DUMMY_PAST, ProviderConfig, create_session, session_provider


def position_ids_for(attention_mask: np.ndarray) -> np.ndarray:
    """Positions of a left-padded batch: 0 at each row's first real token; padding gets 1 (as transformers does)."""
    positions = np.cumsum(attention_mask, axis=-1) - 1
    return np.where(attention_mask == 0, 1, positions).astype(np.int64)


def session_shape(session: ort.InferenceSession, n_positions: int) -> DecoderShape:
    as_spec = lambda v: TensorSpec(v.name, ORT_DTYPES.get(v.type, v.type), tuple(v.shape))  # noqa: E731
    return decoder_shape([as_spec(i) for i in session.get_inputs()], [as_spec(o) for o in session.get_outputs()], n_positions)


def file_shape(model_path: Path, n_positions: int) -> DecoderShape:
    """The contract read from the ONNX file itself, without loading its weights or building a session."""
    return decoder_shape(*graph_io(load_graph(model_path)), n_positions)


def open_decoder(model: ModelFolder, provider: ProviderConfig) -> "OnnxDecoder":
    """A session on the provider (checked: no silent fallback), wrapped as a decoder."""
    # The contract comes from the file first: the TensorRT profile is built from its names and dims.
    shape = file_shape(model.model_path, model.n_positions)
    session = create_session(model.model_path, provider.check(), shape=shape)
    return OnnxDecoder(session, n_positions=model.n_positions, device_id=provider.device_id)


class OnnxDecoder:
    runtime = "onnxruntime"

    def __init__(self, session: ort.InferenceSession, *, n_positions: int | None = None, device_id: int = 0):
        self.session = session
        self.shape = session_shape(session, n_positions or 0)
        self.past_names = list(self.shape.past_names)
        self.present_names = list(self.shape.present_names)
        self.n_layer = self.shape.n_layer
        self.n_head, self.head_dim = self.shape.n_head, self.shape.head_dim
        self.n_positions = n_positions
        self.vocab_size = self.shape.vocab_size
        self.kv_dtype = np.float16 if self.shape.kv_dtype == "float16" else np.float32
        self.uses_position_ids = self.shape.uses_position_ids
        self.provider = session_provider(session)
        self.device, self.device_id = DEVICE_TYPES.get(self.provider, "cpu"), device_id
        # TensorRT rejects zero-sized dims: the prompt step gets masked dummy past slots instead of an empty past.
        self.dummy_past = TRT_DUMMY_PAST if self.provider == "tensorrt" else 0

    # -- inputs -------------------------------------------------------------------------------------------
    def check_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> None:
        """Token ids outside the vocabulary would make CUDA's Gather read garbage without an error."""
        ids = input_ids if attention_mask is None else input_ids[attention_mask[:, -input_ids.shape[1] :] > 0]
        if self.vocab_size is not None and ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise BadInput(f"token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})")

    def check_length(self, total_length: int) -> None:
        if self.n_positions and total_length > self.n_positions:
            raise BadInput(
                f"prompt plus new tokens is {total_length} tokens, beyond the model's context of {self.n_positions}:"
                " shorten the prompt or ask for fewer new tokens"
            )

    def empty_past(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.n_head, self.dummy_past, self.head_dim), self.kv_dtype) for _ in self.past_names]

    def prompt_mask(self, attention_mask: np.ndarray) -> np.ndarray:
        """The prompt's mask, with the dummy past slots (masked out) in front where the provider needs them."""
        mask = attention_mask.astype(np.int64)
        if self.dummy_past:
            mask = np.concatenate([np.zeros((mask.shape[0], self.dummy_past), np.int64), mask], axis=1)
        return mask

    # -- running ------------------------------------------------------------------------------------------
    def run(self, input_ids, attention_mask, position_ids, past, *, last_logits_only: bool = True):
        """One step through IO binding. ``past``: arrays or the OrtValues a previous step returned.
        Returns (logits as numpy: last position only unless asked otherwise, presents as OrtValues)."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=np.int64))
        if self.uses_position_ids:
            binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        for name, value in zip(self.past_names, past):
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            else:
                binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for name in self.present_names:
            binding.bind_output(name, self.device, self.device_id)
        self.session.run_with_iobinding(binding)
        values = binding.get_outputs()
        logits = values[0].numpy()
        return (logits[:, -1:] if last_logits_only else logits), values[1:]

    def step(self, input_ids, attention_mask, position_ids, past):
        """One step with everything on the host: (all logits, presents as numpy arrays)."""
        logits, presents = self.run(input_ids, attention_mask, position_ids, past, last_logits_only=False)
        return logits, [p.numpy() for p in presents]
