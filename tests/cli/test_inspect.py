"""probe inspect: summaries, record tables, filters, --json, incomplete steps, clean errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from probe.cli import main
from probe.dump.reader import load as probe_load
from probe.dump import schema
from scripts_dump.bad_dumps import BAD_DUMPS
from scripts_dump.dumpkit import make_row, write_step

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exited:
        main(["inspect", *map(str, args)])
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def run_subprocess(*args):
    return subprocess.run([sys.executable, "-m", "probe.cli", "inspect", *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture()
def dump(tmp_path):
    root = tmp_path / "dump"
    for step in (0, 1):
        rows = [
            make_row(module="fc1", op="functional.linear", seq=10 * step, min=-1.5, max=2.25, mean=0.125,
                     norm=3.0, nan_count=0, dtype="bfloat16", shape="[4, 8]"),
            make_row(module="fc2", op="functional.linear", seq=10 * step + 1, min=float("nan"), max=float("inf"),
                     mean=float("nan"), norm=float("nan"), nan_count=7, inf_count=1),
            make_row(module="norm", op="functional.layer_norm", slot="kwarg.eps", io="in", seq=10 * step + 2,
                     dtype="", shape="", device="", value="1e-05", min=float("nan"), max=float("nan"),
                     mean=float("nan"), norm=float("nan"), numel=0),
            make_row(module="fc1", op="functional.linear", phase="backward", slot="grad_input.0", seq=10 * step + 3),
        ]
        write_step(root, step, 0, tensors=[torch.ones(3)] if step == 0 else [], rows=rows)
    return root


def test_summary_and_record_table_show_every_step_file(capsys, dump):
    code, out, err = run_cli(capsys, dump)
    assert code == 0 and err == ""
    assert "2 step file(s), steps [0, 1], ranks [0]" in out
    assert "step 0 rank 0" in out and "step 1 rank 0" in out
    assert "records 4  tensors 1  task tensor  level mix  torch 2.13.0+cpu  device cpu  seed 1234" in out
    assert "records 4  tensors 0" in out
    header = next(line for line in out.splitlines() if "key" in line and "seq" in line)
    assert header.split() == ["seq", "key", "dtype", "shape", "min", "max", "mean", "norm", "nan", "inf"]
    fc1 = next(line for line in out.splitlines() if "fc1/functional.linear#0/forward/output.0" in line)
    assert fc1.split()[-8:] == ["[4,", "8]", "-1.5", "2.25", "0.125", "3", "0", "0"]
    fc2 = next(line for line in out.splitlines() if "fc2/" in line)
    assert fc2.split()[-6:] == ["nan", "inf", "nan", "nan", "7", "1"]
    assert "value=1e-05" in out


def test_step_rank_key_and_limit_filters(capsys, dump):
    _, out, _ = run_cli(capsys, dump, "--step", 1, "--rank", 0)
    assert "step 1 rank 0" in out and "step 0 rank 0" not in out
    _, out, _ = run_cli(capsys, dump, "--step", 0, "--key", "fc1")
    keys = [line for line in out.splitlines() if "/functional." in line]
    assert len(keys) == 2 and all("fc1/" in line for line in keys)
    _, out, _ = run_cli(capsys, dump, "--key", "re:/backward/grad_input\\.\\d+$")
    keys = [line for line in out.splitlines() if "/functional." in line]
    assert len(keys) == 2 and all("backward/grad_input.0" in line for line in keys)
    code, out, err = run_cli(capsys, dump, "--limit", 3)
    assert code == 0
    assert len([line for line in out.splitlines() if "/functional." in line]) == 3
    assert "5 more matching record(s) not shown" in err


def test_json_output_is_strict_json_with_nan_as_null(capsys, dump):
    code, out, _ = run_cli(capsys, dump, "--json", "--step", 0)

    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    payload = json.loads(out, parse_constant=refuse)
    assert code == 0
    assert [(entry["step"], entry["rank"]) for entry in payload["files"]] == [(0, 0)]
    assert payload["files"][0]["attrs"]["config"] == {"task": "tensor", "level": "mix", "seed": 1234}
    assert payload["files"][0]["tensor_count"] == 1
    records = payload["records"]
    assert [record["seq"] for record in records] == [0, 1, 2, 3]
    assert records[1]["min"] is None and records[1]["max"] is None and records[1]["nan_count"] == 7
    assert set(schema.COLUMN_NAMES + schema.OPTIONAL_COLUMN_NAMES) | {"step", "rank"} == set(records[0])
    assert payload["incomplete"] == [] and payload["records_not_shown"] == 0


def test_incomplete_step_is_reported_on_stderr_and_finished_steps_still_listed(capsys, dump):
    partial = dump / "step2" / ("rank0" + schema.PARTIAL_SUFFIX)
    partial.parent.mkdir()
    partial.write_bytes(b"\x89HDF\r\n\x1a\n")
    code, out, err = run_cli(capsys, dump)
    assert code == 0
    assert err.strip() == f"probe: warning: step 2 rank 0 is incomplete (process killed mid-step?): {partial}"
    assert "steps [0, 1]" in out
    _, out, _ = run_cli(capsys, dump, "--json")
    assert json.loads(out)["incomplete"][0]["path"] == str(partial)


def test_unknown_step_or_bad_regex_is_a_usage_error(capsys, dump):
    code, _, err = run_cli(capsys, dump, "--step", 9)
    assert code == 2 and "no step file for step 9" in err
    code, _, err = run_cli(capsys, dump, "--key", "re:(")
    assert code == 2 and "not a valid regular expression" in err


@pytest.mark.parametrize("case", sorted(BAD_DUMPS))
def test_bad_dump_exits_2_with_one_error_line(capsys, tmp_path, case):
    build, fragment = BAD_DUMPS[case]
    path = build(str(tmp_path))
    code, out, err = run_cli(capsys, path)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("probe: error: ")
    assert fragment in lines[0] and path in lines[0]


@pytest.mark.parametrize("case", ["truncated", "newer_schema"])
def test_bad_dump_in_a_real_process_exits_2_without_traceback(tmp_path, case):
    build, fragment = BAD_DUMPS[case]
    path = build(str(tmp_path))
    result = run_subprocess(os.path.dirname(os.path.dirname(path)))
    assert result.returncode == 2 and result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and fragment in result.stderr


def test_inspect_imports_no_torch(dump):
    code = (
        "import sys\n"
        "from probe.cli import main\n"
        "try:\n"
        f"    main(['inspect', {str(dump)!r}, '--json'])\n"
        "except SystemExit as exit_:\n"
        "    assert exit_.code == 0, exit_.code\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "False"
    assert json.loads(result.stdout)["files"]


def test_tiny_model_dumped_through_the_debugger_inspects_and_reads_back_exactly(capsys, tmp_path):
    import copy

    from examples.models import MLP, make_batch, train_step
    from probe import PrecisionDebugger

    dump_path = tmp_path / "dump"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"task": "tensor", "dump_path": str(dump_path), "level": "mix", "step": [0]}))
    debugger = PrecisionDebugger(str(config))
    model = MLP(8, 16, 4)
    initial = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [make_batch("mlp", 4, torch.Generator().manual_seed(i), in_features=8, out_features=4)
               for i in range(2)]
    for x, y in batches:
        debugger.start(model)
        train_step(model, optimizer, x, y)
        debugger.stop()
        debugger.step()
    debugger.close()

    dump = probe_load(dump_path)
    assert dump.steps == [0] and dump.ranks == [0]
    with dump.open(0, 0) as step_file:
        assert step_file.attrs["task"] == "tensor" and step_file.attrs["config"]["step"] == [0]
        table = step_file.records

        def stored(key):
            return step_file.tensor(table.row(table.index_of(key))["tensor_id"])

        weight = stored("fc1/Linear#0/forward/param.weight")
        assert np.array_equal(weight, initial.fc1.weight.detach().numpy())
        with torch.no_grad():
            logits = initial(batches[0][0])
        assert np.array_equal(stored("fc2/Linear#0/forward/output.0"), logits.numpy())
        row = table.row(table.index_of("fc2/Linear#0/forward/output.0"))
        assert row["min"] == logits.min().item() and row["max"] == logits.max().item()

    code, out, err = run_cli(capsys, dump_path, "--key", "fc2/Linear#0/forward/output.0", "--json")
    assert code == 0
    payload = json.loads(out)
    assert [record["key"] for record in payload["records"]] == ["fc2/Linear#0/forward/output.0"]


def test_each_step_file_reports_its_cost_and_files_without_it_report_unknown(capsys, tmp_path):
    from probe.config import Config
    from probe.debugger import PrecisionDebugger

    old = os.path.join(REPO_ROOT, "tests", "data", "gpu_dumps", "conv_gpu")  # written before
    code, out, _ = run_cli(capsys, old, "--json", "--limit", "0")
    assert code == 0
    (entry,) = json.loads(out)["files"]
    assert entry["cost"]["host_transfers"] is None and entry["cost"]["capture_ms"] is None
    assert entry["cost"]["bytes"] == os.path.getsize(entry["path"])

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / "new"), level="mix"))
    with debugger.capture(model):
        model(torch.randn(2, 4)).sum().backward()
    debugger.close()
    code, out, _ = run_cli(capsys, tmp_path / "new", "--json", "--limit", "0")
    (entry,) = json.loads(out)["files"]
    cost = entry["cost"]
    assert cost["host_transfers"] == 0 and cost["stale_records"] == 0  # the CPU's host path
    assert cost["capture_ms"] > 0 and cost["bytes"] == os.path.getsize(entry["path"])
    code, out, _ = run_cli(capsys, tmp_path / "new")
    assert f"cost: 0 device-to-host copies, {cost['capture_ms']} ms in probe, {cost['bytes']} bytes" in out
