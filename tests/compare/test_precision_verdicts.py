"""Precision is a finding: a lower dtype chosen by the model's own casts whose values lie within
that dtype's rounding envelope is a finding in the headline and notes (exit 0); beyond it, a
divergence of kind "precision" at its op; under autocast it is expected and counted; whole-run
dtype differences (float32 against float64) pass. Either way the dtypes are listed under "the
runs differ in"."""

import json

import pytest
import torch

import probe
from probe.cli import main as cli
from probe.dump.reader import open_step_file
from tests.verdict_models import SmallNet, batch, train


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("fp32") / "a")


def _compare_cli(a, b, capsys):
    with pytest.raises(SystemExit) as raised:
        cli(["compare", a, b, "--json"])
    out, _ = capsys.readouterr()
    return raised.value.code, json.loads(out)


def test_one_linear_cast_to_bfloat16_within_its_envelope_is_a_finding_in_the_headline_and_exits_0(
        reference, tmp_path, capsys):
    """One precision rule: values within the coarser side's rounding envelope are a finding."""
    b = train(tmp_path / "b", lambda: SmallNet(fc1_dtype=torch.bfloat16))
    code, data = _compare_cli(reference, b, capsys)
    assert code == 0 and data["verdict"] == "pass"
    finding = "precision finding: B computes fc1 functional.linear in bfloat16 where A uses float32 (step 0 rank 0)"
    assert finding in data["headline"]
    assert any(note.startswith(finding) and "rounding envelope" in note for note in data["notes"])
    dtypes = [d for d in data["run_differences"] if d["setting"] == "compute dtypes"]
    assert dtypes and "bfloat16 (1 op)" in dtypes[0]["b"]
    text = probe.compare(reference, b).to_text()
    assert "compute dtypes: float32" in text and "bfloat16 (1 op) in B" in text


def test_a_linear_computed_in_float64_and_cast_back_is_a_finding_by_the_same_rule(reference, tmp_path):
    """Stable-baselines3 style: B's Linears compute in float64, the reference in float32."""
    result = probe.compare(reference, train(tmp_path / "b", lambda: SmallNet(fc1_dtype=torch.float64)))
    headline = result.to_text().splitlines()[0]
    assert result.verdict == "pass", headline
    assert "precision finding: A computes fc1 functional.linear in float32 where B uses float64" in headline


def _overflowing():
    """The batch scaled beyond float16's range: a linear cast to float16 overflows."""
    x, y = batch()
    return x * 1e5, y


def test_one_linear_cast_to_float16_beyond_its_envelope_is_a_precision_divergence_introduced_there(
        tmp_path, capsys):
    a = train(tmp_path / "a", data=_overflowing)
    b = train(tmp_path / "b", lambda: SmallNet(fc1_dtype=torch.float16), data=_overflowing)
    code, data = _compare_cli(a, b, capsys)
    assert code == 1 and data["verdict"] == "diverged"
    first = data["first_divergence"]
    assert (first["module"], first["op"], first["kind"], first["origin"]) == (
        "fc1", "functional.linear", "precision", "introduced")
    assert first["cause"].startswith("B computes fc1 functional.linear in float16 where A uses float32")


def test_autocast_records_its_calls_and_its_lower_precision_passes_with_a_note_counting_the_ops(reference, tmp_path):
    b = train(tmp_path / "b", autocast=torch.bfloat16)
    with open_step_file(b + "/step0/rank0.h5") as handle:
        runs = handle.attrs["autocast"]
    with open_step_file(reference + "/step0/rank0.h5") as handle:
        assert handle.attrs["autocast"] == []
    assert runs and all(dtype == "bfloat16" for _, _, dtype in runs)
    result = probe.compare(reference, b)
    assert result.verdict == "pass"
    notes = [note for note in result.notes if "under autocast" in note]
    assert notes and notes[0].startswith("B ran ") and "ops in bfloat16 under autocast" in notes[0]
    assert any(d["setting"] == "compute dtypes" for d in result.run_differences)


def test_float32_against_float64_passes_and_lists_the_dtypes_among_the_run_differences(reference, tmp_path):
    b = train(tmp_path / "b", dtype=torch.float64)
    result = probe.compare(reference, b)
    assert result.verdict == "pass"
    dtypes = [d for d in result.run_differences if d["setting"] == "compute dtypes"]
    assert dtypes and dtypes[0]["a"].startswith("float32") and dtypes[0]["b"].startswith("float64")
    assert "compute dtypes: float32" in result.to_text()


def test_the_same_dtypes_on_both_sides_list_no_dtype_difference(reference, tmp_path):
    result = probe.compare(reference, train(tmp_path / "b"))
    assert result.verdict == "pass"
    assert not any(d["setting"] == "compute dtypes" for d in result.run_differences)


@pytest.mark.parametrize("mode", ["autocast", "cast"])
def test_a_bf16_model_with_sdpa_against_eager_attention_passes_forward_and_backward(tmp_path, mode):
    from tests.verdict_models import TinyAttention, tokens

    options = dict(steps=3, data=tokens, task="statistics", lr=1e-3)
    options.update({"autocast": torch.bfloat16} if mode == "autocast" else {"dtype": torch.bfloat16})
    a = train(tmp_path / "a", lambda: TinyAttention("sdpa"), **options)
    b = train(tmp_path / "b", lambda: TinyAttention("eager"), **options)
    result = probe.compare(a, b)
    assert result.verdict == "pass", result.to_text()[:1500]


def test_a_precision_finding_followed_by_a_divergence_is_introduced_in_op_summaries_json_and_html(tmp_path):
    """The precision rule is a judge rule: the op summaries, the top ops of the JSON and the HTML
    table are made after it, so they say what the rows say. (A lower precision within its
    envelope followed by a divergence in the same step file is where the difference entered.)"""
    a = train(tmp_path / "a")
    b = train(tmp_path / "b", lambda: SmallNet(fc1_dtype=torch.bfloat16, eps=1e-2))
    result = probe.compare(a, b)
    first = result.first_divergence
    assert (first.module, first.op, first.divergence, first.origin) == ("fc1", "functional.linear", "precision",
                                                                       "introduced")
    call = (first.step, first.rank, first.module, first.op, first.index, first.phase)
    summary = next(s for s in result.op_summaries if (s.step, s.rank, s.module, s.op, s.index, s.phase) == call)
    assert (summary.diverged, summary.origin) == (True, "introduced")
    top = [op for op in json.loads(result.to_json())["top_ops"]
           if (op["module"], op["op"], op["phase"]) == ("fc1", "functional.linear", "forward")]
    assert top and (top[0]["diverged"], top[0]["origin"]) == (True, "introduced")
    html = tmp_path / "report.html"
    result.write_html(str(html))
    page = html.read_text()
    table = page.split('<table id="top-ops">', 1)[1].split("</table>", 1)[0]
    row = next(line for line in table.split("<tr>") if "<td>fc1</td>" in line and "<td>forward</td>" in line)
    assert "<td>introduced</td>" in row and "within tolerance" not in row
