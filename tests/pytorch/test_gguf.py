"""GGUF files in: a GPT-2 GGUF (written here by the gguf package's GGUFWriter, as llama.cpp's converter lays it out,
from the trained fixture) exported to ONNX; its F16 weights checked against transformers, its Q8_0/Q4_0 blocks
kept bit for bit (onnxruntime's own kernels dequantize them) and its logits against PyTorch on the file's
dequantized weights; and, where llama.cpp is installed (.venv-engines), greedy tokens against llama.cpp on files
its own converter wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from gguf_files import FIXTURE, write_gguf
from onnx import helper, numpy_helper

from gpt2onnx.errors import BadInput
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.files import sha256_file
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model

gguf = pytest.importorskip("gguf")
ort = pytest.importorskip("onnxruntime")

# fp32 arithmetic on the same weights (accuracy level 0): only the order of the sums and the kernels' own
# dequantization differ, so the logits (|x| up to ~15 on the fixture) agree as an fp32 export's do: the fp32 gate
FP32_LOGITS = 1e-4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {
        "F16": write_gguf(root / "tiny-f16.gguf", matrices="F16"),
        "Q8_0": write_gguf(root / "tiny-q8_0.gguf", matrices="Q8_0"),
        "Q4_0": write_gguf(root / "tiny-q4_0.gguf", matrices="Q4_0"),  # the token table 4-bit too
    }


def _gguf_name(export_name: str) -> str:
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, 2)
    return table.get_name(f"transformer.{export_name}", (".weight", ".bias"))


def _file_weights(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the file as gguf.quants.dequantize gives it, [rows, width] as stored."""
    reader = gguf.GGUFReader(path)
    return {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type) for t in reader.tensors}


def _run_node(node: onnx.NodeProto, inits: list, feeds: dict, output_rank: int) -> np.ndarray:
    inputs = [
        helper.make_tensor_value_info(
            n, onnx.TensorProto.FLOAT if v.dtype == np.float32 else onnx.TensorProto.INT64, None
        )
        for n, v in feeds.items()
    ]
    out = helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "one", inputs, [out], initializer=inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _prompt_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    for value in session.get_inputs():
        if value.name.startswith("past_key_values"):
            feeds[value.name] = np.zeros((1, 4, 0, 16), np.float32)
    return session.run(["logits"], feeds)[0]


