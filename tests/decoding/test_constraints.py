"""Constrained decoding (gpt2onnx.decoding.constraints, llguidance) on the trained fixture's export: every output is
checked by a parser independent of the engine (json.loads + jsonschema, re.fullmatch, membership), in greedy,
seeded sampling and beam search, speculative decoding, the batching engine (two constraints in one batch) and the
OpenAI endpoint."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import gpt2onnx
from gpt2onnx import Constraint, Decoding, Sampling
from gpt2onnx.decoding.constraints import vocabulary_of
from gpt2onnx.errors import BadInput

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

PROMPTS = ["Return the", "If the file does not exist, raise"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count", "ok"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{2}-[a-z]{2,5}"
CHOICES = ["alpha", "beta", "gamma"]
LARK = 'start: "(" NUM ("," NUM)? ("," NUM)? ")"\nNUM: /[0-9]{1,3}/'
LARK_AS_REGEX = r"\([0-9]{1,3}(,[0-9]{1,3}){0,2}\)"  # the same language, checked by Python's re
MODES = {
    "greedy": (Sampling(), Decoding()),
    "sampling": (Sampling(sample=True, seed=7, temperature=1.5), Decoding()),
    "beams": (Sampling(), Decoding(num_beams=3)),
}


def valid(kind: str, text: str) -> bool:
    """The engine-independent check of one output."""
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(LARK_AS_REGEX, text) is not None


CONSTRAINTS = {
    "json_schema": lambda: Constraint.json_schema(SCHEMA),
    "regex": lambda: Constraint.regex(REGEX),
    "choice": lambda: Constraint.choice(CHOICES),
    "grammar": lambda: Constraint.lark(LARK),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_writes_what_the_constraint_allows(trained_export, mode):
    sampling, decoding = MODES[mode]
    for kind, make in CONSTRAINTS.items():
        result = gpt2onnx.generate(
            trained_export, prompts=PROMPTS, max_new_tokens=40, sampling=sampling, decoding=decoding, constraint=make()
        )
        for text, finished, complete in zip(result.texts, result.finished, result.complete):
            assert finished and complete, (kind, text)
            assert valid(kind, text), (kind, mode, text)
        assert result.as_dict()["prompts"][0]["sequences"][0]["complete"] is True


def test_the_constraint_changes_what_is_written(trained_export):
    """Without it, the fixture writes docstring text, which none of the parsers accepts (so the checks above can
    fail); with it, the greedy text is valid."""
    plain = gpt2onnx.generate(trained_export, prompts=PROMPTS, max_new_tokens=20)
    for kind in CONSTRAINTS:
        assert not any(valid(kind, text) for text in plain.texts), kind


def test_out_of_tokens_is_not_success(trained_export, tmp_path):
    """A constraint that cannot end within max_new_tokens: not finished, not complete; the CLI shows the text and
    exits 1 (never 0 with an unparsable claim of success)."""
    from typer.testing import CliRunner

    from gpt2onnx.cli import app

    result = gpt2onnx.generate(
        trained_export, prompts=PROMPTS[:1], max_new_tokens=3, constraint=Constraint.regex("[a-z]{10}")
    )
    assert result.finished == [False] and result.complete == [False]
    out = tmp_path / "out.json"
    run = CliRunner().invoke(
        app, ["generate", str(trained_export), "--prompt", "x", "--regex", "[a-z]{10}", "--max-new-tokens", "3",
              "--json", str(out)],
    )  # fmt: skip
    assert run.exit_code == 1 and "raise --max-new-tokens" in run.output
    assert json.loads(out.read_text())["prompts"][0]["sequences"][0]["complete"] is False
    ok = CliRunner().invoke(app, ["generate", str(trained_export), "--prompt", "x", "--choice", "yes,no"])
    assert ok.exit_code == 0 and ok.output.strip().removeprefix("x") in ("yes", "no")


def test_a_token_that_would_run_past_the_end_is_refused(trained_export):
    """Byte-level BPE: the regex ends inside a merged token (its text minus the last character). That token is
    refused at the start, a shorter one that fits is allowed, and the output matches exactly."""
    from gpt2onnx.decoding.gpt2_tokenizer import load_gpt2_tokenizer

    tokenizer = load_gpt2_tokenizer(trained_export)
    vocab = tokenizer.backend.get_vocab()
    words = {tokenizer.decode([i]): i for i in vocab.values()}
    long = next(t for t in sorted(words, key=len, reverse=True) if t.isalpha() and t[:-1] in words)
    pattern = re.escape(long[:-1])
    bound = Constraint.regex(pattern).bind(vocabulary_of(trained_export, vocab_size=512, eos_token_ids=(511,)))
    allowed = bound.start(1).allowed()[0]
    assert not allowed[words[long]] and allowed[words[long[:-1]]]
    result = gpt2onnx.generate(
        trained_export, prompts=[long[:-1]], max_new_tokens=8, constraint=Constraint.regex(pattern)
    )
    assert re.fullmatch(pattern, result.texts[0]) and result.complete == [True]


def test_json_tokens_may_cross_from_one_part_into_the_next(trained_export):
    """After '{"name":' the token ' "' runs from the key separator's space into the string's opening quote: it is
    allowed (every allowed token keeps the text a prefix of valid JSON for the schema)."""
    from gpt2onnx.decoding.gpt2_tokenizer import load_gpt2_tokenizer

    tokenizer = load_gpt2_tokenizer(trained_export)
    bound = Constraint.json_schema(SCHEMA).bind(vocabulary_of(trained_export, vocab_size=512, eos_token_ids=(511,)))
    matchers = bound.start(1)
    assert matchers.feed(tokenizer.encode('{"name":'))
    pieces = [tokenizer.decode([int(i)]) for i in np.flatnonzero(matchers.allowed()[0])]
    assert ' "' in pieces
    assert all(' "'.startswith(p) or p.startswith(' "') for p in pieces), pieces


def test_speculative_constrained_equals_constrained_greedy(trained_export):
    from gpt2onnx import Speculation

    for make in CONSTRAINTS.values():
        plain = gpt2onnx.generate(trained_export, prompts=PROMPTS, max_new_tokens=30, constraint=make())
        fast = gpt2onnx.generate(
            trained_export,
            prompts=PROMPTS,
            max_new_tokens=30,
            constraint=make(),
            speculation=Speculation(prompt_lookup=3),
        )
        assert fast.tokens == plain.tokens and fast.complete == plain.complete


def test_engine_two_constraints_in_one_batch_each_as_alone(trained_export):
    from gpt2onnx.serving.engine import BatchingEngine

    asked = [(PROMPTS[0], "regex"), (PROMPTS[1], "json_schema"), (PROMPTS[0], "choice")]
    alone = [
        gpt2onnx.generate(trained_export, prompts=[p], max_new_tokens=40, constraint=CONSTRAINTS[k]()) for p, k in asked
    ]
    with BatchingEngine.open(trained_export, max_batch=4) as engine:
        streams = [engine.submit(p, max_new_tokens=40, constraint=CONSTRAINTS[k]()) for p, k in asked]
        done = [s.result(120) for s in streams]
    assert engine.rows_stepped > engine.steps  # they were decoded together
    for (prompt, kind), got, want in zip(asked, done, alone):
        assert got.tokens == want.tokens[0] and got.complete is True and got.finish_reason == "eos"
        assert valid(kind, got.text), got.text


def test_bad_constraints_are_one_line(trained_export):
    for make, says in [
        (lambda: Constraint.json_schema({"type": 5}), "not a valid JSON schema"),
        (lambda: Constraint.json_schema({"not": {}}), "refused by llguidance"),
        (lambda: Constraint.regex("(a"), "unclosed group"),
        (lambda: Constraint.choice([]), "one or more"),
        (lambda: Constraint.lark("x" * (2 << 20)), "more than"),
    ]:
        with pytest.raises(BadInput, match=says) as err:
            make()
        assert "\n" not in str(err.value)
    with pytest.raises(BadInput, match="can match nothing"):
        gpt2onnx.generate(trained_export, prompts=PROMPTS[:1], constraint=Constraint.regex(r"a[^\s\S]"))
    with pytest.raises(BadInput, match="takes no logits processor"):
        from gpt2onnx.capabilities import resolve
        from gpt2onnx.runtimes.genai import SPEC

        resolve([SPEC.declared, Constraint.regex("a").declared]).check()


def test_endpoint_response_format_and_guided_fields(trained_export, tmp_path):
    """The real openai client: response_format json_schema and vLLM's guided_regex / guided_choice as extra body
    fields; an invalid one is OpenAI's 400 naming the field."""
    import shutil

    openai = pytest.importorskip("openai")
    from tests.serving.test_openai_server import CHAT_TEMPLATE, CHATS, KEY, start, with_template

    folder = tmp_path / "model"  # with a chat template: completions and chat on one server
    shutil.copytree(trained_export, folder)
    with_template(folder, CHAT_TEMPLATE)
    served = start(folder, tmp_path / "stderr.txt", "--api-key", KEY)
    try:
        client = served.client()
        schema = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
        cases = [
            ({"response_format": schema}, "json_schema"),
            ({"guided_regex": REGEX}, "regex"),
            ({"guided_choice": CHOICES}, "choice"),
            ({"guided_grammar": LARK}, "grammar"),
        ]
        for extra, kind in cases:
            reply = client.completions.create(
                model="model", prompt=PROMPTS[1], max_tokens=40, temperature=0, extra_body=extra
            )
            assert reply.choices[0].finish_reason == "stop" and valid(kind, reply.choices[0].text), reply
        chat = client.chat.completions.create(
            model="model", messages=CHATS[0], max_tokens=40, temperature=0, response_format=schema
        )
        assert chat.choices[0].finish_reason == "stop" and valid("json_schema", chat.choices[0].message.content)
        chat = client.chat.completions.create(
            model="model", messages=CHATS[0], max_tokens=60, temperature=0, response_format={"type": "json_object"}
        )
        content, reason = chat.choices[0].message.content, chat.choices[0].finish_reason
        assert content.startswith('{"')  # held to an object: the model's own text starts otherwise
        # this small model does not close an open-ended object within 60 tokens: "length", never a claimed "stop"
        assert reason == "length" or isinstance(json.loads(content), dict)
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="model", prompt="x", max_tokens=4, extra_body={"guided_regex": "(a"})
        assert err.value.body["param"] == "guided_regex" and "unclosed group" in err.value.body["message"]
    finally:
        served.proc.kill()
        served.proc.wait()


