"""int4's prompt step on int8 kernels? The matmul forms an int4 file could take, timed in one process (issue #35).

    .venv/bin/python -m scripts.bench_int4_prompt_forms [--layers 12] [--rows 1 128] [--repeat 30] [--threads 2]

A stack of ``--layers`` GPT-2 MLPs' matmuls (768 → 3072 → 768, so 2 × layers matmuls, no activation between them:
the matmuls are what is timed) on one set of random weights, written in each form below, run at 1 row (decode) and
``--rows`` rows (the prompt step), medians of ``--repeat`` runs after warm-ups, the forms interleaved round by
round so that another process's load falls on all of them alike:

- fp32: MatMul.
- nbits: MatMulNBits, 4-bit round to nearest in blocks of ``--block-size``, accuracy level 4 (int4's recipe).
- integer: MatMulInteger on 7-bit int8 weights per output column from the fp32 weights (int8's form:
  DynamicQuantizeLinear + MatMulInteger, written by onnxruntime's quantize_dynamic).
- folded: MatMulInteger on int8 weights computed IN THE GRAPH from the MatMulNBits initializers (nibbles unpacked
  with BitwiseAnd / BitShift, minus 8, times the block scales, transposed to [K, N], then rounded again to 7 bits
  per output column), a constant subgraph that onnxruntime's constant folding computes once at session creation.
- if-matmul: per matmul, an If on the row count (rows > ``--threshold``): folded's int8 path, else MatMulNBits.
- if-stack: one If around the whole stack: the prompt body on folded int8 matmuls, the decode body on MatMulNBits.

It also reports, per form, the session's creation time and the process's resident memory growth, and whether
constant folding really ran (the optimized model written by ``optimized_model_filepath`` holds no BitShift left).
``--memory``: each form's session created in its own process, its peak and resident memory (also after glibc's
``malloc_trim``). ``--config KEY=VALUE``: onnxruntime session config entries for every session (mlas.* keys).
Figures and what they say: docs/benchmarks.md, "int4's prompt step on int8 kernels".
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gpt2onnx.precisions.prompt_path import int8_matmul_nodes, int8_weight_nodes

OPSET = 21
IR_VERSION = 10


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fp32_model(weights: list[np.ndarray]) -> onnx.ModelProto:
    nodes, inits, x = [], [], "x"
    for i, w in enumerate(weights):
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        x = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", weights[0].shape[0]])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["rows", weights[-1].shape[1]])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def nbits_model(model: onnx.ModelProto, block_size: int) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.ModelProto.FromString(model.SerializeToString())  # the quantizer rewrites its model in place
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=block_size, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    out = quantizer.model.model if hasattr(quantizer.model, "model") else quantizer.model
    out.ir_version = IR_VERSION
    return out


def integer_model(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        onnx.save(model, src)
        quantize_dynamic(src, out, weight_type=QuantType.QInt8, per_channel=True, reduce_range=True)
        quantized = onnx.load(str(out))
    quantized.ir_version = IR_VERSION
    return quantized


def _const(name: str, array) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(array), name))


def unpack_nodes(node: onnx.NodeProto, prefix: str) -> tuple[list[onnx.NodeProto], str, str]:
    """gpt2onnx's fold (gpt2onnx.precisions.prompt_path): an int8 [K, N] weight, 7 bits per output column, and its
    column scales, computed by standard ops from a 4-bit MatMulNBits' initializers."""
    return int8_weight_nodes(node, prefix, opset=OPSET)


def integer_nodes(x: str, w8: str, colscale: str, y: str, p: str) -> list[onnx.NodeProto]:
    """int8.py's form: DynamicQuantizeLinear (uint8, per tensor), MatMulInteger, Cast, times both scales."""
    return int8_matmul_nodes(x, w8, colscale, y, p)


def _rows_above(x: str, threshold: int, p: str) -> list[onnx.NodeProto]:
    """cond = (product of x's leading dimensions) > threshold."""
    return [
        helper.make_node("Shape", [x], [f"{p}_shape"], end=-1),
        helper.make_node("ReduceProd", [f"{p}_shape"], [f"{p}_nrows"], keepdims=0),
        _const(f"{p}_threshold", np.int64(threshold)),
        helper.make_node("Greater", [f"{p}_nrows", f"{p}_threshold"], [f"{p}_many"]),
    ]


