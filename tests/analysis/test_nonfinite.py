"""probe nonfinite / probe.first_nonfinite / stop_on_nonfinite on real dumps of tiny models."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import probe
from probe import Config, NonfiniteError, PrecisionDebugger
from probe.cli import main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THIS_FILE = os.path.basename(__file__)


class LogNet(nn.Module):
    """fc -> log: log of a negative value is NaN, introduced by torch.log."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.fc(x))  # the line the finding must point at


def fixed_lognet():
    """LogNet whose fc sums its inputs times 0.5: NaN exactly when the input is negative."""
    model = LogNet()
    with torch.no_grad():
        model.fc.weight.fill_(0.5)
        model.fc.bias.fill_(0.0)
    return model


def run_steps(tmp_path, inputs, model=None, level="api", **config):
    model = model or LogNet()
    debugger = PrecisionDebugger(Config(task="statistics", level=level,
                                        dump_path=str(tmp_path / "dump"), **config))
    for x in inputs:
        with debugger.capture(model):
            model(x)
    return str(tmp_path / "dump")


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exited:
        main(["nonfinite", *map(str, args)])
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.parametrize("level, op, inputs", [
    ("api", "torch.log", ["input.0"]),
    ("mix", "torch.log", ["input.0"]),
    # a module's inputs are recorded when it starts and its outputs when it returns: both count
    ("module", "LogNet", ["input.0"]),
])
def test_an_op_making_nan_from_finite_inputs_is_named_as_introduced_with_its_source_line(
        tmp_path, level, op, inputs):
    dump = run_steps(tmp_path, [-torch.ones(8, 4)], model=fixed_lognet(), level=level)
    finding = probe.first_nonfinite(dump)
    assert finding is not None
    assert (finding.op, finding.module, finding.phase, finding.slot) == (op, "", "forward", "output.0")
    assert finding.origin == "introduced"
    assert finding.nan_count == 32 and finding.inf_count == 0 and finding.numel == 32
    assert [slot.slot for slot in finding.inputs] == inputs and all(s.finite for s in finding.inputs)
    assert finding.source.startswith(f"{THIS_FILE}:") or THIS_FILE in finding.source
    assert not finding.overflow


def test_nan_arriving_in_the_data_is_inherited_by_the_first_op_that_reads_it(tmp_path):
    x = torch.ones(2, 4)
    x[1, 2] = float("nan")
    dump = run_steps(tmp_path, [x], model=nn.Sequential(nn.Linear(4, 3), nn.ReLU()))
    finding = probe.first_nonfinite(dump)
    assert finding.origin == "inherited"
    assert finding.op == "functional.linear" and finding.slot == "input.0"
    assert finding.nan_count == 1
    assert "inherited" in finding.describe() and "input.0 (1 NaN, 0 Inf)" in finding.describe()


def test_the_first_step_holding_nan_is_found_across_clean_steps(tmp_path):
    clean, negative = torch.ones(3, 4), -torch.ones(3, 4)
    dump = run_steps(tmp_path, [clean, clean, negative, negative], model=fixed_lognet())
    finding = probe.first_nonfinite(dump)
    assert finding.step == 2 and finding.op == "torch.log"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_overflow_is_reported_as_overflow(tmp_path, dtype):
    big = torch.finfo(dtype).max / 2

    class Scale(nn.Module):
        def forward(self, x):
            return torch.mul(x, 4.0)

    dump = run_steps(tmp_path, [torch.full((2, 3), big, dtype=dtype)], model=Scale())
    finding = probe.first_nonfinite(dump)
    assert finding.op == "torch.mul" and finding.origin == "introduced"
    assert finding.inf_count == 6 and finding.overflow and finding.cause == "overflow"
    assert f"{finding.dtype} overflow" in finding.describe()


