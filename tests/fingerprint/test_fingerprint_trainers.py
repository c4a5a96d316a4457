"""Fingerprints wherever a debugger runs: a Lightning Trainer's callback, a transformers
Trainer's callback, and zero-edit ``probe run`` (one row set per optimizer step)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from probe.fingerprint import file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _prints(dump):
    return file.read(file.find_file(str(dump)))


def test_probe_run_fingerprints_a_script_without_probe_code(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"dump_path": "dump", "fingerprint": True}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "probe", "run", "-c", "cfg.json", "--", sys.executable,
                           os.path.join(REPO, "examples", "trainers", "plain_loop.py"), "--steps", "4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    prints = _prints(tmp_path / "dump")
    assert prints.steps.tolist() == [0, 1, 2, 3]
    assert {"param/0.weight", "grad/0.weight"} <= set(prints.index)
    assert not any(name.startswith("step") for name in os.listdir(tmp_path / "dump"))  # no full capture


def test_the_lightning_callback_fingerprints_every_optimizer_step_with_its_loss(tmp_path):
    pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")
    from examples.trainers import lightning_trainer
    from probe.integrations.lightning import ProbeCallback

    callback = ProbeCallback({"dump_path": str(tmp_path / "a"), "fingerprint": True, "overwrite": True})
    lightning_trainer.train("", str(tmp_path / "trainer"), steps=3, accumulation=2, callbacks=[callback])
    prints = _prints(tmp_path / "a")
    assert prints.steps.tolist() == [0, 1, 2]
    assert np.isfinite(prints.loss).all()  # training_step's loss, from on_train_batch_end
    assert {"param/net.0.weight", "grad/net.0.weight", "state/net.0.weight/exp_avg"} <= set(prints.index)


def test_the_transformers_callback_fingerprints_every_step_with_the_models_loss(tmp_path):
    from tests.torch_versions import transformers_or_skip

    transformers_or_skip()
    pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate: pip install -e '.[hf]'")
    from examples.trainers import hf_trainer
    from probe.integrations.hf import ProbeCallback

    callback = ProbeCallback({"dump_path": str(tmp_path / "a"), "fingerprint": True, "overwrite": True})
    hf_trainer.train("", str(tmp_path / "trainer"), callbacks=[callback])
    prints = _prints(tmp_path / "a")
    assert prints.steps.tolist() == [0, 1, 2]
    assert np.isfinite(prints.loss).all()  # the model output's .loss
    assert any(name.startswith("param/transformer.h.0.") for name in prints.index)
