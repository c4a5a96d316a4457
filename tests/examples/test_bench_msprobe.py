"""bench/dump_overhead.py with and without msprobe (mindstudio-probe is optional, not in CI).

The msprobe variants are timed in the benchmark's process next to probe's; what keeps them
from slowing the other variants down is TorchPatches (bench/msprobe_variants.py): it takes
msprobe's replacements of torch functions out after each msprobe step and puts them back
before the next. These tests check that on patches made here the same way msprobe makes
them, and that the benchmark runs, with clean --json output, whether msprobe is there or not.
"""

import json
import os
import types

import torch
import torch.nn.functional as F
from torch.utils.hooks import BackwardHook

import example_runs
from bench import dump_overhead, msprobe_variants
from bench.msprobe_variants import TorchPatches, snapshot

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _patch_like_msprobe():
    """Replace a module function, a class method, and a method torch.Tensor inherits (msprobe
    sets those on Tensor itself); also add a submodule the way a lazy import does."""
    originals = (F.relu, BackwardHook.setup_input_hook, "add" in vars(torch.Tensor))

    def wrapped_relu(*args, **kwargs):
        return originals[0](*args, **kwargs)

    F.relu = wrapped_relu
    BackwardHook.setup_input_hook = lambda self, args: args
    torch.Tensor.add = lambda self, *args, **kwargs: torch._C.TensorBase.add(self, *args, **kwargs)
    F._lazily_imported_submodule = types.ModuleType("lazily_imported_submodule")
    return originals


def _undo(originals):
    F.relu, BackwardHook.setup_input_hook = originals[0], originals[1]
    if not originals[2] and "add" in vars(torch.Tensor):
        del torch.Tensor.add
    vars(F).pop("_lazily_imported_submodule", None)


def test_torch_patches_revert_restores_torch_and_apply_reinstalls_the_patches():
    owners = [F, torch.Tensor, BackwardHook]
    before = snapshot(owners)
    originals = _patch_like_msprobe()
    try:
        patches = TorchPatches(before, snapshot(owners), always=[torch.Tensor])
        assert sorted(patches.names()) == ["BackwardHook.setup_input_hook", "Tensor.add", "torch.nn.functional.relu"]
        wrapped_relu, wrapped_hook = F.relu, BackwardHook.setup_input_hook

        patches.revert()
        assert F.relu is originals[0] and BackwardHook.setup_input_hook is originals[1]
        assert "add" not in vars(torch.Tensor)  # inherited again, as before
        assert isinstance(F._lazily_imported_submodule, types.ModuleType)  # not a patch: kept

        patches.apply()
        assert F.relu is wrapped_relu and BackwardHook.setup_input_hook is wrapped_hook
        assert "add" in vars(torch.Tensor)

        torch.Tensor.view_as = lambda self, other: other  # what patched code may set later
        patches.revert()
        assert "view_as" not in vars(torch.Tensor) and F.relu is originals[0]
    finally:
        _undo(originals)
        vars(torch.Tensor).get("view_as") and delattr(torch.Tensor, "view_as")


def test_table_prints_dashes_and_the_install_command_without_msprobe():
    result = {"label": "MLP", "baseline_ms": 0.5, "stats api": 8.0}
    header, _, row = dump_overhead.format_table([result]).splitlines()
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    assert cells["msprobe L1"] == "-" and cells["msprobe L0"] == "-" and cells["stats api"] == "8.00x"
    args = dump_overhead.argparse.Namespace(sketch_only=False, no_msprobe=False)
    assert "pip install mindstudio-probe==26.2.0" in dump_overhead.msprobe_footer(False, args)


def test_quick_benchmark_runs_and_its_json_stdout_is_clean_with_or_without_msprobe():
    code, stdout, stderr = example_runs.this_process(os.path.join(REPO, "bench", "dump_overhead.py"), REPO,
                                                     "--quick", "--models", "mlp", "--no-count", "--json")
    assert code == 0, stderr[-2000:]
    report = json.loads(stdout)  # msprobe's log goes to stderr, never into the JSON
    (result,) = report["results"]
    assert result["stats api"] > 1.0
    if msprobe_variants.available():
        assert report["msprobe"] == msprobe_variants.version()
        assert result["msprobe L1"] > 1.0 and result["msprobe L0"] > 1.0
        assert result["msprobe_L1_records"] > 0
    else:
        assert report["msprobe"] is None and "msprobe L1" not in result
