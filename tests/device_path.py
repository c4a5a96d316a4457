"""Run a capture test module a second time on the accelerator's path.

``PROBE_DEVICE_PATH=1`` sends CPU tensors through the device bucket (statistics read once per
step, not per record), so that path is held by the same tests without a GPU. Each
``test_*_on_the_device_path.py`` module takes every test and fixture of one capture module
(the functions themselves: their globals, ``__file__`` included, stay the original's) and adds
a module fixture that sets the variable before anything else of the module runs. Being
modules of their own, they run in parallel with the rest of the suite (pytest-xdist) instead
of in a second pytest process after it.
"""

from __future__ import annotations

import importlib
import json
import os

import h5py
import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _on_the_device_path():
    """Autouse fixtures of a scope run before the others of that scope: the module's own
    fixtures that train and capture already see the variable."""
    before = os.environ.get("PROBE_DEVICE_PATH")
    os.environ["PROBE_DEVICE_PATH"] = "1"
    yield
    if before is None:
        del os.environ["PROBE_DEVICE_PATH"]
    else:
        os.environ["PROBE_DEVICE_PATH"] = before


def _test_this_module_captures_through_the_device_bucket(tmp_path):
    from probe.debugger import PrecisionDebugger

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    debugger = PrecisionDebugger({"dump_path": str(tmp_path), "level": "mix", "writer": "inline"})
    with debugger.capture(model):
        model(torch.randn(2, 4)).sum().backward()
    debugger.close()
    with h5py.File(debugger.last_file, "r") as step:
        cost = json.loads(step.attrs["cost"])
    assert cost["host_transfers"] == 1  # the host path copies nothing to the host: 0


def rerun_on_the_device_path(module_name: str, namespace: dict) -> None:
    """Copy module_name's tests, fixtures (private ones included) and marks into namespace,
    the globals of the module that runs them again with PROBE_DEVICE_PATH=1, and add a test
    that the module's captures do take the device path."""
    module = importlib.import_module(module_name)
    for name, value in vars(module).items():
        if not (name.startswith("__") and name.endswith("__")):
            namespace.setdefault(name, value)
    namespace["_on_the_device_path"] = _on_the_device_path
    namespace["test_this_module_captures_through_the_device_bucket"] = \
        _test_this_module_captures_through_the_device_bucket
