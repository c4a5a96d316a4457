"""Zero-edit capture: ``probe run -c cfg -- python script.py`` dumps a script that has no
probe code (examples/trainers/plain_loop.py), one step file per optimizer.step()."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import probe
from tests.step_checks import assert_each_step_holds_micro_batches
from tests.torch_versions import needs_compiled_capture, plain_compile_has_taps

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAIN_LOOP = os.path.join(REPO_ROOT, "examples", "trainers", "plain_loop.py")


def probe_run(tmp_path, *command, options=(), env_extra=None, level="mix"):
    (tmp_path / "cfg.json").write_text(json.dumps({"dump_path": "dump", "level": level}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(env_extra or {})
    done = subprocess.run([sys.executable, "-m", "probe", "run", "-c", "cfg.json", *options,
                           "--", sys.executable, *command], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def test_a_script_without_probe_code_is_dumped_one_step_per_optimizer_step(tmp_path):
    done = probe_run(tmp_path, PLAIN_LOOP, "--steps", "3")
    assert "eval loss" in done.stdout
    # steps 0, 1, 2, one forward of the model each; the no_grad evaluation after them is no step
    dump = assert_each_step_holds_micro_batches(tmp_path / "dump", 3, "", 1)
    assert {"0", "1", "3"} <= {record["module"] for record in dump.records(step=2)}


def test_a_program_that_looks_torch_up_before_importing_it_is_still_captured(tmp_path):
    """datasets and transformers ask importlib.util.find_spec("torch") before anything
    imports torch: the import that follows must still attach."""
    probe_run(tmp_path, "-c", "import importlib.util, runpy, sys; importlib.util.find_spec('torch'); "
              f"sys.argv = [{PLAIN_LOOP!r}, '--steps', '1']; runpy.run_path({PLAIN_LOOP!r}, run_name='__main__')")
    assert probe.load(str(tmp_path / "dump")).steps == [0]


def test_zero_edit_capture_puts_every_micro_batch_in_its_optimizer_steps_file(tmp_path):
    probe_run(tmp_path, PLAIN_LOOP, "--steps", "2", "--accumulation", "3", level="module")
    assert_each_step_holds_micro_batches(tmp_path / "dump", 2, "0", 3)


def test_a_script_that_builds_its_own_debugger_is_not_captured_automatically(tmp_path):
    (tmp_path / "own.py").write_text(
        "import runpy, sys\n"
        "from probe import PrecisionDebugger\n"
        "debugger = PrecisionDebugger()  # the script's own: it captures nothing here\n"
        f"sys.argv = [{PLAIN_LOOP!r}]\n"
        f"runpy.run_path({PLAIN_LOOP!r}, run_name='__main__')\n")
    probe_run(tmp_path, "own.py")
    assert not (tmp_path / "dump" / "step0").exists()


def test_no_attach_and_probe_attach_0_opt_out_of_zero_edit_capture(tmp_path):
    probe_run(tmp_path, PLAIN_LOOP, "--steps", "1", options=("--no-attach",))
    probe_run(tmp_path, PLAIN_LOOP, "--steps", "1", env_extra={"PROBE_ATTACH": "0"})
    assert not (tmp_path / "dump" / "step0").exists()


def test_the_users_own_sitecustomize_still_runs_under_probe_run(tmp_path):
    own = tmp_path / "site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    done = probe_run(tmp_path, "-c", "import os; print(os.environ.get('USER_SITE_RAN'))",
                     env_extra={"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{own}"})
    assert done.stdout.strip() == "yes"


def _attach(tmp_path, monkeypatch, level):
    """Automatic capture attached in this process, as the start-up hook does; removed after."""
    from probe.autoattach import session

    (tmp_path / "cfg.json").write_text(json.dumps({"dump_path": str(tmp_path / "dump"),
                                                   "level": level}))
    monkeypatch.setenv("PROBE_ATTACH", "1")
    monkeypatch.setenv("PROBE_CONFIG", str(tmp_path / "cfg.json"))
    capture = session.attach()
    yield capture
    if session.current() is capture:
        capture.stand_down()


@pytest.fixture
def attached(tmp_path, monkeypatch):
    yield from _attach(tmp_path, monkeypatch, "module")


def test_the_model_is_the_first_trained_module_not_a_frozen_or_no_grad_forward(attached, tmp_path):
    torch.manual_seed(0)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)  # an evaluation before training
    for _ in range(2):
        model(frozen(x)).sum().backward()
        optimizer.step()
    attached.stand_down()
    assert attached.model is model
    dump = probe.load(str(tmp_path / "dump"))
    assert dump.steps == [0, 1]
    assert {record["module"] for record in dump.records(step=1)} == {"", "0", "1"}


def test_a_second_optimizer_does_not_end_steps_and_warns_once(attached, tmp_path):
    model, other = nn.Linear(4, 1), nn.Linear(4, 1)
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    second = torch.optim.SGD(other.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with pytest.warns(RuntimeWarning, match="a second optimizer") as caught:
        for _ in range(3):
            (model(x).sum() + other(x).sum()).backward()
            first.step()
            second.step()
    assert sum("second optimizer" in str(w.message) for w in caught) == 1
    attached.stand_down()
    assert probe.load(str(tmp_path / "dump")).steps == [0, 1, 2]


class _KeywordModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, *, features):
        return self.fc(features)


def test_the_models_keyword_inputs_are_recorded_from_step_0(attached, tmp_path):
    model = _KeywordModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(features=torch.randn(2, 4, requires_grad=True)).sum().backward()
        optimizer.step()
    attached.stand_down()
    dump = probe.load(str(tmp_path / "dump"))
    for step in (0, 1):
        slots = {(record["phase"], record["slot"]) for record in dump.records(step=step)
                 if record["module"] == ""}
        assert {("forward", "kwarg.features"), ("backward", "grad_input.features")} <= slots, step


@needs_compiled_capture()
@pytest.mark.parametrize("level", ["module", "mix"])
def test_a_plain_compiled_model_is_captured_without_edits_or_warnings_from_its_first_step(
        tmp_path, monkeypatch, level):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 1))
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attaching = _attach(tmp_path, monkeypatch, level)  # after the filters a program sets
        attached = next(attaching)
        for _ in range(3):
            compiled(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    attached.stand_down()
    next(attaching, None)
    torch._dynamo.reset()
    # the first step starts inside the compiled model's call: its gate must still close
    assert sum(counters["graph_break"].values()) == 0
    # no warning at all: none of probe's, nor torch's about the global hook that finds the model
    assert not [str(w.message) for w in caught]
    dump = probe.load(str(tmp_path / "dump"))
    assert dump.steps == [0, 1, 2]
    for step in dump.steps:
        keys = {record["key"] for record in dump.records(step=step)}
        assert "/Sequential#0/forward/output.0" in keys
        assert not any("_orig_mod" in key for key in keys)
        if level == "module":  # the parameters inside the region, at its boundary
            assert "1/LayerNorm#0/forward/param.weight" in keys, step
        elif plain_compile_has_taps():  # ops inside the graph, named as eager code names them
            assert "1/functional.layer_norm#0/forward/output.0" in keys, step
            assert "1/functional.layer_norm#0/backward/grad_input.0" in keys, step
