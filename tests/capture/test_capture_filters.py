"""scope, list and data_mode select what a capture records."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe.config import Config
from probe.debugger.debugger import PrecisionDebugger
from probe.dump.reader import load


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(11))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(torch.tanh(x))


def _rows(tmp_path, level="mix", **config):
    torch.manual_seed(0)
    model = Net()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level=level, **config))
    with debugger.capture(model):
        model(torch.randn(3, 4)).sum().backward()
    return load(tmp_path).records(step=0)


def test_scope_keeps_modules_under_the_prefix_on_dot_boundaries(tmp_path):
    rows = _rows(tmp_path, scope=["blocks.1"])
    modules = {row["module"] for row in rows}
    assert modules == {"blocks.1", "blocks.1.0", "blocks.1.1"}  # not blocks.10
    assert {row["kind"] for row in rows} == {"api", "module", "param"}
    assert any(row["phase"] == "backward" for row in rows)


def test_list_selects_ops_by_exact_name(tmp_path):
    rows = _rows(tmp_path, list=["functional.gelu"])
    assert {row["op"] for row in rows} == {"functional.gelu"}
    assert len({row["module"] for row in rows}) == 11


def test_list_selects_by_key_substring_and_by_regex(tmp_path):
    rows = _rows(tmp_path / "sub", list=["tanh"])
    assert {row["op"] for row in rows} == {"torch.tanh"}
    rows = _rows(tmp_path / "re", list=["re:^functional\\.(gelu|linear)$"])
    assert {row["op"] for row in rows} == {"functional.gelu", "functional.linear"}
    rows = _rows(tmp_path / "mod", list=["Linear"], level="module")
    assert {row["op"] for row in rows} == {"Linear"}


@pytest.mark.parametrize("data_mode, phases, ios", [
    (["forward"], {"forward"}, {"in", "out"}),
    (["backward"], {"backward"}, {"in", "out"}),
    (["input"], {"forward", "backward"}, {"in"}),
    (["output"], {"forward", "backward"}, {"out"}),
    (["forward", "output"], {"forward"}, {"out"}),
    (["all"], {"forward", "backward"}, {"in", "out"}),
])
def test_data_mode_selects_phases_and_directions(tmp_path, data_mode, phases, ios):
    rows = _rows(tmp_path, data_mode=data_mode)
    assert {row["phase"] for row in rows} == phases
    assert {row["io"] for row in rows} == ios


def test_filtered_out_calls_keep_the_index_of_selected_ones(tmp_path):
    """Filtering must not change names: a key is the same with or without a list filter."""
    everything = {row["key"] for row in _rows(tmp_path / "all")}
    selected = {row["key"] for row in _rows(tmp_path / "gelu", list=["functional.gelu"])}
    assert selected and selected <= everything


def test_api_level_without_a_model_records_module_as_root(tmp_path):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level="api"))
    with debugger.capture():
        F.silu(torch.randn(3))
    rows = load(tmp_path).records(step=0)
    assert {row["module"] for row in rows} == {""}
