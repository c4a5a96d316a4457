"""Drift: correct runs that part over steps through accumulated rounding are reported as drift,
no op named "introduced"; a fault injected at step 3 is still named at its op, drift or not."""

import torch

import probe
from tests.real_models import TinyResNet, dump_run, resnet_batch
from tests.verdict_models import train


def _nudged():
    """The batch with its last bits moved (elementwise, exact on every CPU): runs that differ
    by rounding from step 0 on."""
    x, y = resnet_batch(16, 16)
    signs = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(1)) * 2 - 1
    return x + x * signs * 2.0 ** -22, y


def _scale_fc(model):
    with torch.no_grad():
        model.fc.weight.mul_(1.001)


def test_threads_1_vs_2_over_5_adamw_steps_pass_or_are_drift_never_an_introduced_op(tmp_path):
    runs = [dump_run(tmp_path / name, lambda: TinyResNet(16), lambda: resnet_batch(16, 16), steps=5, n_threads=n,
                     optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
            for name, n in (("a", 1), ("b", 2))]
    result = probe.compare(*runs)
    if result.verdict == "pass":  # this BLAS sums the same way on 1 and 2 threads
        return
    assert result.drift is not None, result.to_text()[:2000]
    assert result.likely_cause is None
    assert not any(row.origin == "introduced" for row in result.divergences)
    text = result.to_text()
    assert "-- drift (accumulated rounding; no op introduced an error)" in text.splitlines()[0]
    assert "drift: the runs part through accumulated rounding" in text


def test_a_weight_scaled_at_step_3_is_named_at_its_linear_even_when_the_runs_differ_by_rounding(tmp_path):
    a = train(tmp_path / "a", lambda: TinyResNet(16), steps=5, data=lambda: resnet_batch(16, 16), task="statistics")
    b = train(tmp_path / "b", lambda: TinyResNet(16), steps=5, data=_nudged, task="statistics",
              fault=_scale_fc, fault_step=3)
    result = probe.compare(a, b)
    assert result.drift is None
    cause = result.likely_cause
    assert (cause.step, cause.module, cause.op, cause.origin) == (3, "fc", "functional.linear", "introduced")


def test_a_weight_scaled_at_step_3_of_identical_runs_is_named_at_its_linear(tmp_path):
    a = train(tmp_path / "a", lambda: TinyResNet(16), steps=5, data=lambda: resnet_batch(16, 16), task="statistics")
    b = train(tmp_path / "b", lambda: TinyResNet(16), steps=5, data=lambda: resnet_batch(16, 16), task="statistics",
              fault=_scale_fc, fault_step=3)
    result = probe.compare(a, b)
    assert result.drift is None and result.first_divergence.step == 3
    assert (result.likely_cause.module, result.likely_cause.origin) == ("fc", "introduced")


def _parameter_rows(module: str) -> list:
    """A step file's records of a parameter that differs beyond tolerance: its module's own
    record and the api call's input that holds it (level mix), both introduced, and its
    gradient's record, inherited."""
    from probe.comparison import result as R
    from probe.comparison.metrics import Metrics
    from probe.comparison.structs import RecordRow

    def row(op, slot, kind, order, phase="forward", divergence=R.PARAM, origin=R.INTRODUCED):
        return RecordRow(step=5, rank=0, status=R.DIVERGED, module=module, op=op, index=0, phase=phase,
                         slot=slot, io="in" if phase == "forward" else "out", kind=kind,
                         key_a=f"{module}/{op}#0/{phase}/{slot}", metrics=Metrics(evidence="statistics", rel_l2=0.2),
                         divergence=divergence, origin=origin, order=(order, 0, 0, 0))
    return [row("Linear", "param.weight", "param", 2), row("functional.linear", "input.1", "api", 3),
            row("Linear", "param_grad.weight", "param", 9, "backward", R.OUTPUT, R.INHERITED)]


def test_an_api_input_holding_a_drifted_parameter_drifts_with_it_and_a_changed_one_does_not():
    """Judged at the parameter's record: where drift explains that record (the previous step's
    update wrote its difference), the api call's input holding it is no story start either."""
    from probe.comparison import story

    for written, drifts in ((0.2, True), (0.0, False)):
        rows = _parameter_rows("policy.0")
        introduced, carried = story.drift_facts(rows, {"policy.0.weight": written})
        assert introduced and carried is drifts
        assert [row.drifting for row in rows[:2]] == [drifts, drifts]
