"""Sharded training (FSDP2, DDP, tensor parallel) on CPU with gloo, 2 ranks: capture, compare.

One torchrun job (tests/scripts/sharded_train.py) trains the same tiny model once per
scenario, without capture and under capture, and writes each rank's losses and dumps; the
tests read them. FSDP2 frees and re-allocates the memory of its unsharded parameters every
step, and every DTensor is a wrapper without memory of its own: capture must read both
without changing what training computes, and compare must pair their logical tensors with
the records of DDP and of one device.
"""

import math
import os
import sys

import pytest
import torch

from torch_versions import (fsdp2_on_cpu_gap, fsdp2_trains_like_ddp_or_skip,
                            functional_collective_wait_or_skip, sharding_or_skip,
                            tensor_parallel_reduction_gap, transformers_gap)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import sharded_train  # noqa: E402

CAPTURES = [f"{level}.{task}" for level in ("module", "api", "mix")
            for task in ("statistics", "tensor", "checksum")]
#: (baseline, captured) pairs beyond FSDP2 under every level x task
OTHERS = [
    ("fsdp-none-keep", "fsdp-mix.tensor-keep"),
    ("fsdp-none-bf16", "fsdp-mix.statistics-bf16"),
    ("ddp-none", "ddp-mix.statistics"),
    ("tp-none", "tp-mix.statistics"),
    ("tp-none", "tp-api.tensor"),
]
#: dumps only the compare tests read
COMPARED = ["fsdp-mix.statistics-block", "fsdp-mix.statistics-root", "fsdp-mix.statistics-tanh1",
            "fsdp-mix.statistics-scale1", "tp-mix.statistics-adamwbn", "tp-mix.tensor-adamwbn", "tp-mix.statistics-scale1", "tp-mix.statistics-replica1",
            "coll-api.statistics", "coll-api.statistics-fault1", "fsdp-mix.tensor-bf16",
            "bwcoll-api.statistics", "bwcoll-api.statistics-fault1", "tp-api.statistics-xgrad"]
#: examples/distributed/train_fsdp2.py and train_tp.py, one step each
EXAMPLES = ["example-fsdp2-ddp", "example-fsdp2", "example-fsdp2-bug1", "example-tp",
            "example-tp-bug1"]