def _branch(name: str, nodes: list[onnx.NodeProto], out: str) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])


def folded_model(nbits: onnx.ModelProto, *, form: str, threshold: int, fold_inside: bool) -> onnx.ModelProto:
    """nbits' initializers, its matmuls rewritten as ``form``: folded, if-matmul or if-stack. ``fold_inside``: the
    unpacking subgraph inside the If's prompt branch (else in the main graph, the branch reading its result)."""
    model = onnx.ModelProto()
    model.CopyFrom(nbits)
    graph = model.graph
    matmuls = [n for n in graph.node if n.op_type == "MatMulNBits"]
    x_in, y_out = graph.input[0].name, graph.output[0].name
    main, prompt, decode = [], [], []
    for i, node in enumerate(matmuls):
        p = f"mm{i}"
        unpack, w8, colscale = unpack_nodes(node, p)
        x, y = node.input[0], node.output[0]
        if form == "folded":
            main += unpack + integer_nodes(x, w8, colscale, y, p)
        elif form == "if-matmul":
            many = _rows_above(x, threshold, p)
            then_out, else_out = f"{p}_then_y", f"{p}_else_y"
            quick = onnx.NodeProto()
            quick.CopyFrom(node)
            del quick.output[:]
            quick.output.append(else_out)
            quick.name = f"{p}_nbits"
            then_nodes = (unpack if fold_inside else []) + integer_nodes(x, w8, colscale, then_out, p)
            main += (
                ([] if fold_inside else unpack)
                + many
                + [
                    helper.make_node(
                        "If",
                        [f"{p}_many"],
                        [y],
                        then_branch=_branch(f"{p}_prompt", then_nodes, then_out),
                        else_branch=_branch(f"{p}_decode", [quick], else_out),
                    )
                ]
            )
        elif form == "if-stack":
            if not fold_inside:
                main += unpack
            prompt += (unpack if fold_inside else []) + integer_nodes(x, w8, colscale, f"prompt_{y}", p)
            quick = onnx.NodeProto()
            quick.CopyFrom(node)
            quick.input[0] = x if i == 0 else f"decode_{x}"
            del quick.output[:]
            quick.output.append(f"decode_{y}")
            decode.append(quick)
            prompt[-5].input[0] = x if i == 0 else f"prompt_{x}"  # the DynamicQuantizeLinear
        else:
            raise ValueError(form)
    if form == "if-stack":
        main += _rows_above(x_in, threshold, "stack") + [
            helper.make_node(
                "If",
                ["stack_many"],
                [y_out],
                then_branch=_branch("prompt", prompt, f"prompt_{y_out}"),
                else_branch=_branch("decode", decode, f"decode_{y_out}"),
            )
        ]
    del graph.node[:]
    graph.node.extend(main)
    return model


