"""The accuracy measures parity reports besides |Δ|: top-5 agreement, KL divergence, tokens before divergence."""

import math

import numpy as np

from gpt2onnx.verify.metrics import kl_divergence, tokens_before_divergence, top5_hits


def test_kl_divergence_known_values():
    same = np.array([[1.0, 2.0, 3.0]])
    assert abs(kl_divergence(same, same)[0]) < 1e-12
    assert abs(kl_divergence(same, same + 7.0)[0]) < 1e-12  # a shift of all logits changes nothing
    p, q = np.log(np.array([[0.5, 0.5]])), np.log(np.array([[0.9, 0.1]]))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert math.isclose(kl_divergence(p, q)[0], expected, rel_tol=1e-9)


def test_top5_hits():
    ref = np.zeros((2, 10))
    ref[0, 3] = ref[1, 9] = 5.0  # reference top-1: token 3, then token 9
    ours = np.tile(np.arange(10, dtype=float), (2, 1))  # our top-5: tokens 9, 8, 7, 6, 5
    assert top5_hits(ref, ours).tolist() == [False, True]


def test_tokens_before_divergence():
    theirs = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert tokens_before_divergence(theirs.copy(), theirs) == 4
    ours = theirs.copy()
    ours[1, 2] = 0
    assert tokens_before_divergence(ours, theirs) == 2
