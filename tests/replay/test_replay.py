"""Replay against float64 (probe.replay, ``probe compare --replay``): which side is right.

Real dumps of tiny real models (task "tensor") in tmp folders; the sides of
tests/scripts/replay_side.py are dumped in this process, except its "npu" kernel override, which
torch.library cannot undo in the process that made it: that side runs in a process of its own.
"""

import contextlib
import json
import os
import runpy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import probe
from examples.models import MLP, DeepMLP, SmallConvNet, TinyGPT, make_batch, train_step
from probe import PrecisionDebugger, seed_all
from probe.cli import main as cli
from probe.dump.reader import open_step_file
from probe.perturb import other_rounding
from probe.replay.calls import Record, StepSource, decode_value, epsilon
from probe.replay.execute import replay_call
from probe.replay import replay_result
from probe.replay.ops import NotReplayable, check_random, resolve

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIDE_SCRIPT = os.path.join(REPO, "tests", "scripts", "replay_side.py")
OPTIMIZER_OPS = {"Tensor.add_", "Tensor.mul_", "Tensor.lerp_", "Tensor.addcmul_", "Tensor.sqrt", "Tensor.div",
                 "Tensor.addcdiv_", "torch._foreach_add_", "torch._foreach_mul_", "torch._foreach_lerp_",
                 "torch._foreach_addcmul_", "torch._foreach_sqrt", "torch._foreach_div_", "torch._foreach_addcdiv_"}


def _dump(path, model, batch, level="api", optimizer=None, threads=None):
    x, y = batch
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        debugger = PrecisionDebugger({"task": "tensor", "dump_path": str(path), "level": level, "step": [0]})
        debugger.start(model)
        train_step(model, optimizer, x, y)
        debugger.stop()
        debugger.step()
        debugger.close()
    finally:
        torch.set_num_threads(before)
    return str(path)


def _side(path, kind):
    if kind != "npu":
        runpy.run_path(SIDE_SCRIPT)["main"](str(path), kind)
        return str(path)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, SIDE_SCRIPT, str(path), kind], check=True, env=env, cwd=REPO,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return str(path)


