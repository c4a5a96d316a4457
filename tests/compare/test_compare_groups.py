"""Multi-step, multi-rank compares: the same change or the same op seen in every step file is
reported once, with the steps and ranks where it occurs (not once per step file)."""

import json

from probe.comparison import result as R
from probe.comparison.api import assemble as _assemble
from probe.comparison.api import compare_step
from probe.comparison.structs import StepInput
from probe.comparison.tolerances import Tolerances
from probe.report import json_report, terminal
from test_compare_support import mlp_run


def _multi(run_b_of, files):
    """A CompareResult over several (step, rank) files: A = mlp_run(seed=step), B = run_b_of(step)."""
    table = Tolerances()
    outcomes, info = [], []
    for step, rank in files:
        run_a, run_b = mlp_run(seed=step), run_b_of(step)
        outcome = compare_step(StepInput(run_a.records(), run_b.records(), run_a.fetch, run_b.fetch, step=step, rank=rank), table)
        outcomes.append(outcome)
        info.append({"step": step, "rank": rank, "verdict": "diverged" if outcome.diverged else "pass",
                     "counts": outcome.counts()})
    return _assemble(outcomes, info, table, "a/", "b/", [], [], 10, False)


def _gelu_tanh(step):
    return mlp_run(seed=step, gelu_tanh=True)


FIVE_STEPS = [(step, 0) for step in range(5)]


def test_a_changed_argument_seen_in_every_step_is_one_line_naming_the_steps():
    text = terminal.render(_multi(_gelu_tanh, FIVE_STEPS))
    lines = [line for line in text.splitlines() if "kwarg.approximate" in line and line.startswith("  argument")]
    assert len(lines) == 1, text
    assert "in steps 0-4, rank 0" in lines[0]


def test_changes_group_by_key_and_values_over_steps_and_ranks():
    result = _multi(_gelu_tanh, [(0, 0), (0, 1), (1, 0), (1, 1), (3, 0)])
    [change] = [c for c in result.changes if c.kind == "argument"]
    assert change.key == "act/functional.gelu#0/forward/kwarg.approximate"
    assert change.where == [(0, 0), (0, 1), (1, 0), (1, 1), (3, 0)]
    assert (change.value_a, change.value_b) == ('"none"', '"tanh"')
    assert R.where_text(change.where) == "steps 0-1, ranks 0-1; step 3, rank 0"


def test_a_changed_parameter_is_one_change_with_its_worst_error():
    result = _multi(lambda step: mlp_run(seed=step, weight_noise=1e-3 * (step + 1)), FIVE_STEPS)
    [change] = [c for c in result.changes if c.kind == "param"]
    assert change.key == "fc1/Linear#0/forward/param.weight" and len(change.where) == 5
    params = [r for r in result.divergences if r.slot == "param.weight"]
    assert change.rel_l2 == max(r.metrics.rel_l2 for r in params)
    assert change.worst == (4, 0)


def test_top_ops_name_distinct_ops_with_the_worst_step_and_how_often():
    result = _multi(_gelu_tanh, FIVE_STEPS)
    names = [(op.module, op.op, op.index, op.phase) for op in result.top_ops]
    assert len(names) == len(set(names)), names
    gelu = result.top_ops[0]
    assert (gelu.module, gelu.op) == ("act", "functional.gelu")
    assert gelu.where == FIVE_STEPS
    per_step = [s for s in result.op_summaries if (s.module, s.op) == ("act", "functional.gelu")]
    assert gelu.introduced == max(s.introduced for s in per_step)
    assert (gelu.step, gelu.rank) == max(((s.introduced, -s.step), (s.step, s.rank)) for s in per_step)[1]
    lines = terminal.render(result).splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("top ops")):]
    assert sum("act functional.gelu#0" in line for line in table) == 1, "\n".join(table)


def test_json_top_ops_and_changes_carry_where_they_occur():
    data = json.loads(json_report.render(_multi(_gelu_tanh, FIVE_STEPS)))
    top = data["top_ops"][0]
    assert top["occurrences"] == 5 and top["where"] == [{"step": s, "rank": 0} for s in range(5)]
    [change] = data["changes"]
    assert change["kind"] == "argument" and change["occurrences"] == 5 and change["where_text"] == "steps 0-4, rank 0"


def test_where_text_is_compact():
    assert R.where_text([(0, 0)]) == "step 0, rank 0"
    assert R.where_text([(0, 0), (1, 0), (2, 0), (5, 0)]) == "steps 0-2, 5, rank 0"
    assert R.where_text([(0, 0), (0, 1), (0, 2)]) == "step 0, ranks 0-2"
    assert R.where_text([(2, 1), (4, 3)]) == "step 2, rank 1; step 4, rank 3"


def test_top_ops_table_says_where_each_op_adds_error():
    one_rank = terminal.render(_multi(_gelu_tanh, FIVE_STEPS)).splitlines()
    row = next(line for line in one_rank if "act functional.gelu#0 (forward)" in line and "introduced" in line)
    assert "0-4 (5 of 5, worst " in row and row.rstrip().endswith("model.py:11")
    two_ranks = terminal.render(_multi(_gelu_tanh, [(0, 0), (0, 1), (1, 0), (1, 1)])).splitlines()
    row = next(line for line in two_ranks if "act functional.gelu#0 (forward)" in line and "introduced" in line)
    assert "steps 0-1, ranks 0-1 (4 of 4, worst step " in row
