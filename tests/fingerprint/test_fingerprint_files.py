"""Fingerprint files, their compare without torch, and the config of fingerprints."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from probe.fingerprint import file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
K = 16
TENSORS = [{"name": f"param/fc{i}.weight", "kind": "param", "param": f"fc{i}.weight", "state": "",
            "dtype": "float32", "shape": [64, 64], "numel": 4096} for i in range(3)]


def _write(path, steps, gap_of):
    """A fingerprint file whose tensors' sketches differ from the reference's by gap_of(step,
    tensor) of their norm (1.0); gap_of None writes the reference."""
    noise = np.random.default_rng(0)
    base = np.random.default_rng(1).normal(size=(steps, len(TENSORS), K))
    writer = file.FingerprintWriter(path, {"config": json.dumps({"dump_path": os.path.dirname(path)})}, K)
    for step in range(steps):
        rows = np.zeros((len(TENSORS) + 1, 8 + K))  # + the step row
        rows[:-1, 1] = range(len(TENSORS))
        rows[:, 5] = 1.0  # the norm
        for t in range(len(TENSORS)):
            shift = 0.0 if gap_of is None else gap_of(step, t)
            rows[t, 8:] = base[step, t] + shift * noise.normal(size=K)
        writer.append(step, 1.0, TENSORS if step == 0 else [], rows)
    writer.close()
    return path


def _run(tmp_path, name, gap_of, steps=60):
    return _write(str(tmp_path / name / "fingerprints" / "rank0.h5"), steps, gap_of)


def _compare_without_torch(*args):
    """probe compare in a process where importing torch fails."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from probe.cli import main\n"
            f"sys.argv = ['probe', 'compare', *{list(args)!r}]\n"
            "main()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO))


def test_a_written_file_reads_back_step_by_step_and_whole(tmp_path):
    path = _run(tmp_path, "a", None, steps=5)
    whole = file.read(path)
    assert whole.steps.tolist() == [0, 1, 2, 3, 4] and whole.sketch.shape == (5, 3, K)
    assert [entry["name"] for entry in whole.tensors] == [entry["name"] for entry in TENSORS]
    follower = file.Follower(path)
    found = follower.get(3)
    assert found.step == 3 and np.array_equal(found.tensors["param/fc1.weight"][1], whole.sketch[3, 1])
    assert follower.get(7) is None and follower.last_step == 4
    follower.close()


def test_a_reader_sees_the_steps_a_live_writer_adds(tmp_path):
    path = str(tmp_path / "growing.h5")
    writer = file.FingerprintWriter(path, {}, K)
    rows = np.zeros((2, 8 + K))
    writer.append(0, 1.0, TENSORS[:1], rows.copy())
    follower = file.Follower(path)
    assert follower.get(1) is None
    writer.append(1, 2.0, [], rows.copy())
    assert follower.get(1).loss == 2.0
    follower.close()
    writer.close()


def test_steps_of_different_tensor_counts_read_back_row_for_row(tmp_path):
    """The writer keeps a memory layout per row count it has appended: a step with fewer or
    more tensors than the one before must still land whole, in its own rows."""
    path = str(tmp_path / "counts.h5")
    writer = file.FingerprintWriter(path, {}, K)
    values = np.random.default_rng(2)
    written = {}
    for step, count in enumerate([3, 1, 3, 2, 1, 3]):
        rows = np.zeros((count + 1, 8 + K))
        rows[:-1, 1] = range(count)
        rows[:-1, 2:] = values.normal(size=(count, 6 + K))
        written[step] = rows[:-1, 2:].copy()
        writer.append(step, float(step), TENSORS if step == 0 else [], rows)
    writer.close()
    whole = file.read(path)
    assert whole.steps.tolist() == list(range(6)) and whole.loss.tolist() == [float(s) for s in range(6)]
    for step, expected in written.items():
        count = len(expected)
        assert np.array_equal(whole.numbers[step, :count], expected[:, :6])
        assert np.array_equal(whole.sketch[step, :count], expected[:, 6:])
        assert np.isnan(whole.numbers[step, count:]).all()


