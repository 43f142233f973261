"""Parity with the PyTorch reference: the ONNX chain and transformers' chain run side by side on the same
left-padded batches (an optional earlier chunk as past, a prompt chunk, decode steps fed by the reference's
greedy tokens, then free greedy generation on both sides), and their outputs are compared."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from gpt2onnx.reference import cache_as_arrays, reference_step
from gpt2onnx.runtimes.decoder import OnnxDecoder, position_ids_for

# Tolerances per dtype: largest |Δlogits| and |Δpresent|, and the top-1 agreement required. In fp32 the ONNX
# graph and PyTorch differ only by summation order: ~1e-6 is typical for the 124M model, 1e-4 leaves headroom.
# Quantized weights change every logit a little, so their gates measure what matters for generation instead:
# the mean KL divergence of the next-token distributions, and how often the reference's choice stays in our
# top 5. They are set to catch a broken quantization (KL far above 0.1, top-5 near chance), not to rank good
# ones: with random weights the 124M model's next-token distributions are nearly flat (logit std 0.55 over
# 50,257 tokens), which makes top-k agreement a harsh measure. Measured there (20 cases): int8 KL 2e-4,
# top-5 100 %; int4 (block 32) top-5 88 %.
TOLERANCES = {
    "float32": {"logits": 1e-4, "present": 1e-4, "top1": 1.0, "tokens_equal": True},
    # fp16 on the 124M model (random weights): KL 7e-8, top-1 99.6 %, top-5 100 %.
    "float16": {"kl_mean": 1e-4, "top1": 0.98, "top5": 0.99},
    "int8": {"kl_mean": 0.01, "top5": 0.95},
    "int4": {"kl_mean": 0.05, "top5": 0.80},
}
GATE_NAMES = {
    "logits": "max |Δlogits|",
    "present": "max |Δpresent|",
    "top1": "least top-1 agreement (0–1)",
    "top5": "least top-5 agreement (0–1)",
    "kl_mean": "largest mean KL divergence",
}


def tolerances_for(precision: str, overrides: dict[str, float] | None = None) -> dict:
    """The precision's default gates, with ``overrides`` (from --gate NAME=VALUE) on top."""
    from gpt2onnx.errors import Gpt2OnnxError

    if precision not in TOLERANCES:
        raise Gpt2OnnxError(f"no parity tolerances are defined for precision '{precision}'")
    return {**TOLERANCES[precision], **(overrides or {})}


def parse_gates(values: list[str] | None) -> dict[str, float]:
    """--gate NAME=VALUE, repeatable: override one default tolerance."""
    from gpt2onnx.errors import Gpt2OnnxError

    gates = {}
    for value in values or []:
        name, _, number = value.partition("=")
        if name not in GATE_NAMES:
            choices = ", ".join(f"{k} ({v})" for k, v in GATE_NAMES.items())
            raise Gpt2OnnxError(f"--gate '{value}': unknown gate '{name}'; choose one of {choices}")
        try:
            gates[name] = float(number)
        except ValueError:
            raise Gpt2OnnxError(f"--gate '{value}': '{number}' is not a number (e.g. --gate kl_mean=0.02)") from None
    return gates


_SAMPLE_PER_CASE = 20_000  # |Δ| values kept per case to estimate the pooled percentiles


@dataclass
class ParityResult:
    max_abs_logits: float
    max_abs_present: float
    tolerance: float
    batch: int
    prompt_length: int
    decode_steps: int

    @property
    def passed(self) -> bool:
        return bool(self.max_abs_logits <= self.tolerance and self.max_abs_present <= self.tolerance)

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


@dataclass(frozen=True)
class Case:
    batch: int
    prefix_length: int  # tokens run first with an empty past, so the prompt step starts with a real past
    prompt_length: int
    decode_steps: int
    generate_tokens: int
    seed: int


