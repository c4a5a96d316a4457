"""Every example runs end to end in its CI size and prints what its README promises.

Each example runs the way a user starts it (``python examples/<name>/run.py``, from a
temporary working directory so no example depends on being run from the repo root), in the
test's process (tests/example_runs.py; the quickstart in a fresh interpreter), and the test
reads the printed verdicts and names, not only the exit code.
"""

import json
import os
import re

import pytest

import example_runs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO_ROOT, "examples")
NAMES = ("quickstart", "reproducibility", "cpu_vs_gpu", "mixed_precision", "find_the_bug",
         "reinforcement_learning", "distributed")


def run_example(name, tmp_path, *extra, expect_code=0, fresh=False):
    """stdout and --out folder of ``python examples/NAME/run.py --out OUT --smoke EXTRA``, run
    in this process, or with ``fresh`` in a new interpreter."""
    out = tmp_path / "out"
    run = example_runs.fresh_interpreter if fresh else example_runs.this_process
    code, stdout, stderr = run(os.path.join(EXAMPLES, name, "run.py"), tmp_path, "--out", str(out), "--smoke",
                               *extra)
    assert code == expect_code, f"{name} exited {code}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    return stdout, out


@pytest.mark.parametrize("name", NAMES)
def test_every_example_has_a_readme_with_its_command_and_output(name):
    with open(os.path.join(EXAMPLES, name, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    assert f"python examples/{name}/run.py" in readme
    assert "```" in readme  # the pasted output block


def test_quickstart_names_the_changed_gelu_and_writes_the_html_report(tmp_path):
    # a fresh interpreter, as README's demo runs it: the one example run from outside this
    # process's sys.path (every example puts the repository on its path the same way)
    stdout, out = run_example("quickstart", tmp_path, fresh=True)
    assert "DIVERGED at step 0 rank 0: blocks.2.act functional.gelu (forward, output.0) -- introduced" in stdout
    assert re.search(r"^verdict: diverged \(probe compare exit code 1\)", stdout, re.M)
    report = out / "report.html"
    assert f"HTML report: {report}" in stdout
    assert report.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_reproducibility_seeded_runs_are_bit_identical_and_unseeded_differ(tmp_path):
    stdout, _ = run_example("reproducibility", tmp_path)
    seeded = re.search(r"^with seed_all   : run 1 vs run 2: (.*)$", stdout, re.M).group(1)
    unseeded = re.search(r"^without seed_all: run 1 vs run 2: (.*)$", stdout, re.M).group(1)
    assert seeded.startswith("bit-identical (3 losses")
    assert seeded.endswith("probe compare of the last step's checksums: pass")
    assert unseeded.startswith("differ (first at step")
    assert "RESULT: seed_all made the runs repeat exactly" in stdout


def test_cpu_vs_gpu_reports_forward_difference_fits_and_compare_verdict(tmp_path):
    stdout, out = run_example("cpu_vs_gpu", tmp_path, "--device", "cpu")
    assert "candidate: CPU float64, the high-precision bench" in stdout
    diff = float(re.search(r"ValueNet forward on 100 inputs: max \|diff\| (\S+),", stdout).group(1))
    assert 0 < diff < 1e-5  # float32 rounding: present, and small
    for epochs in (100, 1000):
        assert re.search(rf"^\s+{epochs}\s+\d+\.\d+\s+\d+\.\d+\s+\S+\s+\S+$", stdout, re.M)
    # float32 rounding is within float32 tolerance: a dtype change alone is no divergence.
    assert re.search(r"^   verdict: pass$", stdout, re.M), stdout
    assert (out / "cpu_fp32" / "step0" / "rank0.h5").is_file()
    assert (out / "cpu_fp64" / "step0" / "rank0.h5").is_file()


def test_cpu_vs_gpu_thread_candidate_is_named_and_compares_clean(tmp_path):
    stdout, _ = run_example("cpu_vs_gpu", tmp_path, "--device", "cpu", "--candidate", "threads")
    assert re.search(r"^candidate: CPU float32, \d thread\(s\) instead of \d", stdout, re.M)
    assert re.search(r"^   verdict: pass$", stdout, re.M), stdout


def test_mixed_precision_lists_the_ops_that_add_the_most_bf16_error(tmp_path):
    stdout, _ = run_example("mixed_precision", tmp_path)
    assert re.search(r"^verdict: (pass|diverged)$", stdout, re.M)
    ranked = re.findall(r"^  \d\. (\S+) (\S+)#\d+ \((forward|backward)\): adds \S+ x tolerance; "
                        r"output rel L2 ([^,\s]+)", stdout, re.M)
    assert len(ranked) == 5
    # bf16 autocast runs linear layers in bf16: their outputs carry bf16-sized error, forward
    # and backward, both measured by the API records of functional.linear (its backward's
    # grad_input is recorded although autograd runs it as several nodes), so the Linear
    # modules that only repeat them are not ranked.
    assert any((op, phase) == ("functional.linear", "forward") for _, op, phase, _ in ranked), ranked
    assert any((op, phase) == ("functional.linear", "backward") for _, op, phase, _ in ranked), ranked
    assert not any(op == "Linear" for _, op, _, _ in ranked), ranked
    assert all(1e-5 < float(error) < 1e-1 for _, _, _, error in ranked), ranked


def test_find_the_bug_points_at_each_changed_layer_with_checksums(tmp_path):
    """Checksum dumps: the transposed weight keeps its min, max, mean and norm; its sketch
    measures the change, and it is named as the cause, not passed as a match."""
    stdout, out = run_example("find_the_bug", tmp_path, "--task", "checksum")
    found = dict(re.findall(r"probe points at layer: (\S+) -- expected (\S+): CORRECT", stdout))
    assert found == {"blocks.3.norm": "blocks.3.norm", "blocks.3.act": "blocks.3.act",
                     "blocks.3.fc": "blocks.3.fc"}, stdout
    assert re.search(r"cause: parameter blocks\.3\.fc\.weight differs \(rel L2 1\.\d+e\+00\)", stdout), stdout
    assert "RESULT: probe located 3 of 3 injected bug(s)" in stdout
    assert (out / "transpose" / "report.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


@pytest.fixture(scope="module")
def reinforcement_learning_run(tmp_path_factory):
    return run_example("reinforcement_learning", tmp_path_factory.mktemp("rl"))


def test_reinforcement_learning_seeded_episode_returns_repeat(reinforcement_learning_run):
    stdout, out = reinforcement_learning_run
    assert "episode returns repeat exactly: yes" in stdout
    episodes = re.search(r"episodes: (\d+) and (\d+);", stdout)
    assert episodes and episodes.group(1) == episodes.group(2) and int(episodes.group(1)) > 0


def test_reinforcement_learning_fp32_update_is_within_tolerance_of_fp64(reinforcement_learning_run):
    stdout, out = reinforcement_learning_run
    assert "float32 vs float64 high-precision bench" in stdout
    assert (out / "update_fp64" / "step0" / "rank0.h5").is_file()
    # float32 rounding is within float32 tolerance: a dtype change alone is no divergence.
    assert re.search(r"^   verdict: pass$", stdout, re.M), stdout


def test_ppo_against_another_summation_order_parts_by_drift_and_its_step_is_rounding_only(tmp_path):
    """examples/reinforcement_learning/where_they_part.py --smoke: fingerprints of every PPO
    update find the step where the runs part, call it drift (no jump), print the config that
    dumps it, and the full dump of that step compares as rounding only."""
    out = tmp_path / "out"
    code, stdout, stderr = example_runs.this_process(
        os.path.join(EXAMPLES, "reinforcement_learning", "where_they_part.py"), tmp_path, "--smoke", "--out", str(out))
    assert code == 0, stderr
    parting = re.search(r"The runs part at step (\d+) by DRIFT", stdout)
    assert parting, stdout
    step = parting.group(1)
    assert "No jump" in stdout and "JUMP" not in stdout
    assert f'"step": [{step}]' in stdout  # the config that dumps that step in full
    assert f"3. update step {step} dumped in full in both runs" in stdout
    assert "rounding only: no op of that update step differs beyond its tolerance" in stdout
    for side in ("cpu", "other"):
        assert (out / f"{side}_step{step}" / f"step{step}" / "rank0.h5").is_file()


def test_reinforcement_learning_with_random_on_cpu_repeats_across_devices(reinforcement_learning_run):
    """Part 3: trainings launched by probe run with "random_on_cpu": true, on the CPU and on
    --device (the CPU here: no GPU in CI), give the same returns episode by episode."""
    stdout, out = reinforcement_learning_run
    assert 'both with "random_on_cpu": true (launched by probe run' in stdout
    assert re.search(r"^   episode returns identical across devices: yes$", stdout, re.M), stdout
    same = re.search(r"identical returns: (\d+) of (\d+) episodes", stdout)
    assert same and same.group(1) == same.group(2) and int(same.group(1)) > 0
    assert json.loads((out / "random_on_cpu.json").read_text())["random_on_cpu"] is True
    reference = json.loads((out / "cross_reference_cpu.json").read_text())
    assert json.loads((out / "cross_candidate_cpu.json").read_text()) == reference  # two trainings


def test_distributed_compares_each_rank_and_blames_rank_1(tmp_path):
    stdout, out = run_example("distributed", tmp_path)
    for rank in (0, 1):
        assert (out / "reference" / "step0" / f"rank{rank}.h5").is_file()
    # rank 0 receives rank 1's gradients through DDP's (unrecorded) all-reduce: measured by the
    # sketches beyond tolerance, but nothing rank 0 computes from them leaves the tolerance
    assert re.search(r"^  rank 0: pass$", stdout, re.M), stdout
    assert re.search(r"^  rank 1: diverged; first divergence at step 0: "
                     r"blocks\.1\.act/functional\.gelu#0/forward/output\.0 \(introduced\)$",
                     stdout, re.M), stdout
    assert "whole runs (all steps and ranks): verdict diverged" in stdout
    assert "first divergence: step 0, rank 1, blocks.1.act/functional.gelu#0/forward/output.0 (introduced)" in stdout
