"""Wrappers (DDP, torch.compile, activation checkpointing) never change a record's name."""

import torch
from torch import nn

import probe
from probe.capture.eager import wrappers


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Holder(nn.Module):
    """Stands in for DDP: holds the model as ``module`` under a wrapper class name."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner

    def forward(self, x):
        return self.module(x)


Holder.__name__ = "DistributedDataParallel"


class Checkpointed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self._checkpoint_wrapped_module = inner

    def forward(self, x):
        return self._checkpoint_wrapped_module(x)


Checkpointed.__name__ = "CheckpointWrapper"


def _paths(model):
    return [path for path, _ in wrappers.user_modules(model)]


def test_wrapper_segments_drop_out_of_every_module_path():
    torch.manual_seed(0)
    plain = Tiny()
    wrapped = Holder(Tiny())
    wrapped.module.fc1 = Checkpointed(wrapped.module.fc1)
    assert _paths(plain) == ["", "fc1", "act", "fc2"]
    assert _paths(wrapped) == ["", "fc1", "act", "fc2"]
    assert wrappers.unwrap(wrapped) is wrapped.module


def test_a_module_named_module_outside_a_wrapper_keeps_its_name():
    outer = nn.Sequential()
    outer.add_module("module", nn.Linear(2, 2))
    assert _paths(outer) == ["", "module"]


def test_fsdp2_style_class_swap_reports_the_users_class():
    class FSDPModule:
        pass

    swapped = type("FSDPLinear", (FSDPModule, nn.Linear), {})
    layer = nn.Linear(2, 2)
    layer.__class__ = swapped
    assert wrappers.user_kind(layer) == "Linear"
    assert wrappers.user_kind(nn.LayerNorm(2)) == "LayerNorm"


def _dump(tmp_path, name, model, level):
    cfg = {"task": "statistics", "level": level, "dump_path": str(tmp_path / name), "step": [0],
           "seed": 1, "writer": "inline"}
    debugger = probe.PrecisionDebugger(cfg)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with debugger.capture(model):
        model(x).sum().backward()
    debugger.close()
    return probe.load(str(tmp_path / name))


def test_wrapped_and_plain_models_dump_the_same_record_names(tmp_path):
    for level in ("module", "mix"):
        torch.manual_seed(0)
        plain = Tiny()
        torch.manual_seed(0)
        wrapped = Holder(Tiny())
        keys_plain = {r["key"] for r in _dump(tmp_path, f"plain-{level}", plain, level).records(step=0)}
        keys_wrapped = {r["key"] for r in _dump(tmp_path, f"wrapped-{level}", wrapped, level).records(step=0)}
        assert keys_plain == keys_wrapped
        assert not any(key.startswith("module.") for key in keys_wrapped)
