"""The quality of the competing engines' 4-bit formats on one trained GPT-2, against transformers fp32, so that
gpt2onnx's int4 algorithms can be set beside them in one table: llama.cpp's Q4_0 and Q4_K_M GGUF and OpenVINO's
NNCF int4 weights (optimum-intel's defaults, and group size 32 with ratio 1.0), each with its engine's own F32 /
fp32 file as the floor (what the engine alone changes, with no quantization).

    /work/engines/venv/bin/python scripts/bench_engines_quality.py --model /work/reference/gpt2like-6x384 \\
        --work /tmp/engines-quality --json-out engines-quality.json --md-out engines-quality.md

Runs in the engines' virtual environment (/work/shared/peers/engines/prepare.sh builds it: llama-cpp-python
compiled from source, openvino, optimum-intel, nncf, gguf, torch, transformers); standalone, gpt2onnx is not
imported. ``--model`` is a GPT2LMHeadModel folder with its tokenizer files and a heldout.txt.

The files, built under ``--work`` (kept; reused when present unless ``--force``):
- GGUF F32 by llama.cpp's own converter (convert_hf_to_gguf.py, ``--convert``), from a staging copy of the
  folder whose config.json has ``n_ctx`` (transformers 4.57 leaves it out, the converter needs it). The converter
  refuses a BPE pre-tokenizer whose hash it does not know (any tokenizer but the public ones, as the test
  fixture's 512-token BPE): it is then registered as 'gpt-2' (GPT-2's pre-tokenizer regex, which every
  byte-level BPE of ours uses); harmless here, the engines are fed token ids, never text. Said in the output.
- Q4_0, Q4_K_M (``--gguf-types``) by llama.cpp's quantizer (llama_model_quantize, as quantize_gguf.py). The
  k-quants work in super-blocks of 256 columns: a tensor whose rows are not a multiple of 256 long (every
  weight of a 384-wide model but the MLP's down projection) is stored in llama.cpp's fallback type instead
  (Q4_K -> Q5_0, Q6_K -> Q8_0): the tensor types of each file are in the table.
- OpenVINO IR by ``optimum-cli export openvino --task text-generation-with-past``: fp32, int4 with
  optimum-intel's defaults, and int4 ``--group-size 32 --ratio 1.0``; the settings NNCF applied are read back
  from the IR (rt_info) and openvino_config.json, and the weight types from the IR's constants.

Scoring (the protocol is printed with the table and written in the JSON): the first ``--tokens`` tokens of
``--text`` (default heldout.txt; ``--tokens 0``: all of them), tokenized whole by the folder's tokenizer, windows
of ``--context`` tokens every ``--stride`` (default: the context, non-overlapping), each from an empty past, as
gpt2onnx eval's sliding windows: a window scores the tokens after the previous window's end (the first window
all but its first token), and the last window is the one that reaches the text's last token (shorter when the
text ends first), so every token but the first is predicted once. To sit beside scripts/bench_precision.py's
table, give its scored text (WORK/scored.txt) with ``--tokens 0 --context N_POSITIONS --stride N_POSITIONS/2``:
the same tokens, windows and scored positions (the JSON has the token ids' sha256 to compare).
Per scored position, the engine's next-token distribution against transformers' GPT2LMHeadModel fp32 on
the same window, in float64: mean KL(reference ‖ engine) with its standard error, the 99th percentile and the
maximum, the share of positions with the same top-1 token, perplexity and ΔPPL % (from the mean paired NLL
difference, with its standard error), and the file size (MB = 10^6 bytes). llama.cpp: Llama(logits_all=True,
n_ctx=n_batch=n_ubatch=context), the window's ids evaluated in one batch, its logits at every position (the
cache cleared between windows). OpenVINO: OVModelForCausalLM, one forward of input_ids and attention_mask per
window (its state reset: no past), the logits of every position, compiled with INFERENCE_PRECISION_HINT f32,
KV_CACHE_PRECISION f32 and DYNAMIC_QUANTIZATION_GROUP_SIZE 0, so that only the weights differ from fp32 (the
CPU plugin's defaults otherwise quantize activations of compressed-weight matmuls and the KV cache to 8 bits;
``--ov-defaults`` adds a row of the default int4 file under the plugin's defaults). llama.cpp's CPU kernels for
Q4_0/Q4_K quantize the activations to 8 bits (Q8_0/Q8_K) in every dot product; no knob turns that off.
All engines run on ``--threads`` threads through their own APIs (torch.set_num_threads for the reference).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import ctypes
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

CONVERT = Path("/work/engines/.src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py")
GGUF_TYPES = ("Q4_0", "Q4_K_M")
# The types each llama.cpp format stores by design (F32: norms and biases; Q6_K: the output / embedding
# matrix); anything else in such a file is a fallback for rows whose length is not a multiple of the block.
OWN_TYPES = {"Q4_0": {"F32", "Q4_0", "Q6_K"}, "Q4_K_M": {"F32", "Q4_K", "Q6_K"}, "Q8_0": {"F32", "Q8_0"}}
OV_STRICT = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}

# Run in a subprocess: llama.cpp's converter with an unknown BPE pre-tokenizer registered as 'gpt-2'.
CONVERT_WRAPPER = r"""
import sys
sys.path.insert(0, sys.argv[1])
try:  # llama.cpp since 2026: the models in the package conversion/
    from conversion.base import TextModel
