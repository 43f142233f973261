"""gpt2onnx generate: a folder's files, the decoding options, the runtimes and providers, speculative and
constrained decoding."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from tests.bad_input.common import (
    EXIT_RUNTIME,
    GEN,
    REMOTE_CODE,
    B,
    Case,
    Ctx,
    Outcome,
    _generation_raw,
    _og_deployed,
    data_location,
    edit_json,
    export_copy,
    genai_config_file,
    int8_export,
    manifest_edit,
    manifest_file_name,
    no_marker,
    rehash,
    swap_model,
    write,
)


def remote_code_tokenizer(c: Ctx) -> None:
    folder = c.copy("exp", "m")
    (folder / "evil.py").write_text(REMOTE_CODE)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    config["tokenizer_class"] = "EvilTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    config = json.loads((folder / "config.json").read_text())
    config.pop("model_type")  # no local class to fall back on: transformers would ask whether to trust the folder
    (folder / "config.json").write_text(json.dumps(config))


CASES: list[Case] = [
    # The tokenizer files load into a fixed class (trust_remote_code=False): generation works, the folder's code
    # never runs.
    Case(
        "auto-map-tokenizer-not-run",
        "security",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        0,
        remote_code_tokenizer,
        check=no_marker,
        timeout=120,
        process=True,
    ),
    Case(
        "threads-5000",
        "hang",
        ("generate", "{exp}", "--ids", "1,2", "--max-new-tokens", "1", "--threads", "5000"),
        B,
        match="threads",
        timeout=20,
        process=True,
    ),
    Case(
        "temperature-without-sample",
        "silent",
        ("generate", "{exp}", "--ids", "1,2", "--temperature", "0.5"),
        B,
        match="--sample",
    ),
    Case("trt-option-on-cpu", "silent", ("generate", "{exp}", "--ids", "1,2", "--trt-fp16"), B, match="tensorrt"),
    Case("ids-empty-item", "silent", ("generate", "{exp}", "--ids", "1,,2"), B, match="--ids"),
    Case(
        "swapped-model-generate",
        "silent",
        ("generate", "m", "--ids", "1,2", "--max-new-tokens", "1"),
        B,
        export_copy(swap_model),
        match="model.onnx.*sha256|sha256.*model.onnx",
    ),
    Case(
        "ids-beyond-vocab",
        "silent",
        ("generate", "{exp}", "--ids", "1,5000", "--max-new-tokens", "1"),
        B,
        match="5000.*vocabulary",
    ),
    Case(
        "corrupt-manifest",
        "silent",
        ("generate", "m", "--ids", "1,2", "--max-new-tokens", "1"),
        B,
        export_copy(write("gpt2onnx.json", "{not json")),
        match="gpt2onnx.json",
    ),
    Case("ids-beyond-int64", "traceback", ("generate", "{exp}", "--ids", "99999999999999999999999"), B, match="--ids"),
    Case(
        "temperature-nan",
        "traceback",
        ("generate", "{exp}", "--ids", "1,2", "--sample", "--temperature", "nan"),
        B,
        match="temperature",
    ),
    Case(
        "sample-seed-negative",
        "traceback",
        ("generate", "{exp}", "--ids", "1,2", "--sample", "--seed", "-1"),
        B,
        match="seed",
    ),
    Case(
        "manifest-json-list",
        "traceback",
        ("generate", "m", "--ids", "1,2", "--max-new-tokens", "1"),
        B,
        export_copy(write("gpt2onnx.json", "[]")),
        match="gpt2onnx.json",
    ),
    Case(
        "n-positions-raised",
        "traceback",
        ("generate", "m", "--ids", ",".join(["5"] * 130), "--max-new-tokens", "2"),
        B,
        export_copy(edit_json("config.json", n_positions=4096)),
        match="n_positions|position",
    ),
    Case(
        "trt-leaves-no-cache",
        "data-loss",
        ("generate", "m", "--ids", "1,2", "--provider", "tensorrt"),
        EXIT_RUNTIME,
        export_copy(),
        match="tensorrt|TensorRT",
    ),
    Case("generate-folder-is-file", "message", ("generate", "{src}/config.json", "--ids", "1"), B, match="is a file"),
    Case(
        "draft-is-file",
        "message",
        ("generate", "{exp}", "--ids", "1", "--draft", "{src}/config.json"),
        B,
        match="draft",
    ),
    Case("draft-missing", "message", ("generate", "{exp}", "--ids", "1", "--draft", "nope"), B, match="draft"),
    Case(
        "draft-no-model", "message", ("generate", "{exp}", "--ids", "1", "--draft", "{src}"), B, match="no model.onnx"
    ),
    Case("lookup-beams", "message", ("generate", "{exp}", "--ids", "1", "--prompt-lookup", "3", "--num-beams", "2"), B),
    Case("top-p-2", "options", ("generate", "{exp}", "--ids", "1", "--sample", "--top-p", "2"), B, match="top-p"),
    Case("provider-bogus", "options", ("generate", "{exp}", "--ids", "1", "--provider", "tpu"), B, match="tpu"),
    Case("prompt-lookup-zero", "options", ("generate", "{exp}", "--ids", "1", "--prompt-lookup", "0"), B, match="1 to"),
    Case("draft-tokens-bogus", "options", ("generate", "{exp}", "--ids", "1", "--draft-tokens", "x"), B, match="draft"),
    Case(
        "draft-tokens-superscript",  # '²'.isdigit() is true, int('²') raises: once exit 70
        "traceback",
        ("generate", "{exp}", "--ids", "1", "--draft", "{exp}", "--draft-tokens", "²"),
        B,
        match="--draft-tokens must be a number from 1 to 64",
    ),
    Case("max-ngram-alone", "options", ("generate", "{exp}", "--ids", "1", "--max-ngram", "3"), B, match="--max-ngram"),
]


def tokenizer_edit(edit: Callable[[Ctx, Path], None]) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        edit(c, c.copy("exp", "m"))

    return setup


def tokenizer_config_key(key: str, value: str, *, drop: tuple[str, ...] = (), fifo: bool = False):
    """tokenizer_config.json gains ``key``: ``value`` ({dir}: the case folder); ``drop``: files removed first;
    ``fifo``: the value names a FIFO (a load that would block forever)."""

    def edit(c: Ctx, folder: Path) -> None:
        for name in drop:
            (folder / name).unlink()
        target = value.format(dir=c.dir)
        if fifo:
            os.mkfifo(target)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config[key] = target
        (folder / "tokenizer_config.json").write_text(json.dumps(config))

    return tokenizer_edit(edit)


CASES += [
    # -- security: a folder's genai_config.json never reaches onnxruntime-genai ---------------------------------
    Case(
        "genai-custom-ops-library",
        "security",
        ("generate", "m", *GEN, "--runtime", "genai"),
        0,
        genai_config_file(session={"custom_ops_library": "{lib}"}),
        check=no_marker,
    ),
    Case(
        "genai-enable-profiling",
        "security",
        ("generate", "m", *GEN, "--runtime", "genai"),
        0,
        genai_config_file(session={"enable_profiling": "{dir}/profile"}),
    ),
    Case(
        "genai-decoder-filename",
        "security",
        ("generate", "m", *GEN, "--runtime", "genai"),
        0,
        genai_config_file(decoder={"filename": "libevil.so"}),
    ),
    Case(
        "genai-config-not-json",
        "message",
        ("generate", "m", *GEN, "--runtime", "genai"),
        0,
        genai_config_file(raw="{not json"),
    ),
    Case(
        "data-absolute-no-verify",
        "security",
        ("generate", "m", *GEN, "--no-verify-files"),
        B,
        data_location("{dir}/outside.bin"),
        match="not a plain file name",
    ),
    Case(
        "data-link-outside-genai",
        "security",
        ("generate", "m", *GEN, "--runtime", "genai", "--no-verify-files"),
        B,
        data_location("model.onnx_data", link=True),
        match="leads outside",
    ),
    Case(
        "data-fifo",
        "hang",
        ("generate", "m", *GEN),
        B,
        data_location("weights.bin", fifo=True),
        match="regular file",
        process=True,
        timeout=120,
    ),
    Case(
        "data-not-in-manifest",
        "security",
        ("generate", "m", *GEN),
        B,
        export_copy(
            lambda f: (shutil.copy(f / "model.onnx_data", f / "weights.bin"), _relocate(f, "weights.bin")), what="ext"
        ),
        match="does not list",
    ),
    Case(
        "manifest-name-absolute",
        "security",
        ("generate", "m", *GEN),
        B,
        export_copy(manifest_file_name("model.onnx_data/../../../etc/passwd")),
        match="not a plain file name",
    ),
    Case(
        "tokenizer-file-outside",
        "security",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        0,
        tokenizer_config_key("tokenizer_file", "{dir}/nowhere.json", drop=("tokenizer.json",)),
    ),
    Case(
        "tokenizer-file-fifo",
        "hang",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        0,
        tokenizer_config_key("tokenizer_file", "{dir}/pipe.json", drop=("tokenizer.json",), fifo=True),
        process=True,
        timeout=120,
    ),
    Case(
        "tokenizer-vocab-file-outside",
        "security",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        0,
        tokenizer_config_key("vocab_file", "/etc/passwd", drop=("tokenizer.json",)),
    ),
    Case(
        "tokenizer-json-link-outside",
        "security",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        B,
        tokenizer_edit(
            lambda c, f: (
                shutil.move(f / "tokenizer.json", c.dir / "t.json"),
                (f / "tokenizer.json").symlink_to(c.dir / "t.json"),
            )
        ),
        match="leads outside",
    ),
    Case(
        "tokenizer-json-fifo",
        "hang",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        B,
        tokenizer_edit(lambda c, f: ((f / "tokenizer.json").unlink(), os.mkfifo(f / "tokenizer.json"))),
        match="regular file",
        process=True,
        timeout=120,
    ),
    Case(
        "tokenizer-json-folder",
        "traceback",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        B,
        tokenizer_edit(lambda c, f: ((f / "tokenizer.json").unlink(), (f / "tokenizer.json").mkdir())),
        match="regular file",
    ),
    # -- silent: facts from the graph win over the manifest and the configs -------------------------------------------
    Case("kv-cache-lie-shared", "silent", ("generate", "m", *GEN), 0, export_copy(manifest_edit(kv_cache="shared"))),
    Case(
        "skv-openvino-batch-2",
        "traceback",
        ("generate", "{skv}", "--ids", "1,2", "--ids", "3", "--max-new-tokens", "2", "--runtime", "openvino"),
        0,
    ),
    Case(
        "skv-genai-batch-2",
        "traceback",
        ("generate", "{skv}", "--ids", "1,2", "--ids", "3", "--max-new-tokens", "2", "--runtime", "genai"),
        0,
    ),
    *(
        Case(
            f"n-positions-raised-{name}",
            "silent",
            ("generate", "m", "--ids", ",".join(["5"] * 130), "--max-new-tokens", "2", *args),
            B,
            export_copy(edit_json("config.json", n_positions=4096), what=what),
            match="position table",
        )
        for name, what, args in (
            ("int4", "q4", ()),
            ("openvino", "exp", ("--runtime", "openvino")),
            ("genai", "exp", ("--runtime", "genai")),
            ("bench", "exp", ()),
        )
    ),
    Case(
        "generation-config-string-genai-run",
        "silent",
        ("generate", "m", *GEN, "--runtime", "genai"),
        B,
        export_copy(edit_json("generation_config.json", do_sample="false")),
        match="do_sample",
    ),
    Case("ids-underscore", "silent", ("generate", "{exp}", "--ids", "1_0"), B, match="--ids"),
    Case(
        "max-new-tokens-underscore",
        "silent",
        ("generate", "{exp}", "--ids", "1", "--max-new-tokens", "1_0"),
        B,
        match="underscores",
    ),
    Case(
        "quantization-record-garbage",
        "silent",
        ("generate", "m", *GEN),
        (0, B),
        export_copy(manifest_edit(quantization="int4")),
        match="unreadable",
    ),
    Case(
        "trt-cache-dir-on-cpu",
        "options",
        ("generate", "{exp}", "--ids", "1", "--trt-cache-dir", "c"),
        B,
        match="tensorrt",
    ),
    Case("device-id-on-cpu", "options", ("generate", "{exp}", "--ids", "1", "--device-id", "1"), B, match="device id"),
    Case(
        "no-spin-on-cuda",
        "options",
        ("generate", "{exp}", "--ids", "1", "--provider", "cuda", "--no-spin"),
        B,
        match="--no-spin",
    ),
    Case(
        "allow-fallback-on-cpu",
        "options",
        ("generate", "{exp}", "--ids", "1", "--allow-fallback"),
        B,
        match="--allow-fallback",
    ),
    Case(
        "ov-precision-on-onnxruntime",
        "options",
        ("generate", "{exp}", "--ids", "1", "--ov-precision", "bf16"),
        B,
        match="openvino",
    ),
    Case(
        "device-on-genai",
        "options",
        ("generate", "{exp}", "--ids", "1", "--runtime", "genai", "--device", "GPU"),
        B,
        match="openvino",
    ),
    Case(
        "provider-on-openvino",
        "options",
        ("generate", "{exp}", "--ids", "1", "--runtime", "openvino", "--provider", "cuda"),
        B,
        match="--provider",
    ),
    Case("threads-zero", "options", ("generate", "{exp}", "--ids", "1", "--threads", "0"), B, match="threads"),
    Case("runtime-bogus", "options", ("generate", "{exp}", "--ids", "1", "--runtime", "tflite"), B, match="tflite"),
    Case(
        "temperature-subnormal",
        "traceback",
        ("generate", "{exp}", "--ids", "1,2", "--sample", "--temperature", "1e-310"),
        B,
        match="temperature",
    ),
    Case(
        "temperature-tiny",
        "traceback",
        ("generate", "{exp}", "--ids", "1,2", "--sample", "--temperature", "1e-9"),
        B,
        match="temperature",
    ),
]


# -- GPU providers (issue 28): what a provider cannot run is refused from what it declares, before any session ----
CASES += [
    Case(
        "int8-on-cuda",
        "silent",
        ("generate", "m", *GEN, "--provider", "cuda"),
        EXIT_RUNTIME,
        int8_export,
        match=r"provider 'cuda' cannot run this model's MatMulInteger ×\d+ \(CUDA's takes int8 activations only; "
        r"this graph gives it uint8\)",
    ),
    Case(
        "contrib-ops-on-tensorrt",
        "message",
        ("generate", "{q4}", *GEN, "--provider", "tensorrt"),
        EXIT_RUNTIME,
        match=r"takes no com.microsoft op \(TensorRT's parser\).*writes com.microsoft ops \(MatMulNBits\)",
    ),
    Case("tf32-on-cpu", "options", ("generate", "{exp}", *GEN, "--tf32"), B, match="--tf32 applies to the cuda"),
]


def _relocate(folder: Path, name: str) -> None:
    """model.onnx's weights read from ``name`` (a copy of its data file the manifest does not list); the
    manifest re-hashed for model.onnx only."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = name
    onnx.save(model, str(folder / "model.onnx"))
    rehash(folder)


