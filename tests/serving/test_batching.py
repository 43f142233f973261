"""Continuous batching in-process (gpt2onnx.serving.engine), without a server: requests that join and leave
the running batch get the tokens decode() gives each alone; the torch-free tokenizer the server uses equals
transformers'. About 20 s beyond the shared fixtures (tiny_export, trained_export)."""

import random
import time

import numpy as np
import pytest

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.decoding.generate import decode, generate
from gpt2onnx.decoding.gpt2_tokenizer import load_gpt2_tokenizer
from gpt2onnx.decoding.prompts import load_tokenizer
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime
from gpt2onnx.serving.engine import BatchingEngine

PROMPTS = [
    "Return the",
    "The file",
    "If the argument is",
    "This module provides",
    "Raise ValueError if",
    "A list of",
    "Open the",
    "Create a new",
]


@pytest.fixture(scope="module")
def tiny_engine(tiny_export):
    with BatchingEngine.open(tiny_export, max_batch=6) as engine:
        yield engine


@pytest.fixture(scope="module")
def trained_engine(trained_export):
    with BatchingEngine.open(trained_export, max_batch=8) as engine:
        yield engine


def alone(folder, prompt_ids, max_new_tokens, **options):
    """What decode() gives one prompt on its own: the new tokens up to and including the last real one."""
    model = open_folder(folder)
    generation = read_generation_config(folder, vocab_size=model.facts.vocab_size)
    eos = generation.eos_token_ids
    decoder = open_runtime(model, RuntimeOptions())
    result = decode(decoder, np.asarray([prompt_ids]), max_new_tokens=max_new_tokens, eos_token_id=eos, **options)
    return result.tokens[0, : int(result.lengths[0])].tolist()


def test_requests_joining_and_leaving_get_the_tokens_they_get_alone(tiny_export, tiny_engine):
    rng = random.Random(0)
    prompts = [[rng.randrange(999) for _ in range(rng.randrange(1, 20))] for _ in range(24)]
    lengths = [rng.randrange(1, 30) for _ in prompts]
    steps, rows, joined = tiny_engine.steps, tiny_engine.rows_stepped, tiny_engine.rows_joined
    # 24 requests at once for an engine of 6 rows: most wait, and join the batch as earlier ones finish at their
    # own lengths (whatever the machine's speed; arrivals spread over time made the check depend on it)
    streams = [tiny_engine.submit(prompt, max_new_tokens=n) for prompt, n in zip(prompts, lengths)]
    results = [s.result(timeout=60) for s in streams]
    for prompt, n, result in zip(prompts, lengths, results):
        assert result.tokens == alone(tiny_export, prompt, n), prompt
        assert result.finish_reason == ("length" if len(result.tokens) == n else "eos")
    mean_batch = (tiny_engine.rows_stepped - rows) / (tiny_engine.steps - steps)
    assert tiny_engine.rows_joined > joined  # some joined a batch already decoding
    assert mean_batch > 2  # they really were decoded together (at most 6 at once)


def test_a_shared_cache_folder_is_batched_the_concat_way(tiny_export, tmp_path):
    """ort-shared-kv: the batch runs its GroupQueryAttention on a growing past (one buffer length cannot hold rows
    that come and go); beams keep the folder's own shared-cache stepper."""
    from gpt2onnx.exporters.optimize import optimize

    folder = optimize(tiny_export, tmp_path / "skv", fusion="ort-shared-kv").folder
    rng = random.Random(1)
    prompts = [[rng.randrange(999) for _ in range(rng.randrange(1, 15))] for _ in range(8)]
    with BatchingEngine.open(folder, max_batch=4) as engine:
        streams = [engine.submit(p, max_new_tokens=12) for p in prompts]
        beams = engine.generate(prompts[0], max_new_tokens=8, decoding=Decoding(num_beams=3))
        for prompt, stream in zip(prompts, streams):
            assert stream.result(timeout=60).tokens == alone(folder, prompt, 12)
    assert beams.tokens == alone(folder, prompts[0], 8, decoding=Decoding(num_beams=3))


