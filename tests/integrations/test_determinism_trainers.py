"""``probe determinism`` on a transformers Trainer script: unedited, and with probe's callback
given a config of its own (tests/scripts/hf_trainer_train.py: a tiny Llama, nothing
downloaded). Each test is one ``probe determinism`` (two runs, two processes): the process
boundary is what is tested."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="pip install 'precision-probe[hf]'")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "tests", "scripts", "hf_trainer_train.py")


def determinism(tmp_path, *script_args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
    env.update(PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    config = tmp_path / "inline.json"  # step files written by step(): no writer process to start
    config.write_text(json.dumps({"writer": "inline"}))
    return subprocess.run([sys.executable, "-m", "probe.cli", "determinism", "-c", str(config), "--",
                           sys.executable, SCRIPT, "--out", str(tmp_path / "trainer"), *script_args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


def noise_line() -> int:
    with open(SCRIPT, encoding="utf-8") as handle:
        return next(n for n, line in enumerate(handle, 1) if "unseeded on purpose" in line)


def test_an_unedited_trainer_script_that_repeats_is_bit_identical(tmp_path):
    done = determinism(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("note (run 1): automatic capture: the model is LlamaForCausalLM (")
    assert lines[1].startswith("rank 0, run 1 vs run 2: bit-identical (") and "steps 0, 1" in lines[1]
    assert "training loss" in done.stderr and "training loss" not in done.stdout


def test_a_planted_nondeterministic_op_in_an_unedited_trainer_script_is_named(tmp_path):
    done = determinism(tmp_path, "--planted-noise", "--steps", "1")
    assert done.returncode == 1, done.stderr[-3000:]
    out = done.stdout
    assert "nondeterministic op: model.layers.0 torch.randn#0 (forward) at step 0" in out
    assert f"source: {SCRIPT}:{noise_line()}" in out
    assert "torch.randn drew different numbers in identical runs" in out


def test_the_commands_config_wins_over_the_callbacks_own_and_the_report_says_so(tmp_path):
    """The script's ProbeCallback asks for statistics and fingerprints (which capture no step
    in full) into its own folder at level module: the runs record checksums of every step
    into the command's folders (nothing lands in the script's), keep the callback's level,
    and the report names what gave way."""
    own = {"task": "statistics", "dump_path": "own_dump", "level": "module", "fingerprint": True}
    done = determinism(tmp_path, "--planted-noise", "--steps", "1", "--callback-config", json.dumps(own))
    assert done.returncode == 1, done.stderr[-3000:]
    out = done.stdout
    first = out.splitlines()[0]
    assert first.startswith("note (run 1): the script's own config (<dict>) gives way to probe "
                            "determinism's (")
    assert 'task "checksum" (the script\'s: "statistics")' in first
    assert 'dump_path "' in first and '(the script\'s: "own_dump")' in first
    assert "fingerprint false (the script's: true)" in first
    # level module, the callback's: the innermost module holding the draw is named
    assert "nondeterministic op: model.layers.0.mlp LlamaMLP#0 (forward) at step 0" in out
    assert not (tmp_path / "own_dump").exists()