def _files_empty(swap: bool) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        if swap:
            swap_model(folder)
        manifest_edit(files={})(folder)

    return edit


def _low_memory(c: Ctx):
    """This machine has 2 GB available: a run is allowed only if its estimate fits."""
    from unittest import mock

    return mock.patch("gpt2onnx.runtimes.decoder.available_memory", return_value=2 << 30)


GEN1 = ("--ids", "1,2", "--max-new-tokens", "1")


CASES += [
    # -- graph facts over manifest claims: one case per field a command acts on ---------------------------------
    Case(
        "manifest-files-empty",
        "silent",
        ("generate", "m", *GEN1),
        B,
        export_copy(_files_empty(swap=False)),
        match="does not list 'model.onnx'",
    ),
    Case(
        "manifest-files-empty-swapped-model",
        "silent",
        ("generate", "m", *GEN1),
        B,
        export_copy(_files_empty(swap=True)),
        match="does not list 'model.onnx'",
    ),
    *(
        Case(
            f"generate-{key}-{label}",
            "traceback",
            ("generate", "m", *GEN1),
            B,
            _generation_raw(**{key: raw}),
            match=f"{key} {re.escape(raw)} in .* is not a token id: an integer from 0 to 999",
        )
        for key, label, raw in (
            ("eos_token_id", "10-30", str(10**30)),
            ("pad_token_id", "10-30", str(10**30)),
            ("eos_token_id", "outside-vocab", "5000"),
            ("eos_token_id", "negative", "-1"),
            ("pad_token_id", "list", "[1, 2]"),
        )
    ),
    Case(
        "generate-length-penalty-1e300",
        "traceback",
        ("generate", "{exp}", *GEN1, "--num-beams", "2", "--length-penalty", "1e300"),
        B,
        match=r"length_penalty 1e\+300 \(--length-penalty\) is not a finite number from -10 to 10",
    ),
    Case(
        "generate-prompt-invalid-utf8",
        "traceback",
        ("generate", "{exp}", "--prompt", "hello \udcff there", "--max-new-tokens", "1"),
        B,
        match="--prompt is not valid UTF-8 text",
    ),
    Case(
        "generate-num-beams-150000-counted",
        "hang",
        ("generate", "{exp}", "--ids", "1", "--max-new-tokens", "1", "--num-beams", "150000"),
        B,
        inject=_low_memory,
        match="beam search.*2.1 GB available",
    ),
]