except ImportError:
    from convert_hf_to_gguf import TextModel
import convert_hf_to_gguf as c
original = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError as e:
        print("WORKAROUND: unknown BPE pre-tokenizer (" + str(e).splitlines()[0][:120] + "): registered as 'gpt-2'",
              flush=True)
        return "gpt-2"  # llama.cpp's name for GPT-2's pre-tokenizer (llama-vocab.cpp); 'gpt2' fails to load
TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [c.__file__] + sys.argv[2:]
c.main()
"""


def log(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> str:
    log("$", " ".join(str(c) for c in cmd))
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        sys.stderr.write(out[-6000:])
        raise RuntimeError(f"{cmd[0]} ... exited {p.returncode}")
    return out


def size_of(paths) -> int:
    return sum(os.path.getsize(p) for p in paths)


# -- machine ------------------------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "avx_vnni")
                    return [x for x in wanted if x in have]
    except OSError:
        pass
    return []


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("numpy", "torch", "transformers", "llama_cpp", "openvino", "optimum.intel", "nncf", "gguf"):
        try:
            mod = __import__(name, fromlist=["_"])
            out[name] = getattr(mod, "__version__", None) or getattr(mod, "get_version", lambda: "?")()
        except Exception as e:
            out[name] = f"unavailable ({type(e).__name__})"
    try:
        import openvino

        out["openvino"] = openvino.get_version()
    except Exception:
        pass
    return out


# -- the files ----------------------------------------------------------------------------------------------
def stage_for_gguf(model: Path, work: Path) -> Path:
    """A copy of the folder (links) whose config.json has n_ctx, which llama.cpp's converter reads."""
    stage = work / "gguf-stage"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file() and f.name != "config.json":
            (stage / f.name).symlink_to(f.resolve())
    config = json.loads((model / "config.json").read_text())
    config.setdefault("n_ctx", config["n_positions"])
    (stage / "config.json").write_text(json.dumps(config, indent=2))
    return stage


def build_gguf(model: Path, work: Path, convert: Path, types, force: bool, notes: list[str]) -> dict[str, Path]:
    f32 = work / "gguf-f32.gguf"
    if force or not f32.exists():
        stage = stage_for_gguf(model, work)
        wrapper = work / "convert_wrapper.py"
        wrapper.write_text(CONVERT_WRAPPER)
        out = run([sys.executable, wrapper, convert.parent, stage, "--outtype", "f32", "--outfile", f32])
        for line in out.splitlines():
            if "WORKAROUND" in line:
                notes.append("GGUF conversion: " + line.split("WORKAROUND: ", 1)[1])
                log(line)
        (work / "gguf-convert.log").write_text(out)
    files = {"F32": f32}
    import llama_cpp as L

    for name in types:
        dst = work / f"gguf-{name.lower()}.gguf"
        if force or not dst.exists():
            p = L.llama_model_quantize_default_params()
            p.ftype = getattr(L, "LLAMA_FTYPE_MOSTLY_" + name.upper())
            p.nthread = 2
            t = time.time()
            rc = L.llama_model_quantize(str(f32).encode(), str(dst).encode(), ctypes.byref(p))
            log(f"llama_model_quantize {name}: rc {rc}, {time.time() - t:.1f} s")
            if rc != 0:
                raise RuntimeError(f"llama_model_quantize {name} returned {rc}")
        files[name] = dst
    return files