def test_text_prompts_stream_the_text_generate_writes(trained_export, trained_engine):
    streams = [trained_engine.submit(p, max_new_tokens=20) for p in PROMPTS]
    for prompt, stream in zip(PROMPTS, streams):
        events = list(stream)
        completion = stream.result()
        expected = generate(trained_export, prompts=[prompt], max_new_tokens=20)
        assert completion.tokens == expected.tokens[0]
        assert completion.text == expected.texts[0]
        assert "".join(e.text for e in events) == completion.text  # the streamed pieces add up to the text
        assert [t for e in events for t in e.token_ids] == completion.tokens
        assert events[-1].finish_reason == completion.finish_reason and not any(e.last for e in events[:-1])


@pytest.mark.parametrize(
    "sampling, decoding",
    [
        (Sampling(sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=7), Decoding()),
        (Sampling(), Decoding(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=5)),
        (Sampling(), Decoding(stop=("s.", "\n"))),
        (Sampling(), Decoding(num_beams=3, length_penalty=0.8)),  # run alone beside the batch
    ],
    ids=["seeded-sampling", "processors", "stop-strings", "beams"],
)
def test_decoding_options_as_generate_applies_them(trained_export, trained_engine, sampling, decoding):
    # a few greedy requests run in the batch at the same time
    others = [trained_engine.submit(p, max_new_tokens=16) for p in PROMPTS[:3]]
    for prompt in PROMPTS[3:6]:
        completion = trained_engine.generate(prompt, max_new_tokens=16, sampling=sampling, decoding=decoding)
        expected = generate(trained_export, prompts=[prompt], max_new_tokens=16, sampling=sampling, decoding=decoding)
        assert completion.tokens == expected.tokens[0], prompt
        assert completion.text == expected.texts[0]
        if decoding.stop and expected.finished[0]:
            assert completion.finish_reason in ("stop", "eos")
    for stream in others:
        assert stream.result(timeout=60).finish_reason in ("length", "eos")


def test_a_cancelled_request_ends_and_harms_no_other(tiny_export, tiny_engine):
    keep = [tiny_engine.submit([5 + i, 6, 7], max_new_tokens=40) for i in range(3)]
    # as long as the context allows (3 + 120 of 128 positions): the cancel must find it still running, and the tiny
    # model makes 40 tokens in a few milliseconds, as fast as the consumer's thread can be scheduled again
    gone = tiny_engine.submit([9, 8, 7], max_new_tokens=120)
    next(iter(gone))  # its first token came
    gone.cancel()
    assert gone.result(timeout=30).finish_reason == "cancelled"
    for i, stream in enumerate(keep):
        assert stream.result(timeout=60).tokens == alone(tiny_export, [5 + i, 6, 7], 40)


def test_a_failing_callback_cancels_only_its_request(tiny_export, tiny_engine):
    def broken(event):
        raise RuntimeError("the client went away")

    bad = tiny_engine.submit([1, 2, 3], max_new_tokens=30, on_event=broken)
    good = tiny_engine.submit([1, 2, 3], max_new_tokens=30)
    assert bad.result(timeout=30).finish_reason == "cancelled"
    assert good.result(timeout=30).tokens == alone(tiny_export, [1, 2, 3], 30)


@pytest.mark.parametrize(
    "prompt, options, message",
    [
        ([1, 2], dict(max_new_tokens=10**6), "beyond the model's context"),
        ([1, 2], dict(max_new_tokens=0), "max_new_tokens"),
        ([], {}, "empty"),
        ([5000], {}, "outside the vocabulary"),
        ("some text", {}, "no tokenizer"),
        ([1, 2], dict(decoding=Decoding(num_beams=2, num_return_sequences=2)), "one request per sequence"),
        ([1, 2], dict(decoding=Decoding(stop=("x",))), "tokenizer"),
    ],
)
def test_bad_requests_are_refused_in_one_line_and_the_engine_keeps_serving(
    tiny_export, tiny_engine, prompt, options, message
):
    with pytest.raises(BadInput, match=message):
        tiny_engine.submit(prompt, **options)
    assert tiny_engine.generate([3, 4], max_new_tokens=5).tokens == alone(tiny_export, [3, 4], 5)


def test_engine_options_are_checked(tiny_export):
    with pytest.raises(BadInput, match="max_batch"):
        BatchingEngine.open(tiny_export, max_batch=0)


def test_close_ends_waiting_and_running_requests(tiny_export):
    engine = BatchingEngine.open(tiny_export, max_batch=1)
    streams = [engine.submit([1, 2, 3], max_new_tokens=60) for _ in range(3)]
    engine.close()
    assert {s.result(timeout=30).finish_reason for s in streams} <= {"cancelled", "length", "eos"}
    assert all(s.done for s in streams)
    assert not engine._thread.is_alive() and not engine._beam_thread.is_alive()
    with pytest.raises(BadInput, match="closed"):
        engine.submit([1, 2], max_new_tokens=2)


