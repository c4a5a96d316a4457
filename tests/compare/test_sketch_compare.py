"""Compare with sketches: a statistics dump measures each tensor's error instead of bounding it.

The scenarios (tests/sketch_scenarios.py) are dumped by the real debugger once with task
"tensor" and once with task "statistics"; both compares must find the same first divergence
with rel L2 errors within a factor of 2 of each other.
"""

import json
import math
import os

import numpy as np
import pytest
import torch
from sketch_scenarios import SCENARIOS, dump

from probe.comparison import sketch as estimator
from probe.comparison.api import compare
from probe.dump.reader import load
from probe.report.terminal import metrics_line

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "gpu_dumps")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """(scenario, task, faulty) -> dump path, made once per module."""
    root = tmp_path_factory.mktemp("sketch-scenarios")
    made = {}

    def get(scenario, task, faulty, **options):
        key = (scenario, task, faulty, tuple(sorted(options.items())))
        if key not in made:
            name = "-".join([scenario, task, "b" if faulty else "a"] + [f"{k}{v}" for k, v in sorted(options.items())])
            made[key] = dump(root / name, scenario, faulty, task, **options)
        return made[key]

    return get


def _signature(row):
    return row.module, row.op, row.phase, row.slot


def _first_measured(result):
    """The first divergent output measured by its error (a precision finding, an op computed in
    a lower dtype by the model's own cast, is named before it without a size of its own)."""
    outputs = [row for row in result.divergences if row.divergence == "output"]
    return min(outputs, key=lambda row: row.order)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_statistics_and_tensor_dumps_name_the_same_op_with_errors_within_a_factor_of_two(dumps, scenario):
    exact = compare(dumps(scenario, "tensor", False), dumps(scenario, "tensor", True))
    sketched = compare(dumps(scenario, "statistics", False), dumps(scenario, "statistics", True))
    first_t, first_s = _first_measured(exact), _first_measured(sketched)
    assert _signature(exact.first_divergence) == _signature(sketched.first_divergence)
    assert exact.verdict == sketched.verdict == "diverged"
    assert _signature(first_s) == _signature(first_t), (first_s.key, first_t.key)
    assert first_s.origin == first_t.origin == "introduced"
    assert first_s.metrics.sketch is not None and not first_s.metrics.sketch["within_floor"]
    ratio = first_s.metrics.rel_l2 / first_t.metrics.rel_l2
    assert 0.5 <= ratio <= 2, (first_s.metrics.rel_l2, first_t.metrics.rel_l2)


def test_without_sketches_the_bf16_rotary_fault_hides_under_the_lower_bounds(dumps):
    """What the sketches fix: min/max/mean/norm of cos barely move, so the bound passes every
    measured output; only the precision rule (torch.arange made in bfloat16) names the fault."""
    bounded = compare(dumps("rotary-in-bf16", "statistics", False, sketch_size=0),
                      dumps("rotary-in-bf16", "statistics", True, sketch_size=0))
    assert {row.divergence for row in bounded.divergences} == {"precision"}
    assert bounded.first_divergence.op == "torch.arange"
    measured = compare(dumps("rotary-in-bf16", "statistics", False), dumps("rotary-in-bf16", "statistics", True))
    assert measured.first_divergence.divergence == "precision"
    first = _first_measured(measured)
    assert (first.module, first.op) == ("layer.rotary_emb", "Tensor.cos") and first.tol_dtype == "bfloat16"
    assert "estimated (sketch, k=16, \u00b152%)" in metrics_line(first)
    assert any("estimated from each tensor's sketch" in note for note in measured.notes)
    first_json = [row for row in json.loads(json.dumps(measured.to_dict(rows=True)))["rows"]
                  if row["key"] == first.key][0]["metrics"]
    assert first_json["sketch"]["k"] == 16 and first_json["sketch"]["text"] == "estimated (sketch, k=16, \u00b152%)"
    assert first_json["sketch"]["low"] < first_json["rel_l2"] * first.metrics.ref_norm < first_json["sketch"]["high"]


def test_a_changed_conv_weight_is_the_source_at_the_op_that_reads_it(dumps):
    """Weight noise: the weight's sketch shows it changed, so it is a source and the conv that
    reads it introduced the error. With lower bounds alone and the fixed tolerance (--strict)
    the weight looked unchanged, the conv 'inherited', and the likely cause moved to a later,
    innocent op; its rounding envelope (nothing but its initialization computed it) finds it."""
    result = compare(dumps("conv-weight-noise", "statistics", False), dumps("conv-weight-noise", "statistics", True))
    first = result.first_divergence
    assert (first.module, first.op, first.origin) == ("conv2", "torch.conv2d", "introduced")
    assert "parameter conv2.weight differs" in first.cause
    assert (result.likely_cause.module, result.likely_cause.op) == ("conv2", "torch.conv2d")
    weight = [e for e in first.input_errors if e["status"] == "diverged"]
    assert weight and all(e["source"] == "param" for e in weight)
    bounded = compare(dumps("conv-weight-noise", "statistics", False, sketch_size=0),
                      dumps("conv-weight-noise", "statistics", True, sketch_size=0), strict=True)
    assert bounded.first_divergence.origin == "inherited" and bounded.likely_cause.module != "conv2"
    enveloped = compare(dumps("conv-weight-noise", "statistics", False, sketch_size=0),
                        dumps("conv-weight-noise", "statistics", True, sketch_size=0))
    assert (enveloped.likely_cause.module, enveloped.likely_cause.op) == ("conv2", "torch.conv2d")
    assert enveloped.likely_cause.origin == "introduced"