class _Attention(nn.Module):
    """The tests' MultiheadAttention and Tanh, in one model."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.act = nn.Tanh()
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        y, _ = self.mha(x, x, x)
        return self.head(self.act(y).mean(1))


def _calls(step_file):
    """(prefix, kind, op, phase) of every call in a step file, first call of each (kind, op, phase)."""
    with open_step_file(step_file) as handle:
        rows = handle.records.to_dicts()
    seen, calls = set(), []
    for row in rows:
        prefix = row["key"][: len(row["key"]) - len(row["slot"])]
        kind = "api" if row["kind"] == "api" else row["kind"]
        ident = (kind, row["op"], row["phase"])
        if kind == "param" or ident in seen:
            continue
        seen.add(ident)
        calls.append((prefix, kind, row["op"], row["phase"]))
    return calls


@pytest.fixture(scope="module")
def example_dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    seed_all(0)
    mlp = MLP(64, 32, 10)
    cases = {
        "mlp": (mlp, make_batch("mlp", 4, in_features=64, out_features=10),
                torch.optim.AdamW(mlp.parameters(), lr=1e-3, foreach=True)),
        "convnet": (SmallConvNet(), make_batch("convnet", 2), None),
        "deepmlp": (DeepMLP(in_features=32, width=32, depth=2, out_features=10),
                    make_batch("deepmlp", 4, in_features=32, out_features=10), None),
        "gpt": (TinyGPT(vocab=50, d_model=32, n_layers=1, n_heads=2, max_len=8),
                make_batch("gpt", 2, vocab=50, max_len=8), None),
        "attention": (_Attention(), (torch.randn(2, 5, 16), torch.randint(0, 10, (2,))), None),
    }
    return {name: _dump(root / name, model, batch, optimizer=optimizer) + "/step0/rank0.h5"
            for name, (model, batch, optimizer) in cases.items()}


def test_every_op_kind_of_the_example_models_replays_forward_and_backward_on_its_own_inputs_within_a_few_ulps(
        example_dumps):
    replayed, refused = {}, {}
    for name, step_file in example_dumps.items():
        source = StepSource(step_file)
        try:
            for prefix, kind, op, phase in _calls(step_file):
                try:
                    side = replay_call(source, prefix, kind, op, phase)
                except NotReplayable as reason:
                    refused[(op, phase)] = str(reason)
                    continue
                replayed[(op, phase)] = max(side.excess, replayed.get((op, phase), 0.0))
                # a side replayed on its own inputs: its error is rounding, a few ulps at most
                assert side.excess <= 2.0, (name, op, phase, side)
                if side.noise <= 4 * epsilon(side.dtype):  # well conditioned: a few ulps
                    assert side.ulp <= 4.0, (name, op, phase, side)
        finally:
            source.close()
    expected = {
        "functional.linear", "torch.conv2d", "functional.batch_norm", "functional.relu", "functional.max_pool2d",
        "torch.flatten", "Tensor.reshape", "functional.cross_entropy", "functional.layer_norm", "functional.gelu",
        "Tensor.add", "functional.embedding", "functional.scaled_dot_product_attention", "Tensor.split",
        "Tensor.view", "Tensor.transpose", "functional.multi_head_attention_forward", "torch.tanh", "Tensor.mean",
    }
    for op in expected:
        assert (op, "forward") in replayed, op
        assert (op, "backward") in replayed, op
    optimizer = {op for op, phase in replayed if op in OPTIMIZER_OPS}
    assert {"Tensor.addcdiv_", "Tensor.lerp_", "Tensor.sqrt", "torch._foreach_addcdiv_", "torch._foreach_lerp_"} <= optimizer
    # the only api calls refused are random ones, and backward records of identity-like calls
    # (dropout with p=0) that hold no gradient to check
    assert all(reason.startswith(("random op", "no saved outputs")) for reason in refused.values()), refused
    assert ("functional.dropout", "forward") in replayed  # TinyGPT's dropout has p=0: the identity


def test_module_level_linear_and_activations_are_rebuilt_from_dumped_parameters_others_say_why_not(tmp_path):
    seed_all(0)
    step_file = _dump(tmp_path / "mix", MLP(16, 8, 4), make_batch("mlp", 4, in_features=16, out_features=4),
                      level="mix") + "/step0/rank0.h5"
    source = StepSource(step_file)
    try:
        linear = replay_call(source, "fc1/Linear#0/forward/", "module", "Linear", "forward")
        assert linear.ulp <= 4 and linear.excess <= 2
        relu = replay_call(source, "act/ReLU#0/forward/", "module", "ReLU", "forward")
        assert relu.error == 0.0
        with pytest.raises(NotReplayable, match="random op"):
            replay_call(source, "drop/Dropout#0/forward/", "module", "Dropout", "forward")
        with pytest.raises(NotReplayable, match="constructor arguments"):
            replay_call(source, "/MLP#0/forward/", "module", "MLP", "forward")
        with pytest.raises(NotReplayable, match="module-level backward"):
            replay_call(source, "fc1/Linear#0/backward/", "module", "Linear", "backward")
    finally:
        source.close()


@pytest.fixture(scope="module")
def other_order_dumps(tmp_path_factory):
    """The same step, the second time with its reductions summed in another order (what 1
    against 2 threads does on some CPUs and not on others; other_rounding does it always)."""
    root = tmp_path_factory.mktemp("order")
    dumps = []
    for name, order in (("plain", contextlib.nullcontext), ("other", other_rounding)):
        seed_all(0)
        model = SmallConvNet()
        with order():
            dumps.append(_dump(root / name, model, make_batch("convnet", 8)))
    return dumps


def test_conv_bn_adamw_in_another_summation_order_every_replayed_optimizer_op_is_rounding_with_its_amplification(
        other_order_dumps):
    result = probe.compare(*other_order_dumps, replay=40)
    # the summation order changes rounding only; AdamW amplifies it, and compare accepts that
    assert not result.diverged, result.to_text()
    assert any(row.metrics and (row.metrics.rel_l2 or 0) > 0 for row in result.rows)
    ranked = [call for call in result.replay.calls if call["op"] in OPTIMIZER_OPS]
    assert ranked, [call["call"] for call in result.replay.calls]
    # and every optimizer call whose output differs at all, ranked or not
    differing = sorted({(row.step, row.rank, row.key_a) for row in result.rows
                        if row.op in OPTIMIZER_OPS and row.io == "out" and row.key_a and row.metrics
                        and (row.metrics.rel_l2 or 0) > 0})
    calls = replay_result(result, count=40, calls=differing).calls
    optimizer = [call for call in calls if call["op"] in OPTIMIZER_OPS]
    # how many parameters differ depends on which kernels the CPU splits over threads; each one
    # that does runs AdamW's whole chain
    assert {"Tensor.lerp_", "Tensor.sqrt", "Tensor.addcdiv_"} <= {c["op"] for c in optimizer}
    for call in optimizer:
        verdict = call["replay"]
        assert verdict["verdict"] == "rounding", call
        assert verdict["ulp_a"] <= 4 and verdict["ulp_b"] <= 4, call
        assert verdict["rounding"] in ("inherited", "amplified") and verdict["amplification"] > 0, call
        assert f"x{verdict['amplification']:.3g}" in verdict["summary"]
    # nothing in a change of summation order is a wrong kernel
    assert not [call for call in calls if call["replay"]["verdict"].startswith("introduced")], calls
    assert result.to_text().startswith("PASS")


@pytest.fixture(scope="module")
def npu_dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("npu")
    return _side(root / "a", "fp32"), _side(root / "b", "npu")


def test_a_wrong_kernel_on_b_is_introduced_by_b_with_its_ulps_and_a_closer(npu_dumps):
    result = probe.compare(*npu_dumps, replay=5)
    first = result.first_divergence
    assert first.op == "functional.linear" and first.module == "fc1" and first.phase == "forward"
    verdict = result.replay.verdict_for(first.step, first.rank, first.key_a)
    assert verdict["verdict"] == "introduced by B"
    assert verdict["closer"] == "A"
    assert verdict["ulp_a"] <= 4
    assert 1e3 < verdict["ulp_b"] < 1e5  # bfloat16 rounding counted in float32 ulps: ~2^14
    assert verdict["dtype_b"] == "float32"  # the kernel claims float32
    # fc2's input differs (fc1's output did), yet replay sees fc2's own kernel err too
    fc2 = [c for c in result.replay.calls if c["module"] == "fc2" and c["phase"] == "forward"]
    assert fc2 and fc2[0]["replay"]["verdict"] == "introduced by B"


def _cli(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        cli(argv)
    out, err = capsys.readouterr()
    return raised.value.code, out, err


def test_cli_replay_shows_verdicts_in_headline_json_csv_html_and_progress_on_stderr(npu_dumps, tmp_path, capsys):
    csv_path, html_path = tmp_path / "rows.csv", tmp_path / "report.html"
    code, stdout, stderr = _cli(["compare", *npu_dumps, "--replay", "3", "--json", "--csv", str(csv_path),
                                 "--html", str(html_path)], capsys)
    assert code == 1, stderr
    data = json.loads(stdout)
    replay = data["first_divergence"]["replay"]
    assert list(replay)[:6] == ["verdict", "error_a", "error_b", "ulp_a", "ulp_b", "closer"]
    assert replay["verdict"] == "introduced by B" and replay["closer"] == "A"
    assert "[replay: introduced by B" in data["headline"]
    assert all(entry["replay"] is None or entry["replay"]["verdict"] for entry in data["top_ops"])
    assert data["replay"]["replayed"] >= 1 and data["replay"]["left"] == []
    assert "probe: replay 1/" in stderr and "introduced by B" in stderr
    header, *rows = csv_path.read_text().splitlines()
    assert "replay_verdict" in header.split(",")
    assert any("introduced by B" in row for row in rows)
    page = html_path.read_text()
    assert "Which side is right?" in page and "introduced by B" in page
    # the terminal report: headline and section
    text = _cli(["compare", *npu_dumps, "--replay"], capsys)[1]
    assert text.splitlines()[0].endswith("A is closer)]")
    assert "which side is right?" in text


def test_bf16_autocast_vs_fp32_first_op_beyond_tolerance_replays_as_precision_with_its_ulps(tmp_path):
    a, b = _side(tmp_path / "fp32", "gpt32"), _side(tmp_path / "bf16", "bf16")
    result = probe.compare(a, b, tol=["bfloat16=1e-3,1e-5"], replay=3)
    first = result.first_divergence
    assert first is not None and first.dtype_b == "bfloat16"
    verdict = result.replay.verdict_for(first.step, first.rank, first.key_a)
    assert verdict["verdict"] == "precision" and verdict["lower"] == "B"
    assert verdict["dtype_b"] == "bfloat16" and verdict["ulp_b"] <= 1.0  # within bf16 rounding
    assert verdict["closer"] == "A"
    assert "precision: B rounds to bfloat16" in result.to_text().splitlines()[0]


def test_replay_stops_at_its_budget_and_says_what_was_left(other_order_dumps):
    result = probe.compare(*other_order_dumps, replay=5, replay_budget=1e-9)
    assert result.replay.calls == [] and result.replay.left
    assert any("budget" in note and "not replayed" in note for note in result.notes)


def test_replay_overrides_the_statistics_origin_and_says_so(npu_dumps):
    plain = probe.compare(*npu_dumps)
    replayed = probe.compare(*npu_dumps, replay=5)
    fc2_plain = [op for op in plain.top_ops if op.module == "fc2" and op.phase == "forward"]
    fc2 = [op for op in replayed.top_ops if op.module == "fc2" and op.phase == "forward"]
    assert fc2 and fc2[0].origin == "introduced"
    if fc2_plain and fc2_plain[0].origin != "introduced":
        assert any("replay overrides the statistics-based origin" in note for note in replayed.notes)


def test_statistics_dumps_are_not_replayable_for_lack_of_saved_inputs(tmp_path):
    dumps = []
    for threads in (1, 2):
        seed_all(0)
        model = SmallConvNet()
        path = tmp_path / f"s{threads}"
        torch.set_num_threads(threads)
        try:
            debugger = PrecisionDebugger({"task": "statistics", "dump_path": str(path), "level": "api", "step": [0]})
            debugger.start(model)
            train_step(model, torch.optim.AdamW(model.parameters()), *make_batch("convnet", 4))
            debugger.stop()
            debugger.step()
            debugger.close()
        finally:
            torch.set_num_threads(1)
        dumps.append(str(path))
    result = probe.compare(*dumps, replay=2)
    if result.replay.calls:
        assert all(call["replay"]["verdict"] == "not replayable" and "no saved inputs" in call["replay"]["reason"]
                   for call in result.replay.calls)
    assert any("task 'tensor'" in note for note in result.notes)


def test_op_names_resolve_in_place_out_of_place_and_refuse_random_collective_unknown():
    assert resolve("Tensor.add_") is torch.Tensor.add
    assert resolve("Tensor.__iadd__") is torch.Tensor.__add__
    assert resolve("torch._foreach_mul_") is torch._foreach_mul
    assert resolve("functional.gelu") is torch.nn.functional.gelu
    assert resolve("torch.conv2d") is torch.conv2d
    for op, reason in (("Tensor.bernoulli_", "random op"), ("torch.randn_like", "random op"),
                       ("distributed.all_reduce", "collective"), ("mylib.kernel", "unknown function"),
                       ("torch.no_such_op", "unknown function")):
        with pytest.raises(NotReplayable, match=reason):
            resolve(op)
    # dropout draws only in training with p > 0; in eval mode it is the identity and replays
    x = torch.ones(3)
    with pytest.raises(NotReplayable, match="random op: functional.dropout with p=0.1"):
        check_random("functional.dropout", (x, 0.1), {"training": True})
    check_random("functional.dropout", (x, 0.1), {"training": False})
    check_random("functional.scaled_dot_product_attention", (x, x, x), {"dropout_p": 0.0})
    with pytest.raises(NotReplayable, match="dropout_p=0.2"):
        check_random("functional.scaled_dot_product_attention", (x, x, x, None, 0.2), {})


def test_capture_records_what_a_non_tensor_argument_was_and_replay_rebuilds_it(tmp_path):
    debugger = PrecisionDebugger({"task": "tensor", "dump_path": str(tmp_path), "level": "api", "step": [0]})
    debugger.start()
    x = torch.arange(6.0).reshape(2, 3)
    x.to(torch.bfloat16)
    torch.zeros(2, dtype=torch.float16, device=torch.device("cpu"))
    x[:, 1:]
    x.masked_fill(x > 2, float("-inf"))
    y = x.clone()
    y[0, 1:] = 7.0
    debugger.stop()
    debugger.step()
    debugger.close()
    with open_step_file(tmp_path / "step0" / "rank0.h5") as handle:
        assert handle.schema_version == 2
        rows = {row["key"]: row for row in handle.records.to_dicts()}
    assert rows["/Tensor.to#0/forward/input.1"]["value_type"] == "dtype"
    assert rows["/torch.zeros#0/forward/kwarg.device"]["value_type"] == "device"
    assert rows["/Tensor.__getitem__#0/forward/input.1.1"]["value_type"] == "slice"
    assert rows["/Tensor.masked_fill#0/forward/input.2"]["value_type"] == ""

    def value(key, typed=True):
        row = rows[key]
        return decode_value(Record(row["slot"], row["io"], row["kind"], "", "", row["value"], row["value_type"], -1), typed)

    assert value("/Tensor.to#0/forward/input.1") is torch.bfloat16
    assert value("/Tensor.__getitem__#0/forward/input.1.1") == slice(1, None, None)
    assert value("/Tensor.masked_fill#0/forward/input.2") == float("-inf")
    # a GPU run's device, even given as a string, replays on the CPU
    assert decode_value(Record("kwarg.device", "in", "api", "", "", '"cuda:0"', "", -1), True) == torch.device("cpu")
    # a schema-1 record has no value_type: a dtype name is still read as a dtype
    assert value("/Tensor.to#0/forward/input.1", typed=False) is torch.bfloat16
    source = StepSource(str(tmp_path / "step0" / "rank0.h5"))
    try:
        for prefix, op in (("/Tensor.to#0/forward/", "Tensor.to"), ("/Tensor.__getitem__#0/forward/", "Tensor.__getitem__"),
                           ("/Tensor.masked_fill#0/forward/", "Tensor.masked_fill"),
                           ("/Tensor.__setitem__#0/forward/", "Tensor.__setitem__")):
            side = replay_call(source, prefix, "api", op, "forward")
            assert side.ulp <= 0.5, (op, side)
    finally:
        source.close()


def test_schema_1_dumps_still_compare_and_replay_says_what_it_lacks():
    data = os.path.join(REPO, "tests", "data", "gpu_dumps")
    result = probe.compare(os.path.join(data, "conv_cpu"), os.path.join(data, "conv_gpu"), replay=3)
    assert result.evidence == "statistics"  # real H100/CPU dumps of schema 1, task statistics
    assert any("replay needs full tensors" in note for note in result.notes)
    for call in result.replay.calls:
        assert call["replay"]["verdict"] == "not replayable" and "no saved inputs" in call["replay"]["reason"]


def test_a_schema_1_tensor_dump_without_value_types_replays_with_dtypes_read_by_name(npu_dumps, tmp_path):
    import shutil

    import h5py

    old = tmp_path / "old"
    shutil.copytree(npu_dumps[0], old)
    with h5py.File(old / "step0" / "rank0.h5", "r+") as handle:  # what a schema-1 writer left
        handle.attrs["schema_version"] = 1
        del handle["records"]["value_type"]
    result = probe.compare(str(old), npu_dumps[1], replay=2)
    first = result.first_divergence
    assert result.replay.verdict_for(first.step, first.rank, first.key_a)["verdict"] == "introduced by B"


def test_without_replay_reports_have_no_replay_fields_and_bad_replay_arguments_are_refused(npu_dumps, capsys):
    data = json.loads(probe.compare(*npu_dumps).to_json())
    assert "replay" not in data and "replay" not in data["first_divergence"]
    assert all("replay" not in entry for entry in data["top_ops"])
    with pytest.raises(probe.ProbeError, match="replay must be an integer >= 0"):
        probe.compare(*npu_dumps, replay=-1)
    with pytest.raises(probe.ProbeError, match="replay_budget must be a number of seconds > 0"):
        probe.compare(*npu_dumps, replay=1, replay_budget=0)
    code, _, err = _cli(["compare", *npu_dumps, "--replay", "--replay-budget", "0"], capsys)
    assert code == 2 and "--replay-budget" in err


def test_replay_is_a_flag_that_never_eats_a_path_and_its_count_is_its_own_option(npu_dumps, capsys):
    """`--replay A B` replays A against B; `--replay-top N` sets the count; the older
    `A B --replay N` still means N."""
    code, out, err = _cli(["compare", "--replay", *npu_dumps, "--json"], capsys)
    assert code == 1, err
    assert json.loads(out)["replay"]["replayed"] >= 1
    calls = {}
    for argv in (["--replay-top", "0", *npu_dumps], [*npu_dumps, "--replay", "0"], [*npu_dumps, "--replay=0"],
                 ["--replay", "--replay-top", "0", *npu_dumps]):
        code, out, err = _cli(["compare", *argv, "--json"], capsys)
        assert code == 1, (argv, err)
        calls[tuple(argv)] = [call["call"] for call in json.loads(out)["replay"]["calls"]]
    assert len(set(map(tuple, calls.values()))) == 1, calls
    help_text = _cli(["compare", "--help"], capsys)[1]
    assert "--replay-top N" in help_text and "--replay --replay-top 50" in help_text
