"""Speculative decoding (prompt lookup, a draft folder): plain greedy's tokens on the trained model, for both cache
kinds; transformers' prompt lookup and draft schedule; every refusal as one line through the CLI."""

import inspect
import json
import textwrap
from collections import Counter

import numpy as np
import pytest
from typer.testing import CliRunner

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.cli import app
from gpt2onnx.decoding.generate import decode, generate
from gpt2onnx.decoding.processors import softmax, warp
from gpt2onnx.decoding.proposers.draft import ASSISTANT_TOKENS, Draft
from gpt2onnx.decoding.proposers.prompt_lookup import lookup
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.errors import BadInput
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.runtimes.decoder import open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig

# Short enough for the trained model's 128 positions with 48 new tokens: code, docstrings, free text.
PROMPTS = [
    inspect.getsource(textwrap.dedent)[:70],
    inspect.getdoc(json.dumps)[:60],
    "The quick brown fox",
    "Return a list of the",
]
NEW = 48


@pytest.fixture(scope="module", params=["none", "ort", "ort-shared-kv"])
def target(request, trained_checkpoint, trained_export, tmp_path_factory):
    """The trained model exported with each fusion profile: the concatenating cache (none, ort) and the shared
    buffer (ort-shared-kv)."""
    if request.param == "none":
        return trained_export
    out = tmp_path_factory.mktemp(f"spec-{request.param}") / "model"
    return export(str(trained_checkpoint), out, options=ExportOptions(fusion=request.param)).folder


def _random(tmp_path_factory, name: str, vocab: int, *, logits: str = "all", positions: int = 128, fusion="none"):
    config = tmp_path_factory.mktemp(name) / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": 1,
                "n_head": 2,
                "n_embd": 32,
                "vocab_size": vocab,
                "n_positions": positions,
                "eos_token_id": vocab - 1,
                "bos_token_id": vocab - 1,
            }
        )
    )
    options = ExportOptions(validate=False, logits=logits, fusion=fusion)
    return export(str(config), config.parent / "model", random_init=True, options=options).folder


@pytest.fixture(scope="module")
def bad_draft(tmp_path_factory):
    """Random weights with the trained model's 512 tokens, last position's logits only: a draft the model
    rejects often (its cache cut back every round), and a folder whose logits cannot check proposals."""
    return _random(tmp_path_factory, "bad-draft", 512, logits="last")


@pytest.fixture(scope="module")
def other_vocabulary(tmp_path_factory):
    return _random(tmp_path_factory, "vocab-1000", 1000)


@pytest.mark.parametrize("fusion", ["none", "ort-shared-kv"])
def test_a_draft_with_a_shorter_context_proposes_within_it(trained_export, tmp_path_factory, fusion):
    """A draft of 32 positions on a model of 128: it proposes while the sequence fits its context, then the model
    decodes alone; greedy stays plain greedy (once: refused as 'beyond the model's context of 32', the draft's)."""
    draft = _random(tmp_path_factory, f"short-{fusion}", 512, positions=32, fusion=fusion)
    prompt = PROMPTS[2]
    plain = generate(trained_export, prompts=[prompt], max_new_tokens=NEW)
    assert len(plain.prompt_ids[0]) < 32 < len(plain.prompt_ids[0]) + NEW
    drafted = generate(trained_export, prompts=[prompt], max_new_tokens=NEW, speculation=Speculation(draft=draft))
    assert drafted.tokens == plain.tokens
    assert drafted.speculation.proposed > 0 and drafted.speculation.draft_steps > 0


@pytest.fixture(scope="module")
def plain(target):
    return generate(target, prompts=PROMPTS, max_new_tokens=NEW)


@pytest.mark.parametrize(
    "options",
    [
        dict(prompt_lookup=10),
        dict(prompt_lookup=3, max_ngram=1),
        dict(draft="self", draft_tokens=4),
        dict(draft="bad"),  # adaptive: from 20, -1 a round while the model rejects
    ],
    ids=["lookup-10", "lookup-3-unigram", "draft-same-model-4", "draft-random-adaptive"],
)
def test_greedy_tokens_equal_plain_greedy(target, plain, bad_draft, options):
    if "draft" in options:
        options["draft"] = target if options["draft"] == "self" else bad_draft
    result = generate(target, prompts=PROMPTS, max_new_tokens=NEW, speculation=Speculation(**options))
    assert result.tokens == plain.tokens
    assert result.texts == plain.texts
    np.testing.assert_allclose(result.scores, plain.scores, rtol=1e-4)
    spec = result.speculation
    assert spec.tokens == sum(len(t) for t in plain.tokens) and spec.proposed > 0
    assert spec.rounds + len(PROMPTS) < spec.tokens  # fewer model steps than tokens
    if options.get("draft") is bad_draft:
        assert spec.accepted < spec.proposed  # proposals were dropped: the cache was cut back
    if options.get("draft") is target:
        assert spec.rate == 1.0 and spec.draft_steps > 0


