"""bench/device_check.py, the prepared run for a lent GPU, rehearsed on the CPU: another
device's rounding emulated (probe.perturb.other_rounding) must pass, the planted GELU must be
named, and the overhead stage runs only what bench/dump_overhead.py accepts, within its budget."""

import json
import os
import time

import pytest

from bench import device_check, dump_overhead


def test_the_rehearsal_passes_other_rounding_and_names_the_planted_gelu_in_both_tasks(tmp_path, capsys):
    out = tmp_path / "out"
    code = device_check.main(["--device", "cpu", "--out", str(out), "--work", str(tmp_path / "work"),
                              "--only", "env,pairs"])
    assert code == 0, capsys.readouterr().out
    pairs = {(pair["task"], pair["name"]): pair
             for pair in json.loads((out / "pairs.json").read_text())["pairs"]}
    assert set(pairs) == {(task, name) for task in ("statistics", "tensor") for name in ("clean", "buggy")}
    for task in ("statistics", "tensor"):
        clean, buggy = pairs[task, "clean"], pairs[task, "buggy"]
        # the emulated device rounds differently almost everywhere, and that alone passes
        assert clean["verdict"] == "pass" and clean["ok"]
        assert clean["differing"] > clean["counts"]["matched"] // 2
        assert buggy["verdict"] == "diverged" and buggy["ok"]
        assert buggy["first_divergence"]["module"] == device_check.BUGGY_MODULE
        assert buggy["first_divergence"]["origin"] == "introduced"
    # the dumps stay out of the output folder: a lent machine sends back at most 8 files
    assert sorted(os.listdir(out)) == ["env.txt", "pairs.json", "pairs.txt"]
    assert "OK" in (out / "pairs.txt").read_text()


def test_a_pair_that_does_not_give_what_it_must_makes_the_run_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(device_check, "BUGGY_MODULE", "blocks.0.attn")  # not where the bug is
    code = device_check.main(["--device", "cpu", "--out", str(tmp_path), "--work", str(tmp_path / "work"),
                              "--only", "pairs", "--tasks", "statistics"])
    assert code == 1
    assert "WRONG: wanted diverged" in capsys.readouterr().out


@pytest.mark.parametrize("device", sorted(device_check.OVERHEAD_MODELS))
def test_every_overhead_run_is_one_model_that_dump_overhead_accepts(device):
    for model in device_check.OVERHEAD_MODELS[device]:
        command = device_check.overhead_command(model, device, 10)
        assert command[1].endswith(os.path.join("bench", "dump_overhead.py"))
        args, models, repeats = dump_overhead.parse_args(command[2:])
        assert (models, repeats, args.device, args.json) == ([model], 10, device, True)


def test_no_overhead_model_starts_without_budget_left(tmp_path, capsys):
    code = device_check.stage_overhead(str(tmp_path), "cpu", ["mlp", "gpt"], 10, time.monotonic() + 5)
    assert code == 1
    assert "not measured (the budget ran out): mlp, gpt" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


def test_an_unknown_stage_is_refused_with_the_ones_allowed(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        device_check.main(["--out", str(tmp_path), "--only", "pairs,speed"])
    assert stopped.value.code == 2
    assert "unknown stage(s) speed; choose from env, pairs, overhead" in capsys.readouterr().err
