"""Judgement on synthetic runs: first divergence, introduced vs inherited, causes, notes."""

import numpy as np
import pytest

from probe.comparison import result as R
from probe.comparison import story
from probe.comparison.api import compare_step
from probe.comparison.structs import StepInput
from probe.comparison.tolerances import Tolerances
from probe.comparison.api import compare
from test_compare_support import SyntheticRun, linear_checksum_run, mlp_run, square_weight, write_step


def _compare(run_a, run_b, **tolerances):
    fetch_a = run_a.fetch if run_a.task == "tensor" else None
    fetch_b = run_b.fetch if run_b.task == "tensor" else None
    outcome = compare_step(StepInput(run_a.records(), run_b.records(), fetch_a, fetch_b), Tolerances.build(**tolerances))
    first = story.first_divergence(outcome.rows)
    return outcome, first


def _row(outcome, key):
    return next(row for row in outcome.rows if row.key == key)


def test_identical_runs_have_no_divergence():
    outcome, first = _compare(mlp_run(), mlp_run())
    assert first is None and not outcome.diverged
    assert outcome.counts() == {"matched": len(mlp_run().rows), "only_a": 0, "only_b": 0, "diverged": 0, "changed": 0, "explained": 0, "sharded_only": 0}
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
    top = R.rank_top_ops(R.op_summaries([outcome]), 10)
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


def _scaled_chain(rel=1.8e-4, scale=1e-3):
    """sqrt -> div by a small constant: the div only scales an error it was given."""
    rng = np.random.default_rng(4)
    small = (np.abs(rng.standard_normal(64)) * 1e-4).astype(np.float32)
    runs = []
    for factor in (1.0, 1.0 + rel):
        run = SyntheticRun()
        value = (small * factor).astype(np.float32)
        run.call("", "Tensor.sqrt", {"output.0": value})
        run.call("", "Tensor.div", {"input.0": value, "input.1": scale, "output.0": (value / scale).astype(np.float32)})
        runs.append(run)
    return runs


def test_an_op_that_only_scales_an_error_within_tolerance_inherits_it():
    outcome, first = _compare(*_scaled_chain())
    given = _row(outcome, "/Tensor.div#0/forward/input.0")
    div = _row(outcome, "/Tensor.div#0/forward/output.0")
    # the same relative error: within tolerance before the division (the absolute floor covers
    # it), beyond it after (the values are 1000x larger)
    assert given.status == R.MATCH and div.status == R.DIVERGED
    assert div.metrics.rel_l2 == pytest.approx(given.metrics.rel_l2, rel=1e-3)
    assert div.origin == R.INHERITED and "input.0 carries a difference within its own tolerance" in div.cause
    assert first is div and "Tensor.sqrt" in div.cause  # named as the op that made the input
    top = R.rank_top_ops(R.op_summaries([outcome]), 10)
    assert [op.op for op in top if op.op == "Tensor.div"] == []


def _param_and_input(param_noise, input_noise):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(32).astype(np.float32)
    w = rng.standard_normal(32).astype(np.float32)
    runs = []
    for px, pw in ((0.0, 0.0), (input_noise, param_noise)):
        run = SyntheticRun()
        xx = (x * (1 + px)).astype(np.float32)
        ww = (w * (1 + pw)).astype(np.float32)
        run.call("m", "torch.exp", {"output.0": xx})
        run.call("m", "torch.mul", {"input.0": xx, "input.1": ww, "output.0": (xx * ww).astype(np.float32)})
        run.call("m", "Scale", {"input.0": xx, "param.weight": ww}, kind="module")
        runs.append(run)
    return runs


def test_a_changed_parameter_is_the_cause_only_when_its_error_is_at_least_the_inputs():
    outcome, _ = _compare(*_param_and_input(param_noise=1e-2, input_noise=1e-3))
    mul = _row(outcome, "m/torch.mul#0/forward/output.0")
    assert mul.origin == R.INTRODUCED and "parameter" in mul.cause
    outcome, _ = _compare(*_param_and_input(param_noise=1e-4, input_noise=1e-2))
    mul = _row(outcome, "m/torch.mul#0/forward/output.0")
    assert mul.origin == R.INHERITED and "input.0 already carries" in mul.cause