def _generation_config_link(c: Ctx) -> None:
    folder = c.copy("exp", "m")
    data = json.loads((folder / "generation_config.json").read_text())
    data["eos_token_id"] = 3  # what the outside file says: never followed
    (c.dir / "outside.json").write_text(json.dumps(data))
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").symlink_to(c.dir / "outside.json")


CASES += [
    Case(
        "generate-generation-config-link-out",
        "silent",
        ("generate", "m", "--ids", "1,2", "--max-new-tokens", "2"),
        B,
        _generation_config_link,
        match="generation_config.json.*leads outside",
    ),
    Case(
        "generate-top-p-below-float32",
        "silent",
        ("generate", "{exp}", "--ids", "1,2", "--sample", "--top-p", "1e-46"),
        B,
        match="top_p 1e-46.*float32",
    ),
]


def _ort_generate_folder(edit: Callable[[Path, Ctx], None]) -> Callable[[Ctx], None]:
    """The export deployed as 'm' with ort-generate (its manifest lists the ort-generate files), then ``edit``."""

    def setup(c: Ctx) -> None:
        from gpt2onnx.targets.deploy import deploy

        folder = c.copy("exp", "m")
        deploy(folder, "ort-generate")
        edit(folder / "ort-generate", c)

    return setup


def _other_weights(sub: Path, c: Ctx) -> None:
    """Another checkpoint's weights of the same size: every byte of the data file changed."""
    path = sub / "weights.onnx_data"
    data = bytearray(path.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)
    path.unlink()
    path.write_bytes(bytes(data))


