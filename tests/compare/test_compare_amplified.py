"""Amplified is not introduced: outputs judged by what their inputs explain."""

import numpy as np
import pytest

from probe.comparison import result as R
from probe.comparison.api import compare_step
from probe.comparison.structs import StepInput
from probe.comparison.tolerances import Tolerances
from test_compare_support import SyntheticRun


def _outcome(a, b):
    fetch = (a.fetch, b.fetch) if a.task == "tensor" else (None, None)
    return compare_step(StepInput(a.records(), b.records(), *fetch), Tolerances())


def _row(outcome, key):
    return next(row for row in outcome.rows if row.key == key)


def _cancellation(task, fault=0.0):
    """x - 1000 for x near 1000: the inputs differ by one ulp (rounding, rel 6e-8), the
    difference of nearly equal values by far more (subtraction amplifies)."""
    rng = np.random.default_rng(0)
    x = (1000 + rng.uniform(-1, 1, 32)).astype(np.float32)
    runs = []
    for side in (0, 1):
        run = SyntheticRun(task=task)
        xx = x.copy()
        if side:
            xx = np.nextafter(xx, np.float32(2)).astype(np.float32)  # one ulp: rounding
        run.call("", "torch.exp", {"output.0": xx})
        out = (xx - np.float32(1000)).astype(np.float32)
        if side and fault:
            out = (out * (1 + fault)).astype(np.float32)
        run.call("", "torch.sub", {"input.0": xx, "input.1": 1000.0, "output.0": out})
        runs.append(run)
    return runs


@pytest.mark.parametrize("task", ["tensor", "statistics"])
def test_a_subtraction_that_amplifies_rounding_is_explained_not_introduced(task):
    outcome = _outcome(*_cancellation(task))
    sub = _row(outcome, "/torch.sub#0/forward/output.0")
    assert sub.score > 2 and sub.metrics.rel_l2 > 1000 * 6e-8  # beyond float32 tolerance, from one ulp
    assert sub.status == R.EXPLAINED and sub.origin == R.AMPLIFIED and sub.cause.startswith("amplified")
    assert not outcome.diverged


def test_with_tensors_a_subtraction_that_computes_wrongly_is_still_introduced():
    outcome = _outcome(*_cancellation("tensor", fault=0.3))
    sub = _row(outcome, "/torch.sub#0/forward/output.0")
    assert sub.status == R.DIVERGED and sub.origin == R.INTRODUCED
    assert "replayed in float64" in sub.cause


def test_a_cancelling_sum_is_judged_against_the_scale_of_its_summands():
    """A bias gradient sums grad_output over the batch: tiny against its summands, its
    rounding is judged at their scale."""
    rng = np.random.default_rng(1)
    go = rng.standard_normal((64, 4)).astype(np.float32)
    go -= go.mean(axis=0)  # the sum cancels
    runs = []
    for side in (0, 1):
        run = SyntheticRun()
        bias = go.sum(axis=0, dtype=np.float64 if side else np.float32).astype(np.float32)
        bias = (bias + np.float32(3e-6) * side).astype(np.float32)  # another summation order
        run.call("fc", "functional.linear", {"grad_output.0": go, "grad_input.2": bias}, phase="backward")
        runs.append(run)
    outcome = _outcome(*runs)
    bias = _row(outcome, "fc/functional.linear#0/backward/grad_input.2")
    assert bias.metrics.rel_l2 > 1e-2 and bias.scale_norm > 100 * bias.metrics.ref_norm
    assert bias.status in (R.MATCH, R.EXPLAINED) and not outcome.diverged


def test_adams_first_moment_lerp_that_cancels_amplifies_what_its_inputs_differ_by():
    """exp_avg.lerp_(grad, 0.1) where the gradient turns against the moment, 0.9 m + 0.1 g
    near 0: a + w (b - a) subtracts, so inputs that already differ (rel 1e-3) make an output
    that differs far more than 10x: amplified by the op's conditioning, not introduced."""
    rng = np.random.default_rng(0)
    m = rng.uniform(500, 1000, 32).astype(np.float32)
    g = (-9 * m + rng.uniform(-1, 1, 32)).astype(np.float32)
    runs = []
    for side in (0, 1):
        run = SyntheticRun(task="tensor")
        mm, gg = (m, g) if not side else ((m * 1.001).astype(np.float32), (g * 1.001).astype(np.float32) + 1)
        run.call("", "torch.exp", {"output.0": mm})
        run.call("", "torch.exp", {"output.0": gg})
        out = (mm + np.float32(0.1) * (gg - mm)).astype(np.float32)
        run.call("", "Tensor.lerp_", {"input.0": mm, "input.1": gg, "input.2": 0.1, "output.0": out})
        runs.append(run)
    lerp = _row(_outcome(*runs), "/Tensor.lerp_#0/forward/output.0")
    assert lerp.metrics.rel_l2 > 10 * 1.1e-3
    assert lerp.origin == R.AMPLIFIED, lerp.cause