def test_compare_runs_without_torch_and_calls_slow_growth_drift_with_exit_0(tmp_path):
    reference = _run(tmp_path, "a", None)
    drifting = _run(tmp_path, "b", lambda step, t: 1e-7 * 1.25 ** step)
    done = _compare_without_torch(os.path.dirname(os.path.dirname(reference)),
                                  os.path.dirname(os.path.dirname(drifting)), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["verdict"] == "pass" and data["parting"]["kind"] == "drift"
    assert data["first_jump"] is None and data["first_divergence"] is None


def test_compare_without_torch_calls_a_sudden_gap_a_jump_with_exit_1(tmp_path):
    reference = _run(tmp_path, "a", None)
    jumping = _run(tmp_path, "b", lambda step, t: 1e-3 if (t == 2 and step >= 40) else 0.0)
    done = _compare_without_torch(reference, jumping)
    assert done.returncode == 1, done.stderr
    assert "The runs part at step 40 with a JUMP" in done.stdout
    assert "param/fc2.weight" in done.stdout and "verdict: diverged" in done.stdout


def test_a_compare_whose_sides_share_only_fingerprints_compares_them_and_says_so(tmp_path, capsys):
    """A recorded fingerprints only; B fingerprints and the full capture of step 1."""
    import fingerprint_training as training
    from probe.cli import main

    only_prints, with_steps = str(tmp_path / "a"), str(tmp_path / "b")
    training.train(only_prints, 3)
    training.train(with_steps, 3, step=[1])
    assert os.path.isdir(os.path.join(with_steps, "step1"))
    for args in ([], ["--json"]):
        with pytest.raises(SystemExit) as exited:
            main(["compare", only_prints, with_steps, *args])
        out = capsys.readouterr().out
        assert exited.value.code == 0, out
        note = (f"{only_prints} holds no step files: the two runs share only fingerprints, so "
                f"their fingerprints are compared ({with_steps} holds step files too)")
        if args:
            data = json.loads(out)
            assert data["note"] == note and data["kind"] == "fingerprints" and data["verdict"] == "pass"
        else:
            assert out.splitlines()[0] == f"note: {note}" and "verdict: pass" in out


def test_a_file_that_is_not_fingerprints_is_a_clear_error(tmp_path):
    from probe.errors import DumpFormatError

    bogus = tmp_path / "bogus.h5"
    import h5py

    with h5py.File(bogus, "w") as handle:
        handle["x"] = [1]
    with pytest.raises(DumpFormatError, match="not a fingerprint file"):
        file.read(str(bogus))


def test_config_errors_name_the_file_the_key_and_what_is_allowed(tmp_path):
    from probe import PrecisionDebugger
    from probe.config import from_dict
    from probe.errors import ConfigError, RunExistsError

    with pytest.raises(ConfigError, match="fingerprint is false, expected \"fingerprint\": true"):
        from_dict({"reference": "ref/"}, source="config.json")
    with pytest.raises(ConfigError, match="stop_on_divergence is true without a reference"):
        from_dict({"fingerprint": True, "stop_on_divergence": True}, source="config.json")
    with pytest.raises(ConfigError, match="did you mean 'fingerprint'"):
        from_dict({"fingerprints": True}, source="config.json")
    with pytest.raises(ConfigError, match=r"config.json: reference \"nowhere\".*no fingerprint file"):
        PrecisionDebugger(from_dict({"fingerprint": True, "reference": "nowhere",
                                     "dump_path": str(tmp_path / "d")}, source="config.json"))
    _run(tmp_path, "taken", None, steps=1)
    with pytest.raises(RunExistsError, match="already holds another run's fingerprints"):
        PrecisionDebugger(from_dict({"fingerprint": True, "dump_path": str(tmp_path / "taken")}))


def test_with_fingerprints_on_an_empty_step_list_captures_no_step_in_full():
    from probe.config import from_dict

    assert from_dict({}).wants_step(5)
    assert not from_dict({"fingerprint": True}).wants_step(5)
    assert from_dict({"fingerprint": True, "step": [5]}).wants_step(5)


def test_the_device_path_gives_each_tensor_its_own_statistics_and_sketch(monkeypatch):
    """With PROBE_DEVICE_PATH=1 take() sends CPU tensors through the accelerator's path (one
    DeviceBucket for the step, read at write time): the numbers must be each tensor's own."""
    import torch

    from probe.capture.numbers import stats
    from probe.fingerprint import take

    monkeypatch.setenv("PROBE_DEVICE_PATH", "1")
    generator = torch.Generator().manual_seed(0)
    tensors = [(f"t{i}", torch.randn(3 + 97 * i, generator=generator) * (i + 1)) for i in range(70)]
    _, names, numbers_found, sketches_found = take.take(0, tensors, K).resolve()
    by_name = {name: (numbers, sketch) for name, numbers, sketch in zip(names, numbers_found, sketches_found)}
    for name, tensor in tensors:
        numbers, packed = stats.host_stats_and_sketch(tensor, K)
        got_numbers, got_sketch = by_name[name]
        assert np.allclose(got_numbers, numbers, rtol=1e-5, atol=1e-6), name
        expected = np.frombuffer(packed)  # the same linear map, summed in another order: float32 rounding
        assert np.abs(got_sketch - expected).max() <= 1e-5 * np.linalg.norm(expected), name


def test_the_cpu_batch_gives_each_tensor_its_own_statistics_and_sketch():
    """take() with a HostBatch (the recorder's CPU path): small tensors copied into its arena,
    large ones folded there, other dtypes and NaN one by one; each tensor's numbers must be its
    own, as stats.host_stats_and_sketch computes them alone."""
    import torch

    from probe.capture.numbers import stats
    from probe.capture.numbers.host_batch import HostBatch
    from probe.fingerprint import take

    generator = torch.Generator().manual_seed(0)
    tensors = [(f"t{i}", torch.randn(3 + 97 * i, generator=generator) * (i + 1)) for i in range(40)]
    tensors += [("large", torch.randn(300, 257, generator=generator)),
                ("large64", torch.randn(70_000, generator=generator, dtype=torch.float64)),
                ("transposed", torch.randn(40, 30, generator=generator).t()),
                ("half", torch.randn(500, generator=generator).half()),
                ("with_nan", torch.tensor([1.0, float("nan"), -2.0])),
                ("large_with_inf", torch.cat((torch.randn(20_000, generator=generator), torch.tensor([float("inf")])))),
                ("param", torch.nn.Parameter(torch.randn(64, 64, generator=generator)))]
    batch = HostBatch(K)
    for step in range(2):  # the second step reuses the batch's arenas and layouts
        _, names, numbers_found, sketches_found = take.take(step, tensors, K, batch).resolve()
        assert sorted(names) == sorted(name for name, _ in tensors)
        by_name = {name: (numbers, sketch) for name, numbers, sketch in zip(names, numbers_found, sketches_found)}
        for name, tensor in tensors:
            numbers, packed = stats.host_stats_and_sketch(tensor, K)
            got_numbers, got_sketch = by_name[name]
            assert np.allclose(got_numbers, numbers, rtol=1e-5, atol=1e-6, equal_nan=True), name
            expected = np.frombuffer(packed)
            if np.isfinite(expected).all():  # the same linear map, summed in another order
                assert np.abs(got_sketch - expected).max() <= 1e-5 * np.linalg.norm(expected), name
            else:
                assert not np.isfinite(got_sketch).all(), name
