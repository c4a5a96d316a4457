"""Stable names: an extra call in one module renames nothing outside it; op names."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from probe.capture.eager.naming import IGNORED_OPS, Namer, op_name
from probe.config import Config
from probe.debugger.debugger import PrecisionDebugger
from probe.dump.reader import load


class Block(nn.Module):
    def __init__(self, width, extra=False):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.extra = extra

    def forward(self, x):
        h = self.fc(self.norm(x))
        if self.extra:
            torch.relu(h)  # the inserted call; its result is discarded
        return x + F.gelu(h)


class Stack(nn.Module):
    def __init__(self, extra_in=None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(8, extra=(i == extra_in)) for i in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(torch.relu(x))


def _records(tmp_path, level, extra_in):
    torch.manual_seed(0)
    model = Stack(extra_in)
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level=level))
    torch.manual_seed(1)
    x = torch.randn(4, 8)
    with debugger.capture(model):
        model(x).square().mean().backward()
    return {row["key"]: row for row in load(tmp_path).records(step=0)}


@pytest.mark.parametrize("level", ["api", "module", "mix"])
def test_extra_call_in_one_module_renames_nothing_outside_it(tmp_path, level):
    before = _records(tmp_path / "before", level, extra_in=None)
    after = _records(tmp_path / "after", level, extra_in=1)
    assert set(before) <= set(after), sorted(set(before) - set(after))[:5]
    added = set(after) - set(before)
    if level == "module":
        assert not added  # torch.relu is not a module call
    else:
        assert added and all(key.startswith("blocks.1/torch.relu#") for key in added), added
    # every shared record describes the same tensor, although its seq moved
    for key in before:
        a, b = before[key], after[key]
        assert (a["shape"], a["value"]) == (b["shape"], b["value"]), key
        if a["dtype"]:  # a tensor: same statistics (values have NaN statistics)
            assert (a["min"], a["max"], a["norm"]) == (b["min"], b["max"], b["norm"]), key
    moved = [key for key in before if before[key]["seq"] != after[key]["seq"]]
    if level != "module":
        assert moved  # execution order changed after the extra call: seq saw it, keys did not


def test_index_counts_calls_per_module_and_op_within_the_step(tmp_path):
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level="mix"))
    for _ in range(2):
        with debugger.capture(model):
            model(torch.randn(2, 3))
    for step in (0, 1):  # counters restart every step
        keys = {row["key"] for row in load(tmp_path).records(step=step)}
        assert {"0/Linear#0/forward/output.0", "0/Linear#1/forward/output.0",
                "0/functional.linear#0/forward/output.0",
                "0/functional.linear#1/forward/output.0", "1/Tanh#0/forward/output.0",
                "/Sequential#0/forward/output.0"} <= keys
        assert not any(key.startswith("2/") for key in keys)  # a shared module has one path


def test_seq_follows_execution_order(tmp_path):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    x = torch.ones(3)
    with debugger.capture():
        a = torch.exp(x)
        torch.log(a)
        torch.exp(a)
    rows = load(tmp_path).records(step=0)
    order = [(row["op"], row["index"]) for row in sorted(rows, key=lambda r: r["seq"])]
    calls = list(dict.fromkeys(order))
    assert calls == [("torch.exp", 0), ("torch.log", 0), ("torch.exp", 1)]


@pytest.mark.parametrize("func, name", [
    (F.linear, "functional.linear"),
    (F.layer_norm, "functional.layer_norm"),
    (F.max_pool2d, "functional.max_pool2d"),
    (torch.relu, "torch.relu"),
    (torch.einsum, "torch.einsum"),
    (torch.Tensor.add_, "Tensor.add_"),
    (torch.Tensor.__getitem__, "Tensor.__getitem__"),
    (torch.Tensor.split, "Tensor.split"),
    (torch.linalg.vector_norm, "linalg.vector_norm"),
    (torch.fft.fft, "fft.fft"),
    (torch.special.erf, "special.erf"),
    (dist.all_reduce, "distributed.all_reduce"),
])
def test_op_names_are_short_and_stable(func, name):
    assert op_name(func) == name


@pytest.mark.parametrize("func", [torch.Tensor.size, torch.Tensor.dim, torch.Tensor.item,
                                  torch.Tensor.backward, torch.Tensor.register_hook,
                                  torch.is_tensor, torch.Tensor.shape.__get__])
def test_metadata_calls_are_ignored(func):
    assert op_name(func) is None


def test_ignore_list_holds_no_math():
    math_ops = {"Tensor.add", "Tensor.mul", "torch.relu", "functional.linear", "Tensor.clone",
                "Tensor.__getitem__", "Tensor.__setitem__", "Tensor.to", "torch.randn"}
    assert not math_ops & IGNORED_OPS


def test_namer_counts_locally_and_sequences_globally():
    namer = Namer()
    assert [namer.index("a", "relu"), namer.index("b", "relu"), namer.index("a", "relu")] == [0, 0, 1]
    assert [namer.next_seq(), namer.next_seq()] == [0, 1]
    namer.reset()
    assert (namer.index("a", "relu"), namer.next_seq()) == (0, 0)