def test_the_servers_tokenizer_is_transformers(trained_checkpoint, trained_export):
    """The served model tokenizes without transformers: the same ids and text as GPT2TokenizerFast."""
    ours, theirs = load_gpt2_tokenizer(trained_export), load_tokenizer(trained_export)
    text = (trained_checkpoint / "heldout.txt").read_text()[:20000]
    samples = [text, "Hello , world . It's   spaced\n\ttabs <|endoftext|> after", "ünïcödé ✓ 😀", " leading space"]
    for sample in samples:
        ids = ours.encode(sample)
        assert ids == theirs.encode(sample)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    for token in range(0, len(theirs), 7):
        piece = theirs.convert_ids_to_tokens(token)
        assert ours.convert_ids_to_tokens(token) == piece
        assert ours.convert_tokens_to_string([piece]) == theirs.convert_tokens_to_string([piece])


# -- issue 37: one request reader, and one request's failure ends that request only -------------------------------
@pytest.mark.parametrize(
    "prompt, options, message",
    [
        ([78.9, 1.5], {}, r"prompt\[0\] must be a whole-number token id, got float 78.9"),
        (b"Return the", {}, "is bytes, which is neither text nor token ids"),  # never used as ids
        ([True, False], {}, r"prompt\[0\] must be a whole-number token id, got bool"),
        ([1, 2], dict(max_new_tokens=5.0), "max_new_tokens must be a whole number"),
        ([1, 2], dict(max_new_tokens=True), "max_new_tokens must be a whole number"),
        ([1, 2], dict(decoding=Decoding(num_beams=2**31 - 1)), "rows"),  # refused at submit, not on the beam thread
    ],
)
def test_requests_are_read_by_type_before_anything_converts_them(tiny_export, tiny_engine, prompt, options, message):
    with pytest.raises(BadInput, match=message):
        tiny_engine.submit(prompt, **options)
    assert tiny_engine.generate([3, 4], max_new_tokens=5).tokens == alone(tiny_export, [3, 4], 5)


def test_numpy_integers_are_whole_numbers(tiny_export, tiny_engine):
    done = tiny_engine.generate(np.array([3, 4], dtype=np.int32), max_new_tokens=np.int64(5))
    assert done.tokens == alone(tiny_export, [3, 4], 5)
    assert tiny_engine.generate([np.int64(3), 4], max_new_tokens=5).tokens == done.tokens


def test_a_long_text_is_refused_by_its_bytes_before_tokenizing(trained_engine):
    with pytest.raises(BadInput, match="more than the 65,536 bytes read"):
        trained_engine.submit("Return the " * 1_000_000)


class _PoisonedTokenizer:
    """The model's tokenizer, except that decoding text that starts with the tokens ``poison`` raises (a tokenizer
    handed to the engine's public tokenizer= argument that fails on one request's text)."""

    def __init__(self, tokenizer, poison: tuple[int, ...]):
        self.tokenizer, self.poison = tokenizer, poison

    def encode(self, text):
        return self.tokenizer.encode(text)

    def decode(self, ids, **options):
        if tuple(ids[: len(self.poison)]) == self.poison:
            raise RuntimeError("this text cannot be decoded")
        return self.tokenizer.decode(ids, **options)


def test_a_request_whose_text_fails_to_decode_ends_alone_and_the_engine_keeps_serving(trained_export, trained_engine):
    firsts = {p: trained_engine.generate(p, max_new_tokens=12) for p in PROMPTS}
    for k in range(1, 13):  # the shortest start of the new tokens that one request alone has
        starts = [tuple(done.tokens[:k]) for done in firsts.values()]
        unique = [p for p, start in zip(firsts, starts) if starts.count(start) == 1 and len(start) == k]
        if unique:
            victim, poison = unique[0], tuple(firsts[unique[0]].tokens[:k])
            break
    tokenizer = _PoisonedTokenizer(load_gpt2_tokenizer(trained_export), poison)
    model = open_folder(trained_export)
    generation = read_generation_config(trained_export, vocab_size=model.facts.vocab_size)
    decoder = open_runtime(model, RuntimeOptions())
    with BatchingEngine(decoder, tokenizer=tokenizer, eos_token_ids=generation.eos_token_ids, max_batch=8) as engine:
        streams = {p: engine.submit(p, max_new_tokens=12) for p in PROMPTS}
        for prompt, stream in streams.items():
            if prompt == victim:
                with pytest.raises(Exception, match="cannot be decoded"):
                    stream.result(timeout=60)
            else:
                assert stream.result(timeout=60).text == firsts[prompt].text
        assert engine._thread.is_alive()
        later = [p for p in PROMPTS if p != victim][0]
        assert engine.generate(later, max_new_tokens=12).text == firsts[later].text  # later requests are served