def test_bench_constraint_prints_the_rows_and_writes_the_json(trained_export, tmp_path):
    """`bench constraint` with its default set (four constraints): a row each, the step and the machine's load
    printed, every figure in --json (measured: finite and positive; never compared with a speed)."""
    from typer.testing import CliRunner

    from gpt2onnx.cli import app

    out = tmp_path / "cost.json"
    run = CliRunner().invoke(
        app, ["bench", "constraint", str(trained_export), "--repeat", "1", "--warmup", "0", "--new-tokens", "4",
              "--json", str(out)],
    )  # fmt: skip
    assert run.exit_code == 0, run.output
    for row in ("JSON schema", "any JSON", "regex", "choice", "decode step without a constraint", "load "):
        assert row in run.output, row
    report = json.loads(out.read_text())
    assert report["batch"] == 1 and report["new_tokens"] == 4 and report["rounds"]["rounds"] == 1
    assert [c["name"] for c in report["constraints"]] == ["JSON schema", "any JSON object", "regex", "choice"]
    figures = [report["decode_step_ms"]["median"]]
    for c in report["constraints"]:
        assert 2 <= c["tokens"] <= 4 and isinstance(c["complete"], bool)
        figures += [c[k]["median"] for k in ("constrained_step_ms", "mask_and_advance_ms", "mask_share_of_step")]
    assert all(np.isfinite(f) and f > 0 for f in figures), figures
    assert {"load_before", "load_after"} <= set(report["rounds"]["load"]) and report["rounds"]["machine"]


