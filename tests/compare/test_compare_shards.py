"""The shard merge (probe/comparison/shards.py) on hand-made records: the records of every
rank of a step in, each rank's view with logical tensors out."""

import json
import math

from probe.comparison.records import Records
from probe.comparison.shards import logical_view, merge_ranks


def _place(placements, shape, offset, coord, mesh=(2,)):
    return json.dumps({"mesh": list(mesh), "dims": None, "placements": placements,
                       "coord": list(coord), "shape": list(shape), "offset": list(offset)})


def _shard(values, rank, placement, key="fc/functional.linear#0/forward/input.1", **extra):
    finite = [v for v in values if math.isfinite(v)]
    return {"key": key, "module": "fc", "op": "functional.linear", "slot": key.rsplit("/", 1)[1],
            "shape": f"[{len(values)}]", "numel": len(values),
            # NaN propagates into the extremes, as capture's aminmax does
            "min": min(values) if len(finite) == len(values) else math.nan,
            "max": max(values) if len(finite) == len(values) else math.nan,
            "mean": sum(values) / len(values),
            "norm": math.sqrt(sum(v * v for v in finite)),
            "nan_count": sum(v != v for v in values), "inf_count": 0,
            "placement": placement, **extra}


def _rows_by_key(records):
    return {records.get("key", row): records.row(row) for row in range(len(records))}


def test_row_shards_combine_into_the_logical_tensors_statistics():
    full = [1.0, -2.0, 3.0, 0.5, 4.0, -1.0]
    merged = merge_ranks({
        rank: Records.from_dicts([_shard(full[3 * rank:3 * rank + 3], rank,
                                         _place(["S(0)"], [6], [3 * rank], [rank]))])
        for rank in (0, 1)})
    for rank in (0, 1):
        (row,) = _rows_by_key(merged.views[rank]).values()
        assert (row["shape"], row["numel"], row["min"], row["max"]) == ("[6]", 6, -2.0, 4.0)
        assert math.isclose(row["mean"], sum(full) / 6)
        assert math.isclose(row["norm"], math.sqrt(sum(v * v for v in full)))
    assert merged.shards == {"fc/functional.linear#0/forward/input.1": 2}


def test_nan_counts_add_and_a_nan_shard_makes_the_extremes_nan():
    nan = float("nan")
    merged = merge_ranks({
        0: Records.from_dicts([_shard([1.0, nan], 0, _place(["S(0)"], [4], [0], [0]))]),
        1: Records.from_dicts([_shard([2.0, 3.0], 1, _place(["S(0)"], [4], [2], [1]))]),
    })
    (row,) = _rows_by_key(merged.views[1]).values()
    assert row["nan_count"] == 1 and math.isnan(row["min"]) and math.isnan(row["max"])


def test_a_replica_that_differs_is_named_with_its_rank():
    place = [_place(["R"], [3], [0], [rank]) for rank in (0, 1, 2)]
    merged = merge_ranks({
        0: Records.from_dicts([_shard([1.0, 2.0, 3.0], 0, place[0])]),
        1: Records.from_dicts([_shard([1.0, 2.0, 3.0], 1, place[1])]),
        2: Records.from_dicts([_shard([1.0, 2.0, 3.5], 2, place[2])]),
    })
    assert merged.replicas == [("fc/functional.linear#0/forward/input.1", 2)]
    (row,) = _rows_by_key(merged.views[2]).values()
    assert row["max"] == 3.0  # the logical tensor is the first copy


def test_shards_replicated_on_a_second_mesh_dimension_count_once():
    """A 2 x 2 mesh: rows sharded on mesh dim 0, replicated on mesh dim 1."""
    by_rank = {}
    for rank in range(4):
        row = rank // 2
        values = [1.0, 2.0] if row == 0 else [3.0, 4.0]
        by_rank[rank] = Records.from_dicts([_shard(values, rank, _place(
            ["S(0)", "R"], [4], [2 * row], [row, rank % 2], mesh=(2, 2)))])
    merged = merge_ranks(by_rank)
    (row,) = _rows_by_key(merged.views[3]).values()
    assert (row["numel"], row["min"], row["max"], row["mean"]) == (4, 1.0, 4.0, 2.5)
    assert merged.shards == {"fc/functional.linear#0/forward/input.1": 2}
    assert merged.replicas == []


