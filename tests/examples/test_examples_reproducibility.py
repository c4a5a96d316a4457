"""examples/reproducibility's self-check and NaN hunt run as a user runs them and print what
their README promises (run from a temporary working directory in the test's process, like
tests/examples/test_examples.py)."""

import os
import re

import example_runs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDER = os.path.join(REPO_ROOT, "examples", "reproducibility")


def run_script(name, tmp_path, *extra):
    code, stdout, stderr = example_runs.this_process(os.path.join(FOLDER, name), tmp_path, "--out",
                                                     str(tmp_path / "out"), *extra)
    assert code == 0, f"{name} exited {code}\n{stdout}\n{stderr}"
    return stdout


def test_self_check_passes_the_seeded_training_and_names_the_clock_seeded_draw(tmp_path):
    stdout = run_script("self_check.py", tmp_path, "--smoke")
    assert "1. as written: probe determinism exit code 0" in stdout
    assert "2. with clock-seeded input noise: probe determinism exit code 1" in stdout
    assert re.search(r"nondeterministic op: <root> torch\.randn#0 \(forward\) at step 0", stdout), stdout
    assert re.search(r"source: \S*self_check\.py:\d+", stdout)
    assert "RESULT: the seeded training repeats bit for bit; the unseeded draw was found" in stdout


def test_nan_hunt_stops_at_the_float16_overflow_and_names_the_op(tmp_path):
    stdout = run_script("nan_hunt.py", tmp_path, "--dtype", "float16")
    assert re.search(r"^MLP regression, SGD lr 0\.8, float16: NaN/Inf appeared at step \d+$", stdout, re.M)
    assert "first NaN/Inf: step" in stdout and "fc2 functional.linear#0 (forward, api)" in stdout
    assert "origin: introduced here" in stdout
    assert "note: float16 overflow" in stdout
    assert (tmp_path / "out" / "dump_float16").is_dir()
