"""A record of an in-place write that holds the values from before the write is not compared."""

import numpy as np

from probe.comparison import result as R
from probe.comparison import story
from probe.comparison.api import compare_step
from probe.comparison.structs import StepInput
from probe.comparison.tolerances import Tolerances
from test_compare_support import SyntheticRun


def _runs(written_in_b: bool, stale_record: bool):
    """exp_avg.lerp_(grad, 0.1), then param.addcdiv_(exp_avg, denom): B's lerp_ output record
    shows the pre-write zeros (a capture that measured too early) or B's write really did not
    happen."""
    g = np.linspace(-1, 1, 16).astype(np.float32)
    p = np.linspace(1, 2, 16).astype(np.float32)
    denom = np.full(16, 2.0, np.float32)
    runs = []
    for side in (0, 1):
        run = SyntheticRun(task="statistics")
        zeros = np.zeros(16, np.float32)
        m = (0.1 * g).astype(np.float32)
        recorded = zeros.copy() if side and (stale_record or not written_in_b) else m
        used = m if (not side or written_in_b) else zeros
        run.call("", "Tensor.lerp_", {"input.0": zeros, "input.1": g, "input.2": 0.1, "output.0": recorded})
        run.call("", "Tensor.addcdiv_", {"input.0": p, "input.1": recorded, "input.2": denom, "kwarg.value": -0.01,
                                         "output.0": (p - 0.01 * used / denom).astype(np.float32)})
        runs.append(run)
    return runs


def _compare(a, b):
    return compare_step(StepInput(a.records(), b.records(), None, None), Tolerances())


def test_a_pre_write_record_is_not_compared_and_its_readers_are():
    outcome = _compare(*_runs(written_in_b=True, stale_record=True))
    stale = [row for row in outcome.rows if row.stale == "B"]
    assert {(row.op, row.slot) for row in stale} == {("Tensor.lerp_", "output.0"), ("Tensor.addcdiv_", "input.1")}
    assert all(row.status == R.MATCH and "not compared" in row.notes[-1] for row in stale)
    assert not outcome.diverged


def test_a_write_that_did_not_happen_is_where_the_error_entered():
    outcome = _compare(*_runs(written_in_b=False, stale_record=False))
    assert outcome.diverged and not any(row.stale for row in outcome.rows)
    lerp = next(row for row in outcome.rows if row.op == "Tensor.lerp_" and row.slot == "output.0")
    assert story.first_divergence(outcome.rows) is lerp and lerp.origin == R.INTRODUCED