def gguf_tensor_types(path: Path) -> dict:
    """{type: [tensors, elements]} of a GGUF file, and its weights' mean bits per element."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    names: dict[str, list[str]] = collections.defaultdict(list)
    for t in reader.tensors:
        kind = t.tensor_type.name
        counts[kind][0] += 1
        counts[kind][1] += int(t.n_elements)
        names[kind].append(t.name)
    total_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    total_elements = sum(int(t.n_elements) for t in reader.tensors)
    return {
        "types": {k: {"tensors": v[0], "elements": v[1], "names": names[k]} for k, v in counts.items()},
        "bits_per_element": 8 * total_bytes / total_elements,
    }


def export_openvino(model: Path, dst: Path, args_: list[str], force: bool, notes: list[str]) -> list[str]:
    """optimum-cli's export to ``dst``; the arguments it took (a group size no row length is a multiple of is
    refused by NNCF by default: retried with ``--group-size-fallback adjust``, said in the notes)."""
    if force and dst.exists():
        shutil.rmtree(dst)
    done = dst / "export-args.json"
    if (dst / "openvino_model.xml").exists():
        return json.loads(done.read_text()) if done.exists() else args_
    cli = Path(sys.executable).with_name("optimum-cli")
    base = [cli, "export", "openvino", "--model", model, "--task", "text-generation-with-past"]
    base += ["--disable-convert-tokenizer"]  # the engines are fed token ids
    t = time.time()
    try:
        out = run([*base, *args_, dst])
    except RuntimeError as e:
        if "int4" not in args_ or "--group-size-fallback" in args_:
            raise
        log(f"{e}: retried with --group-size-fallback adjust")
        args_ = [*args_, "--group-size-fallback", "adjust"]
        out = run([*base, *args_, dst])
        notes.append(
            f"optimum-cli export {' '.join(args_[:-2])} failed (NNCF: a row length is not a multiple of the group "
            "size); exported with --group-size-fallback adjust (smaller groups, down to 32, else int8 backup)"
        )
    log(f"optimum-cli export {' '.join(args_)}: {time.time() - t:.0f} s")
    (dst / "export.log").write_text(out)
    done.write_text(json.dumps(args_))
    return args_


def openvino_settings(folder: Path) -> dict:
    """What NNCF applied (the IR's rt_info), optimum-intel's quantization_config, and the weights' types."""
    tree = ET.parse(folder / "openvino_model.xml")
    root = tree.getroot()
    rt = {}
    info = root.find("rt_info")
    if info is not None:

        def walk(node, prefix):
            for child in node:
                key = f"{prefix}.{child.tag}" if prefix else child.tag
                if "value" in child.attrib:
                    rt[key] = child.attrib["value"]
                walk(child, key)

        for child in info:
            if child.tag in ("nncf", "optimum"):
                walk(child, child.tag)
    types: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for layer in root.iter("layer"):
        if layer.attrib.get("type") != "Const":
            continue
        data = layer.find("data")
        if data is None:
            continue
        shape = [int(x) for x in data.attrib.get("shape", "").split(",") if x.strip()]
        n = int(np.prod(shape)) if shape else 1
        if n < 1024:  # scales, zero points, shapes: not weights
            continue
        kind = data.attrib.get("element_type", "?")
        types[kind][0] += 1
        types[kind][1] += n
    config = {}
    if (folder / "openvino_config.json").exists():
        config = json.loads((folder / "openvino_config.json").read_text()).get("quantization_config") or {}
    return {"rt_info": rt, "quantization_config": config, "weight_constants": {k: v for k, v in types.items()}}


# -- the windows and the statistics -------------------------------------------------------------------------
def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first) per window, as gpt2onnx eval's sliding windows (gpt2onnx.verify.text.sliding_windows,
    transformers' perplexity guide): start = 0, stride, 2·stride, ...; end = min(start + context, n); the window
    scores its tokens from the previous window's end on (``first``: the index in the window of the first scored
    token; the first window scores all but its first token), and the window that reaches the last token is the
    last, so every token but the text's first is scored once, as bench_precision scores it."""
    out, begin, prev_end = [], 0, 0
    while True:
        end = min(begin + context, n)
        first = max(1, prev_end - begin)
        if end - begin > first:
            out.append((begin, end, first))
        prev_end = end
        if end == n:
            return out
        begin += stride