def _data_outside(sub: Path, c: Ctx) -> None:
    import onnx

    path = sub / "greedy_search.onnx"
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../../outside.bin"
    path.unlink()
    onnx.save(model, str(path))
    shutil.copy(sub / "weights.onnx_data", c.dir / "outside.bin")


def _linked_ort_folder(sub: Path, c: Ctx) -> None:
    shutil.move(sub, c.dir / "elsewhere")
    sub.symlink_to(c.dir / "elsewhere")


def _fifo_ort_file(sub: Path, c: Ctx) -> None:
    (sub / "greedy_search.onnx").unlink()
    os.mkfifo(sub / "greedy_search.onnx")


ORT_GENERATE_RUN = ("generate", "m", "--runtime", "ort-generate", "--ids", "1,2", "--max-new-tokens", "2")


CASES += [
    Case(
        "ort-generate-other-weights",
        "silent",
        ORT_GENERATE_RUN,
        B,
        _ort_generate_folder(_other_weights),
        match="weights.onnx_data.*differs from what the manifest",
    ),
    Case(
        "ort-generate-data-outside",
        "traceback",
        ORT_GENERATE_RUN,
        B,
        _ort_generate_folder(_data_outside),
        match="outside.bin.*not a plain file name",
    ),
    Case(
        "ort-generate-linked-folder",
        "silent",
        ORT_GENERATE_RUN,
        B,
        _ort_generate_folder(_linked_ort_folder),
        match="ort-generate' is a symbolic link",
    ),
    Case(
        "ort-generate-file-fifo",
        "message",
        ORT_GENERATE_RUN,
        B,
        _ort_generate_folder(_fifo_ort_file),
        match="greedy_search.onnx' is a FIFO",
        process=True,
        timeout=120,
    ),
]


