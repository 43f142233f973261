"""gpt2onnx deploy: every target's refusals, what it keeps of a folder the user owns, read-only and foreign folders."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from tests.bad_input.common import (
    EXIT_OUTPUT,
    B,
    Case,
    Ctx,
    Outcome,
    _deployed_with_user_things,
    _generation_raw,
    _int4_external,
    _user_things,
    data_location,
    edit_json,
    export_copy,
    manifest_edit,
    manifest_file_name,
    rehash,
    rehash_all,
    write,
)


def _generation_config(folder: Path, **changes) -> None:
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


CASES: list[Case] = [
    # -- deploy ------------------------------------------------------------------------------------------------------
    Case("deploy-missing-folder", "message", ("deploy", "nope", "--target", "genai"), B, match="does not exist"),
    Case(
        "deploy-target-bogus",
        "options",
        ("deploy", "{exp}", "--target", "onnxruntime-web", "-o", "out"),
        B,
        match="unknown --target",
    ),
    Case(
        "deploy-out-inside-source",
        "data-loss",
        ("deploy", "{exp}", "--target", "genai", "-o", "{exp}/sub"),
        B,
        match="inside",
    ),
    Case(
        "deploy-out-not-ours",
        "data-loss",
        ("deploy", "{exp}", "--target", "genai", "-o", "out", "--force"),
        B,
        lambda c: ((c.dir / "out").mkdir(), (c.dir / "out" / "keep.txt").write_text("mine")),
        match="never replaced",
    ),
    Case(
        "deploy-triton-name-path",
        "security",
        ("deploy", "{exp}", "--target", "triton", "-o", "out", "--triton-name", "../x"),
        B,
        match="Triton model name",
    ),
    Case(  # issue 37: the name is shown escaped, so the error stays one line
        "deploy-triton-name-newline",
        "message",
        ("deploy", "{exp}", "--target", "triton", "-o", "out", "--triton-name", "a\nb"),
        B,
        match=r"Triton model name 'a\\nb'",
    ),
    Case(
        "deploy-ort-generate-early-stopping-never",
        "options",
        ("deploy", "m", "--target", "ort-generate", "-o", "out"),
        B,
        lambda c: _generation_config(c.copy("exp", "m"), early_stopping="never"),
        match="early_stopping 'never'.*true or false",
    ),
    Case(
        "deploy-triton-device-bogus",
        "options",
        ("deploy", "{exp}", "--target", "triton", "-o", "out", "--triton-device", "tpu"),
        B,
        match="tpu",
    ),
    # -- deploy --target server: the container and its manifests (issue 54) -------------------------------------------
    Case(
        "deploy-server-not-exported",
        "message",
        ("deploy", "{dir}", "--target", "server", "-o", "out"),
        B,
        match="holds no model.onnx",
    ),
    Case(
        "deploy-server-no-manifest",
        "message",
        ("deploy", "m", "--target", "server", "-o", "out"),
        B,
        lambda c: (c.copy("exp", "m") / "gpt2onnx.json").unlink(),
        match="has no gpt2onnx.json",
    ),
    Case(
        "deploy-server-name-not-label",
        "security",
        ("deploy", "{exp}", "--target", "server", "-o", "out", "--server-name", "../Model\nx"),
        B,
        match=r"--server-name '\.\./Model\\nx' is not a DNS-1123 label",
    ),
    Case(
        "deploy-server-image-bogus",
        "options",
        ("deploy", "{exp}", "--target", "server", "-o", "out", "--server-image", "Registry/UPPER case:1"),
        B,
        match="--server-image .* is not an image reference",
    ),
    Case(
        "deploy-server-batch-zero",
        "options",
        ("deploy", "{exp}", "--target", "server", "-o", "out", "--server-batch", "0"),
        B,
        match="--server-batch 0 is not an integer from 1 to 256",
    ),
    Case(
        "deploy-server-option-without-target",
        "options",
        ("deploy", "{exp}", "--target", "genai", "-o", "out", "--server-name", "gpt2"),
        B,
        match="--server-name applies to the server target",
    ),
    # -- deploy --target mobile: the ORT format (issue 58) -----------------------------------------------------------
    Case(
        "deploy-mobile-not-exported",
        "message",
        ("deploy", "{dir}", "--target", "mobile", "-o", "out"),
        B,
        match="holds no model.onnx",
    ),
    Case(
        "deploy-mobile-out-inside-source",
        "data-loss",
        ("deploy", "{exp}", "--target", "mobile", "-o", "{exp}/mobile"),
        B,
        match="inside",
    ),
    Case(  # one flatbuffer, no external data: refused by the target's declaration before anything is written
        "deploy-mobile-external-data",
        "options",
        ("deploy", "{ext}", "--target", "mobile", "-o", "out"),
        B,
        match="target mobile.*external data",
    ),
    Case(  # a file of the user's where the target writes, deployed in place: refused, the file kept
        "deploy-mobile-user-file-in-mobile",
        "data-loss",
        ("deploy", "m", "--target", "mobile"),
        B,
        lambda c: (
            c.copy("exp", "m"),
            (c.dir / "m" / "mobile").mkdir(),
            (c.dir / "m" / "mobile" / "a.txt").write_text("x"),
        ),
        match="mobile target would replace it",
    ),
    # -- the browser: deploy --target web, serve ---------------------------------------------------------------------
    Case(
        "deploy-web-lib-missing",
        "message",
        ("deploy", "{exp}", "--target", "web", "-o", "out", "--web-lib", "{dir}"),
        B,
        match="transformers.js is not installed in",
    ),
]


def genai_share_buffer(expected: bool) -> Callable[[Ctx, Outcome], None]:
    def check(c: Ctx, out: Outcome) -> None:
        config = json.loads((c.dir / "out" / "genai_config.json").read_text())
        assert config["search"]["past_present_share_buffer"] is expected, config["search"]

    return check


def _deploy_keeps(c: Ctx, out: Outcome) -> None:
    folder = c.dir / "m"
    assert (folder / "trt_cache" / "engine.bin").read_text() == "engine", "trt_cache/ was lost"
    assert os.readlink(folder / "tokenizer-link") == "tokenizer.json", "the link was lost"
    assert (folder / "notes.txt").read_text() == "mine", "notes.txt was lost"
    assert (folder / "genai_config.json").is_file()
    listed = json.loads((folder / "gpt2onnx.json").read_text())["files"]
    assert "notes.txt" not in listed and "genai_config.json" in listed, sorted(listed)


def _redeploy_drops_only_ours(c: Ctx, out: Outcome) -> None:
    folder = c.dir / "m"
    assert not (folder / "genai_config.json").exists(), "the genai target deployed before was kept"
    assert (folder / "triton").is_dir() and (folder / "trt_cache" / "engine.bin").is_file()


CASES += [
    Case(
        "data-absolute",
        "security",
        ("deploy", "m", "--target", "transformers-js", "-o", "out"),
        B,
        data_location("{dir}/outside.bin"),
        match="not a plain file name",
    ),
    Case(
        "data-link-outside",
        "security",
        ("deploy", "m", "--target", "triton", "-o", "out"),
        B,
        data_location("model.onnx_data", link=True),
        match="leads outside",
    ),
    Case(
        "deploy-manifest-name-dotdot",
        "security",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        B,
        export_copy(manifest_file_name("model.onnx/../../secret")),
        match="not a plain file name",
    ),
    Case(
        "deploy-force-empty-manifest",
        "data-loss",
        ("deploy", "{exp}", "--target", "genai", "-o", "out", "--force"),
        B,
        lambda c: ((c.dir / "out").mkdir(), (c.dir / "out/gpt2onnx.json").write_text("{}")),
        match="not a valid gpt2onnx manifest",
    ),
    # -- data loss: deploy in place keeps what it does not own -----------------------------------------------------
    Case(
        "deploy-in-place-keeps-user-things",
        "data-loss",
        ("deploy", "m", "--target", "genai"),
        0,
        _user_things,
        creates=("m",),
        check=_deploy_keeps,
    ),
    Case(
        "deploy-again-drops-only-its-own",
        "data-loss",
        ("deploy", "m", "--target", "triton"),
        0,
        _deployed_with_user_things,
        creates=("m",),
        check=_redeploy_drops_only_ours,
    ),
    Case(
        "deploy-in-place-foreign-onnx-folder",
        "data-loss",
        ("deploy", "m", "--target", "transformers-js"),
        B,
        export_copy(lambda f: ((f / "onnx").mkdir(), (f / "onnx" / "mine.onnx").write_text("x"))),
        match="not written by gpt2onnx deploy",
    ),
    Case(
        "deploy-in-place-foreign-genai-config",
        "data-loss",
        ("deploy", "m", "--target", "genai"),
        B,
        export_copy(write("genai_config.json", '{"mine": true}')),
        match="not written by gpt2onnx deploy",
    ),
    Case(
        "deploy-in-place-fifo",
        "data-loss",
        ("deploy", "m", "--target", "genai"),
        B,
        export_copy(lambda f: os.mkfifo(f / "queue")),
        match="FIFO",
    ),
    Case(
        "deploy-in-place-symlink-folder",
        "data-loss",
        ("deploy", "link", "--target", "genai"),
        B,
        lambda c: (c.copy("exp", "real"), (c.dir / "link").symlink_to("real")),
        match="symbolic link",
    ),
    Case(
        "kv-cache-lie-shared-deploy",
        "silent",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        0,
        export_copy(manifest_edit(kv_cache="shared")),
        creates=("out",),
        check=genai_share_buffer(False),
    ),
    Case(
        "kv-cache-lie-concat",
        "silent",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        0,
        export_copy(manifest_edit(kv_cache="concat"), what="skv"),
        creates=("out",),
        check=genai_share_buffer(True),
    ),
    Case(
        "skv-deploy-genai-share-buffer",
        "silent",
        ("deploy", "{skv}", "--target", "genai", "-o", "out"),
        0,
        creates=("out",),
        check=genai_share_buffer(True),
    ),
    *(
        Case(
            f"generation-config-{key}-{kind}",
            "silent",
            ("deploy", "m", "--target", "genai", "-o", "out"),
            B,
            export_copy(edit_json("generation_config.json", **{key: value})),
            match=key,
        )
        for key, kind, value in (
            ("do_sample", "string", "false"),
            ("top_k", "float", 2.5),
            ("top_p", "above-1", 3),
            ("temperature", "negative", -1),
            ("eos_token_id", "string", "50256"),
            ("max_length", "bool", True),
        )
    ),
]


# -- manifest claims the graph contradicts ---------------------------------------------------------------------
def _deployed_file(name: str, dtype: str) -> Callable[[Ctx, Outcome], None]:
    def check(c: Ctx, out: Outcome) -> None:
        config = json.loads((c.dir / "out" / "config.json").read_text())
        assert (c.dir / "out" / "onnx" / name).is_file(), sorted(p.name for p in (c.dir / "out" / "onnx").iterdir())
        assert config["transformers.js_config"]["dtype"] == dtype, config["transformers.js_config"]

    return check


def _quantization_claim(folder: Path) -> None:
    manifest_edit(quantization={"method": "int4", "block_size": 32, "ops": {"MatMulNBits": 9}})(folder)


# -- files read from a folder or an option ----------------------------------------------------------------------
def _fake_web_lib(root: Path, *, package_fifo: bool = False) -> Path:
    """A node_modules tree shaped like an npm install of transformers.js 4.3.2 and onnxruntime-web (files empty):
    the web target copies from it without npm."""
    package = root / "node_modules" / "@huggingface" / "transformers"
    ort = root / "node_modules" / "onnxruntime-web"
    for folder in (package / "dist", ort / "dist"):
        folder.mkdir(parents=True)
    if package_fifo:
        os.mkfifo(package / "package.json")
    else:
        meta = {"name": "@huggingface/transformers", "version": "4.3.2", "dependencies": {"onnxruntime-web": "1.0.0"}}
        (package / "package.json").write_text(json.dumps(meta))
    (ort / "package.json").write_text(json.dumps({"name": "onnxruntime-web", "version": "1.0.0"}))
    (package / "dist" / "transformers.min.js").write_text("// transformers.js")
    for name in ("ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm"):
        (ort / "dist" / name).write_text("")
    return root / "node_modules"


def _page_settings(c: Ctx, name: str) -> None:
    import html

    page = (c.dir / name / "index.html").read_text()
    start = page.index('id="gpt2onnx-settings">') + len('id="gpt2onnx-settings">')
    settings = json.loads(page[start : page.index("</script>", start)])
    assert settings["name"] == name, settings["name"]
    assert "<title>" + html.escape(name) + " ·" in page


def _user_tokenizer_json(c: Ctx) -> None:
    """An export whose tokenizer.json the user added later (not in the manifest), and an npm tree for the page."""
    folder = c.copy("exp", "m")
    manifest = json.loads((folder / "gpt2onnx.json").read_text())
    del manifest["files"]["tokenizer.json"]
    (folder / "gpt2onnx.json").write_text(json.dumps(manifest))
    _fake_web_lib(c.dir / "lib")


def _damaged_bpe(name: str) -> Callable[[Ctx], None]:
    """An export with vocab.json and merges.txt but no tokenizer.json, one of the two damaged."""

    def setup(c: Ctx) -> None:
        from transformers import GPT2TokenizerFast

        folder = c.copy("exp", "m")
        GPT2TokenizerFast.from_pretrained(folder).save_pretrained(c.dir / "tok", legacy_format=True)
        shutil.copy(c.dir / "tok" / "merges.txt", folder / "merges.txt")
        vocab = json.loads((c.dir / "tok" / "vocab.json").read_text())
        vocab.setdefault("<|endoftext|>", len(vocab))  # an added token there: GPT-2's vocab.json holds it
        (folder / "vocab.json").write_text(json.dumps(vocab))
        shutil.rmtree(c.dir / "tok")
        (folder / "tokenizer.json").unlink()
        (folder / name).write_text("not a merges file\n" if name == "merges.txt" else "[1, 2]")
        rehash_all(folder)

    return setup


def _out_has(*names: str) -> Callable[[Ctx, Outcome], None]:
    def check(c: Ctx, out: Outcome) -> None:
        for name in names:
            assert (c.dir / "out" / name).exists(), f"out/{name} is missing"

    return check


def _user_files_beside(c: Ctx) -> None:
    folder = c.copy("exp", "m")
    (folder / "notes.txt").write_text("mine")
    (folder / "trt_cache").mkdir()
    (folder / "trt_cache" / "engine.bin").write_text("engine")


def _deployed_with_user_file_in_onnx(c: Ctx) -> None:
    from gpt2onnx.targets.deploy import deploy

    c.copy("exp", "m")
    deploy(c.dir / "m", "transformers-js", out=c.dir / "out")
    (c.dir / "out" / "onnx" / "mine.onnx").write_text("my own graph")


def _model_in_case_folder(c: Ctx) -> None:
    """The case folder itself is the model folder (the command runs from inside it: cd m && gpt2onnx deploy .)."""
    for path in c.exp.iterdir():
        shutil.copy(path, c.dir / path.name)


CASES += [
    # -- deploy's outputs --------------------------------------------------------------------------------------------
    Case(
        "deploy-out-link-to-source",
        "data-loss",
        ("deploy", "m", "--target", "genai", "-o", "link"),
        B,
        lambda c: (c.copy("exp", "m"), (c.dir / "link").symlink_to("m")),
        match="symbolic link",
    ),
    Case(
        "deploy-in-place-from-inside",
        "data-loss",
        ("deploy", ".", "--target", "genai"),
        B,
        _model_in_case_folder,
        match="working directory",
    ),
    Case(
        "deploy-out-keeps-user-files",
        "data-loss",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        0,
        _user_files_beside,
        creates=("out",),
        check=_out_has("notes.txt", "trt_cache/engine.bin", "genai_config.json"),
    ),
    Case(
        "deploy-force-user-file-in-target-folder",
        "data-loss",
        ("deploy", "m", "--target", "transformers-js", "-o", "out", "--force"),
        B,
        _deployed_with_user_file_in_onnx,
        match="onnx/mine.onnx",
    ),
    Case(
        "manifest-dtype-float16-on-fp32-graph",
        "silent",
        ("deploy", "m", "--target", "transformers-js", "-o", "out"),
        0,
        export_copy(manifest_edit(dtype="float16")),
        creates=("out",),
        check=_deployed_file("model.onnx", "fp32"),
    ),
    Case(
        "manifest-quantization-int4-on-fp32-graph",
        "silent",
        ("deploy", "m", "--target", "transformers-js", "-o", "out"),
        0,
        export_copy(_quantization_claim),
        creates=("out",),
        check=_deployed_file("model.onnx", "fp32"),
    ),
    # -- numbers from generation_config.json and the command line ----------------------------------------------
    *(
        Case(
            f"ort-generate-{key}-{label}",
            "traceback",
            ("deploy", "m", "--target", "ort-generate", "-o", "out"),
            B,
            _generation_raw(**{key: raw}),
            match=f"{key} [^ ]+ in '.*generation_config.json' is not",
        )
        for key, label, raw in (
            ("temperature", "nan", "NaN"),
            ("temperature", "infinity", "Infinity"),
            ("no_repeat_ngram_size", "infinity", "Infinity"),
            ("no_repeat_ngram_size", "nan", "NaN"),
            ("no_repeat_ngram_size", "2-64", str(2**64)),
            ("no_repeat_ngram_size", "1e30", "1e30"),
        )
    ),
    Case(
        "genai-top-k-10-20",
        "silent",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        B,
        _generation_raw(top_k=str(10**20)),
        match="top_k 100000000000000000000 in .* is not an integer from 0 to 2,147,483,647",
    ),
    # -- messages name the file at fault, where it is ----------------------------------------------------------------
    *(
        Case(
            f"deploy-damaged-{name.split('.')[0]}-names-the-source",
            "message",
            ("deploy", "m", "--target", "genai", "-o", "out"),
            B,
            _damaged_bpe(name),
            match=f"'m/{name}'",
            absent="out/",
        )
        for name in ("merges.txt", "vocab.json")
    ),
    Case(
        "deploy-web-user-tokenizer-json",
        "message",
        ("deploy", "m", "--target", "web", "-o", "out", "--web-lib", "lib"),
        0,
        _user_tokenizer_json,
        creates=("out",),
        check=_out_has("index.html", "tokenizer.json"),
    ),
    # -- files read from an option, and templates -------------------------------------------------------------------
    Case(
        "deploy-web-lib-package-json-fifo",
        "hang",
        ("deploy", "{exp}", "--target", "web", "-o", "out", "--web-lib", "lib"),
        B,
        lambda c: _fake_web_lib(c.dir / "lib", package_fifo=True),
        match="package.json.*not a regular file",
        process=True,
        timeout=120,
    ),
    Case(
        "deploy-web-title-template",
        "security",
        ("deploy", "{exp}", "--target", "web", "-o", 'x"__GPT2ONNX_TITLE__', "--web-lib", "lib"),
        0,
        lambda c: _fake_web_lib(c.dir / "lib"),
        creates=('x"__GPT2ONNX_TITLE__',),
        check=lambda c, out: _page_settings(c, 'x"__GPT2ONNX_TITLE__'),
    ),
]


# -- round four (issue 37): deploy's Triton output, the ort-generate files, weights the checkpoint cannot hold ----
def _export_link(name: str, *, rehashed: bool = True) -> Callable[[Ctx], None]:
    """A copy of the export as 'm' whose ``name`` is a link to a copy of it outside the folder (manifest
    re-hashed: a crafted folder)."""

    def setup(c: Ctx) -> None:
        folder = c.copy("exp", "m")
        shutil.copy(folder / name, c.dir / f"outside-{name}")
        (folder / name).unlink()
        (folder / name).symlink_to(c.dir / f"outside-{name}")
        if rehashed:
            rehash(folder)

    return setup


CASES += [
    Case(
        "deploy-triton-tokenizer-json-link-out",
        "silent",
        ("deploy", "m", "--target", "triton", "-o", "out"),
        B,
        _export_link("tokenizer.json"),
        match="tokenizer.json.*(leads outside|link)",
    ),
    Case(  # float32 stores 1e-46 as 0.0: sampling.onnx would hold top_p 0 while the manifest records 1e-46
        "deploy-ort-generate-top-p-below-float32",
        "silent",
        ("deploy", "m", "--target", "ort-generate", "-o", "out"),
        B,
        lambda c: _generation_config(c.copy("exp", "m"), do_sample=True, top_p=1e-46),
        match="top_p 1e-46 in 'm/generation_config.json'.*0 as a float32",  # the source's file, not staging's
    ),
    Case(
        "deploy-genai-names-the-source-file",
        "message",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        B,
        lambda c: _generation_config(c.copy("exp", "m"), do_sample=True, top_p=1e-46),
        match="in 'm/generation_config.json'",
    ),
]


def readonly_mount_deploy(c: Ctx, cli) -> Outcome:
    """An in-place deploy of a folder that is a read-only bind mount: the new folder cannot replace it, and no
    empty backup folder (.m.old-PID-*) is left beside it."""
    import pytest

    folder = c.copy("exp", "m")
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    mounted = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({mounted.stderr.strip()[:100]})")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True, capture_output=True)
        out = cli(["deploy", "m", "--target", "genai"], c)
        left = sorted(p.name for p in c.dir.iterdir() if p.name.startswith("."))
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
    assert left == [], f"left beside the folder: {left}"
    return out


HOSTILE_OUTPUT = (
    'x" data_type: TYPE_FP32 dims: [ -1 ] } ] instance_group [ { kind: KIND_GPU count: 1 } ] output [ { name: "y'
)


def _hostile_output_name(c: Ctx) -> None:
    """The export as 'm' with one more graph output whose name would close config.pbtxt's string and add an
    instance kind and an output, were it written unescaped (the manifest re-hashed: a crafted folder)."""
    import onnx
    from onnx import helper

    folder = c.copy("exp", "m")
    model = onnx.load(str(folder / "model.onnx"))
    model.graph.node.append(helper.make_node("Identity", ["logits"], [HOSTILE_OUTPUT]))
    extra = onnx.ValueInfoProto()
    extra.CopyFrom(next(o for o in model.graph.output if o.name == "logits"))
    extra.name = HOSTILE_OUTPUT
    model.graph.output.append(extra)
    (folder / "model.onnx").unlink()
    onnx.save(model, str(folder / "model.onnx"))
    rehash(folder)


def _config_reads_back(c: Ctx, out: Outcome) -> None:
    """Triton's config as protobuf text: one instance_group, one output list, the hostile name one string."""
    from google.protobuf import text_format

    text = (c.dir / "out" / "triton" / "out" / "config.pbtxt").read_text()
    tokenizer, top, strings, depth = text_format.Tokenizer(text.splitlines()), [], [], 0
    while not tokenizer.AtEnd():
        if tokenizer.token.startswith('"'):
            strings.append(tokenizer.ConsumeString())
            continue
        token = tokenizer.token
        depth += token in "[{" and len(token) == 1
        depth -= token in "]}" and len(token) == 1
        if depth == 0 and token[0].isalpha():
            top.append(token)
        tokenizer.NextToken()
    assert top.count("instance_group") == 1 and top.count("output") == 1, top
    assert HOSTILE_OUTPUT in strings and "KIND_GPU" not in top