class Tally:
    def __init__(self):
        self.kl, self.nll, self.ref_nll, self.top1 = [], [], [], []

    def add(self, ref: np.ndarray, got: np.ndarray, targets: np.ndarray) -> None:
        r = ref.astype(np.float64)
        g = got.astype(np.float64)
        r -= r.max(axis=1, keepdims=True)
        g -= g.max(axis=1, keepdims=True)
        lr = r - np.log(np.exp(r).sum(axis=1, keepdims=True))
        lg = g - np.log(np.exp(g).sum(axis=1, keepdims=True))
        rows = np.arange(len(targets))
        self.kl.append(np.einsum("ij,ij->i", np.exp(lr), lr - lg))
        self.nll.append(-lg[rows, targets])
        self.ref_nll.append(-lr[rows, targets])
        self.top1.append(ref.argmax(axis=1) == got.argmax(axis=1))

    def summary(self) -> dict:
        kl, nll, ref_nll = (np.concatenate(x) for x in (self.kl, self.nll, self.ref_nll))
        top1 = np.concatenate(self.top1)
        n = len(kl)
        d = nll - ref_nll

        def se(x):
            return float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan

        ratio = math.exp(d.mean())
        return {
            "positions": n,
            "kl_mean": float(kl.mean()),
            "kl_se": se(kl),
            "kl_p99": float(np.percentile(kl, 99)),
            "kl_max": float(kl.max()),
            "same_top1": float(top1.mean()),
            "ppl": float(math.exp(nll.mean())),
            "ppl_se": float(math.exp(nll.mean()) * se(nll)),
            "ref_ppl": float(math.exp(ref_nll.mean())),
            "dppl_percent": 100 * (ratio - 1),
            "dppl_se_percent": 100 * ratio * se(d),
        }


# -- the engines --------------------------------------------------------------------------------------------
class Reference:
    def __init__(self, model: Path, threads: int):
        import torch
        from transformers import GPT2LMHeadModel

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = GPT2LMHeadModel.from_pretrained(model, torch_dtype=torch.float32).eval()

    def logits(self, ids: np.ndarray) -> np.ndarray:
        t = self.torch.tensor(ids[None], dtype=self.torch.long)
        with self.torch.inference_mode():
            return self.model(input_ids=t, attention_mask=self.torch.ones_like(t), use_cache=False).logits[0].numpy()


class LlamaEngine:
    def __init__(self, path: Path, context: int, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(path),
            logits_all=True,
            n_ctx=context,
            n_batch=context,
            n_ubatch=context,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.info = {"n_ctx": self.llm.n_ctx(), "n_vocab": self.llm.n_vocab(), "n_threads": threads}

    def logits(self, ids: np.ndarray) -> np.ndarray:
        self.llm.reset()  # n_tokens 0: eval removes the cache from position 0 on
        self.llm.eval([int(i) for i in ids])
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)