def test_partial_records_and_incomplete_shards_stay_rank_local():
    merged = merge_ranks({
        0: Records.from_dicts([_shard([1.0, 2.0], 0, _place(["P(sum)"], [2], [0], [0]), key="a/op#0/forward/output.0"),
                               _shard([1.0], 0, _place(["S(0)"], [3], [0], [0]), key="b/op#0/forward/output.0")]),
        1: Records.from_dicts([_shard([3.0, 4.0], 1, _place(["P(sum)"], [2], [0], [1]), key="a/op#0/forward/output.0"),
                               _shard([5.0], 1, _place(["S(0)"], [3], [1], [1]), key="b/op#0/forward/output.0")]),
    })
    assert merged.partial == {"a/op#0/forward/output.0"}
    assert merged.logical == set()  # b: 2 of 3 values recorded
    assert _rows_by_key(merged.views[1])["b/op#0/forward/output.0"]["numel"] == 1


def test_across_world_sizes_only_logical_and_replicated_records_are_compared():
    place = [_place(["S(0)"], [2], [rank], [rank]) for rank in (0, 1)]
    by_rank = {rank: Records.from_dicts([
        _shard([float(rank)], rank, place[rank], key="w/op#0/forward/input.1"),
        _shard([7.0, 8.0], rank, "", key="loss/op#0/forward/output.0"),  # same on both ranks
        _shard([float(rank), 1.0], rank, "", key="act/op#0/forward/output.0"),  # rank-local
    ]) for rank in (0, 1)}
    view, left_out = logical_view(merge_ranks(by_rank))
    assert view.columns["key"] == ["w/op#0/forward/input.1", "loss/op#0/forward/output.0"]
    assert left_out == 1


def test_dumped_shards_are_reassembled_into_the_logical_tensor():
    import numpy as np

    stored = {0: {5: np.array([[1.0, 2.0]])}, 1: {9: np.array([[3.0, 4.0]])}}
    merged = merge_ranks({
        rank: Records.from_dicts([_shard(list(stored[rank][tid].ravel()), rank,
                                         _place(["S(0)"], [2, 2], [rank, 0], [rank]), tensor_id=tid)])
        for rank, tid in ((0, 5), (1, 9))})
    (row,) = _rows_by_key(merged.views[1]).values()
    fetch = merged.fetch({rank: stored[rank].__getitem__ for rank in stored}, stored[1].__getitem__)
    assert fetch(row["tensor_id"]).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert fetch(9).tolist() == [[3.0, 4.0]]  # the rank's own tensors read as before


def test_a_placement_compare_cannot_read_leaves_the_record_rank_local():
    merged = merge_ranks({
        0: Records.from_dicts([_shard([1.0], 0, '{"placements": ["S(0)"], "shape": "bad"}')]),
        1: Records.from_dicts([_shard([2.0], 1, "not json")]),
    })
    assert merged.logical == set()
    assert _rows_by_key(merged.views[0])["fc/functional.linear#0/forward/input.1"]["numel"] == 1


#: a rank's gradient of fc.weight (param_grad call 0) and the shard FSDP2's reduce-scatter
#: made from every rank's (call 1, a DTensor)
_GRAD = [1.0, -2.0, 3.0, 0.5]


def _gradients(local_scale, reduced_scale):
    def grad(index, seq, scale, placement=""):
        values = [v * scale for v in _GRAD]
        return {"module": "fc", "op": "Linear", "index": index, "phase": "backward", "kind": "param",
                "slot": "param_grad.weight", "io": "out", "seq": seq, "shape": "[4]",
                "min": min(values), "max": max(values), "mean": sum(values) / 4,
                "norm": math.sqrt(sum(v * v for v in values)), "placement": placement}
    return Records.from_dicts([grad(0, 1, local_scale), grad(1, 2, reduced_scale, _place(["S(0)"], [4], [0], [0]))])


def _reduced_row(local_scale, reduced_scale):
    from probe.comparison.api import compare_step
    from probe.comparison.structs import StepInput
    from probe.comparison.tolerances import Tolerances

    outcome = compare_step(StepInput(_gradients(1.0, 1.0), _gradients(local_scale, reduced_scale), None, None), Tolerances())
    (row,) = [row for row in outcome.rows if row.key == "fc/Linear#1/backward/param_grad.weight"]
    linked = [row.key for row in outcome.rows if "local_grad" in row.slot]
    return row, linked