def test_each_constraint_kind_is_one_registry_entry_and_its_option_follows(tmp_path):
    """A kind is one entry of CONSTRAINT_KINDS: the options generate and bench constraint take are made from it
    (one per kind, its flag, type and help), and constraint_from builds each kind from its option alone."""
    from gpt2onnx.decoding.constraints import CONSTRAINT_KINDS, ConstraintOptions, constraint_from
    from gpt2onnx.params import options_of

    declared = options_of(ConstraintOptions)
    assert [o.flag for o in declared] == [kind.flag for kind in CONSTRAINT_KINDS.values()]
    assert [o.param.help for o in declared] == [kind.help for kind in CONSTRAINT_KINDS.values()]
    (tmp_path / "s.json").write_text('{"type": "integer"}')
    (tmp_path / "g.lark").write_text('start: "yes" | "no"')
    given = {"json_schema": tmp_path / "s.json", "regex": "[a-c]+", "grammar": tmp_path / "g.lark", "choice": "x, y"}
    assert set(given) == set(CONSTRAINT_KINDS)
    for name, value in given.items():
        built = constraint_from(**{k: (value if k == name else None) for k in CONSTRAINT_KINDS})
        assert built.kind == name and built.grammar
    assert constraint_from(regex=None, choice=None) is None
    with pytest.raises(BadInput, match=r"^--regex is empty: give a regex$"):
        constraint_from(regex="")
    with pytest.raises(BadInput, match=r"^give one constraint: --regex and --choice cannot be combined$"):
        constraint_from(regex="a", choice="b")
    with pytest.raises(BadInput, match=r"^unknown constraint kind 'xml': choose one of json_schema, regex, "):
        constraint_from(xml="<a/>")