class OpenVinoEngine:
    def __init__(self, path: Path, threads: int, strict: bool):
        from optimum.intel import OVModelForCausalLM

        config = {"INFERENCE_NUM_THREADS": str(threads), "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"}
        if strict:
            config.update(OV_STRICT)
        self.model = OVModelForCausalLM.from_pretrained(path, ov_config=config, compile=True)
        import torch

        self.torch = torch
        compiled = (
            self.model.request.get_compiled_model() if hasattr(self.model.request, "get_compiled_model") else None
        )
        if compiled is None:
            compiled = getattr(self.model, "compiled_model", None)
        self.info = {"ov_config": config, "stateful": bool(getattr(self.model, "stateful", False))}
        if compiled is not None:
            for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE"):
                try:
                    self.info["compiled." + key] = str(compiled.get_property(key))
                except Exception:
                    pass

    def logits(self, ids: np.ndarray) -> np.ndarray:
        t = self.torch.tensor(ids[None], dtype=self.torch.long)
        out = self.model(input_ids=t, attention_mask=self.torch.ones_like(t), past_key_values=None, use_cache=False)
        logits = out.logits
        logits = logits.numpy() if hasattr(logits, "numpy") else np.asarray(logits)
        if logits.shape[1] != len(ids):
            raise RuntimeError(f"OpenVINO returned logits for {logits.shape[1]} positions, not {len(ids)}")
        return logits[0]


# -- the table ----------------------------------------------------------------------------------------------
def fmt_types(row: dict) -> str:
    if "gguf" in row:
        items = sorted(row["gguf"]["types"].items(), key=lambda kv: -kv[1]["elements"])
        total = sum(v["elements"] for _, v in items)
        return ", ".join(f"{k} {100 * v['elements'] / total:.0f}%" for k, v in items)
    if "openvino" in row:
        items = sorted(row["openvino"]["weight_constants"].items(), key=lambda kv: -kv[1][1])
        total = sum(v[1] for _, v in items)
        return ", ".join(f"{k} {100 * v[1] / total:.0f}%" for k, v in items)
    return ""


