"""A probe command's config over a script's own (probe/command_config.py): the keys
the command's config file writes win in every debugger a launched program builds, the
trainer callbacks' included; a script run directly is unchanged."""

import json

import pytest

from probe import Config, PrecisionDebugger
from probe import command_config


@pytest.fixture
def launched(tmp_path, monkeypatch):
    """This process as a program ``probe determinism`` launched: its config writes two keys."""
    handed = tmp_path / "run1.config.json"
    handed.write_text(json.dumps({"task": "checksum", "dump_path": str(tmp_path / "run1")}))
    for name in ("PROBE_SEED", "PROBE_ATTACH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PROBE_CONFIG", str(handed))
    monkeypatch.setenv("PROBE_COMMAND", "determinism")
    monkeypatch.setenv("PROBE_NOTES", str(tmp_path / "run1.notes.jsonl"))
    return tmp_path


def _own(tmp_path) -> dict:
    return {"task": "statistics", "dump_path": str(tmp_path / "own"), "level": "module", "seed": 7}


def test_a_debugger_given_a_dict_takes_the_commands_keys_and_keeps_its_others(launched, capsys):
    debugger = PrecisionDebugger(_own(launched))
    config = debugger.config
    debugger.close()
    assert (config.task, config.dump_path) == ("checksum", str(launched / "run1"))
    assert (config.level, config.seed) == ("module", 7)  # keys the command's file does not write
    err = capsys.readouterr().err
    assert "probe: the script's own config (<dict>) gives way to probe determinism's" in err
    (note,) = command_config.read_notes(str(launched / "run1.notes.jsonl"))
    assert note["kind"] == "config" and note["changed"]["task"] == ["statistics", "checksum"]


def test_a_config_file_and_a_config_object_give_way_alike(launched):
    path = launched / "own.json"
    path.write_text(json.dumps(_own(launched)))
    for given in (str(path), Config(**_own(launched))):
        debugger = PrecisionDebugger(given)
        assert (debugger.config.task, debugger.config.level) == ("checksum", "module")
        debugger.close()


def test_a_script_run_directly_uses_its_own_config_even_with_probe_config_exported(
        launched, monkeypatch, capsys):
    monkeypatch.delenv("PROBE_COMMAND")
    debugger = PrecisionDebugger(_own(launched))
    assert debugger.config.task == "statistics" and debugger.config.dump_path == str(launched / "own")
    debugger.close()
    assert "gives way" not in capsys.readouterr().err


def test_probe_run_seed_wins_over_the_scripts_seed(launched, monkeypatch):
    monkeypatch.setenv("PROBE_COMMAND", "run")
    monkeypatch.delenv("PROBE_CONFIG")
    monkeypatch.setenv("PROBE_SEED", "99")
    debugger = PrecisionDebugger(_own(launched))
    assert (debugger.config.seed, debugger.config.task) == (99, "statistics")
    debugger.close()


def _hf(config):
    pytest.importorskip("transformers", reason="pip install 'precision-probe[hf]'")
    from probe.integrations.hf import ProbeCallback

    return ProbeCallback(config)


def _lightning(config):
    pytest.importorskip("lightning", reason="pip install 'precision-probe[lightning]'")
    from probe.integrations.lightning import ProbeCallback

    return ProbeCallback(config)


def _accelerate(config):
    pytest.importorskip("accelerate", reason="pip install 'precision-probe[accelerate]'")
    from probe.integrations.accelerate import AcceleratorCapture

    return AcceleratorCapture(None, config)


@pytest.mark.parametrize("make", [_hf, _lightning, _accelerate], ids=["hf", "lightning", "accelerate"])
def test_every_trainer_callback_takes_the_commands_keys(launched, make):
    callback = make(_own(launched))
    config = callback.debugger.config
    callback.debugger.close()
    assert (config.task, config.dump_path, config.level) == ("checksum", str(launched / "run1"), "module")
