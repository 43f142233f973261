"""torch → ONNX: trace the export module with the IO contract and return a checked ModelProto."""

from __future__ import annotations

import logging
import tempfile
import warnings
from pathlib import Path

import onnx
import torch

from gpt2onnx.artifact.contract import BATCH, PAST, SEQUENCE, TOTAL, IOSpec, apply_io_dims, check_graph_io
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.pytorch.architecture import Architecture

log = logging.getLogger(__name__)

# Opset 17 is the oldest with a native LayerNormalization, and is read by every current runtime:
# ONNX Runtime >= 1.12, TensorRT >= 8.6, OpenVINO, DirectML, onnx2tf. Newer opsets add nothing GPT-2 needs
# before fusion (Gelu arrives in 20 and is used by the fusion profiles that ask for it).
DEFAULT_OPSET = 17
MIN_OPSET = 14  # scaled-dot-product pieces (Trilu, new Reshape semantics) need 14
MAX_OPSET = 20  # the highest opset torch.onnx's TorchScript exporter writes
# IR version matching each opset (onnx's own table); onnxruntime 1.31 reads at most IR 13.
IR_VERSION_FOR_OPSET = {14: 7, 15: 8, 16: 8, 17: 8, 18: 8, 19: 9, 20: 9}


def dummy_inputs(io: IOSpec, spec: Architecture, *, batch=2, sequence=3, past=4) -> tuple[torch.Tensor, ...]:
    """Trace inputs: distinct sizes for each symbolic dim, so no two get tied together by accident."""
    sizes = {BATCH: batch, SEQUENCE: sequence, PAST: past, TOTAL: past + sequence}
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for t in io.inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in t.dims]
        if t.name == "input_ids":
            tensors.append(torch.randint(0, spec.vocab_size, shape, generator=generator))
        elif t.name == "attention_mask":
            tensors.append(torch.ones(shape, dtype=torch.int64))
        elif t.name == "position_ids":
            tensors.append(torch.arange(past, past + sequence).expand(batch, sequence).contiguous())
        else:
            tensors.append(torch.randn(shape, generator=generator))
    return tuple(tensors)


def check_opset(opset: int) -> None:
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise BadInput(f"--opset {opset} is not supported: choose {MIN_OPSET} to {MAX_OPSET} (default {DEFAULT_OPSET})")


def export_module(
    module: torch.nn.Module, io: IOSpec, spec, *, opset: int, head_weight: tuple[str, torch.Tensor] | None = None
) -> onnx.ModelProto:
    """Export ``module`` (forward taking io.inputs in order, returning io.outputs in order).

    ``head_weight`` (name, [vocab, n_embd] tensor) names the logits projection, so the exporter's folded
    transposed copy of it can be replaced by a Gemm on the stored tensor (see _project_logits_with_gemm).
    """
    check_opset(opset)
    module.eval()
    args = dummy_inputs(io, spec)
    with tempfile.TemporaryDirectory(prefix="gpt2onnx-trace-") as tmp:
        path = Path(tmp) / "model.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            # The tracer warns about shape arithmetic; the dynamic axes below and validation cover it.
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                args,
                str(path),
                dynamo=False,
                opset_version=opset,
                input_names=io.input_names,
                output_names=io.output_names,
                dynamic_axes=io.dynamic_axes(),
                do_constant_folding=True,
            )
        model = onnx.load(str(path))  # also pulls in external tensors for models > 2 GB
    if head_weight is not None:
        _project_logits_with_gemm(model, *head_weight)
    model.ir_version = IR_VERSION_FOR_OPSET[opset]
    model.producer_name = "gpt2onnx"
    from gpt2onnx import __version__

    model.producer_version = __version__
    apply_io_dims(model, io)
    check_graph_io(model, io)
    return model


def _project_logits_with_gemm(model: onnx.ModelProto, name: str, weight: torch.Tensor) -> None:
    """Replace MatMul(x, folded weightᵀ) by Gemm(x, weight, transB=1).

    The TorchScript exporter folds the transpose of the logits projection into a new initializer. For GPT-2,
    whose head is tied to the token embedding, that stores the largest matrix twice (+154 MB for 124M).
    Gemm with transB reads the embedding as it is: one copy in the file and in memory.
    """
    from onnx import numpy_helper

    expected = weight.detach().numpy().T
    graph = model.graph
    folded = [
        init
        for init in graph.initializer
        if tuple(init.dims) == expected.shape and init.name not in {name} and init.name.startswith("onnx::")
    ]
    folded = [init for init in folded if (numpy_helper.to_array(init) == expected).all()]
    if len(folded) != 1:
        raise ContractError(f"export: could not locate the logits projection ({len(folded)} candidates)")
    folded_name = folded[0].name
    if name not in {init.name for init in graph.initializer}:
        graph.initializer.append(numpy_helper.from_array(weight.detach().numpy(), name))
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] == folded_name:
            node.op_type = "Gemm"
            node.input[1] = name
            node.attribute.append(onnx.helper.make_attribute("transB", 1))
    graph.initializer.remove(folded[0])
