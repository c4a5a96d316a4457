"""The stored msprobe dumps (tests/data/msprobe, made by tests/scripts/make_msprobe_fixtures.py
with mindstudio-probe 26.2.0) and probe's own dump of the run they recorded."""

import argparse
import importlib.util
import json
import os

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(TESTS, "data", "msprobe")
SCRIPT = os.path.join(TESTS, "scripts", "msprobe_dumps.py")


def stored(name: str) -> str:
    return os.path.join(DATA, name)


def made_with() -> dict:
    with open(stored("made_with.json")) as handle:
        return json.load(handle)


def dump_script():
    spec = importlib.util.spec_from_file_location("msprobe_dumps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe_dump(out, **choices) -> str:
    """probe's dump of msprobe_dumps.py's run (its defaults: mlp, clean, statistics, mix)."""
    options = dict(tool="probe", model="mlp", variant="clean", task="statistics", level="mix", steps=1,
                   ranks=1, list=[], data_mode=["all"], summary_mode="statistics", out=str(out))
    options.update(choices)
    dump_script().train(argparse.Namespace(**options))
    return str(out)


@pytest.fixture(scope="session")
def same_run(tmp_path_factory):
    """probe's dumps of the runs mlp_a and mlp_b (level mix, two steps), mlp_l1 (api) and
    mlp_nonfinite (api) hold."""
    import torch

    if torch.__version__ != made_with()["torch"]:
        pytest.skip(f"the stored msprobe dumps were made with torch {made_with()['torch']}, this is "
                    f"{torch.__version__}: the same seeds may compute other numbers")
    root = tmp_path_factory.mktemp("same_run")
    return {"mix": probe_dump(root / "mix", steps=2), "api": probe_dump(root / "api", level="L1"),
            "nonfinite": probe_dump(root / "nonfinite", level="L1", variant="nonfinite")}