def _genai_worker_run(python: str, timeout: str | None = None) -> Callable[[Ctx, Callable], Outcome]:
    """generate on the genai runtime with its worker's Python set to ``python`` (the script 'hang.sh' in the case
    folder: one that never answers), and its answer time limit to ``timeout`` seconds."""

    def run(c: Ctx, cli) -> Outcome:
        script = c.dir / "hang.sh"
        script.write_text("#!/bin/sh\nsleep 600\n")
        script.chmod(0o755)
        changes = {"GPT2ONNX_GENAI_PYTHON": str(script) if python == "hang.sh" else python}
        if timeout is not None:
            changes["GPT2ONNX_GENAI_TIMEOUT"] = timeout
        argv = ["generate", str(c.exp), "--ids", "1,2", "--max-new-tokens", "2", "--runtime", "genai"]
        return cli(argv, c, env_changes=changes)

    return run


CASES += [
    Case(
        "genai-python-not-python",  # once exit 70: JSONDecodeError on echo's answer
        "traceback",
        (),
        EXIT_RUNTIME,
        run=_genai_worker_run("echo"),
        creates=("hang.sh",),
        match="GPT2ONNX_GENAI_PYTHON must name a Python that has onnxruntime_genai",
    ),
    Case(
        "genai-worker-never-answers",  # once a hang with no time limit
        "hang",
        (),
        EXIT_RUNTIME,
        run=_genai_worker_run("hang.sh", timeout="3"),
        creates=("hang.sh",),
        match="gave no answer within 3 s",
        timeout=60,
    ),
]