@dataclass
class CaseResult:
    case: Case
    logits: dict  # max, p50, p99 of |Δlogits| on real positions
    present: dict  # max, p50, p99 of |Δpresent| on real positions
    top1_agreement: float
    positions_compared: int
    nonfinite: int
    tokens_equal: bool
    top5_agreement: float = 1.0  # share of positions where the reference's top-1 is in our top-5
    kl: dict = field(default_factory=dict)  # KL(reference ‖ ours) of the next-token distributions: mean, max
    tokens_before_divergence: int = 0  # greedy tokens generated before the first one that differs (min over rows)
    samples: dict = field(default_factory=dict, repr=False)  # subsampled |Δ| values, for pooled percentiles

    def as_dict(self) -> dict:
        return {
            "case": asdict(self.case),
            "logits": self.logits,
            "present": self.present,
            "top1_agreement": self.top1_agreement,
            "positions_compared": self.positions_compared,
            "nonfinite": self.nonfinite,
            "tokens_equal": self.tokens_equal,
            "top5_agreement": self.top5_agreement,
            "kl": self.kl,
            "tokens_before_divergence": self.tokens_before_divergence,
        }


def left_padded_batch(vocab_size: int, *, batch: int, length: int, seed: int = 0):
    """Random prompts of different lengths per row, left-padded to ``length`` (row 0 unpadded)."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, vocab_size, size=(batch, length), dtype=np.int64)
    attention_mask = np.ones((batch, length), dtype=np.int64)
    for row in range(1, batch):
        pad = int(rng.integers(1, max(2, length // 2 + 1)))
        attention_mask[row, :pad] = 0
        input_ids[row, :pad] = 0
    return input_ids, attention_mask


def random_cases(count: int, *, seed: int, n_positions: int, max_batch: int = 8) -> list[Case]:
    """Batches 1–max_batch, prompts of several lengths, past 0 or longer, a few decode steps, a greedy run."""
    rng = np.random.default_rng(seed)
    budget = min(n_positions, 96)
    cases = []
    for i in range(count):
        generate_tokens = int(rng.integers(2, 9))
        decode_steps = int(rng.integers(1, 5))
        room = budget - max(generate_tokens, decode_steps)
        prompt_length = int(rng.integers(1, max(2, min(32, room // 2) + 1)))
        prefix_length = 0 if i % 2 == 0 else int(rng.integers(1, max(2, room - prompt_length + 1)))
        cases.append(
            Case(int(rng.integers(1, max_batch + 1)), prefix_length, prompt_length, decode_steps, generate_tokens, seed * 100_003 + i)
        )
    return cases


class _Diffs:
    """Accumulates |Δ| over a case: exact max, percentiles from all values (or a large sample)."""

    def __init__(self, rng):
        self.rng, self.values, self.max = rng, [], 0.0

    def add(self, diff: np.ndarray) -> None:
        if diff.size == 0:
            return
        self.max = max(self.max, float(diff.max()))
        flat = diff.ravel()
        if flat.size > _SAMPLE_PER_CASE:
            flat = self.rng.choice(flat, _SAMPLE_PER_CASE, replace=False)
        self.values.append(flat.astype(np.float32))

    def summary(self) -> tuple[dict, np.ndarray]:
        values = np.concatenate(self.values) if self.values else np.zeros(1, np.float32)
        if values.size > _SAMPLE_PER_CASE:
            values = self.rng.choice(values, _SAMPLE_PER_CASE, replace=False)
        stats = {"max": self.max, "p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}
        return stats, values


def _abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b|, with NaN counted as an infinite difference (max() would otherwise skip it silently)."""
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return np.where(np.isnan(diff), np.inf, diff)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(p_ref ‖ p_ours) per position, of the next-token distributions the logits give."""
    ref, ours = _log_softmax(ref_logits), _log_softmax(logits)
    return (np.exp(ref) * (ref - ours)).sum(-1)


def top5_hits(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Per position: is the reference's top-1 token among our five most likely?"""
    top5 = np.argpartition(-logits, 5, axis=-1)[..., :5] if logits.shape[-1] > 5 else np.argsort(-logits, axis=-1)
    return (top5 == ref_logits.argmax(-1)[..., None]).any(-1)


def tokens_before_divergence(ours: np.ndarray, theirs: np.ndarray) -> int:
    """Greedy tokens that match before the first difference, the worst row."""
    differs = ours != theirs
    first = np.where(differs.any(1), differs.argmax(1), ours.shape[1])
    return int(first.min()) if first.size else 0


def _case_batch(case: Case, vocab_size: int):
    """ids and mask of prefix + prompt, each row left-padded differently (row 0 unpadded)."""
    total = case.prefix_length + case.prompt_length
    rng = np.random.default_rng(case.seed)
    ids = rng.integers(0, vocab_size, size=(case.batch, total), dtype=np.int64)
    mask = np.ones_like(ids)
    for row in range(1, case.batch):
        pad = int(rng.integers(0, total))  # at least one real token per row
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