# -- issue 39: speculative decoding's options, known and refused in one line ---------------------------------------
@pytest.mark.parametrize(
    "parameters",
    [
        {"prompt_lookup_num_tokens": 10},
        {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2, "max_new_tokens": 8},
        {"max_matching_ngram_size": "two"},  # refused by name, before its value is read
        {"assistant_model": "models/distilgpt2", "num_assistant_tokens": 5},
        {"num_assistant_tokens_schedule": "heuristic", "sample": True},
    ],
)
def test_the_request_reader_refuses_speculative_parameters_by_name(parameters):
    """The reader NAME-generate and NAME-infer use (parse_request, after request_parameters unwraps what
    NAME-infer forwards): a 400 naming the parameter, not 'unknown parameter' and not ignored."""
    import json

    from gpt2onnx.serving.requests import SPECULATIVE_PARAMETERS, parse_request
    from gpt2onnx.serving.triton_models import FORWARDED, request_parameters

    class Request:  # what Triton's Python backend hands the model: parameters() as JSON text
        def __init__(self, sent: dict):
            self.sent = sent

        def parameters(self) -> str:
            return json.dumps(self.sent)

    named = [k for k in parameters if k in SPECULATIVE_PARAMETERS]
    sent = [Request(parameters), Request({FORWARDED: json.dumps(parameters), "triton_x": 1})]  # generate, infer
    for read in [parameters, *(request_parameters(r) for r in sent)]:
        with pytest.raises(BadInput) as refused:
            parse_request(read)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"parameter {', '.join(named)}: ")
        assert "speculative decoding runs in `gpt2onnx generate`, not in the batching engine" in message
        assert "unknown parameter" not in message


def test_submit_refuses_speculation_and_the_engine_keeps_serving(tiny_export, tiny_engine):
    from gpt2onnx.decoding.speculative import Speculation

    with pytest.raises(BadInput, match="speculative decoding runs in `gpt2onnx generate`, not in the batching engine"):
        tiny_engine.submit([1, 2, 3], max_new_tokens=5, speculation=Speculation(prompt_lookup=10))
    with pytest.raises(BadInput, match="not in the batching engine"):
        tiny_engine.submit([1, 2, 3], speculation=Speculation(draft=tiny_export, draft_tokens=4))
    assert tiny_engine.generate([3, 4], max_new_tokens=5).tokens == alone(tiny_export, [3, 4], 5)


# -- issue 53: the engine is exact on every cache layout -----------------------------------------------------------
def _layout_builds():
    """(id, fusion profile, --kv-cache, --dtype) per registered layout: the first profile that makes it, with an
    fp32 and an fp16 cache, and a layout's quantized caches where it stores one."""
    from gpt2onnx.layouts.all_layouts import LAYOUTS
    from gpt2onnx.precisions.kv_cache import FLOAT_CACHE, KV_CACHES
    from gpt2onnx.profiles.all_profiles import PROFILES

    builds = []
    for name, layout in LAYOUTS.items():
        profile = next(p for p in PROFILES.values() if p.layout is layout)
        caches = [*KV_CACHES] if layout.ensures.get("quantizable_cache") else []
        builds += [(f"{name}-{dtype}", profile.name, FLOAT_CACHE, dtype) for dtype in ("fp32", "fp16")]
        builds += [(f"{name}-{cache}", profile.name, cache, "fp32") for cache in caches]
    return builds