def _optimizer_steps(tmp_path, noise=1e-3):
    """Two step files per run: step 0 makes the optimizer state s from a gradient (B's differs),
    step 1 updates s in place (Tensor.lerp_) with a gradient both runs agree on."""
    rng = np.random.default_rng(6)
    grads = [rng.standard_normal(32).astype(np.float32) for _ in range(2)]
    paths = []
    for name, factor in (("a", 1.0), ("b", 1.0 + noise)):
        zeros = np.zeros(32, np.float32)
        g0 = (grads[0] * factor).astype(np.float32)
        state = (0.1 * g0).astype(np.float32)
        step0 = SyntheticRun()
        step0.call("", "torch.zeros_like", {"output.0": zeros})
        step0.call("", "Tensor.lerp_", {"input.0": zeros, "input.1": g0, "input.2": 0.1, "output.0": state})
        step1 = SyntheticRun()
        step1.call("", "Tensor.lerp_", {"input.0": state, "input.1": grads[1], "input.2": 0.1,
                                        "output.0": (0.9 * state + 0.1 * grads[1]).astype(np.float32)})
        write_step(step0, tmp_path / name, step=0)
        write_step(step1, tmp_path / name, step=1)
        paths.append(str(tmp_path / name))
    return paths


def test_optimizer_state_carried_over_from_the_previous_step_is_inherited_not_introduced(tmp_path):
    a, b = _optimizer_steps(tmp_path)
    result = compare(a, b)
    step1 = [r for r in result.rows if r.step == 1]
    state = next(r for r in step1 if r.slot == "input.0")
    update = next(r for r in step1 if r.slot == "output.0")
    assert state.status == update.status == R.DIVERGED
    assert update.origin == R.INHERITED and "carried over from the previous step" in update.cause
    assert result.first_divergence.step == 0 and result.first_divergence.origin == R.INTRODUCED
    # compared alone, step 1 has no evidence of where the state came from: it enters there
    alone = compare(a, b, steps=[1])
    assert alone.first_divergence.origin == R.INTRODUCED and "no recorded op produced it" in alone.first_divergence.cause


def test_a_module_grad_output_recorded_before_its_producer_is_still_produced():
    """Module backward hooks record a module's grad_output before the downstream module's
    grad_input (the same tensor): that late record is its producer, not an external input."""
    rng = np.random.default_rng(7)
    g = rng.standard_normal(16).astype(np.float32)
    runs = []
    for factor in (1.0, 1.01):
        run = SyntheticRun()
        made = (g * factor).astype(np.float32)
        run.call("fc", "Linear", {"grad_output.0": g}, phase="backward", kind="module")
        run.call("norm", "LayerNorm", {"grad_output.0": made}, phase="backward", kind="module")
        run.call("fc", "Linear", {"grad_input.0": made}, phase="backward", kind="module")
        run.call("norm", "LayerNorm", {"grad_input.0": (made * 2).astype(np.float32)}, phase="backward", kind="module")
        for row in run.rows:  # one call per module firing: its records share the index, not the seq
            if row["index"] == 1:
                row["index"], row["key"] = 0, row["key"].replace("#1/", "#0/")
        runs.append(run)
    a, b = runs
    outcome, first = _compare(a, b)
    norm_out = _row(outcome, "norm/LayerNorm#0/backward/grad_input.0")
    assert norm_out.origin == R.INHERITED and "made by fc/Linear#0/backward/grad_input.0" in norm_out.cause
    assert first.key == "fc/Linear#0/backward/grad_input.0" and first.origin == R.INTRODUCED


