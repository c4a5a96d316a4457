"""Judgement on synthetic runs: first divergence, introduced vs inherited, causes, notes."""

import numpy as np
import pytest

from probe.comparison import result as R
from probe.comparison import groups, verdict
from probe.comparison.engine import compare_step
from probe.comparison.tolerances import Tolerances
from test_compare_support import SyntheticRun, mlp_run


def _compare(run_a, run_b, **tolerances):
    fetch_a = run_a.fetch if run_a.task == "tensor" else None
    fetch_b = run_b.fetch if run_b.task == "tensor" else None
    outcome = compare_step(run_a.records(), run_b.records(), fetch_a, fetch_b, Tolerances.build(**tolerances))
    first = verdict.first_divergence(outcome.rows)
    return outcome, first


def _row(outcome, key):
    return next(row for row in outcome.rows if row.key == key)


def test_identical_runs_have_no_divergence():
    outcome, first = _compare(mlp_run(), mlp_run())
    assert first is None and not outcome.diverged
    assert outcome.counts() == {"matched": len(mlp_run().rows), "only_a": 0, "only_b": 0, "diverged": 0}
    assert all(row.score == 0.0 for row in outcome.rows if row.metrics and row.metrics.evidence == "tensor")


@pytest.mark.parametrize("task", ["tensor", "statistics", "checksum"])
def test_changed_weight_is_introduced_at_the_op_that_consumes_it(task):
    outcome, first = _compare(mlp_run(task=task), mlp_run(weight_noise=1e-3, task=task))
    assert first.key == "fc1/functional.linear#0/forward/output.0"
    assert first.origin == R.INTRODUCED and "parameter" in first.cause
    param = _row(outcome, "fc1/Linear#0/forward/param.weight")
    assert param.status == R.DIVERGED and param.divergence == R.PARAM
    gelu = _row(outcome, "act/functional.gelu#0/forward/output.0")
    assert gelu.status == R.DIVERGED and gelu.origin == R.INHERITED
    assert first.metrics.evidence == task


def test_changed_argument_is_the_cause_and_earlier_ops_stay_clean():
    outcome, first = _compare(mlp_run(), mlp_run(gelu_tanh=True))
    assert first.key == "act/functional.gelu#0/forward/output.0"
    assert first.origin == R.INTRODUCED and "kwarg.approximate" in first.cause
    argument = _row(outcome, "act/functional.gelu#0/forward/kwarg.approximate")
    assert argument.divergence == R.ARGUMENT
    other_calls = [row for row in outcome.rows if row.seq_a < first.seq_a]
    assert other_calls and all(row.status == R.MATCH for row in other_calls)


def test_an_extra_call_is_unmatched_and_everything_else_still_matches():
    outcome, first = _compare(mlp_run(), mlp_run(extra_call=True))
    assert first is None
    only_b = [row.key for row in outcome.rows if row.status == R.ONLY_B]
    assert only_b == ["act/Tensor.clone#0/forward/input.0", "act/Tensor.clone#0/forward/output.0"]
    assert outcome.counts()["matched"] == len(mlp_run().rows)


def test_a_dtype_difference_alone_is_a_note_not_an_error():
    outcome, first = _compare(mlp_run(dtype=np.float64), mlp_run(dtype=np.float32))
    assert first is None
    noted = [row for row in outcome.rows if row.notes]
    assert noted and all("judged as float32" in row.notes[0] for row in noted)


def test_nan_on_one_side_only_diverges_even_within_tolerance():
    a, b = SyntheticRun(), SyntheticRun()
    x = np.ones(4, np.float32)
    y = x.copy()
    y[2] = np.nan
    a.call("m", "torch.sqrt", {"input.0": x, "output.0": x * 2})
    b.call("m", "torch.sqrt", {"input.0": x, "output.0": np.where(np.isnan(y), np.nan, 2).astype(np.float32)})
    outcome, first = _compare(a, b)
    assert first is not None and first.slot == "output.0"
    assert any("NaN on one side" in reason for reason in first.reasons)


