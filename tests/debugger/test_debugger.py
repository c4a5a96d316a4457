"""PrecisionDebugger lifecycle: numerics untouched, everything removed at stop(), steps, filters."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe.config import Config
from probe.debugger.debugger import PrecisionDebugger
from probe.dump import schema
from probe.dump.reader import load
from probe.errors import CaptureError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEVELS = ("api", "module", "mix")
TASKS = ("statistics", "tensor", "checksum")


class TinyNet(nn.Module):
    """Conv, BatchNorm (in-place running stats), in-place ReLU, LayerNorm, GELU, dropout."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.norm = nn.LayerNorm(64)
        self.fc = nn.Linear(64, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.act(self.bn(self.conv(x)))
        x = self.norm(torch.flatten(x, 1))
        x = F.dropout(F.gelu(self.fc(x)), p=0.25, training=self.training)
        return self.head(x)


def _train(debugger, steps=3):
    """3 SGD steps of TinyNet; returns per-step (loss, logits, {name: grad})."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    results = []
    for _ in range(steps):
        x = torch.randn(4, 2, 4, 4, generator=data)
        y = torch.randint(0, 3, (4,), generator=data)
        if debugger is not None:
            debugger.start(model)
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        if debugger is not None:
            debugger.stop()
            debugger.step()
        results.append((loss.detach(), logits.detach(), grads))
    return results, model


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("level", LEVELS)
def test_capture_leaves_losses_outputs_and_gradients_bit_identical(tmp_path, level, task):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level=level, task=task))
    captured, captured_model = _train(debugger)
    PrecisionDebugger(Config(dump_path=str(tmp_path / "unused")))  # same seeding as above
    plain, plain_model = _train(None)
    for (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) in zip(captured, plain):
        assert torch.equal(loss_a, loss_b)
        assert torch.equal(logits_a, logits_b)
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name
    for (name, a), b in zip(captured_model.state_dict().items(), plain_model.state_dict().values()):
        assert torch.equal(a, b), name
    debugger.wait()
    assert sorted(n for n in os.listdir(tmp_path) if n != ".rank0.lock") == ["step0", "step1", "step2"]


def _hook_state(model):
    import torch.nn.modules.module as module_globals

    state = [len(module_globals._global_forward_pre_hooks),
             len(module_globals._global_forward_hooks),
             len(module_globals._global_forward_hooks_always_called)]
    for module in model.modules():
        state.append((len(module._forward_hooks), len(module._forward_pre_hooks),
                      len(module._backward_hooks), len(module._backward_pre_hooks),
                      len(module._forward_hooks_always_called)))
    for param in model.parameters():
        state.append(len(getattr(param, "_post_accumulate_grad_hooks", None) or {}))
    return state


def _torch_state():
    return (list(torch.overrides._get_current_function_mode_stack()), F.gelu, F.linear,
            torch.relu, torch.Tensor.add, torch.Tensor.__mul__)


def _assert_same_torch_state(before):
    after = _torch_state()
    assert len(after[0]) == len(before[0]) and all(a is b for a, b in zip(after[0], before[0]))
    assert all(a is b for a, b in zip(after[1:], before[1:]))


@pytest.mark.parametrize("level", LEVELS)
def test_stop_restores_every_hook_mode_and_torch_function(tmp_path, level):
    model = TinyNet()
    hooks_before, torch_before = _hook_state(model), _torch_state()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level=level))
    debugger.start(model)
    try:
        if level in ("api", "mix"):
            assert len(torch.overrides._get_current_function_mode_stack()) == \
                len(torch_before[0]) + 1
        assert _hook_state(model) != hooks_before  # something was installed
        model(torch.randn(2, 2, 4, 4)).sum().backward()
    finally:
        debugger.stop()
    assert _hook_state(model) == hooks_before
    _assert_same_torch_state(torch_before)
    debugger.step()


@pytest.mark.parametrize("level", LEVELS)
def test_exception_inside_capture_removes_hooks_and_mode_and_still_writes_the_step(tmp_path,
                                                                                   level):
    model = TinyNet()
    hooks_before, torch_before = _hook_state(model), _torch_state()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level=level))
    with pytest.raises(ZeroDivisionError):
        with debugger.capture(model):
            model(torch.randn(2, 2, 4, 4))
            1 / 0
    assert _hook_state(model) == hooks_before
    _assert_same_torch_state(torch_before)
    assert not debugger.started
    assert load(tmp_path).records(step=0)  # what ran before the exception was written


class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        x = self.inner(x)
        raise ValueError("boom inside forward")


def test_exception_inside_a_module_forward_leaves_no_module_on_the_stack(tmp_path):
    model = Exploding()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level="mix"))
    debugger.start(model)
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(2, 4))
    torch.tanh(torch.ones(1))  # recorded outside every module again
    debugger.stop()
    debugger.step()
    rows = load(tmp_path).records(step=0)
    assert any(row["key"] == "/torch.tanh#0/forward/output.0" for row in rows)


def test_start_twice_and_stop_without_start_raise_capture_error(tmp_path):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    with pytest.raises(CaptureError, match="stop\\(\\) called but capture of step 0"):
        debugger.stop()
    debugger.start()
    with pytest.raises(CaptureError, match="already started"):
        debugger.start()
    debugger.stop()
    with pytest.raises(CaptureError, match="expected a torch.nn.Module"):
        debugger.start(model="not a model")
    assert not debugger.started


def test_step_while_started_stops_first(tmp_path):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    stack_before = len(torch.overrides._get_current_function_mode_stack())
    debugger.start()
    torch.relu(torch.ones(2))
    debugger.step()
    assert len(torch.overrides._get_current_function_mode_stack()) == stack_before
    assert debugger.current_step == 1
    debugger.wait()  # the writer process may still be writing it
    assert os.path.isfile(tmp_path / "step0" / "rank0.h5")


@pytest.mark.parametrize("writer", ["process", "inline"])
def test_a_dump_folder_removed_between_steps_comes_back_with_the_next_steps_file(tmp_path, writer):
    """start() makes dump_path once, with the rank's lock; the file writer makes it again."""
    import shutil

    folder = tmp_path / "dump"
    debugger = PrecisionDebugger(Config(dump_path=str(folder), writer=writer))
    for step in range(3):
        if step == 1:
            shutil.rmtree(folder)
        debugger.start()
        torch.relu(torch.ones(2))
        debugger.stop()
        debugger.step()
        debugger.wait()
    assert sorted(load(str(folder)).steps) == [1, 2]
    debugger.close()


def test_the_first_start_makes_the_dump_folder_and_holds_the_ranks_lock(tmp_path):
    folder = tmp_path / "dump"
    debugger = PrecisionDebugger(Config(dump_path=str(folder)))
    debugger.start()
    assert (folder / ".rank0.lock").exists()  # before anything is written
    debugger.stop()
    debugger.close()


def test_several_start_stop_pairs_accumulate_into_one_step_file(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level="mix"))
    x = torch.randn(2, 3)
    debugger.start(model)
    out = model(x)
    debugger.stop()
    torch.sigmoid(x)  # between the pairs: not recorded
    debugger.start(model)
    out = model(out)
    out.sum().backward()
    debugger.stop()
    debugger.step()
    debugger.wait()
    assert [n for n in os.listdir(tmp_path) if n != ".rank0.lock"] == ["step0"]
    rows = load(tmp_path).records(step=0)
    keys = {row["key"] for row in rows}
    assert "0/Linear#0/forward/output.0" in keys and "0/Linear#1/forward/output.0" in keys
    assert "0/functional.linear#1/forward/input.0" in keys
    assert any(row["phase"] == "backward" for row in rows)
    assert not any("sigmoid" in row["op"] for row in rows)
    seqs = [row["seq"] for row in rows]
    assert seqs == sorted(seqs)


