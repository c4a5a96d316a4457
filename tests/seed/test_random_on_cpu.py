"""random_on_cpu: draws aimed at another device come from the CPU generator, as a CPU run's.

No accelerator is needed to test the redirect: the "lazy" device (torch._lazy's TorchScript
backend) is a device other than the CPU that carries values, so every covered call aimed at it
can be compared bit for bit with a pure-CPU run of the same code, with the CPU generator's state
after each. Caveat: the lazy backend itself computes random ops with CPU kernels and the CPU
generator, so on lazy the values match even without the mode; the mode's ``redirected`` count
shows that each call did take the redirect (and the values that the redirect reproduces a CPU
run exactly). What the CUDA generator would have drawn cannot be shown without a GPU.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

from probe import Config, PrecisionDebugger
from probe.seed.random_on_cpu import COVERED, RandomOnCpu
from probe.seed import remove_dropout_now, restore_dropout

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def lazy():
    try:
        import torch._lazy
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        torch.zeros(1, device="lazy").cpu()
    except Exception as error:  # torch builds without the lazy TorchScript backend
        pytest.skip(f"no lazy device in this torch: {error}")
    return torch.device("lazy")


def covered_calls(device, x):
    """One call of each covered kind; x lives on device. Returns the results on the CPU."""
    p = torch.full((8,), 0.3).to(device)
    probs = torch.tensor([0.2, 0.5, 0.3]).to(device)
    calls = {
        "torch.rand": lambda: torch.rand(3, 4, device=device),
        "torch.randn": lambda: torch.randn(5, device=device),
        "torch.randint": lambda: torch.randint(0, 10, (6,), device=device),
        "torch.randperm": lambda: torch.randperm(7, device=device),
        "torch.normal(size)": lambda: torch.normal(0.0, 1.0, (3,), device=device),
        "torch.normal(tensor)": lambda: torch.normal(x, 1.0),
        "torch.bernoulli": lambda: torch.bernoulli(p),
        "torch.multinomial": lambda: torch.multinomial(probs, 5, True),
        "torch.rand_like": lambda: torch.rand_like(x),
        "torch.randn_like": lambda: torch.randn_like(x),
        "Tensor.normal_": lambda: torch.empty(5, 3, device=device).normal_(),
        "Tensor.uniform_": lambda: torch.empty(5, 3, device=device).uniform_(-1, 1),
        "Tensor.bernoulli_": lambda: torch.empty(5, 3, device=device).bernoulli_(0.4),
        "Tensor.exponential_": lambda: torch.empty(5, 3, device=device).exponential_(),
        "Tensor.normal_ (strided view)": lambda: torch.zeros(6, 4, device=device)[:, ::2].normal_(),
        "F.dropout": lambda: F.dropout(x, 0.3),
        "nn.Dropout": lambda: nn.Dropout(0.5)(x),
        "F.dropout(inplace)": lambda: F.dropout(x.clone(), 0.5, inplace=True),
        "F.dropout1d": lambda: F.dropout1d(x[0], 0.5),
        "F.dropout2d": lambda: F.dropout2d(x, 0.5),
        "F.dropout3d": lambda: F.dropout3d(x, 0.5),
        "F.alpha_dropout": lambda: F.alpha_dropout(x, 0.2, True),
        "F.feature_alpha_dropout": lambda: F.feature_alpha_dropout(x, 0.2, True),
        "F.rrelu": lambda: F.rrelu(x, training=True),
        "nn.init.kaiming_uniform_": lambda: nn.init.kaiming_uniform_(torch.empty(4, 3, device=device)),
    }
    results = {}
    for name, call in calls.items():
        results[name] = call().cpu()
        results[name + " / generator state"] = torch.get_rng_state()
    return results


def test_each_covered_call_on_another_device_draws_bit_for_bit_what_a_cpu_run_draws(lazy):
    x = torch.randn(4, 6, 5, 3)
    torch.manual_seed(0)
    expected = covered_calls(torch.device("cpu"), x)
    torch.manual_seed(0)
    with RandomOnCpu() as mode:
        got = covered_calls(lazy, x.to(lazy))
    assert mode.redirected == len(expected) // 2  # every covered call above was moved to the CPU generator
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_dropout_on_another_device_matches_cpu_forward_and_backward(lazy):
    def run(device):
        torch.manual_seed(3)
        x = torch.linspace(-1, 1, 30).reshape(5, 6).to(device).requires_grad_()
        weight = torch.arange(30.0).reshape(5, 6).to(device)
        out = nn.Dropout(0.4)(x)
        (out * weight).sum().backward()
        return out.detach().cpu(), x.grad.cpu()

    out_cpu, grad_cpu = run("cpu")
    with RandomOnCpu() as mode:
        out_lazy, grad_lazy = run(lazy)
    assert mode.redirected == 1
    assert torch.equal(out_cpu, out_lazy) and torch.equal(grad_cpu, grad_lazy)
    assert (out_cpu == 0).any() and (out_cpu != 0).any()  # a real mask, not all or nothing


DRAWS = {
    "randn": lambda d: torch.randn(5, device=d),
    "rand": lambda d: torch.rand(2, 3, device=d),
    "randint": lambda d: torch.randint(0, 7, (9,), device=d),
    "randperm": lambda d: torch.randperm(20, device=d),
    "normal": lambda d: torch.normal(2.0, 3.0, (4,), device=d),
    "normal_": lambda d: torch.empty(6, device=d).normal_(),
    "uniform_": lambda d: torch.empty(6, device=d).uniform_(),
    "bernoulli_": lambda d: torch.empty(6, device=d).bernoulli_(0.5),
    "exponential_": lambda d: torch.empty(6, device=d).exponential_(),
}


@pytest.mark.parametrize("name", list(DRAWS))
def test_a_draw_aimed_at_another_device_is_redirected_and_advances_the_cpu_generator_alike(lazy, name):
    torch.manual_seed(5)
    expected = DRAWS[name]("cpu")
    after_cpu = torch.get_rng_state()
    torch.manual_seed(5)
    with RandomOnCpu() as mode:
        out = DRAWS[name](lazy)
    assert out.device.type == "lazy" and mode.redirected == 1
    assert torch.equal(out.cpu(), expected) and torch.equal(torch.get_rng_state(), after_cpu)


def test_a_draw_whose_device_comes_from_a_default_device_context_is_redirected_too(lazy):
    with torch.device(lazy):  # a DeviceContext mode below ours: the call has no device=
        with RandomOnCpu() as mode:
            out = torch.randn(6)
    assert out.device.type == "lazy" and mode.redirected == 1


def test_meta_tensors_are_left_alone_so_deferred_init_allocates_nothing():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with RandomOnCpu() as mode:
        layer = torch.nn.Linear(4096, 4096, device="meta")  # kaiming_uniform_ on meta
        torch.randn(10**9, device="meta")
        F.dropout(torch.empty(10**9, device="meta"), 0.5)
    assert mode.redirected == 0 and layer.weight.is_meta
    assert torch.equal(torch.get_rng_state(), before)


def test_covered_list_names_the_issue_functions():
    for name in ("torch.rand", "torch.randn", "torch.randint", "torch.randperm", "torch.normal",
                 "torch.bernoulli", "Tensor.normal_", "Tensor.uniform_", "Tensor.bernoulli_",
                 "Tensor.exponential_", "F.dropout", "F.dropout1d", "F.dropout2d", "F.dropout3d",
                 "F.alpha_dropout", "F.rrelu"):
        assert name in COVERED


def test_removed_dropout_stays_removed_under_random_on_cpu(lazy):
    x = torch.randn(4, 5).to(lazy)
    remove_dropout_now()
    try:
        with RandomOnCpu() as mode:
            out = F.dropout(x, 0.5)
    finally:
        restore_dropout()
    assert mode.redirected == 0 and torch.equal(out.cpu(), x.cpu())


def _stack():
    return list(_get_current_function_mode_stack())


def _random_modes():
    return [m for m in _stack() if isinstance(m, RandomOnCpu)]


def test_debugger_applies_it_between_start_and_stop_only_and_removes_it_exactly(tmp_path, lazy):
    before = _stack()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / "d"), random_on_cpu=True,
                                        step=[5]))  # step 0 is not captured: still redirected
    assert not _random_modes()
    debugger.start()
    (mode,) = _random_modes()
    torch.randn(4, device=lazy)
    debugger.stop()
    assert mode.redirected == 1
    assert _stack() == before
    debugger.step()


def test_capture_below_it_records_the_users_dropout_call_once(tmp_path, lazy):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / "d"), random_on_cpu=True))
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).to(lazy)
    with debugger.capture(model):
        model(torch.ones(3, 4).to(lazy))
    import probe

    ops = [row["op"] for row in probe.load(str(tmp_path / "d")).records() if row["slot"] == "output.0"]
    assert ops == ["torch.ones", "Tensor.to", "functional.linear", "functional.dropout"]


def test_off_by_default_installs_nothing(tmp_path):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / "d")))
    debugger.start()
    try:
        assert not any(isinstance(m, RandomOnCpu) for m in _stack())
    finally:
        debugger.stop()


def test_probe_run_applies_it_for_the_whole_run(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"random_on_cpu": True, "dump_path": str(tmp_path / "d")}))
    script = (
        "import torch, probe\n"
        "from torch.overrides import _get_current_function_mode_stack as stack\n"
        "probe.PrecisionDebugger()\n"  # the config comes from probe run; nothing started
        "print(' '.join(type(m).__name__ for m in stack()))\n"
    )
    done = subprocess.run([sys.executable, "-m", "probe.cli", "run", "-q", "-c", str(config), "--",
                           sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "RandomOnCpu"