def test_a_dtype_limit_argument_that_follows_the_dtype_is_a_note():
    """torch.clamp(x, min=-torch.finfo(x.dtype).max) in a float64 run against a float32 one."""
    x = np.linspace(-1, 1, 16)
    a, b = SyntheticRun(), SyntheticRun()
    a.call("", "torch.clamp", {"input.0": x, "kwarg.min": -np.finfo(np.float64).max, "output.0": x})
    b.call("", "torch.clamp", {"input.0": x.astype(np.float32), "kwarg.min": float(-np.finfo(np.float32).max),
                               "output.0": x.astype(np.float32)})
    outcome, first = _compare(a, b)
    assert first is None, first and first.reasons
    assert any("dtype limit argument" in note for row in outcome.rows for note in row.notes)
    # the same values in a call whose dtypes agree are a real change of argument; here it
    # changes nothing the call computed, so it is said, not made a divergence
    c = SyntheticRun()
    c.call("", "torch.clamp", {"input.0": x, "kwarg.min": float(-np.finfo(np.float32).max), "output.0": x})
    outcome, first = _compare(a, c)
    argument = _row(outcome, "/torch.clamp#0/forward/kwarg.min")
    assert first is None and argument.status == R.MATCH and "no effect here" in argument.notes[-1]


def test_a_changed_argument_that_changes_nothing_is_a_note_and_one_that_does_is_the_cause():
    x = np.linspace(-1, 1, 16).astype(np.float32)
    runs = {}
    for name, use_cache, scale in (("a", True, 1.0), ("same", False, 1.0), ("scaled", False, 1.001)):
        run = SyntheticRun()
        run.call("attn", "Attention", {"input.0": x, "kwarg.use_cache": use_cache, "output.0": (x * scale).astype(np.float32)},
                 kind="module")
        runs[name] = run
    outcome, first = _compare(runs["a"], runs["same"])
    assert first is None and not outcome.diverged
    outcome, first = _compare(runs["a"], runs["scaled"])
    assert first is not None and first.origin == R.INTRODUCED and "kwarg.use_cache changed" in first.cause


@pytest.mark.parametrize("step, status", [(0, R.DIVERGED), (1, R.CHANGED)])
def test_a_transposed_weight_is_a_divergence_in_step_0_and_a_note_once_updated(step, status):
    """Checksums differ, min/max/NaN/Inf equal: rounding cannot permute a weight nothing has
    computed yet (step 0); from step 1 on an optimizer update could have rounded it."""
    weight = square_weight()
    a, b = linear_checksum_run(weight), linear_checksum_run(np.ascontiguousarray(weight.T))
    outcome = compare_step(StepInput(a.records(), b.records(), None, None, step=step), Tolerances())
    param = _row(outcome, "fc/Linear#0/forward/param.weight")
    assert param.status == status and param.size_unknown
    assert R.SIZE_UNKNOWN in (param.reasons + param.notes)[0]
    if status == R.DIVERGED:
        assert param.divergence == R.PARAM
        assert param.to_dict()["size_unknown"] is True


def test_rounding_of_a_computed_output_is_changed_not_diverged():
    weight = square_weight()
    outcome = compare_step(StepInput(linear_checksum_run(weight).records(), linear_checksum_run(weight, noise=1e-7).records(), None, None), Tolerances())
    out = _row(outcome, "fc/functional.linear#0/forward/output.0")
    assert not outcome.diverged and out.status == R.CHANGED and "rounding can explain it" in out.notes[0]
    assert outcome.counts()["changed"] == 1


def test_a_parameter_whose_extremes_moved_is_changed_not_diverged():
    """Every element one rounding off (an initialization computed differently) moves the
    min or max; a reordering never does."""
    weight = square_weight()
    nudged = np.nextafter(weight, np.float32(np.inf)).astype(np.float32)
    outcome = compare_step(StepInput(linear_checksum_run(weight).records(), linear_checksum_run(nudged).records(), None, None), Tolerances())
    param = _row(outcome, "fc/Linear#0/forward/param.weight")
    assert param.status == R.CHANGED and "min or max moved" in param.notes[0]


def test_a_shuffled_batch_is_a_divergence_when_nothing_differed_before():
    weight = square_weight()
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    outcome = compare_step(StepInput(linear_checksum_run(weight, x).records(), linear_checksum_run(weight, x[::-1].copy()).records(), None, None), Tolerances())
    data = _row(outcome, "fc/Linear#0/forward/input.0")
    assert data.status == R.DIVERGED and data.divergence == R.INPUT and data.size_unknown