#: the tiny transformers Llama: tensor parallel (clean, and a query shard scaled on rank 1),
#: DDP and FSDP2, two steps each
LLAMA = ["tp-mix.statistics-llama", "tp-mix.statistics-llama-scale1", "ddp-mix.statistics-llama",
         "fsdp-mix.statistics-llama"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    sharding_or_skip()
    out = tmp_path_factory.mktemp("sharded")
    scenarios = ["fsdp-none"] + [f"fsdp-{capture}" for capture in CAPTURES]
    scenarios += sorted({name for pair in OTHERS for name in pair}) + COMPARED + EXAMPLES
    if transformers_gap() is None:
        scenarios += LLAMA
    if fsdp2_on_cpu_gap():
        scenarios = [name for name in scenarios if not _uses_fsdp2(name)]
    sharded_train.launch(out, scenarios)
    return out


def _uses_fsdp2(scenario):
    return scenario.startswith(("fsdp-", "example-fsdp2"))


def _fsdp2_or_skip(*scenarios):
    if fsdp2_on_cpu_gap() and any(_uses_fsdp2(name) for name in scenarios):
        pytest.skip(fsdp2_on_cpu_gap())


def _one_device_dump(folder, capture, adamwbn=False):
    """The same model on one device, with the tensor-parallel run's global batch."""
    debugger = sharded_train.debugger_for(capture, str(folder))
    sharded_train.train(sharded_train.build(norm=adamwbn), sharded_train.batches(100), debugger, adamw=adamwbn)
    return folder


@pytest.fixture(scope="module")
def one_device(job):
    return _one_device_dump(job / "one", "mix.statistics")


@pytest.fixture(scope="module")
def one_device_tensors(job):
    return _one_device_dump(job / "one-tensors", "api.tensor")


def _paired_share(result):
    return _paired_shares(result)[0]


def _paired_shares(result):
    """(share of A's records paired, share of B's records paired)."""
    counts = result.counts
    return (counts["matched"] / (counts["matched"] + counts["only_a"]),
            counts["matched"] / (counts["matched"] + counts["only_b"]))


def _llama_or_skip(*scenarios):
    if transformers_gap():
        pytest.skip(transformers_gap())
    _fsdp2_or_skip(*scenarios)


@pytest.fixture(scope="module")
def one_device_llama(job):
    """The tiny Llama on one device, with the tensor-parallel run's batches."""
    _llama_or_skip()
    folder = job / "one-llama"
    sharded_train.train(sharded_train.build_llama(), sharded_train.llama_batches(100),
                        sharded_train.debugger_for("mix.statistics", str(folder)),
                        loss_of=sharded_train.llama_loss)
    return folder


def test_fsdp2_trains_bit_identically_under_every_level_and_task(job):
    _fsdp2_or_skip("fsdp-none")
    baseline = [sharded_train.losses(job, "fsdp-none", rank) for rank in (0, 1)]
    assert baseline[0] != baseline[1]  # each rank trains on its own data
    for capture in CAPTURES:
        for rank in (0, 1):
            assert sharded_train.losses(job, f"fsdp-{capture}", rank) == baseline[rank], capture


@pytest.mark.parametrize("baseline, captured", OTHERS)
def test_reshard_keep_mixed_precision_ddp_and_tensor_parallel_train_bit_identically(
        job, baseline, captured):
    _fsdp2_or_skip(baseline, captured)
    for rank in (0, 1):
        assert sharded_train.losses(job, captured, rank) == sharded_train.losses(job, baseline, rank)


def test_a_dtensor_is_recorded_as_its_local_shard_with_its_placement(job):
    """Tensor parallel: the first Linear's weight (16 x 8) is split by rows; each rank records
    its 8 x 8 shard's statistics (no NaN, no -1 counts) and where the shard sits."""
    import json

    from probe.dump.reader import load

    dump = load(job / "tp-mix.statistics")
    weight = sharded_train.build()[0].weight.detach()
    for rank in (0, 1):
        rows = list(dump.records(step=0, rank=rank))
        tensors = [row for row in rows if row["dtype"] and row["numel"] > 0]
        assert tensors and not any(math.isnan(row["mean"]) or row["nan_count"] < 0
                                   for row in tensors)
        (row,) = [row for row in rows if row["key"] == "0/Linear#0/forward/param.weight"]
        place = json.loads(row["placement"])
        assert place == {"mesh": [2], "dims": ["tp"], "placements": ["S(0)"], "coord": [rank],
                         "shape": [16, 8], "offset": [8 * rank, 0]}
        shard = weight[8 * rank:8 * rank + 8]
        assert row["shape"] == "[8, 8]" and row["numel"] == 64
        assert (row["min"], row["max"]) == (shard.min().item(), shard.max().item())
        assert not any(row["placement"] for row in rows if row["module"] == "1")  # GELU's input is plain


@pytest.mark.parametrize("path", ["host", "device"])  # the device path, run on CPU
@pytest.mark.parametrize("task", ["statistics", "checksum"])
@pytest.mark.parametrize("size", [8, 100_000])  # batched on the host, and computed alone
def test_capture_leaves_every_storage_it_reads_resizable(task, size, path):
    """Tensor.numpy() marks a storage as not resizable for good; FSDP2 then cannot free its
    unsharded parameters ("Trying to resize storage that is not resizable")."""
    from probe.capture.recorder import Recorder
    from probe.config import Config

    tensors = [torch.randn(size), torch.randn(size, dtype=torch.float64),
               torch.randn(2, size)[:, ::2], torch.arange(size)]
    recorder = Recorder(Config(task=task), defer_stats=path != "host")
    call = recorder.call("api", "", "torch.neg", 0, "forward", "", 1)
    for position, tensor in enumerate(tensors):
        recorder.add(call, f"input.{position}", "in", tensor)
    recorder.resolve()
    assert all(row[13] == row[13] for row in recorder.rows)  # statistics were computed
    for tensor in tensors:
        tensor.untyped_storage().resize_(0)  # what FSDP2 does after forward


#: FSDP2 wrappings: fully_shard on each Linear and the root; on the first Linear and the root
#: (the second Linear's parameters in the root's group, as a block's Linears are in the block's);
#: on the root alone
WRAPPINGS = ["", "-block", "-root"]


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_ddp_and_fsdp2_with_the_same_data_pass_with_parameters_paired_as_logical_tensors(
        job, wrapping):
    fsdp2_trains_like_ddp_or_skip()
    from probe import compare

    result = compare(job / "ddp-mix.statistics", job / f"fsdp-mix.statistics{wrapping}")
    assert result.verdict == "pass", result.first_divergence
    # every gradient DDP recorded (this rank's, before the all-reduce) pairs with the one this
    # FSDP2 rank computed before its reduce-scatter, whichever module's group holds it
    grads = [row for row in result.rows if row.slot.startswith("param_grad.")]
    assert grads and all(row.status != "only_a" for row in grads)
    # FSDP2's reduced shards have no DDP partner: said, not compared with the unreduced ones
    assert any("reduced gradients of B (param_grad call 1" in note for note in result.notes)
    assert _paired_share(result) >= 0.9
    # the optimizer's updates of FSDP2's sharded parameters pair with DDP's whole ones
    targets = {row.target for row in result.rows if row.target and row.status != "only_b"}
    assert targets == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert any("merged" in note and "2 shards" in note for note in result.notes)


def test_fsdp2_where_rank_1_alone_uses_the_tanh_gelu_diverges_at_rank_1s_gelu(job):
    _fsdp2_or_skip("fsdp-")
    from probe import compare

    result = compare(job / "fsdp-mix.statistics", job / "fsdp-mix.statistics-tanh1")
    first = result.first_divergence
    assert result.verdict == "diverged"
    assert (first.rank, first.module, first.op, first.origin) == (1, "1", "functional.gelu", "introduced")


def test_an_fsdp2_shard_scaled_on_rank_1_is_the_headline_at_that_parameter_and_rank(job):
    _fsdp2_or_skip("fsdp-")
    from probe import compare
    result = compare(job / "fsdp-mix.statistics", job / "fsdp-mix.statistics-scale1")
    first = result.first_divergence
    assert result.verdict == "diverged"
    assert (first.step, first.rank, first.module, first.slot, first.origin) == (
        0, 1, "0", "param.weight", "introduced"), result.to_text()[:1500]
    assert result.likely_cause is first and "rank 1's shard of parameter 0.weight differs on entry" in first.cause
    assert result.to_text().startswith("DIVERGED at step 0 rank 1: 0 Linear (forward, param.weight) -- introduced")
    # the all-gathers carry it: on rank 0 their inputs agree, yet they did not introduce it
    gathers = [row for row in result.rows if row.step == 0 and "all_gather" in row.op and row.io == "out"
               and row.status == "diverged"]
    assert gathers and all(row.origin == "inherited" for row in gathers)


def test_one_device_and_tensor_parallel_pass_with_every_one_device_record_paired(job, one_device):
    """The activations between the two parallel Linears are plain tensors, each rank's
    block of the hidden features: merged from the ranks' blocks, they pair with one device's
    (comparison/rank_blocks.py)."""
    from probe import compare

    result = compare(one_device, job / "tp-mix.statistics")
    assert result.verdict == "pass", result.first_divergence
    # where the all-reduce goes unrecorded, the row-parallel Linear's output stays rank-local
    assert _paired_shares(result)[0] >= (1.0 if tensor_parallel_reduction_gap() is None else 0.95)
    gelu = [row for row in result.rows if row.key_a == "1/functional.gelu#0/forward/output.0"]
    assert gelu and all(row.status == "match" and row.shape_b == "[4, 16]" for row in gelu)
    assert any("merged 10 plain records of 2 ranks, each rank's block" in note for note in result.notes)
    assert any("not compared: the world sizes differ (1 and 2)" in note for note in result.notes)


def test_one_device_and_tensor_parallel_llama_pair_nine_in_ten_records_of_each_side_and_pass(
        job, one_device_llama):
    """q/k/v/gate/up column-parallel, o/down row-parallel: every rank holds its own heads and
    features as plain tensors from the column-parallel Linears to the row-parallel ones
    (rotary embedding, attention scores, the gated MLP product); merged from the ranks'
    blocks they pair with one device's, and so does each rank's head count passed to expand
    and reshape. Both ways: one device against tensor parallel and back."""
    _llama_or_skip()
    if tensor_parallel_reduction_gap():
        pytest.skip(tensor_parallel_reduction_gap())
    from probe import compare

    for a, b in ((one_device_llama, job / "tp-mix.statistics-llama"),
                 (job / "tp-mix.statistics-llama", one_device_llama)):
        result = compare(a, b)
        assert result.verdict == "pass", result.to_text()[:2000]
        assert min(_paired_shares(result)) >= 0.9, (_paired_shares(result), result.counts)
        collectives = [row for row in result.rows if row.status in ("only_a", "only_b")
                       and row.op.startswith("ops._c10d_functional.")]
        assert result.counts["sharded_only"] >= len(collectives) > 0
    scores = [row for row in result.rows
              if row.key_a == "model.layers.1.self_attn/functional.softmax#0/forward/output.0"]
    assert scores and all(row.status == "match" and row.shape_a == "[2, 4, 8, 8]" for row in scores)


def test_a_tensor_parallel_llama_query_shard_scaled_on_rank_1_is_named_at_its_linear(
        job, one_device_llama):
    _llama_or_skip()
    from probe import compare

    result = compare(one_device_llama, job / "tp-mix.statistics-llama-scale1")
    first = result.first_divergence
    assert result.verdict == "diverged"
    assert (first.step, first.module, first.op, first.origin) == (
        0, "model.layers.0.self_attn.q_proj", "functional.linear", "introduced"), result.to_text()[:1500]
    assert "parameter model.layers.0.self_attn.q_proj.weight differs" in first.cause


def test_ddp_and_fsdp2_llama_pair_every_record_but_fsdp2s_own_collectives_and_reduced_gradients(job):
    """FSDP2 on each decoder layer and the root: its all-gathers, reduce-scatters and reduced
    gradient shards have no DDP partner, and are counted as what only a sharded run makes
    (counts.sharded_only); everything else pairs, rank by rank, both ways."""
    _llama_or_skip("fsdp-")
    fsdp2_trains_like_ddp_or_skip()
    from probe import compare

    for a, b, fsdp2_only in (("ddp-mix.statistics-llama", "fsdp-mix.statistics-llama", "only_b"),
                             ("fsdp-mix.statistics-llama", "ddp-mix.statistics-llama", "only_a")):
        result = compare(job / a, job / b)
        assert result.verdict == "pass", result.to_text()[:2000]
        assert min(_paired_shares(result)) >= 0.9, (_paired_shares(result), result.counts)
        assert result.counts[fsdp2_only] == result.counts["sharded_only"] > 0, result.counts
        assert "only a sharded run makes" in result.to_text().splitlines()[0]


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_one_device_and_tensor_parallel_with_a_zero_gradient_bias_and_adamw_pass_by_rounding_where_measured(job, task):
    """A bias before a BatchNorm has a gradient of rounding noise alone; AdamW's division makes
    lr-sized updates of it, of either sign, and the runs part from there: rounding, not a bug.
    The row-parallel Linear's partial sums pair with one device's output through their
    all-reduce, and the BatchNorm's running statistics (which training mode does not read) are
    no input of its output. The GELU's input and output between the parallel Linears pair as
    the ranks' blocks merged: with tensors they are reassembled and measured, so the pass is
    by rounding only; with statistics they have no sketch (each rank sketched its block as a
    whole), their error is bounded from below only, and the headline claims no more than a
    pass."""
    if tensor_parallel_reduction_gap():
        pytest.skip(tensor_parallel_reduction_gap())
    from probe import compare

    one = _one_device_dump(job / f"one-adamwbn-{task}", f"mix.{task}", adamwbn=True)
    result = compare(one, job / f"tp-mix.{task}-adamwbn")
    assert result.verdict == "pass", result.to_text()[:2000]
    headline = result.to_text().splitlines()[0]
    if task == "tensor":
        assert headline.startswith("PASS: the runs differ by rounding only"), result.to_text()[:600]
    else:
        assert headline.startswith("PASS: ") and "rounding only" not in headline, headline
    assert _paired_share(result) >= 0.9
    linear = [row for row in result.rows if row.key_a == "2/functional.linear#0/forward/output.0"]
    assert linear and all(row.status != "only_a" for row in linear)  # its partial sums, reduced


def test_a_changed_shard_of_a_tensor_parallel_weight_is_found_at_its_linear(job, one_device):
    from probe import compare

    result = compare(one_device, job / "tp-mix.statistics-scale1")
    first = result.first_divergence
    assert result.verdict == "diverged"
    assert (first.step, first.module, first.op, first.origin) == (0, "0", "functional.linear", "introduced")
    assert "parameter 0.weight differs" in first.cause
    weights = [row for row in result.divergences if row.key_b == "0/Linear#0/forward/param.weight"]
    assert weights and weights[0].shape_b == "[16, 8]"  # the logical weight, merged


def test_fsdp2_in_bfloat16_raises_no_false_alarm_against_float32(job):
    _fsdp2_or_skip("fsdp-")
    """FSDP2 with bfloat16 parameters passes against float32 under the bfloat16 tolerance,
    with full tensors and with statistics (sketches estimate each error, k=16: +-52%). The
    reduced gradient shards and the backward reduce-scatter calls that made them are judged
    from the rank-local gradients they were made from (comparison/normalize.py)."""
    from probe import compare

    for task in ("tensor", "statistics"):
        result = compare(job / f"fsdp-mix.{task}", job / f"fsdp-mix.{task}-bf16")
        assert result.verdict == "pass", (task, result.first_divergence)
        assert not [row.key for row in result.rows if row.status == "diverged"], task


def test_a_sharded_model_warns_once_where_this_torch_is_known_not_to_capture_it(job):
    """probe.compat knows which torch versions capture sharded training only in part; an
    FSDP2 or tensor-parallel model hears so once per process (every scenario of the job runs in
    the same two rank processes), at its first start()."""
    import json

    from probe.compat import version_gaps

    for rank in (0, 1):
        caught = []
        for path in sorted(job.glob(f"*.rank{rank}.warnings.json")):
            with open(path) as found:
                caught += [text for text in json.load(found)
                           if text.startswith("TorchVersionWarning") and "FSDP2" in text]
        gap = version_gaps.sharded_capture_gap()
        assert caught == ([] if gap is None else [f"TorchVersionWarning: probe: {gap}; "
                                                  "see docs/torch-versions.md"])


def test_a_functional_collective_is_recorded_with_its_waited_result_not_its_buffer(job):
    """Tensor parallel's all_reduce (torch.ops._c10d_functional) returns before its result is
    there; the result is recorded where it is waited for, and every rank holds the same."""
    functional_collective_wait_or_skip()
    from probe.dump.reader import load

    dump = load(job / "tp-mix.statistics")
    waited = []
    for rank in (0, 1):
        rows = list(dump.records(step=0, rank=rank))
        assert not [row for row in rows if row["op"] == "ops._c10d_functional.all_reduce"
                    and row["io"] == "out"]
        waited.append([(row["min"], row["max"], row["mean"]) for row in rows
                       if row["op"].startswith("ops._c10d_functional._wrap") and row["io"] == "out"])
    assert waited[0] and waited[0] == waited[1]


def test_tensor_parallels_backward_all_reduce_of_an_input_gradient_is_recorded(job):
    """ColwiseParallel's input is replicated, so its gradient is all-reduced in backward
    (DTensor's redistribution, a functional collective): its waited result is recorded after
    the loss, and every rank holds the same."""
    functional_collective_wait_or_skip()
    from probe.dump.reader import load

    dump = load(job / "tp-api.statistics-xgrad")
    waited = []
    for rank in (0, 1):
        rows = list(dump.records(step=0, rank=rank))
        loss = max(row["seq"] for row in rows if row["op"] == "Tensor.mean")
        waited.append([(row["min"], row["max"], row["mean"]) for row in rows
                       if row["op"].startswith("ops._c10d_functional.") and row["io"] == "out"
                       and row["seq"] > loss])
    assert waited[0] and waited[0] == waited[1]


def test_tensor_dumps_of_shards_are_reassembled_and_compared_as_tensors(job, one_device_tensors):
    from probe import compare

    result = compare(one_device_tensors, job / "tp-api.tensor")
    assert result.verdict == "pass", result.first_divergence
    assert result.evidence == "tensor"
    weights = [row for row in result.rows if row.key_b == "0/functional.linear#0/forward/input.1"]
    assert weights and weights[0].shape_b == "[16, 8]" and weights[0].status == "match"


def test_a_replicated_tensor_whose_copies_differ_is_named_with_its_rank(job, one_device):
    from probe import compare

    result = compare(one_device, job / "tp-mix.statistics-replica1")
    assert "B: replicated tensor 2/Linear#0/forward/param.bias differs on rank 1 from the first copy" \
        in result.notes, result.notes


def test_a_step_one_sharded_run_lacks_is_an_error_unless_allowed(job, one_device, tmp_path):
    import shutil

    from probe import compare
    from probe.errors import CompareError

    shorter = tmp_path / "tp"
    shutil.copytree(job / "tp-mix.statistics", shorter)
    shutil.rmtree(shorter / "step2")
    with pytest.raises(CompareError, match="step 2 only in A"):
        compare(one_device, shorter)
    result = compare(one_device, shorter, allow_missing=True)
    assert result.verdict == "pass" and result.missing == ["step 2 only in A"]


@pytest.mark.parametrize("scenario", ["coll", "bwcoll"])
def test_a_collective_whose_inputs_agree_but_whose_output_differs_introduced_the_error(job, scenario):
    """Rank 1's all-reduce result is scaled inside the collective (a stand-in for a faulty
    reduction), in forward (coll) or in a gradient hook during backward (bwcoll): the first
    divergence is that collective on rank 1, named introduced."""
    from probe import compare
    from probe.compat import uncaptured_collectives

    if "all_reduce" in uncaptured_collectives():
        pytest.skip("this torch runs dist.all_reduce without asking a TorchFunctionMode")
    assert compare(job / f"{scenario}-api.statistics", job / f"{scenario}-api.statistics").verdict == "pass"
    result = compare(job / f"{scenario}-api.statistics", job / f"{scenario}-api.statistics-fault1")
    first = result.first_divergence
    assert result.verdict == "diverged"
    assert (first.step, first.rank, first.op, first.origin) == (0, 1, "distributed.all_reduce", "introduced")
    assert first.key_a == "/distributed.all_reduce#0/forward/output.0"


def test_fsdp2_backward_collectives_are_recorded_under_the_module_they_reduce(job):
    """FSDP2 re-gathers a module's parameters for backward (reshard_after_forward=True) and
    reduce-scatters its gradients, both inside autograd's backward: each is recorded after
    the loss, named after the module whose parameters it moves."""
    _fsdp2_or_skip("fsdp-")
    from probe.compat import uncaptured_collectives
    from probe.dump.reader import load

    if {"reduce_scatter_tensor", "all_gather_into_tensor"} & set(uncaptured_collectives()):
        pytest.skip("this torch runs FSDP2's collectives without asking a TorchFunctionMode")
    reduced = {("0", "distributed.reduce_scatter_single", 0), ("2", "distributed.reduce_scatter_single", 0)}
    regathered = {("0", "distributed.all_gather_single", 1), ("2", "distributed.all_gather_single", 1)}
    for folder, expected in (("fsdp-api.statistics", reduced | regathered),
                             ("fsdp-mix.tensor-keep", reduced)):
        rows = list(load(job / folder).records(step=1, rank=1))
        loss = max(row["seq"] for row in rows if row["op"] == "Tensor.mean")
        in_backward = {(row["module"], row["op"], row["index"]) for row in rows
                       if row["op"].startswith("distributed.") and row["slot"] == "output.0"
                       and row["seq"] > loss}
        assert in_backward == expected, (folder, in_backward)


def test_row_shards_of_a_tensor_parallel_weight_merge_into_the_one_device_sketch(job, one_device):
    """ColwiseParallel splits the first weight by rows, RowwiseParallel the second by columns
    (a block strided in the flat index): each rank sketches its shard with the projection
    entries of their logical positions, and the sum is the one-device sketch."""
    import numpy as np

    from probe.comparison.records import Records
    from probe.comparison.shards import merge_ranks
    from probe.dump.reader import load

    def weight_sketch(records):
        row = records.columns["key"].index("0/Linear#0/forward/param.weight")
        return records.row(row)["sketch"]

    def step_records(folder, rank):
        with load(folder).open(0, rank) as step:
            return Records.from_table(step.records)

    merged = merge_ranks({rank: step_records(job / "tp-mix.statistics", rank) for rank in (0, 1)})
    expected = np.asarray(weight_sketch(step_records(one_device, 0)))
    assert np.allclose(weight_sketch(merged.views[1]), expected, rtol=1e-5,
                       atol=1e-5 * np.abs(expected).max())
    by_rank = {rank: step_records(job / "tp-mix.statistics", rank) for rank in (0, 1)}
    logical, one = merge_ranks(by_rank).views[0], step_records(one_device, 0)
    for columns in ("2/Linear#0/forward/param.weight", "2/Linear#0/backward/param_grad.weight"):
        for records in by_rank.values():  # RowwiseParallel: Shard(1) of [4, 16]
            row = records.row(records.columns["key"].index(columns))
            assert '"S(1)"' in row["placement"] and row["shape"] == "[4, 8]"
            assert np.isfinite(row["sketch"]).all()  # a missing sketch reads as NaN
        found = logical.row(logical.columns["key"].index(columns))["sketch"]
        expected = np.asarray(one.row(one.columns["key"].index(columns))["sketch"])
        assert found is not None and np.allclose(found, expected, rtol=1e-5,
                                                 atol=1e-5 * np.abs(expected).max())


def test_the_fsdp2_example_passes_against_ddp_and_names_the_bug_rank(job):
    fsdp2_trains_like_ddp_or_skip()
    from probe import compare

    against_ddp = compare(job / "example-fsdp2-ddp", job / "example-fsdp2")
    assert against_ddp.verdict == "pass", against_ddp.first_divergence
    assert any("merged" in note and "2 shards" in note for note in against_ddp.notes)
    bug = compare(job / "example-fsdp2", job / "example-fsdp2-bug1")
    first = bug.first_divergence
    assert (bug.verdict, first.rank, first.module, first.op, first.origin) == (
        "diverged", 1, "1", "functional.gelu", "introduced")


def test_the_tensor_parallel_example_passes_against_one_device_and_finds_the_scaled_shard(
        job, tmp_path):
    from examples.distributed import train_tp
    from probe import compare

    one = tmp_path / "one"
    train_tp.run(train_tp.parse(["--one-device", "--dump", str(one), "--steps", "1"]))
    clean = compare(one, job / "example-tp")
    assert clean.verdict == "pass", clean.first_divergence
    bug = compare(one, job / "example-tp-bug1")
    first = bug.first_divergence
    assert (bug.verdict, first.module, first.op, first.origin) == (
        "diverged", "0", "functional.linear", "introduced")
    assert "parameter 0.weight differs" in first.cause
