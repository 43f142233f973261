"""A decoder-with-past ONNX graph as a stepper: prompt with empty past, then one token per step.

Input and output names are read from the graph, so any folder that follows the IO contract works,
ours or optimum's.
"""

from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort

from gpt2onnx.errors import Gpt2OnnxError

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
_NUMPY_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def position_ids_for(attention_mask: np.ndarray) -> np.ndarray:
    """Positions of a left-padded batch: 0 at each row's first real token; padding gets 1 (as transformers does)."""
    positions = np.cumsum(attention_mask, axis=-1) - 1
    return np.where(attention_mask == 0, 1, positions).astype(np.int64)


class OnnxDecoder:
    def __init__(self, session: ort.InferenceSession):
        self.session = session
        inputs = {i.name: i for i in session.get_inputs()}
        for required in ("input_ids", "attention_mask"):
            if required not in inputs:
                raise Gpt2OnnxError(f"model has no input '{required}': it does not follow the decoder IO contract")
        self.past_names = sorted(
            (n for n in inputs if _PAST.match(n)), key=lambda n: (int(_PAST.match(n)[1]), _PAST.match(n)[2] != "key")
        )
        if not self.past_names:
            raise Gpt2OnnxError("model has no past_key_values.{i}.key/value inputs: export it with past key/values")
        self.n_layer = len(self.past_names) // 2
        first = inputs[self.past_names[0]]
        self.n_head, self.head_dim = first.shape[1], first.shape[3]
        self.kv_dtype = _NUMPY_DTYPES.get(first.type, np.float32)
        self.uses_position_ids = "position_ids" in inputs
        self.output_names = [o.name for o in session.get_outputs()]
        for i in range(self.n_layer):
            for kind in ("key", "value"):
                if f"present.{i}.{kind}" not in self.output_names:
                    raise Gpt2OnnxError(f"model has no output 'present.{i}.{kind}': it does not follow the IO contract")

    def empty_past(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.n_head, 0, self.head_dim), self.kv_dtype) for _ in self.past_names]

    def step(self, input_ids, attention_mask, position_ids, past):
        """One forward pass; returns (logits, presents in past order)."""
        feeds = {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64)}
        if self.uses_position_ids:
            feeds["position_ids"] = position_ids.astype(np.int64)
        feeds.update(zip(self.past_names, past))
        outputs = dict(zip(self.output_names, self.session.run(None, feeds)))
        presents = [outputs[name.replace("past_key_values", "present")] for name in self.past_names]
        return outputs["logits"], presents

    def greedy(self, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int) -> np.ndarray:
        """Greedy continuation of a left-padded batch: [batch, max_new_tokens] new token ids."""
        mask = attention_mask.astype(np.int64)
        logits, past = self.step(input_ids, mask, position_ids_for(mask), self.empty_past(input_ids.shape[0]))
        tokens = []
        for _ in range(max_new_tokens):
            next_ids = logits[:, -1, :].argmax(-1)[:, None].astype(np.int64)
            tokens.append(next_ids)
            if len(tokens) == max_new_tokens:
                break
            mask = np.concatenate([mask, np.ones_like(next_ids)], axis=1)
            positions = position_ids_for(mask)[:, -1:]
            logits, past = self.step(next_ids, mask, positions, past)
        return np.concatenate(tokens, axis=1)