def session(model: onnx.ModelProto, threads: int, optimized: Path | None = None, config: tuple[str, ...] = ()):
    import onnxruntime as ort

    options = ort.SessionOptions()
    for pair in config:
        key, _, value = pair.partition("=")
        options.add_session_config_entry(key, value)
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--inner", type=int, default=3072)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--threshold", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forms", nargs="+", default=["fp32", "nbits", "integer", "folded", "if-matmul", "if-stack"])
    parser.add_argument("--fold-outside", action="store_true", help="the unpacking subgraph outside the Ifs")
    parser.add_argument(
        "--config",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="onnxruntime session config entries for every session (e.g. mlas.use_lut_gemm=1)",
    )
    parser.add_argument("--memory", action="store_true", help="each form's peak memory, its own process")
    parser.add_argument("--created-only", action="store_true", help=argparse.SUPPRESS)  # one form, --memory's
    args = parser.parse_args()
    if args.memory:
        import subprocess
        import sys

        for name in args.forms:
            command = [sys.executable, "-m", "scripts.bench_int4_prompt_forms", "--created-only", "--forms", name]
            command += ["--layers", str(args.layers), "--block-size", str(args.block_size)]
            command += ["--fold-outside"] if args.fold_outside else []
            command += ["--config", *args.config] if args.config else []
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            print(done.stdout.strip().splitlines()[-1], flush=True)
        return

    rng = np.random.default_rng(0)
    weights = []
    for _ in range(args.layers):
        weights.append((rng.standard_normal((args.width, args.inner)) * 0.02).astype(np.float32))
        weights.append((rng.standard_normal((args.inner, args.width)) * 0.02).astype(np.float32))
    base = fp32_model(weights)
    nbits = nbits_model(base, args.block_size)
    builders = {
        "fp32": lambda: base,
        "nbits": lambda: nbits,
        "integer": lambda: integer_model(base),
        "folded": lambda: folded_model(nbits, form="folded", threshold=args.threshold, fold_inside=True),
        "if-matmul": lambda: folded_model(
            nbits, form="if-matmul", threshold=args.threshold, fold_inside=not args.fold_outside
        ),
        "if-stack": lambda: folded_model(
            nbits, form="if-stack", threshold=args.threshold, fold_inside=not args.fold_outside
        ),
    }
    sessions = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.forms:
            model = builders[name]()
            if args.created_only:
                import resource

                before, started = rss_mb(), time.perf_counter()
                peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                sess = session(model, args.threads, config=tuple(args.config))
                elapsed = time.perf_counter() - started
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                after = rss_mb()
                import ctypes

                ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the process still holds, not glibc's free lists
                print(
                    f"{name:10s} session {elapsed:6.2f} s; RSS before {before:6.0f} MB, peak {peak:6.0f} MB "
                    f"(peak before {peak_before:6.0f}), after {after:6.0f} MB, after malloc_trim {rss_mb():6.0f} MB"
                )
                return
            before, started = rss_mb(), time.perf_counter()
            optimized = Path(tmp) / f"{name}.onnx"
            sessions[name] = session(model, args.threads, optimized, tuple(args.config))
            elapsed = time.perf_counter() - started
            opt = onnx.load(str(optimized), load_external_data=False)
            ops: dict[str, int] = {}

            def count(g):
                for node in g.node:
                    ops[node.op_type] = ops.get(node.op_type, 0) + 1
                    for attr in node.attribute:
                        if attr.type == onnx.AttributeProto.GRAPH:
                            count(attr.g)

            count(opt.graph)
            kept = {k: v for k, v in sorted(ops.items()) if k not in ("Constant",)}
            print(
                f"{name:10s} session {elapsed:6.2f} s, RSS +{rss_mb() - before:6.0f} MB, "
                f"file {model.ByteSize() / 2**20:6.1f} MB; optimized ops {kept}",
                flush=True,
            )
    inputs = {r: rng.standard_normal((r, args.width)).astype(np.float32) for r in args.rows}
    reference = {r: sessions["fp32"].run(None, {"x": inputs[r]})[0] if "fp32" in sessions else None for r in args.rows}
    for r in args.rows:
        for name, sess in sessions.items():
            for _ in range(3):
                out = sess.run(None, {"x": inputs[r]})[0]
            if reference[r] is not None:
                ref = reference[r]
                rel = float(np.abs(out - ref).max() / np.abs(ref).max())
                print(f"rows {r:4d} {name:10s} max |Δ| / max |fp32| = {rel:.4f}", flush=True)
    times = {(r, n): [] for r in args.rows for n in sessions}
    for _ in range(args.repeat):
        for r in args.rows:
            for name, sess in sessions.items():
                started = time.perf_counter()
                sess.run(None, {"x": inputs[r]})
                times[(r, name)].append((time.perf_counter() - started) * 1000)
    print(f"\nmedian ms of {args.repeat} (interleaved), {2 * args.layers} matmuls {args.width}x{args.inner}:")
    print("form       " + "".join(f"{f'{r} rows':>12s}" for r in args.rows))
    for name in sessions:
        print(f"{name:10s} " + "".join(f"{statistics.median(times[(r, name)]):12.2f}" for r in args.rows))
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