@dataclass
class _Step:
    """One step of both chains: ours (ONNX) and the reference's outputs, and which positions are real."""

    logits: np.ndarray
    ref_logits: np.ndarray
    presents: list[np.ndarray]  # dummy past slots (TensorRT) already removed
    ref_presents: list[np.ndarray]
    real_queries: np.ndarray  # [batch, step length] bool
    real_keys: np.ndarray  # [batch, 1, total length, 1] bool, broadcastable over K/V

    def aligned_logits(self):
        """(ours, reference, real) on the positions the ONNX graph returns: all of them, or the last only
        for an export with --logits last."""
        n = self.logits.shape[1]
        return self.logits, self.ref_logits[:, -n:], self.real_queries[:, -n:]


def _lockstep(decoder: OnnxDecoder, reference, ids: np.ndarray, mask: np.ndarray, *, chunks, decode_steps: int):
    """Run the ONNX chain and the reference side by side: the prompt in ``chunks`` (the first with an empty
    past, later ones on the past the earlier built), then ``decode_steps`` steps fed with the reference's greedy
    tokens. Yields a _Step after every forward pass."""
    past, ref_past = decoder.empty_past(ids.shape[0]), None

    def both(step_ids, step_mask, positions):
        nonlocal past, ref_past
        ref_logits, ref_past = reference_step(reference, step_ids, step_mask, positions, ref_past)
        logits, past = decoder.step(step_ids, decoder.prompt_mask(step_mask), positions, past)
        return _Step(
            logits,
            ref_logits,
            [p[:, :, decoder.dummy_past :] for p in past],
            cache_as_arrays(ref_past),
            step_mask[:, -step_ids.shape[1] :].astype(bool),
            step_mask.astype(bool)[:, None, :, None],
        )

    for start, end in chunks:
        step_mask = mask[:, :end]
        step = both(ids[:, start:end], step_mask, position_ids_for(step_mask)[:, start:end])
        yield step
    step_mask = mask
    for _ in range(decode_steps):
        step_ids = step.ref_logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        step_mask = np.concatenate([step_mask, np.ones_like(step_ids)], axis=1)
        step = both(step_ids, step_mask, position_ids_for(step_mask)[:, -1:])
        yield step


def _kv_diffs(step: _Step):
    for ours, theirs in zip(step.presents, step.ref_presents):
        yield ours, _abs_diff(ours, theirs)[np.broadcast_to(step.real_keys, ours.shape)]


def run_case(decoder: OnnxDecoder, reference, case: Case, *, vocab_size: int) -> CaseResult:
    ids, mask = _case_batch(case, vocab_size)
    rng = np.random.default_rng(case.seed + 1)
    logit_diffs, present_diffs = _Diffs(rng), _Diffs(rng)
    agree = top5 = compared = nonfinite = 0
    kls: list[np.ndarray] = []
    total = case.prefix_length + case.prompt_length
    chunks = [(0, case.prefix_length), (case.prefix_length, total)] if case.prefix_length else [(0, total)]
    for step in _lockstep(decoder, reference, ids, mask, chunks=chunks, decode_steps=case.decode_steps):
        logits, ref_logits, real = step.aligned_logits()
        nonfinite += int((~np.isfinite(logits)).sum())
        logit_diffs.add(_abs_diff(logits, ref_logits)[real])
        agree += int((logits.argmax(-1) == ref_logits.argmax(-1))[real].sum())
        top5 += int(top5_hits(ref_logits, logits)[real].sum())
        kls.append(kl_divergence(ref_logits, logits)[real])
        compared += int(real.sum())
        for ours, diff in _kv_diffs(step):
            nonfinite += int((~np.isfinite(ours)).sum())
            present_diffs.add(diff)
    ours = decoder.greedy(ids, mask, case.generate_tokens)
    theirs = reference_greedy(reference, ids, mask, case.generate_tokens)
    logits_stats, logits_sample = logit_diffs.summary()
    present_stats, present_sample = present_diffs.summary()
    return CaseResult(
        case,
        logits_stats,
        present_stats,
        agree / max(compared, 1),
        compared,
        nonfinite,
        bool(np.array_equal(ours, theirs)),
        top5 / max(compared, 1),
        {"mean": float(np.concatenate(kls).mean()), "max": float(np.concatenate(kls).max())},
        tokens_before_divergence(ours, theirs),
        {"logits": logits_sample, "present": present_sample},
    )