def test_processors_and_stops_apply_per_position(target, plain):
    """The repetition penalty, no-repeat n-grams and minimum new tokens see each position's own sequence; an
    end-of-sequence id met inside a kept run ends the row there, as in the plain loop."""
    decoding = Decoding(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=5)
    base = generate(target, prompts=PROMPTS[:2], max_new_tokens=NEW, decoding=decoding)
    for spec in (Speculation(prompt_lookup=5), Speculation(draft=target, draft_tokens=3)):
        assert generate(
            target, prompts=PROMPTS[:2], max_new_tokens=NEW, decoding=decoding, speculation=spec
        ).tokens == (base.tokens)
    stop = Decoding(stop=(plain.texts[0][8:11],))  # text met a few tokens in
    stopped = generate(target, prompts=PROMPTS[:1], max_new_tokens=NEW, decoding=stop)
    ours = generate(
        target, prompts=PROMPTS[:1], max_new_tokens=NEW, decoding=stop, speculation=Speculation(prompt_lookup=10)
    )
    assert ours.tokens == stopped.tokens and ours.finished == stopped.finished == [True]


def test_prompt_lookup_is_transformers_candidate_generator():
    torch = pytest.importorskip("torch")
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    rng = np.random.default_rng(0)
    for _ in range(300):
        length, vocab = int(rng.integers(1, 40)), int(rng.integers(2, 8))
        sequence = rng.integers(0, vocab, length).tolist()
        tokens, ngram = int(rng.integers(1, 12)), int(rng.integers(1, 4))
        eos = (vocab - 1,) if rng.random() < 0.5 else ()
        theirs = PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor(eos or [99]),
            num_output_tokens=tokens,
            max_matching_ngram_size=ngram,
            max_length=999,
        )
        candidates, _ = theirs.get_candidates(torch.tensor([sequence]))
        assert lookup(sequence, tokens, ngram, eos) == candidates[0, length:].tolist(), (sequence, tokens, ngram)


class _Stub:
    dummy_past = 0

    def crop_past(self, past, length):
        return past


def test_adaptive_draft_schedule_is_transformers_heuristic():
    draft = Draft(_Stub(), "adaptive", Decoding(), ())
    assert draft.k == ASSISTANT_TOKENS
    draft.seen = [1, 2, 3]
    draft.update([1, 2, 3, 4], proposed=5, accepted=5)
    assert draft.k == ASSISTANT_TOKENS + 2
    for _ in range(30):
        draft.update([1, 2, 3, 4], proposed=3, accepted=1)
    assert draft.k == 1
    fixed = Draft(_Stub(), 4, Decoding(), ())
    fixed.seen, fixed.past = [1, 2, 9, 9], []
    fixed.update([1, 2, 3, 4], proposed=4, accepted=0)
    assert fixed.k == 4 and fixed.seen == [1, 2]  # the draft's cache cut to what it shares with the sequence


def test_speculation_options_are_checked_when_built():
    for bad, words in [
        (dict(), "one proposer"),
        (dict(prompt_lookup=3, draft="d"), "not both"),
        (dict(prompt_lookup=0), "1 to 64"),
        (dict(prompt_lookup=True), "1 to 64"),
        (dict(prompt_lookup=3, max_ngram=0), "--max-ngram"),
        (dict(draft="d", max_ngram=2), "--max-ngram applies to prompt lookup"),
        (dict(prompt_lookup=3, draft_tokens=2), "--draft-tokens applies to a draft"),
        (dict(draft="d", draft_tokens="some"), "'adaptive'"),
        (dict(draft="d", draft_tokens=65), "1 to 64"),
    ]:
        with pytest.raises(BadInput, match=words):
            Speculation(**bad)
    assert Speculation(draft="d", draft_tokens="7").draft_tokens == 7
    assert Speculation(prompt_lookup=4).max_ngram == 2


runner = CliRunner()


def run(*args):
    return runner.invoke(app, ["generate", *[str(a) for a in args]])


def one_line_error(result, pattern):
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert "Traceback" not in text and isinstance(result.exception, SystemExit), text
    assert len(text.splitlines()) == 1 and text.startswith("error: "), text
    assert pattern in text, text