def test_float32_inf_from_finite_inputs_is_not_called_a_half_overflow(tmp_path):
    class Divide(nn.Module):
        def forward(self, x):
            return torch.div(x, 0.0)

    finding = probe.first_nonfinite(run_steps(tmp_path, [torch.ones(3)], model=Divide()))
    assert finding.origin == "introduced" and finding.inf_count == 3 and not finding.overflow
    assert finding.cause == "division by zero" and "its denominator input.1 (value 0.0) is 0" in finding.describe()


def test_cli_prints_the_finding_and_exits_1(tmp_path, capsys):
    torch.manual_seed(0)
    dump = run_steps(tmp_path, [torch.randn(8, 4)])
    code, out, _ = run_cli(capsys, dump)
    assert code == 1
    assert out.startswith("first NaN/Inf: step 0 rank 0: <root> torch.log#0 (forward, api)")
    assert "origin: introduced here" in out and f"source: " in out
    code, out, _ = run_cli(capsys, dump, "--json")
    data = json.loads(out)
    assert code == 1 and data["found"] and data["first"]["op"] == "torch.log"
    assert data["by_rank"]["0"]["origin"] == "introduced"


def test_cli_says_none_found_and_exits_0_on_a_clean_dump(tmp_path, capsys):
    dump = run_steps(tmp_path, [torch.ones(2, 4)], model=nn.Linear(4, 2))
    code, out, _ = run_cli(capsys, dump)
    assert code == 0 and out.startswith("none found")
    assert probe.first_nonfinite(dump) is None


def test_cli_missing_dump_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "probe.cli", "nonfinite", str(tmp_path / "nothing")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_one_finding_per_rank_from_a_folder_with_two_rank_files(tmp_path, monkeypatch, capsys):
    for rank, value in ((0, -1.0), (1, 1.0)):
        monkeypatch.setenv("RANK", str(rank))
        run_steps(tmp_path, [torch.ones(2, 4), torch.full((2, 4), value)], model=fixed_lognet())
    found = probe.analysis.nonfinite.find_nonfinite(str(tmp_path / "dump"))
    assert sorted(found) == [0]  # rank 1 stayed finite
    assert found[0].step == 1


def test_stop_on_nonfinite_raises_at_step_after_writing_the_step_file(tmp_path):
    model = fixed_lognet()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / "dump"), stop_on_nonfinite=True))
    steps_done = 0
    with pytest.raises(NonfiniteError, match=r"step 2 rank 0 holds NaN/Inf") as raised:
        for x in (torch.ones(2, 4), torch.ones(2, 4), -torch.ones(2, 4), torch.ones(2, 4)):
            debugger.start(model)
            model(x)
            debugger.stop()
            debugger.step()
            steps_done += 1
    assert steps_done == 2
    assert os.path.isfile(tmp_path / "dump" / "step2" / "rank0.h5")
    assert "probe nonfinite" in str(raised.value)
    assert probe.first_nonfinite(str(tmp_path / "dump")).step == 2


def test_without_stop_on_nonfinite_a_nan_step_does_not_raise(tmp_path):
    dump = run_steps(tmp_path, [-torch.ones(2, 4), torch.ones(2, 4)], model=fixed_lognet(),
                     stop_on_nonfinite=False)
    assert probe.first_nonfinite(dump) is not None  # NaN was there, and training went on