CASES += [
    Case(
        "generate-ort-generate-beams-as-check-says",
        "message",
        ("generate", "og", "--runtime", "ort-generate", "--num-beams", "2", "--ids", "1,2", "--max-new-tokens", "1"),
        B,
        _og_deployed,
        match="length_penalty to 1.0: pass --length-penalty 0",
    ),
    Case(
        "generate-ort-generate-not-deployed-as-check-says",
        "message",
        ("generate", "{exp}", "--runtime", "ort-generate", "--ids", "1,2", "--max-new-tokens", "1"),
        B,
        match="has no ort-generate/ files .*: deploy it first",
    ),
]


# -- constraints (issue 57): refused in one line before any decoding -------------------------------------------
def spec_file(name: str, text: str) -> Callable[[Ctx], None]:
    """A schema or grammar file in the case folder."""

    def setup(c: Ctx) -> None:
        (c.dir / name).write_text(text)

    return setup


CONSTRAIN = ("generate", "{exp}", "--ids", "1,2", "--max-new-tokens", "2")


CASES += [
    Case(
        "constraint-schema-invalid",
        "message",
        (*CONSTRAIN, "--json-schema", "s.json"),
        B,
        spec_file("s.json", '{"type": 5}'),
        match="not a valid JSON schema",
    ),
    Case(
        "constraint-schema-not-json",
        "message",
        (*CONSTRAIN, "--json-schema", "s.json"),
        B,
        spec_file("s.json", '{"type": '),
        match="is not JSON",
    ),
    Case("constraint-schema-missing", "message", (*CONSTRAIN, "--json-schema", "nope.json"), B, match="no such file"),
    Case(
        "constraint-schema-depth-bomb",
        "message",
        (*CONSTRAIN, "--json-schema", "s.json"),
        B,
        spec_file("s.json", '{"type": "array", "items": ' * 20_000 + "{}" + "}" * 20_000),
        match="nested too deeply",
    ),
    Case(
        "constraint-schema-unsupported",
        "message",
        (*CONSTRAIN, "--json-schema", "s.json"),
        B,
        spec_file("s.json", '{"not": {"type": "string"}}'),
        match="refused by llguidance.*not",
    ),
    Case(
        "constraint-regex-unsatisfiable",
        "message",
        (*CONSTRAIN, "--regex", r"a[^\s\S]b"),
        B,
        match="can match nothing",
    ),
    Case("constraint-regex-invalid", "message", (*CONSTRAIN, "--regex", "(a"), B, match="unclosed group"),
    Case(
        "constraint-grammar-10mb",
        "message",
        (*CONSTRAIN, "--grammar", "g.lark"),
        B,
        spec_file("g.lark", "start: " + " | ".join(f'"w{i}"' for i in range(1_000_000))),
        match="more than 1,048,576",
    ),
    Case(
        "constraint-grammar-depth-bomb",
        "message",
        (*CONSTRAIN, "--grammar", "g.lark"),
        B,
        spec_file("g.lark", "start: " + "(" * 50_000 + '"a"' + ")" * 50_000),
        match="too deeply nested",
    ),
    Case("constraint-two-kinds", "options", (*CONSTRAIN, "--regex", "a", "--choice", "a,b"), B, match="give one"),
]


CASES += [
    Case(
        "generate-adapter-not-switchable",
        "message",
        ("generate", "{exp}", "--ids", "1,2", "--adapter", "x"),
        B,
        match="has no adapter 'x'",
    ),
]
