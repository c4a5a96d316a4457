"""examples/reproducibility's self-check and NaN hunt run as a user runs them and print what
their README promises (run from a temporary working directory, like tests/examples/test_examples.py)."""

import os
import re
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDER = os.path.join(REPO_ROOT, "examples", "reproducibility")


def run_script(name, tmp_path, *extra):
    command = [sys.executable, os.path.join(FOLDER, name), "--out", str(tmp_path / "out"), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


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
