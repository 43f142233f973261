"""A decoder-with-past ONNX graph as a stepper: prompt with empty past, then one token per step.

Input and output names are read from the graph, so any folder that follows the IO contract works, ours or
optimum's. Steps run through IO binding: the presents stay where the provider put them (on the GPU for cuda
and tensorrt) and are bound as the next step's past without a copy; only the last position's logits come
back to the host.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort

from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.runtimes.providers import DEVICE_TYPES, TRT_DUMMY_PAST, DecoderShape, session_provider

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
_NUMPY_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def position_ids_for(attention_mask: np.ndarray) -> np.ndarray:
    """Positions of a left-padded batch: 0 at each row's first real token; padding gets 1 (as transformers does)."""
    positions = np.cumsum(attention_mask, axis=-1) - 1
    return np.where(attention_mask == 0, 1, positions).astype(np.int64)


def graph_shape(inputs: dict[str, list], outputs: list[str], n_positions: int) -> DecoderShape:
    """Read (and check) the decoder IO contract. ``inputs``: name → shape (ints, or names for symbolic dims)."""
    for required in ("input_ids", "attention_mask"):
        if required not in inputs:
            raise Gpt2OnnxError(f"model has no input '{required}': it does not follow the decoder IO contract")
    if "logits" not in outputs:
        raise Gpt2OnnxError("model has no output 'logits': it does not follow the decoder IO contract")
    past = [n for n in inputs if _PAST.match(n)]
    if not past:
        raise Gpt2OnnxError("model has no past_key_values.{i}.key/value inputs: export it with past key/values")
    n_layer = len(past) // 2
    for i in range(n_layer):
        for kind in ("key", "value"):
            if f"past_key_values.{i}.{kind}" not in inputs:
                raise Gpt2OnnxError(f"model has no input 'past_key_values.{i}.{kind}': it does not follow the IO contract")
            if f"present.{i}.{kind}" not in outputs:
                raise Gpt2OnnxError(f"model has no output 'present.{i}.{kind}': it does not follow the IO contract")
    ordered = tuple(f"past_key_values.{i}.{kind}" for i in range(n_layer) for kind in ("key", "value"))
    first = inputs[ordered[0]]
    if len(first) != 4 or not isinstance(first[1], int) or not isinstance(first[3], int):
        raise Gpt2OnnxError(f"input '{ordered[0]}' has shape {first}, expected [batch, n_head, past, head_dim]")
    return DecoderShape(ordered, first[1], first[3], n_positions, "position_ids" in inputs)


def session_shape(session: ort.InferenceSession, n_positions: int) -> DecoderShape:
    return graph_shape({i.name: i.shape for i in session.get_inputs()}, [o.name for o in session.get_outputs()], n_positions)


def file_shape(model_path: Path, n_positions: int) -> DecoderShape:
    """The contract read from the ONNX file itself, without loading its weights or building a session."""
    from gpt2onnx.inspection import load_graph

    graph = load_graph(model_path).graph
    dims = lambda v: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]  # noqa: E731
    return graph_shape({v.name: dims(v) for v in graph.input}, [v.name for v in graph.output], n_positions)


def read_n_positions(folder: Path) -> int:
    """The model's context length, from the folder's config.json."""
    config = Path(folder) / "config.json"
    try:
        return int(json.loads(config.read_text())["n_positions"])
    except (OSError, ValueError, KeyError, TypeError):
        raise Gpt2OnnxError(f"'{config}' is missing or has no n_positions: the model folder needs its config.json") from None


class OnnxDecoder:
    def __init__(self, session: ort.InferenceSession, *, n_positions: int | None = None, device_id: int = 0):
        self.session = session
        self.shape = session_shape(session, n_positions or 0)
        self.past_names = list(self.shape.past_names)
        self.present_names = [n.replace("past_key_values", "present") for n in self.past_names]
        self.n_layer = len(self.past_names) // 2
        self.n_head, self.head_dim = self.shape.n_head, self.shape.head_dim
        self.n_positions = n_positions
        vocab = next(o.shape for o in session.get_outputs() if o.name == "logits")[-1]
        self.vocab_size = vocab if isinstance(vocab, int) else None
        self.kv_dtype = _NUMPY_DTYPES.get(next(i.type for i in session.get_inputs() if i.name == self.past_names[0]), np.float32)
        self.uses_position_ids = self.shape.uses_position_ids
        self.provider = session_provider(session)
        self.device, self.device_id = DEVICE_TYPES.get(self.provider, "cpu"), device_id
        # TensorRT rejects zero-sized dims: the prompt step gets masked dummy past slots instead of an empty past.
        self.dummy_past = TRT_DUMMY_PAST if self.provider == "tensorrt" else 0

    @classmethod
    def from_folder(cls, folder: Path, session: ort.InferenceSession) -> "OnnxDecoder":
        return cls(session, n_positions=read_n_positions(folder))

    # -- inputs -------------------------------------------------------------------------------------------
    def check_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> None:
        """Token ids outside the vocabulary would make CUDA's Gather read garbage without an error."""
        ids = input_ids if attention_mask is None else input_ids[attention_mask[:, -input_ids.shape[1] :] > 0]
        if self.vocab_size is not None and ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise Gpt2OnnxError(f"token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})")

    def check_length(self, total_length: int) -> None:
        if self.n_positions and total_length > self.n_positions:
            raise Gpt2OnnxError(
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

    def greedy(self, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int) -> np.ndarray:
        """Greedy continuation of a left-padded batch: [batch, max_new_tokens] new token ids."""
        from gpt2onnx.runtimes.generate import generate

        return generate(self, input_ids, attention_mask, max_new_tokens=max_new_tokens).tokens
