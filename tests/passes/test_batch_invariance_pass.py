"""The batch-invariance rewrites (gpt2onnx/passes/batch_invariance.py) as graph edits: every export carries them,
``strip`` gives back the plain graph (what the fusion rules and fp16's conversion match), and writing them again
gives the same graph. What they are for (a row's logits bitwise the same alone, beside others and left-padded) is
tests/serving/test_batch_invariance.py's."""

import copy

import onnx
import pytest

from gpt2onnx.artifact.graph import ALIGNED, PAIRED, all_nodes, graph_facts
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.passes.batch_invariance import make_batch_invariant, strip
from gpt2onnx.precisions.quantize_options import QuantizeOptions

EXPORTS = {  # fp32 (attention only), fp16 (kept fp32 scores), int4's prompt path (an If with a head per branch)
    "fp32": dict(),
    "fp16": dict(dtype="fp16"),
    "int4-prompt-int8": dict(quantization=QuantizeOptions("int4", prompt_kernel="int8")),
}


def _nodes(model: onnx.ModelProto) -> list[tuple]:
    return [(n.op_type, tuple(n.input), tuple(n.output)) for n in all_nodes(model.graph, prompt_body=True)]


@pytest.mark.parametrize("name", list(EXPORTS))
def test_the_rewrites_are_written_undone_and_written_again_alike(name, tmp_path):
    folder = export("tiny", tmp_path / name, random_init=True, options=ExportOptions(validate=False, **EXPORTS[name]))
    model = onnx.load(str(folder.folder / "model.onnx"))
    names = [n.name for n in all_nodes(model.graph, prompt_body=True)]
    softmaxes = sum(n.startswith(ALIGNED) and n.endswith("/scores") and "fill" not in n for n in names)
    assert softmaxes == 2 * (2 if "prompt" in name else 1)  # tiny: 2 layers (twice in int4's If)
    paired = sum(n.startswith(PAIRED) and n.endswith("/y") for n in names)
    assert paired == sum(n.op_type == "MatMulNBits" for n in all_nodes(model.graph, prompt_body=True))
    facts = graph_facts(model)
    assert not facts.padding_dependent and not facts.batch_dependent

    plain = strip(copy.deepcopy(model))
    onnx.checker.check_model(plain)
    assert not any(n.name.startswith((ALIGNED, PAIRED)) for n in all_nodes(plain.graph, prompt_body=True))
    assert graph_facts(plain).padding_dependent  # the plain graph's attention follows the padding
    again, counts = make_batch_invariant(copy.deepcopy(plain))
    assert _nodes(again) == _nodes(model)
    assert make_batch_invariant(again)[1] == (0, 0)  # a graph that has them is left as it is