def test_probe_nonfinite_and_determinism_never_import_torch(tmp_path):
    dump = run_steps(tmp_path, [-torch.ones(2, 4)], model=fixed_lognet())
    code = ("import sys\n"
            "from probe.cli import main\n"
            "import probe.commands.determinism\n"
            "try:\n"
            f"    main(['nonfinite', {dump!r}])\n"
            "except SystemExit as exit_:\n"
            "    assert exit_.code == 1, exit_.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert done.returncode == 0, done.stderr
    assert "first NaN/Inf" in done.stdout


def test_values_at_the_half_dtype_max_are_called_saturated(tmp_path):
    class Scale(nn.Module):
        def forward(self, x):
            return torch.mul(x, 2.0)

    x = torch.tensor([65504.0, 1.0], dtype=torch.float16)  # already at float16's largest value
    finding = probe.first_nonfinite(run_steps(tmp_path, [x], model=Scale()))
    assert finding.overflow and finding.inf_count == 1
    assert any(note.startswith("input.0 reach 65504") for note in finding.notes), finding.notes


def test_a_dump_of_zero_records_is_nothing_recorded_and_exit_2_never_all_finite(tmp_path, capsys):
    with pytest.warns(UserWarning, match="selects no module"):
        dump = run_steps(tmp_path, [torch.ones(2, 4)], model=nn.Linear(4, 2), scope=["no_such_module"])
    assert len(probe.load(dump).records(step=0)) == 0
    code, out, err = run_cli(capsys, dump)
    assert code == 2 and out == "" and "none found" not in err
    assert err.startswith("probe: error: nothing was recorded: the step files of") and err.count("\n") == 1
    with pytest.raises(probe.NothingRecordedError):
        probe.first_nonfinite(dump)


def test_adamw_eps_underflowing_in_float16_is_a_division_by_zero_not_an_overflow(tmp_path):
    """AdamW's eps 1e-8 rounds to 0 in float16, and so does a tiny gradient's square: sqrt(v) +
    eps is 0 and the update divides by it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8, foreach=False)
    debugger = PrecisionDebugger(Config(task="statistics", level="api", dump_path=str(tmp_path / "dump")))
    with debugger.capture(model):
        (model(torch.randn(3, 4).half()) * 1e-3).sum().backward()
        optimizer.step()
    finding = probe.first_nonfinite(str(tmp_path / "dump"))
    assert finding.op == "Tensor.addcdiv_" and finding.origin == "introduced"
    assert finding.cause == "division by zero" and not finding.overflow
    text = finding.describe()
    assert "overflow" not in text
    assert "division by zero: its denominator input.2 (float16, min 0, max 0) holds 0" in text
    assert "AdamW's eps 1e-8" in text and "5.96e-08" in text


def test_sqrt_of_a_negative_value_is_an_invalid_operation(tmp_path):
    class Root(nn.Module):
        def forward(self, x):
            return torch.sqrt(x)

    finding = probe.first_nonfinite(run_steps(tmp_path, [torch.tensor([4.0, -1.0])], model=Root()))
    assert finding.cause == "invalid operation" and not finding.overflow
    assert "invalid operation: sqrt of a value outside its domain >= 0: input.0 (float32, min -1, max 4)" \
        in finding.describe()


def test_a_result_beyond_the_dtype_max_is_an_overflow_in_float32_too(tmp_path):
    class Exp(nn.Module):
        def forward(self, x):
            return torch.exp(x)

    finding = probe.first_nonfinite(run_steps(tmp_path, [torch.tensor([1.0, 100.0])], model=Exp()))
    assert finding.cause == "overflow" and finding.overflow
    assert "float32 overflow: a result beyond 3.40282e+38" in finding.describe()


class _Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


@pytest.mark.parametrize("values, cause, text", [
    ([0.0, 1.0], "division by zero", "log of 0 is -Inf"),
    ([-1.0, 1.0], "invalid operation", "invalid operation: log of a value outside its domain >= 0"),
])
def test_log_of_zero_is_a_division_by_zero_and_of_a_negative_value_invalid(tmp_path, values, cause, text):
    finding = probe.first_nonfinite(run_steps(tmp_path, [torch.tensor(values)], model=_Log()))
    assert finding.cause == cause and text in finding.describe()


def test_zero_divided_by_zero_is_an_invalid_operation_naming_the_zero_denominator(tmp_path):
    class Ratio(nn.Module):
        def forward(self, x):
            return torch.div(x, x)

    finding = probe.first_nonfinite(run_steps(tmp_path, [torch.tensor([0.0, 2.0])], model=Ratio()))
    assert finding.cause == "invalid operation" and finding.nan_count == 1
    assert "invalid operation: 0/0: its denominator input.1 (float32, min 0, max 2) holds 0" in finding.describe()
