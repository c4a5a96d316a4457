"""One story per report: the headline, likely_cause and the top ops agree."""

import numpy as np

from probe.comparison import result as R
from probe.comparison.api import assemble as _assemble
from probe.comparison.api import compare_step
from probe.comparison.structs import StepInput
from probe.comparison.tolerances import Tolerances
from probe.report import terminal
from test_compare_support import SyntheticRun


def _rank0(noise):
    """Rank 0 computes nothing wrong; the gradient it receives from the all-reduce (made by no
    record of the rank) differs, so its optimizer update only inherits the error."""
    run = SyntheticRun()
    g = np.linspace(-1, 1, 16).astype(np.float32)
    run.call("fc", "functional.linear", {"grad_output.0": g, "grad_input.0": g}, phase="backward")
    p = np.linspace(1, 2, 16).astype(np.float32)
    grad = (g * (1 + noise)).astype(np.float32)
    run.call("", "Tensor.add_", {"input.0": p, "input.1": grad, "output.0": (p + grad).astype(np.float32)})
    return run


def _rank1(approximate):
    run = SyntheticRun()
    x = np.linspace(-2, 2, 64).astype(np.float32)
    out = x * (1 + (1e-3 if approximate == "tanh" else 0))
    for _ in range(3):  # rank 1's GELU runs later in its step than rank 0's update does
        run.call("", "torch.relu", {"input.0": x, "output.0": np.maximum(x, 0)})
    run.call("act", "functional.gelu", {"input.0": x, "kwarg.approximate": approximate,
                                        "output.0": out.astype(np.float32)})
    return run


def _result(pairs):
    table = Tolerances()
    outcomes, info = [], []
    for rank, (a, b) in enumerate(pairs):
        outcome = compare_step(StepInput(a.records(), b.records(), a.fetch, b.fetch, rank=rank), table)
        outcomes.append(outcome)
        info.append({"step": 0, "rank": rank, "verdict": "diverged" if outcome.diverged else "pass",
                     "counts": outcome.counts()})
    return _assemble(outcomes, info, table, "a/", "b/", [], [], 10, False)


def test_a_rank1_only_fault_is_the_headline_cause_and_top_op_on_rank_1():
    result = _result([(_rank0(0.0), _rank0(1e-2)), (_rank1("none"), _rank1("tanh"))])
    rank0 = [row for row in result.rows if row.rank == 0 and row.status == R.DIVERGED]
    assert rank0 and all(row.origin != R.INTRODUCED for row in rank0 if row.divergence == R.OUTPUT)
    first = result.first_divergence
    assert (first.rank, first.op, first.origin) == (1, "functional.gelu", R.INTRODUCED)
    assert result.likely_cause is first
    assert (result.top_ops[0].rank, result.top_ops[0].op) == (1, "functional.gelu")
    assert result.top_ops[0].where == [(0, 1)]
    text = terminal.render(result)
    assert text.startswith("DIVERGED at step 0 rank 1: act functional.gelu")
    assert "no single op introduced" not in text


def test_an_input_within_tolerance_is_never_said_to_already_carry_the_error():
    a, b = SyntheticRun(), SyntheticRun()
    x = np.linspace(1, 2, 64).astype(np.float32) * 1e-3
    for run, noise in ((a, 0.0), (b, 1e-4)):
        xx = (x * (1 + noise)).astype(np.float32)
        run.call("m", "torch.exp", {"output.0": xx})
        run.call("m", "torch.mul", {"input.0": xx, "input.1": 1000.0, "output.0": (xx * 1000).astype(np.float32)})
    result = _result([(a, b)])
    first = result.first_divergence
    given = next(item for item in first.input_errors if item["slot"] == "input.0")
    assert given["status"] == R.MATCH
    assert "already carries the error" not in first.cause and "within its own tolerance" in first.cause
