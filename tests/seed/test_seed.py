import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from probe.errors import SeedError
from probe.seed import (
    DropoutRemover,
    SeedReport,
    determinism_state,
    dropout_removed,
    restore_dropout,
    seed_all,
)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
TRAIN_SCRIPT = os.path.join(HERE, "scripts", "train_repro.py")
ENV_NAMES = ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC")


@pytest.fixture(autouse=True)
def restore_global_torch_state():
    """seed_all changes process-wide flags; put every one back so other tests are unaffected."""
    saved = {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "precision": torch.get_float32_matmul_precision(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
        "env": {name: os.environ.get(name) for name in ENV_NAMES},
    }
    yield
    while dropout_removed():
        restore_dropout()
    torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["warn_only"])
    torch.backends.cudnn.benchmark = saved["benchmark"]
    torch.backends.cudnn.deterministic = saved["cudnn_deterministic"]
    torch.backends.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = saved["cudnn_tf32"]
    torch.set_float32_matmul_precision(saved["precision"])
    torch.set_rng_state(saved["torch_rng"])
    np.random.set_state(saved["numpy_rng"])
    random.setstate(saved["python_rng"])
    for name, value in saved["env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# ---------------------------------------------------------------- repeatability across processes


def _launch(runs):
    return subprocess.Popen(
        [sys.executable, TRAIN_SCRIPT, "--steps", "20", "--mode", "true", "--runs", runs],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _runs(process):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    runs = [json.loads(line) for line in out.splitlines()]
    assert all(len(run["losses"]) == 20 for run in runs), out
    return [run["losses"] for run in runs]


def test_seed_all_makes_two_processes_train_bit_identically_and_seeds_matter():
    # Unseeded runs come first: their processes' RNGs are still fresh and unrelated.
    # Seed 7 then runs after different histories (unseeded, or unseeded then nothing else),
    # so equality also shows that seed_all resets everything a previous run touched.
    first, second = _launch("none,7,8"), _launch("none,7")
    unseeded_a, seven_a, eight = _runs(first)
    unseeded_b, seven_b = _runs(second)
    assert seven_a == seven_b  # float.hex strings: bit-identical across processes
    assert seven_a != eight
    assert unseeded_a != unseeded_b


# ---------------------------------------------------------------- the report


def test_report_lists_seeded_sources_and_the_cudnn_flags_it_set_on_torch_backends():
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = False
    report = seed_all(99)
    assert isinstance(report, SeedReport)
    assert report.seed == 99 and report.mode is False and report.remove_dropout is False
    assert {"python", "numpy", "torch.cpu"} <= set(report.sources)
    assert report.devices[0] == "cpu"
    assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cudnn.deterministic is True
    assert report.settings["torch.backends.cudnn.benchmark"] is False
    assert report.settings["torch.backends.cudnn.deterministic"] is True
    assert report.settings["torch.manual_seed"] == 99
    assert report.env["PYTHONHASHSEED"] == "99" == os.environ["PYTHONHASHSEED"]
    assert "torch.use_deterministic_algorithms" not in report.settings
    assert "probe run" in report.hash_seed_note


def test_seed_all_actually_seeds_python_numpy_and_torch():
    seed_all(5)
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    seed_all(5)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first
    seed_all(6)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) != first


def test_report_to_dict_is_json_and_carries_the_determinism_snapshot():
    report = seed_all(3, mode=True)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["seed"] == 3 and data["mode"] is True
    assert data["settings"]["torch.use_deterministic_algorithms"] is True
    assert data["settings"]["torch.backends.cuda.matmul.allow_tf32"] is False
    assert data["env"]["CUBLAS_WORKSPACE_CONFIG"] == os.environ["CUBLAS_WORKSPACE_CONFIG"]
    assert data["determinism"]["deterministic_algorithms"] is True
    assert data["determinism"]["env"]["PYTHONHASHSEED"] == "3"


# ---------------------------------------------------------------- mode


def test_mode_true_enables_deterministic_algorithms_and_turns_tf32_off():
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    os.environ.pop("HCCL_DETERMINISTIC", None)
    report = seed_all(1, mode=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cudnn.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "highest"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["HCCL_DETERMINISTIC"] == "true"
    assert report.settings["torch.use_deterministic_algorithms.warn_only"] is False


def test_mode_warn_enables_deterministic_algorithms_in_warn_only_form():
    torch.use_deterministic_algorithms(False)
    seed_all(1, mode="warn")
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert determinism_state()["deterministic_algorithms_warn_only"] is True


def test_mode_keeps_a_cublas_workspace_config_the_user_chose():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    report = seed_all(1, mode=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in report.env


def test_mode_false_leaves_deterministic_algorithms_as_they_were():
    torch.use_deterministic_algorithms(True, warn_only=True)
    seed_all(1, mode=False)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()


def test_determinism_state_is_json_and_reflects_the_flags_in_force():
    torch.backends.cudnn.benchmark = True
    os.environ["PYTHONHASHSEED"] = "17"
    state = json.loads(json.dumps(determinism_state()))
    assert state["cudnn.benchmark"] is True
    assert state["num_threads"] == torch.get_num_threads()
    assert state["env"]["PYTHONHASHSEED"] == "17"
    for key in ("cudnn.enabled", "cudnn.deterministic", "deterministic_algorithms",
                "cuda.matmul.allow_tf32", "cudnn.allow_tf32", "float32_matmul_precision",
                "mkldnn.enabled"):
        assert key in state


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("seed", [-1, 2**32, True, 1.0, "1", None])
def test_bad_seed_raises_seed_error_naming_the_value(seed):
    with pytest.raises(SeedError, match="seed is .*0 .. 4294967295"):
        seed_all(seed)


@pytest.mark.parametrize("mode", ["on", "Warn", 1, 0, None, "true"])
def test_bad_mode_raises_seed_error(mode):
    with pytest.raises(SeedError, match="mode is"):
        seed_all(1, mode=mode)


def test_bad_seed_changes_nothing():
    torch.backends.cudnn.benchmark = True
    with pytest.raises(SeedError):
        seed_all(-5, mode=True)
    assert torch.backends.cudnn.benchmark is True


def test_seed_limits_are_accepted():
    assert seed_all(0).seed == 0
    assert seed_all(2**32 - 1).seed == 2**32 - 1


# ---------------------------------------------------------------- dropout removal


class DropoutEverywhere(nn.Module):
    """Each dropout flavour torch offers, on one path, so each one must be neutralised."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
        self.drop2d = nn.Dropout2d(0.5)
        self.alpha = nn.AlphaDropout(0.5)

    def forward(self, x):
        x = self.drop(self.fc(x))
        x = F.dropout(x, 0.3, training=self.training)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        heads = x.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            heads, heads, heads, dropout_p=0.5 if self.training else 0.0)
        x = x + attended.transpose(1, 2).reshape(x.shape)
        x = self.drop2d(x.unsqueeze(-1)).squeeze(-1)
        return self.alpha(x)


def _train_equals_eval(module, x):
    module.eval()
    with torch.no_grad():
        expected = module(x)
        module.train()
        got = module(x)
    return torch.equal(got, expected)


DROPOUT_CASES = {
    "nn.Dropout": lambda: nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)),
    "nn.Dropout1d": lambda: nn.Sequential(nn.Linear(8, 8), nn.Dropout1d(0.5)),
    "nn.AlphaDropout": lambda: nn.Sequential(nn.Linear(8, 8), nn.AlphaDropout(0.5)),
    "nn.FeatureAlphaDropout": lambda: nn.Sequential(nn.Linear(8, 8), nn.FeatureAlphaDropout(0.5)),
    "nn.MultiheadAttention": lambda: _First(nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)),
    "nn.TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5, batch_first=True),
    "F.scaled_dot_product_attention": lambda: _SDPA(),
    "torch.dropout": lambda: _TorchDropout(),
    "everything": DropoutEverywhere,
}


class _First(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        return self.attn(x, x, x)[0]


class _SDPA(nn.Module):
    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x, None, 0.5 if self.training else 0.0)


class _TorchDropout(nn.Module):
    def forward(self, x):
        return torch.dropout(x, 0.5, self.training)


@pytest.mark.parametrize("case", sorted(DROPOUT_CASES))
def test_remove_dropout_makes_train_outputs_equal_eval_outputs_until_restored(case):
    torch.manual_seed(0)
    module = DROPOUT_CASES[case]()
    x = torch.randn(2, 5, 8)
    assert not _train_equals_eval(module, x), "the case must show dropout before removal"
    report = seed_all(0, remove_dropout=True)
    assert report.remove_dropout and dropout_removed()
    assert _train_equals_eval(module, x)
    assert restore_dropout() is True
    assert not dropout_removed()
    assert not _train_equals_eval(module, x)


def test_remove_dropout_keeps_gradients_flowing():
    seed_all(0, remove_dropout=True)
    layer = nn.Linear(4, 4)
    out = F.dropout(layer(torch.randn(3, 4)), 0.5, training=True)
    out.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_remove_dropout_twice_pushes_one_mode_and_restore_is_idempotent():
    from torch.overrides import _get_current_function_mode_stack

    depth = len(_get_current_function_mode_stack())
    seed_all(0, remove_dropout=True)
    seed_all(0, remove_dropout=True)
    assert len(_get_current_function_mode_stack()) == depth + 1
    assert restore_dropout() is True
    assert restore_dropout() is False
    assert len(_get_current_function_mode_stack()) == depth


class _CountingMode(TorchFunctionMode):
    """Stands in for probe's capture mode: records every function it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_mode_pushed_after_dropout_removal_sees_calls_and_dropout_stays_removed():
    seed_all(0, remove_dropout=True)
    x = torch.randn(4, 8)
    with _CountingMode() as counting:
        out = F.dropout(x, 0.5, training=True)
    assert "dropout" in counting.seen
    assert torch.equal(out, x)
    assert dropout_removed()


def test_restore_dropout_refuses_while_a_later_mode_is_active_then_works_after_it_pops():
    seed_all(0, remove_dropout=True)
    counting = _CountingMode()
    counting.__enter__()
    try:
        with pytest.raises(SeedError, match="_CountingMode.*stop it first"):
            restore_dropout()
        assert dropout_removed()
    finally:
        counting.__exit__(None, None, None)
    assert restore_dropout() is True


def test_dropout_remover_works_as_a_context_manager_under_an_earlier_mode():
    x = torch.randn(4, 8)
    with _CountingMode() as counting, DropoutRemover():
        out = F.dropout(x, 0.5, training=True)
    assert torch.equal(out, x)
    assert "dropout" in counting.seen  # re-issued call reaches the outer mode


@pytest.mark.parametrize("value", [1, "yes", None])
def test_bad_remove_dropout_raises_seed_error(value):
    with pytest.raises(SeedError, match="remove_dropout"):
        seed_all(1, remove_dropout=value)


def test_hash_seed_note_says_fixed_only_when_the_process_started_with_that_seed():
    code = ("from probe.seed import seed_all; "
            "print(seed_all(4).hash_seed_note); print(seed_all(5).hash_seed_note)")
    env = dict(os.environ, PYTHONHASHSEED="4")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(HERE), check=True).stdout.splitlines()
    assert "str hashes are fixed" in out[0]
    assert "child processes only" in out[1] and "PYTHONHASHSEED=4" in out[1]
