"""The supported torch range: what setup.cfg says, what `make setup` installs, and the private
torch API probe/compat/ relies on, checked on whichever torch runs the suite (CI runs it on
2.4.1, 2.8.0, 2.12.0, 2.13.0 and 2.15.0)."""

import configparser
import os
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from probe import compat
from torch_versions import VERSION

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_setup_cfg_requires_torch_2_4_and_this_torch_is_in_range():
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO_ROOT, "setup.cfg"))
    requires = config["options"]["install_requires"].split()
    assert "torch>=2.4" in requires
    assert VERSION >= (2, 4)


def test_torch_pins_hold_the_installed_torch_and_pick_a_transformers_that_supports_it():
    printed = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "torch_pins.py")],
                             capture_output=True, text=True, check=True).stdout.split()
    from importlib.metadata import version

    assert printed[0] == f"torch=={version('torch')}"
    assert ("transformers<5" in printed) == (VERSION < (2, 6))


def test_installed_transformers_runs_on_this_torch():
    """`make setup` installs the models extra with a transformers whose torch backend is on."""
    from torch_versions import transformers_or_skip

    transformers = transformers_or_skip()
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    assert model.transformer.wte.weight.grad is not None


def test_compat_mode_stack_helpers_take_one_mode_out_and_put_it_back():
    class Outer(TorchFunctionMode):
        pass

    class Inner(TorchFunctionMode):
        pass

    outer, inner = Outer(), Inner()
    with outer, inner:
        assert compat.function_mode_stack()[-2:] == [outer, inner]
        compat.pop_function_mode()
        assert compat.function_mode_stack()[-1] is outer
        compat.push_function_mode(inner)
        assert compat.function_mode_stack()[-1] is inner
    assert compat.function_mode_stack() == []


def test_compat_sequence_numbers_grow_with_node_creation_and_task_ids_differ_per_pass():
    x = torch.randn(3, requires_grad=True)
    first = x * 2
    second = first.exp()
    assert compat.sequence_nr(second.grad_fn) > compat.sequence_nr(first.grad_fn)
    tasks = []
    second.grad_fn.register_hook(lambda *_: tasks.append(compat.graph_task_id()))
    second.sum().backward(retain_graph=True)
    second.sum().backward()
    assert len(tasks) == 2 and tasks[0] != tasks[1] and -1 not in tasks


@pytest.mark.parametrize("name", ["float8_e8m0fnu", "float4_e2m1fn_x2", "bfloat16"])
def test_has_dtype_follows_the_versions_that_added_each_dtype(name):
    since = {"float8_e8m0fnu": (2, 7), "float4_e2m1fn_x2": (2, 8), "bfloat16": (1, 0)}[name]
    assert compat.has_dtype(name) == (VERSION >= since)