def test_cli_reports_acceptance(trained_export, tmp_path):
    out = tmp_path / "out.json"
    result = run(trained_export, "--prompt", PROMPTS[2], "--max-new-tokens", 20, "--prompt-lookup", 5, "--json", out)
    assert result.exit_code == 0, result.output
    assert "prompt-lookup: accepted" in result.stderr and "tokens per target step" in result.stderr
    report = json.loads(out.read_text())
    assert report["speculation"]["tokens"] == 20 and report["settings"]["speculation"]["prompt_lookup_num_tokens"] == 5


@pytest.mark.parametrize(
    "mode",
    [
        ("--prompt-lookup", 5),
        ("--draft", "{self}"),
        ("--draft", "{self}", "--draft-tokens", "adaptive"),
        ("--prompt-lookup", 5, "--json", "{json}"),
        ("--json", "{json}"),
        ("--num-beams", 1),
    ],
)
def test_cli_stdout_is_the_text_alone(trained_export, tmp_path, mode):
    """Greedy's stdout is the prompt and its continuation, the same bytes in every mode (speculative decoding's
    figures go to stderr and --json): a pipe or a redirect gets the text alone."""
    args = ("--prompt", PROMPTS[2], "--max-new-tokens", 12)
    plain = run(trained_export, *args)
    assert plain.exit_code == 0, plain.output
    given = [str(a).replace("{self}", str(trained_export)).replace("{json}", str(tmp_path / "g.json")) for a in mode]
    result = run(trained_export, *args, *given)
    assert result.exit_code == 0, result.output
    assert result.stdout == plain.stdout and result.stdout.startswith(PROMPTS[2]) and result.stdout.endswith("\n")
    assert ("accepted" in result.stderr) == ("--prompt-lookup" in given or "--draft" in given)


def test_cli_stdout_of_beams_is_the_text_alone(trained_export):
    """One beam sequence: its prompt and text (the score on stderr); several: each labelled, one a line."""
    args = ("--prompt", PROMPTS[2], "--max-new-tokens", 6, "--num-beams", 3)
    one = run(trained_export, *args)
    assert one.exit_code == 0, one.output
    assert one.stdout.startswith(PROMPTS[2]) and "score" not in one.stdout and "score of 0: " in one.stderr
    several = run(trained_export, *args, "--num-return-sequences", 2)
    assert several.stdout.startswith("0.0: ") and "\n0.1: " in several.stdout and "score" not in several.stdout


def test_cli_refusals(trained_export, bad_draft, other_vocabulary):
    folder, prompt = trained_export, ("--prompt", "Return a")
    one_line_error(run(folder, *prompt, "--draft", other_vocabulary), "vocabulary of 1000 tokens")
    one_line_error(run(folder, *prompt, "--draft", other_vocabulary), "one of 512")
    one_line_error(run(bad_draft, "--ids", "1,2,3", "--prompt-lookup", 3), "--logits last")
    one_line_error(run(folder, *prompt, "--prompt-lookup", 0), "1 to 64")
    one_line_error(run(folder, *prompt, "--prompt-lookup", "x"), "--prompt-lookup")
    one_line_error(run(folder, *prompt, "--max-ngram", 2), "--max-ngram applies to prompt lookup")
    one_line_error(run(folder, *prompt, "--draft-tokens", 2), "--draft-tokens applies to a draft")
    one_line_error(run(folder, *prompt, "--draft", folder, "--draft-tokens", "lots"), "'adaptive'")
    one_line_error(run(folder, *prompt, "--draft", folder, "--prompt-lookup", 3), "not both")
    beams = "beam search (--num-beams), which the request uses: drop --num-beams"
    one_line_error(run(folder, *prompt, "--draft", folder, "--num-beams", 2), beams)
    one_line_error(run(folder, *prompt, "--prompt-lookup", 3, "--num-beams", 2), beams)
    one_line_error(run(folder, *prompt, "--prompt-lookup", 3, "--runtime", "openvino"), "use --runtime onnxruntime")
    one_line_error(run(folder, *prompt, "--draft", folder.parent / "missing"), "missing")


def test_the_acceptance_rule_samples_the_models_distribution():
    """transformers' _speculative_sampling on one position: a proposal drawn from q, kept with probability
    min(1, p/q), else a draw from max(p - q, 0): the token follows p (total variation 0.02 at most over 20,000
    draws, where q's own distribution is 0.4 away)."""
    from gpt2onnx.decoding.speculative import _choose

    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    q = np.array([0.1, 0.1, 0.2, 0.3, 0.3])
    rng, sampling = np.random.default_rng(0), Sampling(sample=True)
    draws = 20_000
    tokens = [_choose(np.log(p), int(rng.choice(5, p=q)), q, sampling, rng) for _ in range(draws)]
    seen = np.bincount(tokens, minlength=5) / draws
    assert 0.5 * np.abs(seen - p).sum() < 0.02 and 0.5 * np.abs(q - p).sum() > 0.4