def markdown(result: dict) -> str:
    p = result["protocol"]
    lines = [
        f"# Engines' 4-bit formats on {p['model']}",
        "",
        f"Protocol: the first {p['tokens']} tokens of {p['text']} (the folder's tokenizer), {p['windows']} windows of "
        f"{p['context']} tokens every {p['stride']} from an empty past, {p['scored']} positions scored (each token "
        f"predicted once); against transformers GPT2LMHeadModel fp32 on the same windows, float64 statistics. "
        f"CPU: {p['cpu']} ({', '.join(p['cpu_flags'])}), {p['threads']} threads per engine. "
        f"{p['date']}. Shares of weight elements by stored type (GGUF: every tensor; OpenVINO: constants of "
        f"1024+ elements). MB = 10^6 bytes.",
        "",
        "| engine, format | file MB | mean KL | KL p99 | same top-1 % | PPL | ΔPPL % | weight types |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['name']} | | failed: {row['error'][:120]} | | | | | |")
            continue
        s = row.get("stats")
        if s is None:  # the reference
            lines.append(f"| {row['name']} | {row['mb']:.1f} | – | – | – | {row['ppl']:.3f} | – | f32 |")
            continue
        lines.append(
            f"| {row['name']} | {row['mb']:.1f} | {s['kl_mean']:.4g} ± {s['kl_se']:.1g} | {s['kl_p99']:.4g} | "
            f"{100 * s['same_top1']:.2f} | {s['ppl']:.3f} | {s['dppl_percent']:+.2f} ± {s['dppl_se_percent']:.2f} | "
            f"{fmt_types(row)} |"
        )
    if result["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


# -- main ---------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="GPT2LMHeadModel folder with heldout.txt")
    ap.add_argument("--work", type=Path, required=True, help="where the engines' files are built (kept)")
    ap.add_argument("--text", type=Path, help="the text to score (default: the folder's heldout.txt)")
    ap.add_argument("--tokens", type=int, default=16384, help="score the text's first N tokens (0: all of them)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--stride", type=int, help="default: the context (non-overlapping windows)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf-types", nargs="*", default=list(GGUF_TYPES))
    ap.add_argument("--no-gguf", action="store_true")
    ap.add_argument("--no-openvino", action="store_true")
    ap.add_argument("--no-ov-g32", action="store_true", help="skip the int4 --group-size 32 --ratio 1.0 export")
    ap.add_argument("--ov-defaults", action="store_true", help="also the default int4 under the plugin's defaults")
    ap.add_argument("--convert", type=Path, default=CONVERT, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--jobs", type=int, default=3, help="OpenVINO exports run at once (beside the GGUF builds)")
    ap.add_argument("--force", action="store_true", help="rebuild the files even if present")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--md-out", type=Path)
    args = ap.parse_args()
    stride = args.stride or args.context
    if not 1 <= stride <= args.context:
        ap.error("--stride must be 1 to --context")
    model = args.model.resolve()
    text = args.text or model / "heldout.txt"
    args.work.mkdir(parents=True, exist_ok=True)
    work = args.work.resolve()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    notes: list[str] = []

    config = json.loads((model / "config.json").read_text())
    if args.context > config["n_positions"]:
        ap.error(f"--context {args.context} > the model's n_positions {config['n_positions']}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    content = text.read_text(encoding="utf-8")
    if args.tokens:
        ids = np.array(tok(content[: max(200_000, args.tokens * 12)], verbose=False)["input_ids"], dtype=np.int64)
    if not args.tokens or len(ids) < args.tokens:
        ids = np.array(tok(content, verbose=False)["input_ids"], dtype=np.int64)
    if args.tokens:
        ids = ids[: args.tokens]
    wins = windows(len(ids), args.context, stride)
    scored = sum(end - start - first for start, end, first in wins)
    vocab = config["vocab_size"]
    log(f"{len(ids)} tokens, {len(wins)} windows of {args.context} every {stride}, {scored} positions scored")

    # The engines' files: the OpenVINO exports (--jobs at once, each a subprocess) beside the GGUF builds.
    engines: list[tuple[str, str, Path, dict]] = []  # name, kind, path, options
    rows: list[dict] = []
    ov_rows = []
    if not args.no_openvino:
        ov_rows = [("fp32", ["--weight-format", "fp32"], "OpenVINO fp32 (IR)")]
        ov_rows.append(("int4", ["--weight-format", "int4"], "OpenVINO NNCF int4, optimum-intel defaults"))
        if not args.no_ov_g32:
            ov_rows.append(
                (
                    "int4-g32-r1",
                    ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"],
                    "OpenVINO NNCF int4, group 32, ratio 1.0",
                )
            )
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        exports = [
            pool.submit(export_openvino, model, work / f"ov-{tag}", cli_args, args.force, notes)
            for tag, cli_args, _ in ov_rows
        ]
        if not args.no_gguf:
            try:
                files = build_gguf(model, work, args.convert, args.gguf_types, args.force, notes)
                for name, path in files.items():
                    engines.append((f"llama.cpp {name} (GGUF)", "gguf", path, {}))
            except Exception as e:
                log(f"GGUF failed: {e}")
                rows.append({"name": "llama.cpp GGUF", "error": str(e)})
        for (tag, _, name), future in zip(ov_rows, exports):
            try:
                cli_args = future.result()
                path = work / f"ov-{tag}"
                engines.append((name, "ov", path, {"strict": True, "cli": cli_args}))
                if tag == "int4" and args.ov_defaults:
                    engines.append((name + ", CPU plugin defaults", "ov", path, {"strict": False, "cli": cli_args}))
            except Exception as e:
                log(f"OpenVINO {tag} failed: {e}")
                rows.append({"name": name, "error": str(e)})

    # Score: the reference once per window, every engine open at once (small models), streamed window by window.
    ref = Reference(model, args.threads)
    ref_tally = Tally()
    open_engines = []
    for name, kind, path, opts in engines:
        row = {"name": name, "path": str(path)}
        try:
            if kind == "gguf":
                row["mb"] = os.path.getsize(path) / 1e6
                row["gguf"] = gguf_tensor_types(path)
                eng = LlamaEngine(path, args.context, args.threads)
            else:
                files = [path / "openvino_model.bin", path / "openvino_model.xml"]
                row["mb"] = size_of(files) / 1e6
                row["openvino"] = openvino_settings(path)
                row["openvino"]["optimum_cli_args"] = opts["cli"]
                eng = OpenVinoEngine(path, args.threads, opts["strict"])
            row["engine_info"] = eng.info
            open_engines.append((row, eng, Tally(), [0.0]))
        except Exception as e:
            log(f"{name}: failed to open: {e}")
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)

    t0 = time.time()
    for w, (start, end, first) in enumerate(wins):
        window = ids[start:end]
        targets = window[first:]  # predicted by positions first - 1 ... end - start - 2
        r = ref.logits(window)[:, :vocab]
        ref_tally.add(r[first - 1 : -1], r[first - 1 : -1], targets)
        for row, eng, tally, clock in open_engines:
            if "error" in row:
                continue
            try:
                t = time.perf_counter()
                g = eng.logits(window)
                clock[0] += time.perf_counter() - t
                if g.shape[1] < vocab:
                    raise RuntimeError(f"{g.shape[1]} logits per position, the model has {vocab} tokens")
                tally.add(r[first - 1 : -1], g[first - 1 : -1, :vocab], targets)
            except Exception as e:
                log(f"{row['name']}: failed on window {w}: {e}")
                row["error"] = f"{type(e).__name__}: {e}"
        if w % 16 == 0 or w == len(wins) - 1:
            log(f"window {w + 1}/{len(wins)}, {time.time() - t0:.0f} s")
    for row, eng, tally, clock in open_engines:
        if "error" not in row:
            row["stats"] = tally.summary()
            row["engine_seconds"] = clock[0]
            row["ppl"] = row["stats"]["ppl"]
    ref_stats = ref_tally.summary()
    ref_row = {
        "name": "transformers fp32 (reference)",
        "path": str(model),
        "mb": size_of([model / "model.safetensors"]) / 1e6,
        "ppl": ref_stats["ref_ppl"],
        "ppl_se": ref_stats["ppl_se"],
    }
    rows.insert(0, ref_row)

    for row in rows:
        own = OWN_TYPES.get(row["name"].split()[1]) if "gguf" in row else None
        if own:
            odd = [n for k, v in row["gguf"]["types"].items() if k not in own for n in v["names"]]
            if odd:
                notes.append(
                    f"{row['name']}: {len(odd)} tensors in other types than the format's own "
                    f"({', '.join(k for k in row['gguf']['types'])}; llama.cpp's fallbacks for rows whose length "
                    f"is not a multiple of the block): {', '.join(odd[:8])}{' ...' if len(odd) > 8 else ''}"
                )
        if "openvino" in row and "int4" in row["name"] and "defaults" not in row["name"].split(", ")[-1]:
            rt = row["openvino"]["rt_info"]
            keep = {
                k.split(".")[-1]: v
                for k, v in rt.items()
                if "weight_compression" in k and not k.endswith("advanced_parameters")
            }
            if keep:
                notes.append(f"{row['name']}: NNCF applied {json.dumps(keep)}")
    order = ["transformers"] + [f"llama.cpp {t}" for t in ("F32", *args.gguf_types)] + [n for _, _, n in ov_rows]
    rows.sort(key=lambda r: next((i for i, o in enumerate(order) if r["name"].startswith(o)), len(order)))
    result = {
        "protocol": {
            "model": str(model),
            "text": str(text),
            "tokens": int(len(ids)),
            "text_sha256": hashlib.sha256(content.encode("utf-8")).hexdigest(),
            "ids_sha256": hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest(),
            "context": args.context,
            "stride": stride,
            "windows": len(wins),
            "scored": scored,
            "threads": args.threads,
            "cpu": cpu_name(),
            "cpu_flags": cpu_flags(),
            "cores": os.cpu_count(),
            "loadavg_end": os.getloadavg(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "versions": versions(),
            "model_config": {k: config.get(k) for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")},
            "train_report": json.loads((model / "train_report.json").read_text())
            if (model / "train_report.json").exists()
            else None,
            "description": __doc__.split("Scoring (")[1].split("\n\n")[0].strip(),
        },
        "rows": rows,
        "notes": notes,
    }
    md = markdown(result)
    print(md)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if args.md_out:
        args.md_out.write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