def compare_decoder(
    decoder: OnnxDecoder,
    reference,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    *,
    decode_steps: int,
    tolerance: float,
) -> ParityResult:
    """Prompt (empty past) then ``decode_steps`` greedy steps (the reference's tokens feed both chains);
    logits compared on the real (unpadded) positions the graph returns, presents on real positions."""
    mask = attention_mask.astype(np.int64)
    worst_logits = worst_present = 0.0
    steps = _lockstep(decoder, reference, input_ids, mask, chunks=[(0, input_ids.shape[1])], decode_steps=decode_steps)
    for step in steps:
        logits, ref_logits, real = step.aligned_logits()
        worst_logits = max(worst_logits, float(_abs_diff(logits, ref_logits)[real].max()))
        for _, kv_diff in _kv_diffs(step):
            worst_present = max(worst_present, float(kv_diff.max()))
    return ParityResult(
        worst_logits, worst_present, tolerance, int(input_ids.shape[0]), int(input_ids.shape[1]), decode_steps
    )


def compare_block(
    session, reference, block_index: int, input_ids, attention_mask, *, decode_steps: int, tolerance: float
) -> ParityResult:
    """Feed the single-block graph the hidden states transformers' block ``block_index`` received, and compare
    what it returns with what that block returned (hidden states on real positions, and its cache)."""
    block = reference.transformer.h[block_index]
    captured = {}
    pre = block.register_forward_pre_hook(
        lambda m, args, kwargs: captured.__setitem__("in", args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True,
    )
    post = block.register_forward_hook(
        lambda m, args, out: captured.__setitem__("out", out[0] if isinstance(out, tuple) else out)
    )
    try:
        mask = attention_mask.astype(np.int64)
        n_head, head_dim = reference.config.n_head, reference.config.n_embd // reference.config.n_head
        past = [np.zeros((input_ids.shape[0], n_head, 0, head_dim), np.float32)] * 2
        ids, positions = input_ids, position_ids_for(mask)
        ref_past, worst_hidden, worst_present = None, 0.0, 0.0
        for _ in range(decode_steps + 1):
            ref_logits, ref_past = reference_step(reference, ids, mask, positions, ref_past)
            hidden_in, hidden_out = (captured[k].detach().numpy() for k in ("in", "out"))
            out, key, value = session.run(
                None, {"hidden_states": hidden_in, "attention_mask": mask, "past_key": past[0], "past_value": past[1]}
            )
            real = mask[:, -ids.shape[1] :].astype(bool)
            worst_hidden = max(worst_hidden, float(_abs_diff(out, hidden_out)[real].max()))
            kv_real = mask.astype(bool)[:, None, :, None]
            ref_kv = cache_as_arrays(ref_past)[2 * block_index : 2 * block_index + 2]
            for ours, theirs in ((key, ref_kv[0]), (value, ref_kv[1])):
                worst_present = max(worst_present, float(_abs_diff(ours, theirs)[np.broadcast_to(kv_real, ours.shape)].max()))
            past = [key, value]
            ids = ref_logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            mask = np.concatenate([mask, np.ones_like(ids)], axis=1)
            positions = position_ids_for(mask)[:, -1:]
    finally:
        pre.remove()
        post.remove()
    return ParityResult(
        worst_hidden, worst_present, tolerance, int(input_ids.shape[0]), int(input_ids.shape[1]), decode_steps
    )


def reference_greedy(reference, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """transformers' own generate(), greedy: [batch, max_new_tokens] new token ids."""
    if isinstance(reference, OnnxReference):
        return reference.decoder.greedy(input_ids, attention_mask, max_new_tokens)
    with torch.no_grad():
        out = reference.generate(
            input_ids=torch.as_tensor(input_ids),
            attention_mask=torch.as_tensor(attention_mask),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,  # no early stop: the same number of tokens for every row
            pad_token_id=0,
        )
    return out[:, input_ids.shape[1] :].numpy()


@dataclass
class ParityReport:
    provider: str
    dtype: str
    tolerances: dict
    cases: list[CaseResult]
    totals: dict

    @property
    def passed(self) -> bool:
        return bool(self.totals["passed"])

    def as_dict(self) -> dict:
        return {
            "provider": self.provider,
            "dtype": self.dtype,
            "tolerances": self.tolerances,
            "totals": self.totals,
            "cases": [c.as_dict() for c in self.cases],
        }


def summarize(results: list[CaseResult], tolerances: dict) -> dict:
    logits = np.concatenate([r.samples["logits"] for r in results])
    present = np.concatenate([r.samples["present"] for r in results])
    compared = sum(r.positions_compared for r in results)
    agreed = sum(r.top1_agreement * r.positions_compared for r in results)
    totals = {
        "cases": len(results),
        "logits": {
            "max": max(r.logits["max"] for r in results),
            "p50": float(np.percentile(logits, 50)),
            "p99": float(np.percentile(logits, 99)),
        },
        "present": {
            "max": max(r.present["max"] for r in results),
            "p50": float(np.percentile(present, 50)),
            "p99": float(np.percentile(present, 99)),
        },
        "top1_agreement": agreed / max(compared, 1),
        "positions_compared": compared,
        "nonfinite": sum(r.nonfinite for r in results),
        "tokens_equal_cases": sum(r.tokens_equal for r in results),
        "top5_agreement": sum(r.top5_agreement * r.positions_compared for r in results) / max(compared, 1),
        "kl": {
            "mean": sum(r.kl["mean"] * r.positions_compared for r in results) / max(compared, 1),
            "max": max(r.kl["max"] for r in results),
        },
        "tokens_before_divergence": {
            "min": min(r.tokens_before_divergence for r in results),
            "mean": sum(r.tokens_before_divergence for r in results) / len(results),
        },
    }
    failures = []
    if "logits" in tolerances and totals["logits"]["max"] > tolerances["logits"]:
        failures.append(f"max |Δlogits| {totals['logits']['max']:.3g} > {tolerances['logits']:g}")
    if "present" in tolerances and totals["present"]["max"] > tolerances["present"]:
        failures.append(f"max |Δpresent| {totals['present']['max']:.3g} > {tolerances['present']:g}")
    if "top1" in tolerances and totals["top1_agreement"] < tolerances["top1"]:
        failures.append(f"top-1 agreement {100 * totals['top1_agreement']:.2f}% < {100 * tolerances['top1']:g}%")
    if "top5" in tolerances and totals["top5_agreement"] < tolerances["top5"]:
        failures.append(f"top-5 agreement {100 * totals['top5_agreement']:.2f}% < {100 * tolerances['top5']:g}%")
    if "kl_mean" in tolerances and not totals["kl"]["mean"] <= tolerances["kl_mean"]:  # NaN fails too
        failures.append(f"mean KL divergence {totals['kl']['mean']:.3g} > {tolerances['kl_mean']:g}")
    if totals["nonfinite"]:
        failures.append(f"{totals['nonfinite']} NaN/Inf values")
    if tolerances.get("tokens_equal") and totals["tokens_equal_cases"] < len(results):
        failures.append(f"greedy tokens differ in {len(results) - totals['tokens_equal_cases']} cases")
    totals["failures"] = failures
    totals["passed"] = not failures
    return totals


def check_parity(
    folder,
    *,
    provider=None,
    cases: int = 20,
    seed: int = 0,
    reference: str | None = None,
    max_batch: int = 8,
    on_case=None,
    gates: dict[str, float] | None = None,
    emulate_fp16: bool = False,
) -> ParityReport:
    """Randomized cases of an exported folder against the PyTorch reference rebuilt from its manifest.

    ``emulate_fp16``: run an fp16 model with fp16 arithmetic as a GPU does it, on the CPU provider
    (:mod:`gpt2onnx.runtimes.fp16_emulation`)."""
    import dataclasses
    import tempfile
    from pathlib import Path

    from gpt2onnx.errors import Gpt2OnnxError
    from gpt2onnx.reference import reference_model
    from gpt2onnx.runtimes.model_folder import open_decoder, open_folder, reference_checkpoint
    from gpt2onnx.runtimes.providers import ProviderConfig

    if cases < 1:
        raise Gpt2OnnxError(f"--cases must be a positive integer, got {cases}")
    model = open_folder(folder)
    tolerances = tolerances_for(model.precision, gates)
    provider = provider or ProviderConfig()
    if emulate_fp16:
        if model.dtype != "float16":
            raise Gpt2OnnxError(f"--emulate-fp16 needs an fp16 model: '{folder}' is {model.dtype}; drop --emulate-fp16")
        if provider.name != "cpu":
            raise Gpt2OnnxError("--emulate-fp16 runs on the cpu provider (a GPU computes fp16 itself): drop one of them")
    with tempfile.TemporaryDirectory(prefix="gpt2onnx-fp16-") as tmp:
        if emulate_fp16:
            from gpt2onnx.runtimes.fp16_emulation import write_emulated_fp16

            model = dataclasses.replace(model, model_path=write_emulated_fp16(model.model_path, Path(tmp) / "model.onnx"))
        decoder = open_decoder(model, provider)
        ckpt = reference_checkpoint(model, reference)
        if decoder.vocab_size not in (None, ckpt.spec.vocab_size) or decoder.n_layer != ckpt.spec.n_layer:
            raise Gpt2OnnxError("the reference checkpoint does not match the exported model (vocabulary or layer count)")
        torch.set_num_threads(1)  # leave the cores to onnxruntime between reference steps
        ref = reference_model(ckpt)
        results = []
        for case in random_cases(cases, seed=seed, n_positions=model.n_positions, max_batch=max_batch):
            results.append(run_case(decoder, ref, case, vocab_size=ckpt.spec.vocab_size))
            if on_case is not None:
                on_case(results[-1])
    label = decoder.provider + (" (fp16 emulated)" if emulate_fp16 else "")
    return ParityReport(label, model.precision, tolerances, results, summarize(results, tolerances))


def gate_check(
    decoder: OnnxDecoder, reference, *, precision: str, vocab_size: int, n_positions: int, cases: int = 4, gates=None
) -> dict:
    """The precision's gates on a few seeded randomized cases (what export and optimize check before writing)."""
    tolerances = tolerances_for(precision, gates)
    results = [
        run_case(decoder, reference, case, vocab_size=vocab_size)
        for case in random_cases(cases, seed=0, n_positions=n_positions, max_batch=4)
    ]
    return {"precision": precision, "tolerances": tolerances, **summarize(results, tolerances)}


def precision_gates(
    model_path, reference, *, precision: str, vocab_size: int, n_positions: int, gates=None, decoder=None
) -> dict:
    """What export and optimize check before writing a reduced-precision model: the precision's gates on the
    CPU provider and, for fp16, also with fp16 arithmetic emulated as a GPU does it
    (:mod:`gpt2onnx.runtimes.fp16_emulation`): the CPU provider computes most fp16 nodes in fp32, which hides
    an overflow the graph has on fp16 hardware. ``decoder``: a CPU decoder already open on ``model_path``."""
    import tempfile
    from pathlib import Path

    from gpt2onnx.runtimes.providers import cpu_session

    def check(decoder: OnnxDecoder) -> dict:
        return gate_check(
            decoder, reference, precision=precision, vocab_size=vocab_size, n_positions=n_positions, gates=gates
        )

    checked = check(decoder or OnnxDecoder(cpu_session(model_path)))
    if precision != "float16":
        return checked
    from gpt2onnx.runtimes.fp16_emulation import write_emulated_fp16

    with tempfile.TemporaryDirectory(prefix="gpt2onnx-fp16-") as tmp:
        emulated_path = write_emulated_fp16(Path(model_path), Path(tmp) / "emulated.onnx")
        emulated = check(OnnxDecoder(cpu_session(emulated_path)))
    failures = checked["failures"] + [f"fp16 arithmetic as on a GPU: {f}" for f in emulated["failures"]]
    kept = ("logits", "kl", "top1_agreement", "top5_agreement", "nonfinite", "tokens_before_divergence", "passed")
    return {**checked, "fp16_emulated": {k: emulated[k] for k in kept}, "failures": failures, "passed": not failures}


class OnnxReference:
    """An ONNX decoder behind the reference model's interface, to check a rewritten graph against its source
    (gpt2onnx optimize) with the same comparison code that checks exports against PyTorch."""

    def __init__(self, decoder: OnnxDecoder):
        self.decoder = decoder

    def __call__(self, *, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True):
        from types import SimpleNamespace

        batch = input_ids.shape[0]
        past = self.decoder.empty_past(batch) if past_key_values is None else [t.numpy() for pair in past_key_values for t in pair]
        logits, presents = self.decoder.step(input_ids.numpy(), attention_mask.numpy(), position_ids.numpy(), past)
        pairs = [(torch.from_numpy(presents[i]), torch.from_numpy(presents[i + 1])) for i in range(0, len(presents), 2)]
        return SimpleNamespace(logits=torch.from_numpy(logits), past_key_values=pairs)
