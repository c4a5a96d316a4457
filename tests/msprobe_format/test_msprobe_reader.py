"""Reading msprobe dumps (stored, made by mindstudio-probe 26.2.0) as probe's records."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import DATA, stored
from probe.cli import main
from probe.dump import formats, msprobe_layout
from probe.dump.msprobe import MsprobeDump
from probe.errors import DumpFormatError


def records(name: str, step: int = 0, rank: int = 0) -> list[dict]:
    with formats.load(stored(name)).open(step, rank) as step_file:
        return step_file.records.to_dicts()


def by_key(rows: list[dict]) -> dict:
    return {row["key"]: row for row in rows}


def copy(name: str, tmp_path) -> str:
    target = tmp_path / name
    shutil.copytree(stored(name), target)
    return str(target)


def edit_dump_json(folder: str, change) -> None:
    path = os.path.join(folder, "dump.json")
    with open(path) as handle:
        loaded = json.load(handle)
    change(loaded["data"])
    with open(path, "w") as handle:
        json.dump(loaded, handle, indent=1)


def test_an_msprobe_dump_is_found_by_its_folders_at_any_depth():
    root = stored("mlp_a")
    assert formats.load(root).steps == [0, 1]
    for path in (os.path.join(root, "step1"), os.path.join(root, "step1", "proc0"),
                 os.path.join(root, "step1", "proc0", "dump.json")):
        assert isinstance(formats.load(path), MsprobeDump)
        assert list(formats.load(path).files) == [(1, 0)]
    ranks = formats.load(stored("mlp_ranks"))
    assert (ranks.steps, ranks.ranks) == ([0], [0, 1])


def test_a_probe_dump_is_never_taken_for_an_msprobe_dump():
    gpu_dumps = os.path.join(os.path.dirname(DATA), "gpu_dumps")
    probe_root = os.path.join(gpu_dumps, sorted(os.listdir(gpu_dumps))[0])
    assert not msprobe_layout.is_msprobe_dump(probe_root)
    assert not isinstance(formats.load(probe_root), MsprobeDump)


def test_two_process_folders_of_one_step_are_refused_naming_both(tmp_path):
    root = copy("mlp_l1", tmp_path)
    shutil.copytree(os.path.join(root, "step0", "proc0"), os.path.join(root, "step0", "proc7"))
    with pytest.raises(DumpFormatError, match="proc0, proc7.*name the one to read"):
        formats.load(root)


def test_records_are_named_by_module_op_index_phase_and_slot():
    rows = by_key(records("mlp_a"))
    expected = {
        "fc1/functional.linear#0/forward/input.1": "api",
        "fc2/functional.linear#0/forward/output.0": "api",
        "fc1/Linear#0/forward/input.0": "module",
        "fc1/Linear#0/forward/param.weight": "param",
        "fc2/Linear#0/backward/param_grad.weight": "param",
        "fc2/Linear#0/backward/grad_output.0": "module",
        "fc2/Linear#0/backward/grad_input.0": "module",
        "fc2/functional.linear#0/backward/grad_output.0": "api",
        "fc2/functional.linear#0/backward/grad_node.1": "api",
        "/functional.cross_entropy#0/forward/output.0": "api",
        "/Tensor.add_#3/forward/output.0": "api",
        "act/functional.relu#0/forward/kwarg.inplace": "api",
    }
    assert {key: rows[key]["kind"] for key in expected} == expected
    assert rows["act/functional.relu#0/forward/kwarg.inplace"]["value"] == "false"
    assert rows["fc1/Linear#0/forward/param.weight"]["io"] == "in"
    assert rows["fc2/functional.linear#0/backward/grad_node.1"]["io"] == "out"


def test_a_module_call_brackets_its_inner_calls_in_execution_order():
    seq = {key: row["seq"] for key, row in by_key(records("mlp_a")).items()}
    assert seq["fc1/Linear#0/forward/input.0"] < seq["fc1/functional.linear#0/forward/output.0"] \
        < seq["fc1/Linear#0/forward/output.0"] < seq["act/ReLU#0/forward/input.0"]
    assert seq["fc2/Linear#0/backward/grad_output.0"] < seq["fc2/functional.linear#0/backward/grad_node.1"] \
        < seq["fc2/Linear#0/backward/grad_input.0"]


def test_level_l1_counts_each_op_over_the_step_and_backward_takes_its_forward_index():
    keys = set(by_key(records("mlp_l1")))
    assert {"/functional.linear#0/forward/output.0", "/functional.linear#1/forward/output.0",
            "/functional.linear#1/backward/grad_node.1", "/functional.linear#0/backward/grad_node.0"} <= keys


def test_counters_msprobe_carries_over_steps_are_renumbered_per_step(tmp_path):
    root = copy("mlp_a", tmp_path)

    def carried(data):  # what msprobe writes when a counter is not reset at step(): step 1 goes on from step 0
        for name in list(data):
            if ".parameters_grad." in name:
                data[name.replace(".parameters_grad.0", ".parameters_grad.1")] = data.pop(name)
    edit_dump_json(os.path.join(root, "step1", "proc0"), carried)
    step1 = by_key(records_of(root, 1))
    assert "fc2/Linear#0/backward/param_grad.weight" in step1
    assert {key for key in step1 if "param_grad" in key} == {key for key in by_key(records("mlp_a", 1))
                                                            if "param_grad" in key}


def records_of(root: str, step: int) -> list[dict]:
    with formats.load(root).open(step, 0) as step_file:
        return step_file.records.to_dicts()


def test_a_null_statistic_is_unknown_not_zero():
    target = by_key(records("mlp_a"))["/functional.cross_entropy#0/forward/input.1"]  # int64 labels
    assert target["dtype"] == "int64" and math.isnan(target["mean"]) and math.isnan(target["norm"])
    assert target["min"] >= 0 and target["max"] >= target["min"]
    doubled = by_key(records("mlp_nonfinite"))["/torch.mul#0/forward/output.0"]  # float64
    assert doubled["dtype"] == "float64" and (doubled["min"], doubled["max"]) == (2.0, 2.0)
    assert math.isnan(doubled["mean"]) and math.isnan(doubled["norm"])


def test_bare_nan_and_infinity_tokens_are_read_as_present_or_absent():
    rows = by_key(records("mlp_nonfinite"))
    log = rows["/torch.log#0/forward/output.0"]
    assert log["min"] == -math.inf and (log["nan_count"], log["inf_count"]) == (0, 1)
    divided = rows["/torch.div#0/forward/output.0"]
    assert math.isnan(divided["max"]) and divided["nan_count"] == 1
    assert all(row["nan_count"] == row["inf_count"] == 0 for key, row in rows.items()
               if "linear" in key and row["dtype"])


def test_the_norm_of_a_negative_scalar_is_its_absolute_value(tmp_path):
    root = copy("mlp_l1", tmp_path)

    def negative_loss(data):  # msprobe's Max, Min, Mean and Norm of a 0-d tensor are all its value
        leaf = data["Functional.cross_entropy.0.forward"]["output"][0]
        leaf.update({name: -leaf[name] for name in ("Max", "Min", "Mean", "Norm")})
    edit_dump_json(os.path.join(root, "step0", "proc0"), negative_loss)
    loss = by_key(records_of(root, 0))["/functional.cross_entropy#0/forward/output.0"]
    assert loss["min"] < 0 and loss["norm"] == -loss["min"]


def test_checksums_say_which_kind_they_are():
    checksums = {row["checksum"] for row in records("mlp_md5") if row["checksum"]}
    assert len(checksums) > 10
    assert all(text.startswith("crc32:") and len(text) == len("crc32:") + 8 for text in checksums)


def test_the_checksum_of_an_in_place_calls_input_is_dropped_and_its_statistics_kept():
    rows = by_key(records("mlp_md5"))
    written = rows["/Tensor.add_#0/forward/input.0"]  # the optimizer's update of fc1.weight
    assert written["checksum"] == "" and math.isfinite(written["norm"])
    assert rows["/functional.linear#0/forward/input.1"]["checksum"].startswith("crc32:")  # the same weight, read


def test_tensor_files_are_read_as_numpy_arrays_matching_their_records():
    with formats.load(stored("mlp_tensor_a")).open(0, 0) as step_file:
        assert step_file.tensor_count == 8
        for row in step_file.records.to_dicts():
            values = step_file.tensor(row["tensor_id"])
            assert list(values.shape) == json.loads(row["shape"])
            assert (float(values.min()), float(values.max())) == pytest.approx((row["min"], row["max"]))


class _RunsCode:
    """Pickles into a call that creates a file: what loading a .pt with full unpickling would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_tensor_file_holding_more_than_a_tensor_is_refused_and_never_run(tmp_path):
    import torch

    root = copy("mlp_tensor_a", tmp_path)
    folder = os.path.join(root, "step0", "proc0", "dump_tensor_data")
    marker = tmp_path / "ran"
    torch.save(_RunsCode(str(marker)), os.path.join(folder, "Functional.linear.0.forward.input.0.pt"))
    np.save(os.path.join(folder, "Functional.linear.0.forward.input.1.npy"), np.array([{"a": 1}], dtype=object),
            allow_pickle=True)
    edit_dump_json(os.path.join(root, "step0", "proc0"), lambda data: data["Functional.linear.0.forward"][
        "input_args"][1].update(data_name="Functional.linear.0.forward.input.1.npy"))
    with formats.load(root).open(0, 0) as step_file:
        ids = {row["key"]: row["tensor_id"] for row in step_file.records.to_dicts()}
        with pytest.raises(DumpFormatError, match="refused .*weights_only"):
            step_file.tensor(ids["/functional.linear#0/forward/input.0"])
        with pytest.raises(DumpFormatError, match="refused .*unpickling"):
            step_file.tensor(ids["/functional.linear#0/forward/input.1"])
    assert not marker.exists()