def test_a_reduced_gradient_is_explained_by_the_local_gradients_it_was_made_from():
    # the local gradient differs within float32's tolerance, the reduced one 3x beyond it
    row, linked = _reduced_row(1 + 1e-5, 1 + 6e-5)
    assert linked == ["fc/Linear#1/backward/local_grad.weight"]
    assert (row.status, row.origin) == ("explained", "amplified"), (row.status, row.cause)
    assert "made by a reduce-scatter from rank-local gradients that differ by rel L2 1.00e-05" in row.cause


def test_a_reduced_gradient_whose_local_gradients_agree_but_which_differs_is_introduced():
    row, linked = _reduced_row(1.0, 1 + 6e-5)
    assert linked == ["fc/Linear#1/backward/local_grad.weight"]
    assert (row.status, row.origin) == ("diverged", "introduced"), (row.status, row.cause)
    assert "its inputs agree within tolerance (largest input rel L2 0" in row.cause


def _reduce_scatter_step(local_scale, input_scale, output_scale):
    """fc's local gradient (seq 1), FSDP2's backward reduce-scatter of it (seq 2: input.1 the
    flat copy FSDP2 makes, padded, that no record produces; output.0 the shard) and the reduced
    gradient (seq 3)."""
    def stats(values):
        return {"shape": f"[{len(values)}]", "min": min(values), "max": max(values),
                "mean": sum(values) / len(values), "norm": math.sqrt(sum(v * v for v in values))}

    def record(module, op, index, phase, kind, slot, io, seq, values, placement=""):
        return {"module": module, "op": op, "index": index, "phase": phase, "kind": kind, "slot": slot,
                "io": io, "seq": seq, "placement": placement, **stats(values)}

    grad = [v * local_scale for v in _GRAD]
    collective = "distributed.reduce_scatter_single"
    return Records.from_dicts([
        record("fc", "Linear", 0, "backward", "param", "param_grad.weight", "out", 1, grad),
        record("fc", collective, 0, "forward", "api", "input.1", "in", 2,
               [v * input_scale for v in _GRAD] + [0.0] * 4),
        record("fc", collective, 0, "forward", "api", "output.0", "out", 2, [v * output_scale for v in _GRAD[:2]]),
        record("fc", "Linear", 1, "backward", "param", "param_grad.weight", "out", 3,
               [v * output_scale for v in _GRAD[:2]], _place(["S(0)"], [4], [0], [0])),
    ])


def _reduce_scatter_rows(local_scale, input_scale, output_scale):
    from probe.comparison.api import compare_step
    from probe.comparison.structs import StepInput
    from probe.comparison.tolerances import Tolerances

    outcome = compare_step(StepInput(_reduce_scatter_step(1.0, 1.0, 1.0), _reduce_scatter_step(local_scale, input_scale, output_scale), None, None), Tolerances())
    return {row.slot: row for row in outcome.rows if row.op == "distributed.reduce_scatter_single"}


def test_a_reduce_scatter_input_assembled_from_accepted_local_gradients_is_accepted():
    # the local gradient differs within float32's tolerance (2e-5); FSDP2's flat copy of it
    # and the reduced shard, beyond it, carry that difference and are not errors of their own
    rows = _reduce_scatter_rows(1 + 1.5e-5, 1 + 2.5e-5, 1 + 2.5e-5)
    assert "local_grad.weight" in rows
    assert rows["input.1"].status == "explained", rows["input.1"].reasons
    assert "assembled from the local gradients linked to this call" in rows["input.1"].cause
    assert (rows["output.0"].status, rows["output.0"].origin) == ("explained", "amplified"), rows["output.0"].cause


def test_a_reduce_scatter_whose_inputs_agree_but_whose_output_differs_is_introduced():
    rows = _reduce_scatter_rows(1.0, 1.0, 1 + 6e-5)
    assert (rows["output.0"].status, rows["output.0"].origin) == ("diverged", "introduced"), rows["output.0"].cause


def test_a_reduce_scatter_input_far_beyond_its_local_gradients_is_not_accepted():
    rows = _reduce_scatter_rows(1 + 1.5e-5, 1 + 2e-4, 1 + 2e-4)
    assert rows["input.1"].status == "diverged"
