"""Metrics of a comparison: |Δ| statistics on real positions, KL divergence of the next-token distributions,
top-k agreement, greedy tokens before divergence, and the totals over many cases."""

from __future__ import annotations

import numpy as np

from gpt2onnx.artifact.report import DiffStats, Divergence, Figures, KlStats, MeanMax

_SAMPLE_PER_CASE = 20_000  # |Δ| values kept per case to estimate the pooled percentiles


class Diffs:
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


def abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b|, with NaN counted as an infinite difference (max() would otherwise skip it silently)."""
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return np.where(np.isnan(diff), np.inf, diff)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(p_ref ‖ p_ours) per position, of the next-token distributions the logits give."""
    ref, ours = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(ref) * (ref - ours)).sum(-1)


def information(ref_logits: np.ndarray) -> np.ndarray:
    """Per position: how far the reference's next-token distribution is from uniform, ln V − entropy, in nats
    (its KL from the uniform distribution). Near 0 where the weights carry no learned signal (random weights:
    gates.FLAT_NATS), a few nats on a trained model."""
    logp = log_softmax(ref_logits)
    return np.log(ref_logits.shape[-1]) + (np.exp(logp) * logp).sum(-1)


def relative_error(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Per position: ‖Δlogits‖₂ / ‖reference logits − their mean‖₂, the error relative to the logits' own spread
    (a shift of every logit by one constant changes no probability, so it is not counted). Unlike KL or top-k
    agreement it does not depend on how peaked the predictions are: the same graph error measures the same on
    random and on trained weights."""
    ref = ref_logits.astype(np.float64)
    diff = logits.astype(np.float64) - ref
    diff -= diff.mean(-1, keepdims=True)
    spread = np.linalg.norm(ref - ref.mean(-1, keepdims=True), axis=-1)
    return np.linalg.norm(diff, axis=-1) / np.maximum(spread, 1e-30)


def top5_hits(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Per position: is the reference's top-1 token among our five most likely?"""
    top5 = np.argpartition(-logits, 5, axis=-1)[..., :5] if logits.shape[-1] > 5 else np.argsort(-logits, axis=-1)
    return (top5 == ref_logits.argmax(-1)[..., None]).any(-1)


def tokens_before_divergence(ours: np.ndarray, theirs: np.ndarray) -> int:
    """Greedy tokens that match before the first difference, the worst row."""
    differs = ours != theirs
    first = np.where(differs.any(1), differs.argmax(1), ours.shape[1])
    return int(first.min()) if first.size else 0


def summarize(results) -> Figures:
    """Totals over CaseResults: pooled |Δ| percentiles, agreements weighted by positions, KL, divergence."""
    logits = np.concatenate([r.samples["logits"] for r in results])
    with_present = [r for r in results if r.present]  # a loop runtime (genai) exposes no presents
    compared = sum(r.positions_compared for r in results)

    def weighted(values) -> float:
        """The mean over all compared positions of a per-case mean."""
        return sum(v * r.positions_compared for v, r in zip(values, results)) / max(compared, 1)

    present = None
    if with_present:
        pooled = np.concatenate([r.samples["present"] for r in with_present])
        worst = max(r.present["max"] for r in with_present)
        present = DiffStats(worst, float(np.percentile(pooled, 50)), float(np.percentile(pooled, 99)))
    return Figures(
        cases=len(results),
        logits=DiffStats(
            max(r.logits["max"] for r in results), float(np.percentile(logits, 50)), float(np.percentile(logits, 99))
        ),
        top1_agreement=weighted(r.top1_agreement for r in results),
        positions_compared=compared,
        nonfinite=sum(r.nonfinite for r in results),
        tokens_equal_cases=sum(r.tokens_equal for r in results),
        top5_agreement=weighted(r.top5_agreement for r in results),
        kl=KlStats(weighted(r.kl["mean"] for r in results), max=max(r.kl["max"] for r in results)),
        relative_error=MeanMax(
            weighted(r.relative_error["mean"] for r in results), max(r.relative_error["max"] for r in results)
        ),
        tokens_before_divergence=Divergence(
            min(r.tokens_before_divergence for r in results),
            sum(r.tokens_before_divergence for r in results) / len(results),
        ),
        present=present,
        reference_information=weighted(r.reference_information for r in results),
    )