def test_an_op_that_amplifies_inherited_error_tenfold_is_introduced():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(64).astype(np.float32)
    x_b = (x * (1 + 1e-4)).astype(np.float32)  # inherited: rel 1e-4 (beyond float32 tolerance)
    a, b = SyntheticRun(), SyntheticRun()
    for run, xx, amp in ((a, x, 0.0), (b, x_b, 5e-3)):
        run.call("m", "torch.exp", {"output.0": xx})
        run.call("m", "torch.mul", {"input.0": xx, "output.0": (xx * (1 + amp)).astype(np.float32)})
        run.call("m", "torch.neg", {"input.0": xx, "output.0": -xx})
    outcome, _ = _compare(a, b)
    mul = _row(outcome, "m/torch.mul#0/forward/output.0")
    neg = _row(outcome, "m/torch.neg#0/forward/output.0")
    assert mul.origin == R.INTRODUCED and "amplifies" in mul.cause
    assert neg.origin == R.INHERITED


def test_dtype_valued_arguments_are_notes():
    a, b = SyntheticRun(), SyntheticRun()
    x = np.ones(3, np.float32)
    a.call("m", "Tensor.to", {"input.0": x, "input.1": "float32", "output.0": x})
    b.call("m", "Tensor.to", {"input.0": x, "input.1": "bfloat16", "output.0": x})
    outcome, first = _compare(a, b)
    assert first is None
    assert any("dtype argument" in note for row in outcome.rows for note in row.notes)


def test_external_input_difference_makes_the_first_consumer_introduced():
    a, b = SyntheticRun(), SyntheticRun()
    x = np.arange(8, dtype=np.float32)
    a.call("m", "torch.relu", {"input.0": x, "output.0": x})
    b.call("m", "torch.relu", {"input.0": x + 1, "output.0": x + 1})
    outcome, first = _compare(a, b)
    assert first.origin == R.INTRODUCED and "no recorded op produced it" in first.cause


def test_first_divergence_is_earliest_in_execution_order_including_backward():
    a, b = SyntheticRun(), SyntheticRun()
    x = np.linspace(1, 2, 16).astype(np.float32)
    for run, g in ((a, x), (b, x * 1.01)):
        run.call("m", "Linear", {"input.0": x, "output.0": x * 2}, kind="module")
        run.call("m", "Linear", {"grad_output.0": x, "grad_input.0": g}, phase="backward", kind="module")
        run.call("n", "Linear", {"grad_output.0": g, "grad_input.0": g * 3}, phase="backward", kind="module")
    outcome, first = _compare(a, b)
    assert (first.module, first.phase, first.slot, first.origin) == ("m", "backward", "grad_input.0", R.INTRODUCED)
    assert _row(outcome, "n/Linear#0/backward/grad_input.0").origin == R.INHERITED


def test_tiny_norm_tensors_are_judged_against_the_absolute_floor():
    a, b = SyntheticRun(), SyntheticRun()
    noise = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    a.call("m", "torch.sub", {"output.0": noise * 1e-9})
    b.call("m", "torch.sub", {"output.0": -noise * 1e-9})  # 200% relative, 2e-9 absolute
    outcome, first = _compare(a, b)
    assert first is None
    outcome, first = _compare(a, b, atol=0.0)
    assert first is not None


def test_top_ops_rank_the_error_each_op_adds():
    outcome, _ = _compare(mlp_run(), mlp_run(weight_noise=1e-3))
    top = groups.rank_top_ops(outcome.summaries, 10)
    assert top[0].module == "fc1" and top[0].op == "functional.linear"
    assert all(op.kind == "api" for op in top)
    assert [op.introduced for op in top] == sorted((op.introduced for op in top), reverse=True)


def test_a_changed_dtype_argument_is_named_as_the_cause_when_the_output_diverges():
    a, b = SyntheticRun(), SyntheticRun()
    x = np.linspace(1, 2, 64).astype(np.float32)
    a.call("m", "Tensor.to", {"input.0": x, "input.1": "float32", "output.0": x})
    b.call("m", "Tensor.to", {"input.0": x, "input.1": "float8_e5m2", "output.0": (x * 1.01).astype(np.float32)})
    outcome, first = _compare(a, b)
    assert first.slot == "output.0" and first.origin == R.INTRODUCED
    assert "argument input.1 changed" in first.cause
    argument = _row(outcome, "m/Tensor.to#0/forward/input.1")
    assert argument.status == R.MATCH and argument.notes
