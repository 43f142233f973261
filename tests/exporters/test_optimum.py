"""The exported folder is a drop-in for optimum's ORTModelForCausalLM."""

import warnings

import numpy as np
import torch
from conftest import import_optimum

from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.verify.lockstep import left_padded_batch, reference_greedy


def test_optimum_generate_matches_transformers(tiny_folder, tiny_export):
    ORTModelForCausalLM = import_optimum("optimum.onnxruntime", "ORTModelForCausalLM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ORTModelForCausalLM.from_pretrained(tiny_export, provider="CPUExecutionProvider")
    assert model.use_cache
    ids, mask = left_padded_batch(1000, batch=3, length=6, seed=7)
    generated = model.generate(
        input_ids=torch.as_tensor(ids),
        attention_mask=torch.as_tensor(mask),
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[:, ids.shape[1] :].numpy()
    expected = reference_greedy(reference_model(load_checkpoint(str(tiny_folder))), ids, mask, max_new_tokens=10)
    np.testing.assert_array_equal(generated, expected)
    assert len(np.unique(expected)) > 3