CASES += [
    Case(
        "deploy-triton-hostile-output-name",
        "security",
        ("deploy", "m", "--target", "triton", "-o", "out"),
        0,
        _hostile_output_name,
        creates=("out",),
        check=_config_reads_back,
    ),
    Case("deploy-readonly-mount", "data-loss", (), EXIT_OUTPUT, run=readonly_mount_deploy, creates=("m",), timeout=240),
]


def _deployed_files_load(c: Ctx, out: Outcome) -> None:
    import onnxruntime as ort

    for name in ("model_q4.onnx", "model_q4f16.onnx"):
        ort.InferenceSession(str(c.dir / "out" / "onnx" / name), providers=["CPUExecutionProvider"])


CASES += [
    Case(
        "deploy-tjs-int4-external-data",  # once exit 70: onnx refused the data file's hard links
        "traceback",
        ("deploy", "q", "--target", "transformers-js", "-o", "out"),
        0,
        _int4_external,
        creates=("out",),
        check=_deployed_files_load,
        timeout=240,
    ),
]


def _named_by_its_graph(c: Ctx, out: Outcome) -> None:
    files = sorted(p.name for p in (c.dir / "m" / "onnx").iterdir())
    assert "model.onnx" in files and "model_quantized.onnx" not in files, files  # the manifest's int8 is not obeyed
    assert json.loads((c.dir / "m" / "config.json").read_text())["transformers.js_config"]["dtype"] == "fp32"


CASES += [
    Case(
        "tjs-manifest-says-int8",  # the graph is fp32: its files are named as fp32's, whatever the manifest says
        "silent",
        ("deploy", "m", "--target", "transformers-js"),
        0,
        export_copy(manifest_edit(precision="int8")),
        creates=("m",),
        check=_named_by_its_graph,
    ),
]