def test_prompts_joining_together_run_in_steps_of_bounded_size(tiny_export, monkeypatch):
    """Nine requests of 10 tokens admitted in one loop turn (submitted from the first one's callback, on the
    engine's thread), with room for 16 padded prompt tokens a step: one prompt step each (a step's logits are
    [rows, tokens, vocabulary]: unbounded, 16 prompts of 48 tokens held 871 MB in the 124M int8 server), and each
    request's tokens its own alone."""
    from gpt2onnx.serving import engine as engine_module

    monkeypatch.setattr(engine_module, "PREFILL_TOKENS", 16)
    rng = random.Random(7)
    prompts = [[rng.randrange(999) for _ in range(10)] for _ in range(9)]
    streams = []
    with BatchingEngine.open(tiny_export, max_batch=9) as engine:

        def on_event(event):
            if len(streams) == 1:  # the first token of the first request: the other eight arrive together
                streams.extend(engine.submit(p, max_new_tokens=6) for p in prompts[1:])

        streams.append(engine.submit(prompts[0], max_new_tokens=6, on_event=on_event))
        deadline = time.monotonic() + 60
        while len(streams) < 9 and time.monotonic() < deadline:
            time.sleep(0.01)
        results = [s.result(timeout=60) for s in streams]
        assert engine.prompt_steps == 9 and engine.rows_joined >= 8
    for prompt, result in zip(prompts, results):
        assert result.tokens == alone(tiny_export, prompt, 6)


@pytest.fixture(scope="module")
def peaked_export(tmp_path_factory):
    """The tiny shape with weights spread 0.5: logits so peaked that a rounding difference in a kernel rarely
    flips a token, and a wrong cache row always does."""
    from conftest import make_config, write_hf_folder

    from gpt2onnx.exporters.export import export

    config = make_config("h4-v1000")
    config.initializer_range = 0.5
    root = tmp_path_factory.mktemp("peaked")
    return export(str(write_hf_folder(root / "checkpoint", config)), root / "export").folder


@pytest.mark.parametrize("build", _layout_builds(), ids=lambda b: b[0])
def test_requests_joining_mid_stream_get_their_alone_tokens_on_every_layout(peaked_export, tmp_path, build):
    """20 requests of prompts 1 to 24 tokens long: each running one submits the next two at its own token counts
    (on the engine's thread, so the joins come at fixed steps, while the batch decodes and keeps its cache), at
    most 8 rows at once; every request's greedy tokens are decode()'s for it alone on the same folder."""
    from gpt2onnx.exporters.optimize import optimize
    from gpt2onnx.precisions.kv_cache import FLOAT_CACHE

    name, fusion, cache, dtype = build
    folder = peaked_export
    if (fusion, cache, dtype) != ("none", FLOAT_CACHE, "fp32"):
        built = optimize(peaked_export, tmp_path / name, fusion=fusion, kv_cache=cache, dtype=dtype, validate=False)
        folder = built.folder
    rng = random.Random(53)
    count = 20
    prompts = [[rng.randrange(999) for _ in range(rng.randrange(1, 25))] for _ in range(count)]
    lengths = [rng.randrange(8, 40) for _ in prompts]
    spawn_at = [sorted(rng.sample(range(1, n - 2), 2)) for n in lengths]  # before its last step: it is still running
    streams = {}

    with BatchingEngine.open(folder, max_batch=8) as engine:

        def submit(i):
            streams[i] = engine.submit(prompts[i], max_new_tokens=lengths[i], on_event=lambda e: on_event(i, e))

        def on_event(i, event):
            for child, at in zip((2 * i + 1, 2 * i + 2), spawn_at[i]):
                if child < count and child not in streams and (event.index >= at or event.last):
                    submit(child)

        submit(0)
        deadline = time.monotonic() + 120
        while len(streams) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(streams) == count, f"only {len(streams)} of {count} requests were submitted"
        results = {i: streams[i].result(timeout=60) for i in range(count)}
        joined = engine.rows_joined
    assert joined >= count // 2, joined  # most joined a batch that was decoding

    model = open_folder(folder)
    eos = read_generation_config(folder, vocab_size=model.facts.vocab_size).eos_token_ids
    decoder = open_runtime(model, RuntimeOptions())
    wrong = []
    for i in range(count):
        result = decode(decoder, np.asarray([prompts[i]]), max_new_tokens=lengths[i], eos_token_id=eos)
        expected = result.tokens[0, : int(result.lengths[0])].tolist()
        got = results[i].tokens
        if got != expected:
            first = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            wrong.append((i, len(prompts[i]), first))
    assert not wrong, (
        f"{len(wrong)} of {count} requests differ from decode() alone (request, prompt length, first token)"
    )
