"""Fingerprints find where two long runs part: a tiny MLP trained 2,000 steps under
PrecisionDebugger with "fingerprint": true (fingerprint_training.py)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fingerprint_training as training
from probe.errors import DivergenceError
from probe.fingerprint import compare, file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
STEPS = 2000


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain run, 2,000 steps: every test's reference."""
    path = str(tmp_path_factory.mktemp("fingerprints") / "reference")
    training.train(path, STEPS)
    return path


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fingerprints") / "injected")
    training.train(path, STEPS, "inject")
    return path


def _read(path):
    return file.read(file.find_file(path))


def test_every_optimizer_step_is_one_row_per_parameter_gradient_and_adam_state(reference):
    prints = _read(reference)
    assert prints.steps.tolist() == list(range(STEPS))
    names = sorted(entry["name"] for entry in prints.tensors)
    expected = sorted(f"{kind}/{param}" for param in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
                      for kind in ("param", "grad")) + sorted(
        f"state/{param}/{key}" for param in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        for key in ("exp_avg", "exp_avg_sq"))
    assert names == sorted(expected)
    assert np.isfinite(prints.loss).all()  # the loss debugger.note_loss was given
    assert np.isfinite(prints.sketch).all() and np.isfinite(prints.numbers).all()


def test_a_one_parameter_change_at_step_1337_is_a_jump_at_that_step_and_that_parameter(reference, injected):
    result = compare.compare(_read(reference), _read(injected))
    assert result.parting_step == training.INJECT_STEP
    assert result.parting_kind == "jump"
    assert result.jump_step == training.INJECT_STEP
    assert [t.name for t in result.jumped] == [training.INJECTED]
    assert result.verdict == "diverged"


def test_probe_compare_json_names_step_1337_and_exits_1(reference, injected, tmp_path):
    html = tmp_path / "parts.html"
    done = subprocess.run([sys.executable, "-m", "probe", "compare", reference, injected, "--json",
                           "--html", str(html)], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert data["verdict"] == "diverged"
    first = data["first_divergence"]
    assert (first["step"], first["key"], first["module"], first["slot"]) == (
        training.INJECT_STEP, training.INJECTED, "fc2", "param.bias")
    assert data["parting"]["kind"] == "jump"
    # the compare contract's values: the optimizer's updates are forward calls in a step file
    assert (first["phase"], first["origin"], first["made_by"], first["parting"]) == (
        "forward", "introduced", "optimizer", "jump")
    configs = data["dump_configs"]
    assert configs["a"]["step"] == configs["b"]["step"] == [training.INJECT_STEP]
    assert configs["a"]["task"] == "tensor" and configs["a"]["dump_path"] != configs["b"]["dump_path"]
    page = html.read_text()
    assert "<svg" in page and training.INJECTED in page and "rounding envelope" in page


def test_runs_that_only_sum_in_another_order_drift_apart_without_a_jump(reference, tmp_path):
    reordered = str(tmp_path / "reordered")
    training.train(reordered, 800, "reorder")
    result = compare.compare(_read(reference), _read(reordered))
    assert result.steps == list(range(800))
    assert result.parting_step is not None, "the pair never parted: the test shows nothing"
    assert result.parting_kind == "drift"
    assert result.jump_step is None and result.verdict == "pass"


def test_live_reference_catches_step_1337_dumps_it_in_full_and_stops(reference, tmp_path, capfd):
    candidate = str(tmp_path / "live")
    with pytest.raises(DivergenceError, match=f"step {training.INJECT_STEP} jumped"):
        training.train(candidate, STEPS, "inject", reference=reference, stop_on_divergence=True)
    step_folders = sorted(name for name in os.listdir(candidate) if name.startswith("step"))
    assert step_folders == [f"step{training.INJECT_STEP}"]  # the provisional captures were dropped
    from probe.dump.reader import load

    dump = load(os.path.join(candidate, f"step{training.INJECT_STEP}", "rank0.h5"))
    assert any(record["key"].startswith("fc2") for record in dump.records())
    message = capfd.readouterr().err
    assert message.count("jumped away from the reference") == 1 and training.INJECTED in message
    assert _read(candidate).steps[-1] == training.INJECT_STEP  # stopped there


def test_a_reference_with_missing_steps_and_an_early_end_is_reported_not_crashed_on(reference, tmp_path, capfd):
    # a reference holding steps 0-99 without 50-54
    full = _read(reference)
    shortened = str(tmp_path / "short" / "fingerprints" / "rank0.h5")
    writer = file.FingerprintWriter(shortened, {"config": "{}"}, full.k)
    names = [entry for entry in full.tensors]
    for position in [*range(50), *range(55, 100)]:
        rows = np.zeros((len(names) + 1, 8 + full.k))  # + the step row
        rows[:-1, 1] = range(len(names))
        rows[:-1, 2:8] = full.numbers[position]
        rows[:-1, 8:] = full.sketch[position]
        writer.append(position, float(full.loss[position]), names if position == 0 else [], rows)
    writer.close()
    training.train(str(tmp_path / "candidate"), 120, reference=str(tmp_path / "short"))
    err = capfd.readouterr().err
    assert "has no steps 50-54; not compared" in err
    assert "ends at step 99: step 100 and later are not compared" in err
    assert "jumped" not in err


def test_a_run_killed_mid_training_leaves_every_finished_step_readable(tmp_path):
    dump = str(tmp_path / "killed")
    done = subprocess.run([sys.executable, os.path.join(HERE, "fingerprint_training.py"), dump, "400",
                           "--kill-at", "150"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == -9, done.stderr
    prints = _read(dump)
    assert prints.steps.tolist() == list(range(150))
    assert np.isfinite(prints.numbers).all() and np.isfinite(prints.sketch).all()