def test_inspect_lists_an_msprobe_dump(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["inspect", stored("mlp_a"), "--step", "0", "--key", "fc1"])
    out = capsys.readouterr().out
    assert exited.value.code == 0
    assert "format msprobe  task statistics  level mix" in out
    assert "fc1/functional.linear#0/forward/output.0" in out


def test_a_compare_of_statistics_never_imports_torch():
    code = ("import sys; from probe.comparison.api import compare; "
            f"result = compare({stored('mlp_a')!r}, {stored('mlp_b')!r}); "
            "print(result.verdict, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["pass", "False"], done.stderr


def test_msprobe_names_become_the_op_names_probes_capture_gives():
    from probe.dump.msprobe_names import parse

    ops = {name: parse(name).op for name in (
        "Functional.linear.3.forward", "Functional.conv2d.0.forward", "Tensor.__rmul__.1.backward",
        "Tensor.__iadd__.0.forward", "Torch.matmul.2.forward", "Distributed.all_reduce.0.forward")}
    assert ops == {"Functional.linear.3.forward": "functional.linear", "Functional.conv2d.0.forward": "torch.conv2d",
                   "Tensor.__rmul__.1.backward": "Tensor.mul", "Tensor.__iadd__.0.forward": "Tensor.add_",
                   "Torch.matmul.2.forward": "torch.matmul", "Distributed.all_reduce.0.forward": "distributed.all_reduce"}
    module = parse("Module.blocks.0.attn.CausalSelfAttention.backward.1")
    assert (module.kind, module.path, module.op, module.phase, module.count) == (
        "module", "blocks.0.attn", "CausalSelfAttention", "backward", 1)
    grads = parse("Module.fc.Linear.parameters_grad.7")
    assert (grads.kind, grads.path, grads.phase) == ("param_grad", "fc", "backward")
    assert parse("optimizer") is None and parse("Module.fc.Linear.forward.x") is None