def test_sketch_estimates_agree_with_the_exact_errors_of_tensor_dumps(dumps):
    """Tensor dumps carry sketches too: across every record pair of every scenario with an
    error above 1e-4, the estimate lies within the 95% band for >= 90% of the pairs and
    within a factor of 2 for all of them."""
    ratios = []
    for scenario in SCENARIOS:
        with load(dumps(scenario, "tensor", False)).open(0, 0) as a, load(dumps(scenario, "tensor", True)).open(0, 0) as b:
            rows_a = {key: row for row, key in enumerate(a.records.column("key"))}
            seen = set()
            for row_b, key in enumerate(b.records.column("key")):
                row_a = rows_a.get(key)
                if row_a is None:
                    continue
                ids = (a.records.column("tensor_id")[row_a], b.records.column("tensor_id")[row_b])
                if min(ids) < 0 or ids in seen:
                    continue
                seen.add(ids)
                xa = a.tensor(int(ids[0])).astype(np.float64).ravel()
                xb = b.tensor(int(ids[1])).astype(np.float64).ravel()
                if xa.shape != xb.shape or not np.isfinite(xa).all():
                    continue
                norm, true = np.linalg.norm(xa), np.linalg.norm(xa - xb)
                if not true > 1e-4 * norm:  # well above the float32 floor (1.5e-5 of the norms)
                    continue
                found = estimator.estimate(a.records.sketches()[row_a], b.records.sketches()[row_b], norm,
                                           np.linalg.norm(xb), a.records.column("dtype")[row_a],
                                           b.records.column("dtype")[row_b])
                ratios.append(found.err_l2 / true)
    ratios = np.array(ratios)
    low, high = estimator.band(16)
    assert len(ratios) > 100
    assert np.mean((ratios >= 1 / high) & (ratios <= 1 / low)) >= 0.9
    assert ratios.min() >= 0.5 and ratios.max() <= 2


def test_identical_runs_pass_with_sketch_errors_exactly_zero(dumps):
    result = compare(dumps("gelu-tanh", "statistics", False), dumps("gelu-tanh", "statistics", False, level="mix"))
    assert result.verdict == "pass"
    sketched = [r.metrics.sketch for r in result.rows if r.metrics is not None and r.metrics.sketch]
    assert len(sketched) > 100 and all(s["raw_err"] == 0 for s in sketched)


@pytest.mark.parametrize("options", [{"threads": 2}, {"dtype": torch.float64}], ids=["threads-1-vs-2", "fp32-vs-fp64"])
def test_rounding_level_differences_stay_within_tolerance_with_sketches(dumps, options):
    """Threads and float64 change rounding only: the sketches must not turn it into errors."""
    a = dumps("gelu-tanh", "statistics", False, threads=1)
    b = dumps("gelu-tanh", "statistics", False, **options)
    result = compare(a, b)
    assert result.verdict == "pass", result.first_divergence and result.first_divergence.reasons
    measured = [r for r in result.rows if r.metrics is not None and r.metrics.sketch]
    assert measured
    if "threads" in options and not any(r.metrics.sketch["raw_err"] > 0 for r in measured):
        pytest.skip("1 and 2 threads sum in the same order with this CPU's kernels: no rounding to judge")
    # float32 against float64 always rounds differently
    assert any(r.metrics.sketch["raw_err"] > 0 for r in measured)


def test_schema_1_dumps_still_compare_with_their_lower_bounds():
    """Real schema-1 dumps (H100 and its host CPU, no sketches) open and compare as before."""
    a, b = os.path.join(DATA, "conv_cpu"), os.path.join(DATA, "conv_gpu")
    with load(a).open(0, 0) as step:
        assert step.schema_version == 1 and step.records.sketches() is None
    result = compare(a, b)
    assert result.verdict == "pass" and result.evidence == "statistics"
    assert any("lower bounds" in note for note in result.notes)
    assert all(r.metrics is None or r.metrics.sketch is None for r in result.rows)


def test_a_schema_2_dump_compares_against_a_schema_1_dump_on_lower_bounds(dumps, tmp_path):
    """One side without sketches: the estimate needs both, so the bound decides."""
    new = dumps("gelu-tanh", "statistics", False)
    result = compare(new, dumps("gelu-tanh", "statistics", False, sketch_size=0))
    assert result.verdict == "pass"
    assert all(r.metrics is None or r.metrics.sketch is None for r in result.rows)


@pytest.mark.parametrize("k, low, high", [(1, 0.000982069, 5.0238862), (16, 6.9076643, 28.8453507),
                                          (100, 74.2219274, 129.5611972)])
def test_chi_square_quantiles_match_the_tables(k, low, high):
    assert estimator.chi2_quantile(0.025, k) == pytest.approx(low, rel=1e-6)
    assert estimator.chi2_quantile(0.975, k) == pytest.approx(high, rel=1e-6)


def test_estimator_floor_missing_and_mixed_sizes():
    base = np.linspace(-1, 1, 16) * 10
    norm = 100.0
    floor = estimator.rounding_floor("float32", norm, "float32", norm)
    tiny = estimator.estimate(base, base + floor / 2, norm, norm, "float32", "float32")
    assert tiny.err_l2 == 0 and tiny.within_floor and "no difference" in tiny.text()
    real = estimator.estimate(base, base + 1.0, norm, norm, "float32", "float32")
    assert real.rel_l2 == pytest.approx(0.01) and real.low < real.err_l2 < real.high
    assert estimator.estimate(base, None, norm, norm, "float32", "float32") is None
    assert estimator.estimate(base, base * math.nan, norm, norm, "float32", "float32") is None
    longer = np.concatenate([base + 1.0, np.full(16, 99.0)])  # k = 32 against k = 16: common prefix
    assert estimator.estimate(base, longer, norm, norm, "float32", "float32").k == 16
    assert estimator.rounding_floor("float64", 1.0, "int64", 1.0) < 1e-12 < floor
