"""probe compare on msprobe dumps: the verdicts probe gives on its own dumps of the same runs."""

import json
import os
import shutil

import pytest

from conftest import stored
from probe import compare
from probe.cli import main


def first(result) -> tuple:
    found = result.first_divergence
    return (found.module, found.op, found.phase, found.slot, found.origin)


def counts(result) -> dict:
    return result.counts


def test_a_clean_pair_dumped_twice_by_msprobe_passes():
    result = compare(stored("mlp_a"), stored("mlp_b"))
    assert result.verdict == "pass"
    assert counts(result)["diverged"] == 0 and counts(result)["only_a"] == counts(result)["only_b"] == 0
    assert counts(result)["matched"] == 138  # every record of both steps


def test_msprobe_counters_shifted_by_an_extra_call_pass():
    result = compare(stored("mlp_a"), stored("mlp_extra_call"), steps=[0])
    assert result.verdict == "pass"
    assert counts(result)["only_b"] == 3 and counts(result)["only_a"] == 0  # the extra linear: 2 inputs, 1 output
    assert counts(result)["matched"] == 69


def test_a_bf16_kernel_is_introduced_at_its_linear():
    result = compare(stored("mlp_a"), stored("mlp_bf16"), steps=[0])
    assert result.verdict == "diverged"
    assert first(result) == ("fc2", "functional.linear", "forward", "output.0", "introduced")
    assert "bfloat16" in result.first_divergence.cause


def test_a_scaled_weight_is_introduced_where_it_is_read():
    result = compare(stored("mlp_a"), stored("mlp_scaled"), steps=[0])
    assert first(result) == ("fc1", "functional.linear", "forward", "output.0", "introduced")


def test_levels_l0_and_l1_compare_with_mix_on_what_both_recorded():
    for other, paired in (("mlp_l1", 46), ("mlp_l0", 23)):
        result = compare(stored(other), stored("mlp_a"), steps=[0])
        assert result.verdict == "pass" and counts(result)["matched"] == paired, other


def test_every_rank_of_a_distributed_msprobe_dump_is_compared():
    result = compare(stored("mlp_ranks"), stored("mlp_ranks"))
    assert result.verdict == "pass"
    assert sorted((step["step"], step["rank"]) for step in result.steps) == [(0, 0), (0, 1)]


def _by_checksum(result) -> list:
    return [row for row in result.rows if row.metrics is not None and row.metrics.evidence == "checksum"]


def test_msprobe_checksums_are_evidence_between_msprobe_dumps_only(same_run):
    result = compare(stored("mlp_md5"), stored("mlp_md5"))
    assert result.verdict == "pass"
    assert len(_by_checksum(result)) > 10 and all(row.metrics.bit_equal for row in _by_checksum(result))
    mixed = compare(stored("mlp_md5"), same_run["api"])
    assert mixed.verdict == "pass" and counts(mixed)["matched"] >= 30 and not _by_checksum(mixed)


def test_an_msprobe_dump_against_probes_dump_of_the_same_run_passes_either_way(same_run):
    for a, b in ((stored("mlp_a"), same_run["mix"]), (same_run["mix"], stored("mlp_a"))):
        result = compare(a, b)
        assert result.verdict == "pass", (a, b)
        assert counts(result)["matched"] >= 2 * 55  # forward, module gradients, parameter gradients
        assert not {"seed", "threads", "torch version"} & {line["setting"] for line in result.run_differences}


def test_nan_and_inf_beside_a_probe_dump_compare_as_msprobe_knows_them(same_run):
    result = compare(stored("mlp_nonfinite"), same_run["nonfinite"])
    assert result.verdict == "pass"
    divided = next(row for row in result.rows if row.key == "/torch.div#0/forward/output.0")
    assert divided.status == "match"  # probe counts 1 NaN and 1 Inf; msprobe's NaN max hides the Inf


def test_an_msprobe_l1_dump_pairs_probes_calls_without_their_module_paths(same_run):
    result = compare(stored("mlp_l1"), same_run["mix"], steps=[0])
    assert result.verdict == "pass" and counts(result)["matched"] >= 30
    assert any("without their module paths" in note for note in result.notes)


def test_an_msprobe_dump_against_probe_still_finds_the_bf16_kernel(same_run):
    result = compare(same_run["mix"], stored("mlp_bf16"), steps=[0])
    assert first(result) == ("fc2", "functional.linear", "forward", "output.0", "introduced")


def test_the_compare_notes_say_statistics_only_bound_the_error():
    notes = compare(stored("mlp_a"), stored("mlp_b")).notes
    assert any("msprobe dump" in note and "bounded from below" in note for note in notes)


def _inner_in_place_write(data):
    """The ReLU module's input as msprobe records it when it reads it after the module's
    in-place relu wrote it: the relu's output statistics, where the API record holds the true input."""
    relu = data["Functional.relu.0.forward"]
    relu["input_kwargs"]["inplace"]["value"] = True
    data["Module.act.ReLU.forward.0"]["input_args"][0] = dict(relu["output"][0])


def test_a_module_input_recorded_after_its_own_in_place_write_is_no_finding(tmp_path):
    root = tmp_path / "written"
    shutil.copytree(stored("mlp_a"), root)
    path = root / "step0" / "proc0" / "dump.json"
    loaded = json.loads(path.read_text())
    _inner_in_place_write(loaded["data"])
    path.write_text(json.dumps(loaded, indent=1))
    result = compare(root, stored("mlp_b"), steps=[0])
    assert result.verdict == "pass"
    assert any("written_input" in note for note in result.notes)
    written = [row for row in result.rows if row.slot.startswith("written_input")]
    assert [(row.module, row.status) for row in written] == [("act", "only_a")]


def test_replay_reruns_the_divergence_from_msprobes_tensor_files():
    result = compare(stored("mlp_tensor_a"), stored("mlp_tensor_bf16"), replay=5)
    assert result.evidence == ["tensor"] or "tensor" in result.evidence
    assert first(result) == ("", "functional.linear", "forward", "output.0", "introduced")
    replayed = result.replay.calls[0]
    assert replayed["call"] == "/functional.linear#1/forward"
    assert replayed["replay"]["verdict"] != "not replayable" and "bfloat16" in json.dumps(replayed["replay"])


def run_compare(capsys, *args):
    with pytest.raises(SystemExit) as exited:
        main(["compare", *map(str, args)])
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def test_the_command_line_compares_msprobe_dumps_with_its_exit_codes(capsys, tmp_path):
    code, out, _ = run_compare(capsys, stored("mlp_a"), stored("mlp_bf16"), "--step", "0", "--json")
    assert code == 1 and json.loads(out)["first_divergence"]["op"] == "functional.linear"
    assert run_compare(capsys, stored("mlp_a"), stored("mlp_b"))[0] == 0
    broken = tmp_path / "broken" / "step0" / "proc0"
    broken.mkdir(parents=True)
    (broken / "dump.json").write_text('{"task": "statistics", "level": "mix", "data": {"Functional.linear.0.forw')
    code, out, err = run_compare(capsys, tmp_path / "broken", stored("mlp_b"))
    assert code == 2 and "dump.json is not valid JSON" in err and "Traceback" not in err
    assert os.path.isdir(broken)


def test_two_rank_folders_compare_whatever_their_step_numbers():
    assert compare(stored("mlp_a/step1/proc0"), stored("mlp_b/step1/proc0")).verdict == "pass"
    other_step = compare(stored("mlp_a/step0/proc0/dump.json"), stored("mlp_b/step1/proc0"))
    assert other_step.verdict == "diverged" and other_step.counts["matched"] == 69  # step 1 trained on
