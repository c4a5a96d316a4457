"""The rounding envelope of one tensor over steps (probe/fingerprint/envelope.py), on made-up
fingerprints: a gradient summed over a batch whose terms cancel at one step."""

import numpy as np

from probe.fingerprint import envelope

K = 16
STEPS = 10
NUMEL = 64


def _judge(norms, differences):
    """(outside, jumped) per step of a float32 tensor whose reference norm is norms[s] and
    whose two runs' sketches differ by differences[s] in every row (an absolute size)."""
    sketch_a = np.random.default_rng(0).normal(size=(STEPS, K))
    sketch_b = sketch_a + np.asarray(differences)[:, None]
    numbers = np.zeros((STEPS, 6))
    numbers[:, 3] = norms
    gaps = envelope.measure(numbers, sketch_a, numbers.copy(), sketch_b, "float32", NUMEL,
                            envelope.recent_norms(numbers[:, 3]))
    limit = envelope.allowed(gaps.fresh, envelope.recent_max(gaps.high))
    return gaps.outside, gaps.low > limit


def test_a_gradient_whose_sum_cancels_for_a_step_keeps_the_rounding_of_its_usual_terms():
    """Its norm falls 7-fold for one step while the two runs still differ by what rounding
    makes at its usual size (1e-5 of it, after steps of less): neither outside nor a jump."""
    norms = np.ones(STEPS)
    norms[-1] = 1 / 7
    differences = np.full(STEPS, 1e-7)
    differences[-1] = 1e-5
    outside, jumped = _judge(norms, differences)
    assert not outside.any() and not jumped.any()


def test_a_difference_beyond_rounding_at_a_cancelling_step_still_jumps():
    norms = np.ones(STEPS)
    norms[-1] = 1 / 7
    differences = np.full(STEPS, 1e-7)
    differences[-1] = 1e-3
    outside, jumped = _judge(norms, differences)
    assert outside[-1] and jumped[-1] and not jumped[:-1].any()
