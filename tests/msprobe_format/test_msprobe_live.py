"""Real msprobe dumps made now, in subprocesses (mindstudio-probe patches torch for the rest of the
process it runs in): the verdicts on the project's TinyGPT.

Runs where mindstudio-probe is importable by this interpreter, or by the one named in
PROBE_MSPROBE_PYTHON (msprobe kept out of the test environment: python3 -m venv /tmp/msvenv;
/tmp/msvenv/bin/pip install torch==2.13.0 mindstudio-probe==26.2.0).
"""

import os
import subprocess
import sys

import pytest

from conftest import SCRIPT, probe_dump
from probe import compare

INSTALL = "pip install mindstudio-probe==26.2.0 (or name a Python that has it in PROBE_MSPROBE_PYTHON)"


def msprobe_python() -> str:
    """The interpreter that has mindstudio-probe, asked by its installed metadata: msprobe is never
    imported here."""
    python = os.environ.get("PROBE_MSPROBE_PYTHON", sys.executable)
    check = "from importlib.metadata import version; version('mindstudio-probe')"
    if subprocess.run([python, "-c", check], capture_output=True, timeout=60).returncode != 0:
        pytest.skip(f"mindstudio-probe is not installed: {INSTALL}")
    return python


@pytest.fixture(scope="module")
def gpt_dumps(tmp_path_factory):
    """TinyGPT dumped by msprobe (mix, statistics): clean twice, with an extra call, with a bf16
    kernel; all at once, each in its own process."""
    python = msprobe_python()
    root = tmp_path_factory.mktemp("msprobe_live")
    runs = {"clean": ["--steps", "2"], "again": ["--steps", "2"], "extra_call": ["--variant", "extra_call"],
            "bf16": ["--variant", "bf16"]}
    started = {name: subprocess.Popen([python, SCRIPT, str(root / name), "--model", "gpt", *arguments],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for name, arguments in runs.items()}
    for name, process in started.items():
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, f"msprobe run {name} failed:\n{err[-2000:]}"
    dumps = {name: str(root / name) for name in runs}
    dumps["probe"] = probe_dump(root / "probe", model="gpt", steps=2)
    return dumps


def test_real_msprobe_dumps_of_one_run_pass(gpt_dumps):
    result = compare(gpt_dumps["clean"], gpt_dumps["again"])
    assert result.verdict == "pass" and result.counts["diverged"] == 0 and result.counts["only_a"] == 0


def test_real_msprobe_dumps_with_an_extra_call_pass(gpt_dumps):
    result = compare(gpt_dumps["clean"], gpt_dumps["extra_call"], steps=[0])
    assert result.verdict == "pass" and result.counts["only_b"] == 3


def test_a_real_bf16_kernel_is_introduced_at_its_linear(gpt_dumps):
    found = compare(gpt_dumps["clean"], gpt_dumps["bf16"], steps=[0]).first_divergence
    assert (found.module, found.op, found.phase, found.origin) == (
        "blocks.0.mlp.0", "functional.linear", "forward", "introduced")


def test_a_real_msprobe_dump_against_probes_dump_of_the_same_run_passes(gpt_dumps):
    result = compare(gpt_dumps["clean"], gpt_dumps["probe"])
    assert result.verdict == "pass" and result.counts["matched"] > 500