def _probs(decoder, sequence, sampling):
    out, _ = decoder.run(
        np.array([sequence]),
        np.ones((1, len(sequence)), np.int64),
        np.arange(len(sequence))[None],
        decoder.empty_past(1),
    )
    return softmax(warp(out[:, -1].astype(np.float32), sampling).astype(np.float64))[0]


def test_sampling_with_a_draft_keeps_the_distribution_and_prompt_lookup_keeps_the_draws(trained_export, bad_draft):
    """Sampled with a draft, the first two new tokens follow the model's own joint distribution (exact, from its
    logits; chi-square over 300 seeds, far below what the draft's tokens would give); with prompt lookup a seed
    gives plain sampling's very tokens."""
    decoder = open_decoder(open_folder(trained_export), ProviderConfig())
    draft = open_decoder(open_folder(bad_draft), ProviderConfig())
    prompt, sampling = [40, 41, 42, 43, 44, 45], Sampling(sample=True, top_k=4)
    first = _probs(decoder, prompt, sampling)
    joint = {}
    for a in np.flatnonzero(first):
        second = _probs(decoder, [*prompt, int(a)], sampling)
        joint |= {(int(a), int(b)): first[a] * second[b] for b in np.flatnonzero(second)}
    runs = 300
    spec = Speculation(draft=bad_draft, draft_tokens=3)
    counts = Counter(
        tuple(
            decode(
                decoder,
                np.array([prompt]),
                max_new_tokens=2,
                sampling=Sampling(sample=True, top_k=4, seed=seed),
                speculation=spec,
                draft=draft,
            ).tokens[0]
        )
        for seed in range(runs)
    )
    assert set(counts) <= set(joint)
    chi2 = sum((counts[k] - runs * p) ** 2 / (runs * p) for k, p in joint.items())
    assert chi2 < 3 * len(joint), (chi2, len(joint))  # 15 degrees of freedom: p < 1e-4 at 45
    for seed in range(3):
        seeded = Sampling(sample=True, seed=seed, top_k=20)
        plain = decode(decoder, np.array([prompt]), max_new_tokens=30, sampling=seeded)
        ours = decode(
            decoder, np.array([prompt]), max_new_tokens=30, sampling=seeded, speculation=Speculation(prompt_lookup=5)
        )
        np.testing.assert_array_equal(ours.tokens, plain.tokens)


def test_bench_speculative_on_real_prompts(trained_export, tmp_path):
    """bench speculative: per kind of real prompt, gpt2onnx's greedy and prompt lookup beside transformers' greedy
    and prompt_lookup_num_tokens, in rotating rounds with the ratio to gpt2onnx's greedy; gpt2onnx's proposals keep
    its greedy tokens; without a proposer, refused in one line."""
    import torch

    out, table = tmp_path / "s.json", tmp_path / "s.md"
    args = ["--prompt-lookup", "6", "--new-tokens", "12", "--warmup", "0", "--repeat", "2", "--json", str(out)]
    # one thread for onnxruntime and torch (which the bench sets for the process: put back after): with the
    # default, the two runtimes' thread pools alternate on a shared 2-core runner, 16 to 100 s instead of 6 to 9
    threads = torch.get_num_threads()
    try:
        command = ["bench", "speculative", str(trained_export), *args, "--md", str(table), "--threads", "1"]
        result = runner.invoke(app, command)
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    names = ["gpt2onnx greedy", "gpt2onnx prompt-lookup 6", "transformers greedy", "transformers prompt-lookup 6"]
    assert set(report["rounds"]) == {"stdlib code", "stdlib docstrings", "free text"}
    for kind, rounds in report["rounds"].items():
        assert rounds["variants"] == names and rounds["baseline"] == "gpt2onnx greedy" and len(rounds["orders"]) == 2
        runs = {r["run"]: r for r in report["runs"] if r["kind"] == kind}
        assert list(runs) == names
        assert runs["gpt2onnx prompt-lookup 6"]["same_tokens"] and runs["gpt2onnx greedy"]["same_tokens"]
        assert runs["gpt2onnx greedy"]["tokens_per_target_step"] == 1.0
        assert runs["gpt2onnx greedy"]["acceptance"] is None
        assert 0 <= runs["gpt2onnx prompt-lookup 6"]["acceptance"] <= 1
        assert runs["gpt2onnx prompt-lookup 6"]["tokens_per_target_step"] >= 1.0
    assert "| free text | gpt2onnx prompt-lookup 6 |" in table.read_text()
    refused = runner.invoke(app, ["bench", "speculative", str(trained_export)])
    assert refused.exit_code == 2 and "give --prompt-lookup N or --draft DIR" in refused.output