def test_unselected_step_installs_nothing_and_writes_nothing(tmp_path):
    model = TinyNet()
    hooks_before = _hook_state(model)
    stack_before = len(torch.overrides._get_current_function_mode_stack())
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level="mix", step=[1]))
    debugger.start(model)
    try:
        assert _hook_state(model) == hooks_before
        assert len(torch.overrides._get_current_function_mode_stack()) == stack_before
        model(torch.randn(2, 2, 4, 4))
    finally:
        debugger.stop()
    debugger.step()
    debugger.wait()
    assert not os.path.exists(tmp_path / "step0")
    debugger.start(model)
    try:
        assert _hook_state(model) != hooks_before
        model(torch.randn(2, 2, 4, 4))
    finally:
        debugger.stop()
    debugger.step()
    debugger.wait()
    assert sorted(n for n in os.listdir(tmp_path) if n != ".rank0.lock") == ["step1"]


def test_rank_filter_uses_the_rank_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    skipped = PrecisionDebugger(Config(dump_path=str(tmp_path / "skip"), rank=[0]))
    with skipped.capture():
        torch.relu(torch.ones(2))
    assert not os.path.exists(tmp_path / "skip")
    kept = PrecisionDebugger(Config(dump_path=str(tmp_path / "keep"), rank=[1]))
    with kept.capture():
        torch.relu(torch.ones(2))
    kept.wait()
    assert os.listdir(tmp_path / "keep" / "step0") == ["rank1.h5"]


