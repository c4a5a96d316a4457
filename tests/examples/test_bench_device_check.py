"""bench/device_check.py, the prepared run for a lent GPU, rehearsed on the CPU: another
device's rounding emulated (probe.perturb.other_rounding) must pass, the planted GELU must be
named, and the overhead stage runs only what bench/dump_overhead.py accepts, within its budget."""

import json
import os
import time

import pytest

from bench import device_check, dump_overhead, record_cost


def test_the_rehearsal_passes_other_rounding_and_names_the_planted_gelu_in_both_tasks(tmp_path, capsys):
    out = tmp_path / "out"
    path_before = os.environ.get("PROBE_DEVICE_PATH")
    code = device_check.main(["--device", "cpu", "--out", str(out), "--work", str(tmp_path / "work"),
                              "--only", "env,pairs"])
    assert code == 0, capsys.readouterr().out
    pairs = {(pair["task"], pair["name"]): pair
             for pair in json.loads((out / "pairs.json").read_text())["pairs"]}
    assert set(pairs) == {(task, name) for task in ("statistics", "tensor") for name in ("clean", "buggy")}
    for task in ("statistics", "tensor"):
        clean, buggy = pairs[task, "clean"], pairs[task, "buggy"]
        # the emulated device rounds differently almost everywhere (and B's statistics come
        # from the device bucket, as on a GPU), and that alone passes
        assert clean["verdict"] == "pass" and clean["ok"]
        assert clean["differing"] > clean["counts"]["matched"] // 2
        assert buggy["verdict"] == "diverged" and buggy["ok"]
        assert buggy["first_divergence"]["module"] == device_check.BUGGY_MODULE
        assert buggy["first_divergence"]["origin"] == "introduced"
    assert os.environ.get("PROBE_DEVICE_PATH") == path_before  # the accelerator's path for B and C only
    # the dumps stay out of the output folder: a lent machine sends back at most 8 files
    assert sorted(os.listdir(out)) == ["env.txt", "pairs.json"]
    printed = capsys.readouterr().out
    assert printed.count(" OK\n") == 4 and "WRONG" not in printed


def test_a_pair_that_does_not_give_what_it_must_makes_the_run_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(device_check, "BUGGY_MODULE", "blocks.0.attn")  # not where the bug is
    code = device_check.main(["--device", "cpu", "--out", str(tmp_path), "--work", str(tmp_path / "work"),
                              "--only", "pairs", "--tasks", "statistics"])
    assert code == 1
    assert "WRONG: wanted diverged" in capsys.readouterr().out
    # the dumps go with a lent machine: compare's whole report of a wrong pair is kept
    pairs = json.loads((tmp_path / "pairs.json").read_text())["pairs"]
    assert [pair["name"] for pair in pairs if "report" in pair] == ["buggy"]
    assert pairs[1]["report"]["first_divergence"]["module"] == "blocks.1.mlp.1"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_bench_run_is_one_model_that_its_script_accepts(device):
    for model in device_check.BENCH_MODELS["overhead"][device]:
        command = device_check.bench_command("overhead", model, device, 10)
        assert command[1].endswith(os.path.join("bench", "dump_overhead.py"))
        args, models, repeats = dump_overhead.parse_args(command[2:])
        assert (models, repeats, args.device, args.json) == ([model], 10, device, True)
    for model in device_check.BENCH_MODELS["records"][device]:
        command = device_check.bench_command("records", model, device, 10)
        assert command[1].endswith(os.path.join("bench", "record_cost.py"))
        args, models, levels, paths = record_cost.parse_args(command[2:])
        assert (models, args.repeats, args.device, args.json, args.floor) == ([model], 10, device, True, True)
        assert levels == list(record_cost.LEVELS)
        # on a GPU the host path would read every record back with a sync: not what is measured
        assert paths == (list(record_cost.PATHS) if device == "cpu" else ["device", "records"])


@pytest.mark.parametrize("stage", sorted(device_check.BENCHES))
def test_no_bench_model_starts_without_budget_left(tmp_path, capsys, stage):
    code = device_check.stage_bench(str(tmp_path), stage, "cpu", ["mlp", "gpt"], 10, time.monotonic() + 5)
    assert code == 1
    assert f"{stage}: not measured (the budget ran out): mlp, gpt" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


def test_a_bench_stage_runs_its_script_and_writes_its_rows_and_table(tmp_path):
    # the records stage's script in a process of its own, one level and path (the smallest run)
    code = device_check.stage_bench(str(tmp_path), "records", "cpu", ["tiny"], 1, time.monotonic() + 300,
                                    ("--levels", "api", "--paths", "records", "--writer", "inline"))
    assert code == 0
    found = json.loads((tmp_path / "records.json").read_text())
    assert [(row["level"], row["path"], row["device"]) for row in found["rows"]] == [("api", "records", "cpu"),
                                                                                      ("api", "floor", "cpu")]
    assert found["rows"][0]["records"] > 0 and found["runs"][0]["model"] == "tiny"
    assert "| in-step us/record |" in (tmp_path / "records.txt").read_text()


def test_an_unknown_stage_is_refused_with_the_ones_allowed(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        device_check.main(["--out", str(tmp_path), "--only", "pairs,speed"])
    assert stopped.value.code == 2
    assert "unknown stage(s) speed; choose from env, pairs, overhead" in capsys.readouterr().err