def test_f16_gguf_exports_with_its_tokenizer_config_and_manifest(files, tmp_path):
    out = tmp_path / "f16"
    result = export(str(files["F16"]), out)
    assert result.check.passed and result.manifest.precision == "float32"
    source = result.manifest.source
    assert source["kind"] == "gguf" and source["sha256"] == sha256_file(files["F16"])
    assert source["tensor_types"]["blk.0.attn_qkv.weight"] == "F16"
    assert source["tensor_types"]["position_embd.weight"] == "F32"
    config = json.loads((out / "config.json").read_text())
    fixture = json.loads((FIXTURE / "config.json").read_text())
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon", "eos_token_id"):
        assert config[key] == fixture[key], key
    assert json.loads((out / "vocab.json").read_text()) == json.loads((FIXTURE / "vocab.json").read_text())
    assert (out / "merges.txt").read_text().split("\n")[1:] == (FIXTURE / "merges.txt").read_text().split("\n")[1:]
    from tokenizers import Tokenizer

    text = "def add(a, b):\n    return a + b<|endoftext|>"
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == (
        Tokenizer.from_file(str(FIXTURE / "tokenizer.json")).encode(text).ids
    )


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_quantized_blocks_are_the_files_bit_for_bit(files, tmp_path, kind):
    """Every MatMulNBits and the token table's GatherBlockQuantized, run by onnxruntime on an identity (its own
    dequantization), equal gguf.quants.dequantize of the file's tensor bit for bit; the logits at accuracy level 0
    equal PyTorch's on the dequantized weights within the fp32 gate."""
    method = "int4" if kind == "Q4_0" else "int8-weights"
    options = ExportOptions(validate=False, quantization=QuantizeOptions(method=method, accuracy_level=0))
    result = export(str(files[kind]), tmp_path / kind, options=options)
    assert result.manifest.quantization.shared_embedding == "wte.weight"
    model = onnx.load(tmp_path / kind / "model.onnx")
    inits = {i.name: i for i in model.graph.initializer}
    expected = _file_weights(files[kind])
    kinds = {"MatMulNBits": 0, "GatherBlockQuantized": 0}
    for node in model.graph.node:
        if node.op_type not in kinds:
            continue
        kinds[node.op_type] += 1
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["bits"] == (4 if kind == "Q4_0" else 8) and attrs["block_size"] == 32
        if node.op_type == "MatMulNBits":
            assert len(node.input) == 3  # no zero points: the op's default, as Q8_0/Q4_0 are symmetric
            k = attrs["K"]
            got = _run_node(
                node, [inits[node.input[1]], inits[node.input[2]]], {node.input[0]: np.eye(k, dtype=np.float32)}, 2
            ).T
            source = node.input[1].removesuffix("_Q4").removesuffix("_Q8").removesuffix("_for_matmul")
        else:
            vocab = inits[node.input[0]].dims[0]
            feeds = {node.input[1]: np.arange(vocab, dtype=np.int64)[None]}
            got = _run_node(node, [inits[node.input[0]], inits[node.input[2]]], feeds, 4).reshape(vocab, -1)
            source = "wte.weight"
        want = expected[_gguf_name(source)].astype(np.float32)
        # bit for bit, zeros' signs aside: gguf computes d·(q − 8) and gives −0.0 where d < 0 and q = 8, onnxruntime
        # +0.0 (equal numbers: adding 0.0 makes both +0.0 and changes nothing else)
        assert got.shape == want.shape, source
        assert np.array_equal((got + 0.0).view(np.uint32), (want + 0.0).view(np.uint32)), source
    assert kinds == {"MatMulNBits": 9, "GatherBlockQuantized": 1}
    ckpt = load_checkpoint(str(files[kind]))
    ids = np.array([[5, 300, 17, 42, 99, 511, 7, 260]], np.int64)
    with torch.no_grad():
        want = reference_model(ckpt)(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(_prompt_logits(tmp_path / kind, ids) - want).max() <= FP32_LOGITS


def test_refusals_are_one_line(files, tmp_path):
    q41 = write_gguf(tmp_path / "q4_1.gguf", matrices="Q4_1")
    with pytest.raises(BadInput, match="Q4_1.*float minimum"):
        load_checkpoint(str(q41))
    k = write_gguf(tmp_path / "q4_k.gguf", types={"blk.0.ffn_down.weight": "Q4_K"})
    with pytest.raises(BadInput, match="Q4_K.*K-quant"):
        load_checkpoint(str(k))
    with pytest.raises(BadInput, match="kept as they are .int4.*--quantize int8"):
        export(str(files["Q4_0"]), tmp_path / "x", options=ExportOptions(quantization=QuantizeOptions(method="int8")))
    assert not (tmp_path / "x").exists()


# -- against llama.cpp (its converter and its runtime, in .venv-engines; CI has neither) -------------------------
ENGINES = Path(__file__).resolve().parents[2] / ".venv-engines" / "bin" / "python"


def _llama_cpp() -> bool:
    if not ENGINES.exists():
        return False
    return subprocess.run([ENGINES, "-c", "import llama_cpp"], capture_output=True).returncode == 0


_GREEDY = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import engine_worker as e
e.build("llama.cpp", sys.argv[2], sys.argv[3], sys.argv[4], 2)
run = e._Llama(sys.argv[3], 2, cells=256, rows=1)
tokens, _ = run.generate([json.loads(sys.argv[5])], int(sys.argv[6]))
print(json.dumps(tokens[0]))
"""


@pytest.mark.skipif(
    not _llama_cpp(), reason="llama-cpp-python is not installed in .venv-engines (scripts/setup-engines.sh)"
)
@pytest.mark.parametrize("kind", ["F16", "Q8_0", "Q4_0"])
def test_llama_cpp_files_give_llama_cpps_greedy_tokens(tmp_path, kind):
    """A GGUF written by llama.cpp's converter (and quantizer) from the trained fixture exports, and gpt2onnx's
    greedy tokens on it equal llama.cpp's own on the same file."""
    prompt, new = [464, 300, 17, 42], 16
    path = tmp_path / f"tiny-{kind}.gguf"
    worker = Path(__file__).resolve().parents[2] / "gpt2onnx" / "benchmarks" / "compare"
    done = subprocess.run(
        [ENGINES, "-c", _GREEDY, worker, FIXTURE, path, kind, json.dumps(prompt), str(new)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    method = {"Q8_0": "int8-weights", "Q4_0": "int4"}.get(kind)  # fp32 arithmetic (level 0) on the file's blocks
    quantization = QuantizeOptions(method=method, accuracy_level=0) if method else QuantizeOptions()
    options = ExportOptions(quantization=quantization)
    export(str(path), tmp_path / "onnx", options=options)
    ids = list(prompt)
    for _ in range(new):  # greedy, end-of-text banned as llama.cpp's run bans it (every row gets `new` tokens)
        logits = _prompt_logits(tmp_path / "onnx", np.array([ids], np.int64))[0, -1]
        logits[511] = -np.inf
        ids.append(int(logits.argmax()))
    assert ids[len(prompt) :] == theirs
    assert len(set(theirs)) > 1  # not a degenerate run of one token


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q6_K"])
def test_each_kept_type_is_dequantized_by_onnxruntime_as_gguf_does(kind):
    """Random blocks of each kept type (scales drawn as fp16 of GPT-2's magnitudes, codes uniform), as a
    MatMulNBits run by onnxruntime on an identity, equal gguf.quants.dequantize bit for bit (zeros' signs aside)."""
    from gpt2onnx.precisions.gguf_blocks import KEPT, FileBlocks, dequantized, nbits_blocks

    rng = np.random.default_rng(0)
    rows, width = 8, 512
    _, _, block_bytes, values = KEPT[kind]
    raw = rng.integers(0, 256, (rows, width // values, block_bytes), dtype=np.uint8)
    scale_at = {"Q6_K": slice(208, 210)}.get(kind, slice(0, 2))
    raw[..., scale_at] = rng.uniform(-0.01, 0.01, (rows, width // values, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    codes, scales, bits, block = nbits_blocks(FileBlocks(kind, rows, width, raw))
    node = helper.make_node(
        "MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=width, N=rows, bits=bits, block_size=block
    )
    inits = [numpy_helper.from_array(codes, "b"), numpy_helper.from_array(scales, "s")]
    got = _run_node(node, inits, {"x": np.eye(width, dtype=np.float32)}, 2).T
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    assert np.array_equal((got + 0.0).view(np.uint32), (want + 0.0).view(np.uint32))
    assert np.array_equal(dequantized(codes, scales, bits), want)


# -- gpt2onnx compare from a GGUF (its reference and builds from the dequantized weights; llama.cpp's row the file) --
COMPARE_SETTINGS = ["--repeat", "1", "--warmup", "0", "--prompt-len", "8", "--new-tokens", "4", "--batch", "1"]


def _compare(*args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gpt2onnx", "compare", *map(str, args), *COMPARE_SETTINGS, "--context", "32"]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_compare_from_a_gguf_names_it_and_refuses_a_changed_file(tmp_path):
    """compare F16.gguf: our fp32 built from the file's weights (written as a Hugging Face folder under --work for the
    converters), scored against PyTorch on the same weights (fp32 both: KL under the fp32 gate's 1e-6, only the
    sums' order differs); the report and the work folder's record name the GGUF by sha256, and the same path holding
    another file is refused before any work (its record differs in the checkpoint's weights)."""
    from gpt2onnx.benchmarks.compare.compare import Settings, compare

    path = write_gguf(tmp_path / "tiny.gguf", matrices="F16")
    text = tmp_path / "text.txt"
    text.write_text((FIXTURE / "heldout.txt").read_text()[:600])
    work = tmp_path / "work"
    proc = _compare(path, "--work", work, "--only", "gpt2onnx:fp32", "--text", text, "--json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["source"]["checkpoint"]["kind"] == "gguf"
    assert report["source"]["checkpoint"]["sha256"] == sha256_file(path)
    assert json.loads((work / "compare-source.json").read_text()) == report["source"]
    folder = work / "checkpoint-tiny-gguf"
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt"} <= {p.name for p in folder.iterdir()}
    fixture = json.loads((FIXTURE / "config.json").read_text())
    written = json.loads((folder / "config.json").read_text())
    assert all(written[k] == fixture[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"))
    (row,) = report["summary"]
    assert row["variant"] == "gpt2onnx fp32" and row["kl_mean"] < 1e-6 and row["same_top1"] > 0.999, row
    write_gguf(path, matrices="BF16")  # the same path, other bytes
    with pytest.raises(BadInput, match="differs in the checkpoint's weights"):
        compare(str(path), work=work, only=["gpt2onnx:fp32"], settings=Settings(8, 4, 1, 2, 1, 0), quality=False)


def test_compare_from_a_gguf_runs_llama_cpp_on_that_file_alone(files):
    """llama.cpp's row is the file itself, named by its type; another llama.cpp type is refused in one line."""
    from gpt2onnx.benchmarks.compare.compare import source_gguf, variants_of

    gguf_source = source_gguf(str(files["Q8_0"]), random_init=False)
    assert gguf_source == (files["Q8_0"].resolve(), "Q8_0")
    (row,) = variants_of(["llama.cpp"], gguf_source)
    assert row.name == "llama.cpp Q8_0 (the source file)" and row.path(Path("work")) == files["Q8_0"].resolve()
    assert [v.name for v in variants_of(None, gguf_source) if v.engine.name == "llama.cpp"] == [row.name]
    with pytest.raises(BadInput, match=r"runs llama.cpp on that file \(Q8_0\) alone"):
        variants_of(["llama.cpp:Q4_0"], gguf_source)


@pytest.mark.skipif(
    not _llama_cpp(), reason="llama-cpp-python is not installed in .venv-engines (scripts/setup-engines.sh)"
)
def test_compare_from_a_gguf_measures_llama_cpp_on_the_file(files, tmp_path):
    """llama.cpp runs the Q8_0 file as it is (nothing converted): its size is the file's, and its logits against
    PyTorch on the file's dequantized weights are close (llama.cpp rounds the activations to 8 bits in its Q8_0
    products, so not equal: mean KL under 1e-2, a broken run gives > 1)."""
    text = tmp_path / "text.txt"
    text.write_text((FIXTURE / "heldout.txt").read_text()[:600])
    proc = _compare(
        files["Q8_0"], "--work", tmp_path / "w", "--only", "llama.cpp", "--text", text, "--json", tmp_path / "r.json"
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    (record,) = report["variants"]
    assert record["name"] == "llama.cpp Q8_0 (the source file)"
    assert record["file_bytes"] == files["Q8_0"].stat().st_size
    assert not list((tmp_path / "w").glob("llama.cpp-*"))  # nothing converted
    (row,) = report["summary"]
    assert row["kl_mean"] < 1e-2 and row["same_top1"] > 0.9, row