def test_root_attributes_describe_the_run(tmp_path):
    config = Config(dump_path=str(tmp_path), level="mix", task="checksum", seed=7)
    debugger = PrecisionDebugger(config)
    with debugger.capture(nn.Linear(2, 2)) as active:
        active  # the context manager yields the debugger
        torch.relu(torch.ones(2))
    with load(tmp_path).open(0, 0) as step:
        attrs = step.attrs
    for name in schema.ROOT_ATTRS:
        assert name in attrs, name
    assert attrs["schema_version"] == schema.SCHEMA_VERSION
    assert attrs["torch_version"] == str(torch.__version__)
    assert (attrs["step"], attrs["rank"], attrs["world_size"]) == (0, 0, 1)
    assert (attrs["task"], attrs["level"], attrs["device"]) == ("checksum", "mix", "cpu")
    assert attrs["config"] == config.to_dict()
    assert attrs["seed_report"]["seed"] == 7
    assert attrs["determinism"]["num_threads"] == torch.get_num_threads()
    assert attrs["record_count"] == len(step.records)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_is_read_from_a_path_or_from_probe_config(tmp_path, monkeypatch, suffix):
    path = tmp_path / f"config{suffix}"
    values = {"dump_path": str(tmp_path / "dump"), "level": "module", "task": "checksum"}
    path.write_text(json.dumps(values))  # JSON is YAML too
    assert PrecisionDebugger(str(path)).config.level == "module"
    monkeypatch.setenv("PROBE_CONFIG", str(path))
    from_env = PrecisionDebugger()
    assert (from_env.config.level, from_env.config.task) == ("module", "checksum")


def test_interpreter_exit_writes_a_step_left_open(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {REPO_ROOT!r})
        from probe.config import Config
        from probe.debugger.debugger import PrecisionDebugger
        debugger = PrecisionDebugger(Config(dump_path={str(tmp_path)!r}))
        debugger.start()
        torch.tanh(torch.ones(3))
        # no stop(), no step(): the exit handler finishes the file
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path / "step0") == ["rank0.h5"]
    keys = {row["key"] for row in load(tmp_path).records(step=0)}
    assert "/torch.tanh#0/forward/output.0" in keys


class OtherMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_stop_under_a_foreign_mode_removes_only_probes_mode_and_says_so(tmp_path):
    stack_before = list(torch.overrides._get_current_function_mode_stack())
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    debugger.start()
    other = OtherMode()
    other.__enter__()
    with pytest.raises(CaptureError, match="OtherMode"):
        debugger.stop()
    stack = torch.overrides._get_current_function_mode_stack()
    assert len(stack) == len(stack_before) + 1 and stack[-1] is other
    other.__exit__(None, None, None)
    assert list(torch.overrides._get_current_function_mode_stack()) == stack_before
    assert not debugger.started
