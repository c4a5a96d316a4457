"""probe compare on dumps made by the real debugger from the small example models.

Each test writes two one-step dumps (a seeded reference and a variant) and checks what the
compare finds: no false alarm between correct runs, every injected fault located at its
layer's op with origin "introduced", robust alignment when the op sequences differ.
"""

import contextlib
import json
import types

import pytest
import torch
import torch.nn.functional as F

from examples.models import DeepMLP, SmallConvNet, make_batch, train_step
from probe.cli import main
from probe.comparison.api import compare
from probe.config import from_dict
from probe.debugger.debugger import PrecisionDebugger
from real_models import threads as _threads
from sketch_scenarios import replace_block  # blocks.1 of the same width-32 DeepMLP

WIDTH = 32


def _deep():
    return DeepMLP(in_features=WIDTH, width=WIDTH, depth=3, out_features=4), dict(in_features=WIDTH, out_features=4)


def _dump(path, build=_deep, variant=None, level="mix", task="tensor", dtype=None, autocast=False,
          threads=None, mkldnn=True, batch=8, model_name="deepmlp", sketch_size=16):
    """One training step of a freshly seeded model, captured to path; returns path."""
    debugger = PrecisionDebugger(from_dict({"task": task, "level": level, "dump_path": str(path), "seed": 1,
                                            "sketch_size": sketch_size}))
    torch.manual_seed(0)
    model, sizes = build()
    if variant is not None:
        variant(model)
    x, y = make_batch(model_name, batch, generator=torch.Generator().manual_seed(0), **sizes)
    if dtype is not None:
        model.to(dtype)
        x = x.to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        precision = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with _threads(threads), torch.backends.mkldnn.flags(enabled=mkldnn):
            debugger.start(model)
            if autocast:
                optimizer.zero_grad()
                with precision:
                    logits = model(x)
                F.cross_entropy(logits.float(), y).backward()
                optimizer.step()
            else:
                train_step(model, optimizer, x, y)
            debugger.stop()
            debugger.step()
    finally:
        debugger.close()
    return str(path)


def _cli_json(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        main(["compare", *argv, "--json"])
    return info.value.code, json.loads(capsys.readouterr().out)


def _nothing_diverged_before(result, first):
    """Nothing before the first divergence is flagged, except the faulty layer's own changed
    parameter or argument records (they are the cause, reported as such)."""
    earlier = [r for r in result.divergences if r.seq_a is not None and r.seq_a < first.seq_a]
    causes = [r for r in earlier if r.divergence in ("param", "argument") and r.module == first.module]
    assert earlier == causes, [r.key for r in earlier]


@pytest.mark.parametrize("task", ["tensor", "statistics", "checksum"])
def test_two_identical_seeded_runs_compare_clean(tmp_path, capsys, task):
    a = _dump(tmp_path / "a", task=task)
    b = _dump(tmp_path / "b", task=task)
    code, data = _cli_json(capsys, a, b)
    assert code == 0 and data["verdict"] == "pass" and data["first_divergence"] is None
    assert data["counts"]["matched"] > 100 and data["counts"]["only_a"] == data["counts"]["only_b"] == 0
    assert data["evidence"] == task


def _wide():
    return DeepMLP(in_features=64, width=128, depth=4, out_features=10), {"in_features": 64, "out_features": 10}


@pytest.mark.parametrize("task", ["tensor", "checksum"])
def test_thread_count_difference_compares_clean(tmp_path, capsys, task):
    a = _dump(tmp_path / "a", build=_wide, threads=1, batch=32, task=task)
    b = _dump(tmp_path / "b", build=_wide, threads=2, batch=32, task=task)
    code, data = _cli_json(capsys, a, b)
    assert code == 0 and data["verdict"] == "pass"
    if task == "checksum":  # where the bytes differ (rounding), it is said so, not a divergence
        if not data["counts"]["changed"]:
            pytest.skip("1 and 2 threads give the same bytes with this CPU's kernels: nothing changed to report")
        assert "changed (checksum differs" in data["headline"]


@pytest.mark.parametrize("task", ["tensor", "checksum"])
def test_mkldnn_on_versus_off_compares_clean_although_values_differ(tmp_path, task):
    build = lambda: (SmallConvNet(), {})
    a = _dump(tmp_path / "a", build=build, model_name="convnet", batch=8, task=task)
    b = _dump(tmp_path / "b", build=build, model_name="convnet", batch=8, mkldnn=False, task=task)
    result = compare(a, b)
    assert result.verdict == "pass", result.first_divergence and result.first_divergence.key
    differs = (any(r.metrics is not None and r.metrics.max_abs > 0 for r in result.rows) if task == "tensor"
               else any(r.status == "changed" for r in result.rows))
    if not differs:
        pytest.skip("mkldnn on and off compute the same bits on this CPU: no difference to judge")
    if task == "checksum":
        changed = [r for r in result.rows if r.status == "changed"]
        # with sketches (the default) each change is measured, and within tolerance
        assert all(not r.size_unknown and "(sketch, k=16" in r.notes[-1] for r in changed)


def test_thread_count_difference_over_optimizer_steps_compares_clean_with_checksums(tmp_path):
    """From step 1 on the parameters themselves differ by rounding (the step-0 updates did):
    their checksums differ while their statistics agree, which is no divergence."""
    a = _adamw_dump(tmp_path / "a", "checksum", threads=1, build=_wide)
    b = _adamw_dump(tmp_path / "b", "checksum", threads=2, build=_wide)
    result = compare(a, b)
    assert result.verdict == "pass", result.first_divergence and result.first_divergence.reasons
    params = [r for r in result.rows if r.step == 1 and r.slot.startswith("param.") and r.status == "changed"]
    if not params:
        pytest.skip("1 and 2 threads give the same bytes with this CPU's kernels: no parameter changed")


def _transposed_weight(model):
    with torch.no_grad():
        fc = model.blocks[1].fc
        fc.weight.copy_(fc.weight.t().clone())  # square: loads without complaint


@pytest.mark.parametrize("level", ["mix", "api"])
def test_a_transposed_square_weight_is_a_divergence_with_checksums(tmp_path, level):
    """Same values in other places: min, max, mean and norm agree, only the checksum tells.
    Nothing computed the weight in step 0, so rounding cannot explain it. (Without sketches:
    with them the size is measured, tests/compare/test_sketch_compare.py.)"""
    a = _dump(tmp_path / "a", task="checksum", level=level, sketch_size=0)
    b = _dump(tmp_path / "b", task="checksum", level=level, variant=_transposed_weight, sketch_size=0)
    result = compare(a, b)
    first = result.first_divergence
    assert (first.module, first.op, first.origin) == ("blocks.1.fc", "functional.linear", "introduced")
    weight = next(e for e in first.input_errors if e["slot"] == "input.1")
    assert weight["status"] == "diverged" and weight["size_unknown"]
    assert "checksum differs; statistics agree, size unknown" in first.cause
    _nothing_diverged_before(result, first)


def _noisy_weight(model):
    with torch.no_grad():
        fc = model.blocks[1].fc
        fc.weight.add_(torch.randn(fc.weight.shape, generator=torch.Generator().manual_seed(3)) * 1e-3)


@pytest.mark.parametrize(
    "variant, level, module, op",
    [
        (_noisy_weight, "mix", "blocks.1.fc", "functional.linear"),
        (replace_block(eps=1e-3), "mix", "blocks.1.norm", "functional.layer_norm"),
        (replace_block(approximate="tanh"), "mix", "blocks.1.act", "functional.gelu"),
        (replace_block(approximate="tanh"), "module", "blocks.1.act", "GELU"),
        (_noisy_weight, "api", "blocks.1.fc", "functional.linear"),
    ],
    ids=["weight-noise", "layernorm-eps", "gelu-tanh", "gelu-tanh-module-level", "weight-noise-api-level"],
)
def test_injected_fault_is_found_at_its_layer_op_and_introduced(tmp_path, variant, level, module, op):
    a = _dump(tmp_path / "a", level=level)
    b = _dump(tmp_path / "b", level=level, variant=variant)
    result = compare(a, b)
    first = result.first_divergence
    assert result.verdict == "diverged"
    assert (first.module, first.op, first.phase, first.origin) == (module, op, "forward", "introduced")
    assert result.likely_cause is first
    _nothing_diverged_before(result, first)


def test_a_changed_weight_is_also_reported_as_a_param_divergence(tmp_path):
    result = compare(_dump(tmp_path / "a"), _dump(tmp_path / "b", variant=_noisy_weight))
    params = [r for r in result.divergences if r.divergence == "param" and r.slot == "param.weight"]
    assert [r.module for r in params] == ["blocks.1.fc"]
    assert "parameter" in result.first_divergence.cause


def test_the_optimizer_updating_a_changed_weight_inherits_its_difference(tmp_path):
    result = compare(_dump(tmp_path / "a"), _dump(tmp_path / "b", variant=_noisy_weight))
    update = [r for r in result.divergences if r.module == "" and r.op.endswith("_") and r.divergence == "output"]
    assert update and all(r.origin == "inherited" for r in update)
    assert any("parameter blocks.1.fc.weight, read after the backward began" in r.cause for r in update)
    introduced = [op for op in result.top_ops if op.diverged and op.origin == "introduced"]
    assert [(op.module, op.op) for op in introduced] == [("blocks.1.fc", "functional.linear")]
    # the loss's grad_output is 1.0 in both runs; its grad_input differs because its forward
    # logits did, and the backward is judged against the call's forward records too
    loss = {r.slot: r for r in result.rows if r.op == "functional.cross_entropy" and r.phase == "backward"}
    assert loss["grad_output.0"].status == "match"
    assert loss["grad_input.0"].status == "diverged" and loss["grad_input.0"].origin == "inherited"
    assert loss["grad_input.0"].cause.startswith("forward input.0 of this call already carries the error")


def _extra_add(model):
    block = model.blocks[1]

    def forward(self, x):
        x = x + 0.0  # an extra Tensor.add before the block's own: shifts that stream's index
        return x + self.act(self.fc(self.norm(x)))

    block.forward = types.MethodType(forward, block)


def test_one_extra_call_is_only_in_b_and_everything_after_still_pairs(tmp_path):
    result = compare(_dump(tmp_path / "a"), _dump(tmp_path / "b", variant=_extra_add))
    only_b = {r.key.rsplit("/", 1)[0] for r in result.rows if r.status == "only_b"}
    assert only_b == {"blocks.1/Tensor.add#0/forward", "blocks.1/Tensor.add#0/backward"} or only_b == {
        "blocks.1/Tensor.add#0/forward"}
    assert result.counts["only_a"] == 0 and result.verdict == "pass"
    shifted = [r for r in result.rows if r.key == "blocks.1/Tensor.add#0/forward/output.0" and r.status == "match"]
    assert shifted and shifted[0].key_b == "blocks.1/Tensor.add#1/forward/output.0"


def test_bf16_autocast_against_fp32_aligns_and_names_the_ops_that_add_error(tmp_path):
    result = compare(_dump(tmp_path / "a"), _dump(tmp_path / "b", autocast=True))
    assert result.counts["matched"] > 100
    assert result.top_ops and all(op.introduced > 0 for op in result.top_ops)
    model_ops = {"functional.linear", "functional.layer_norm", "functional.gelu", "Tensor.add", "Tensor.reshape",
                 "functional.cross_entropy", "Linear"}
    assert result.top_ops[0].op in model_ops
    assert any("bfloat16" in note for r in result.rows for note in r.notes)
    # a linear's backward is several autograd nodes (a transpose and a matmul); the API-level
    # call records its grad_input all the same, so functional.linear measures the bf16 error
    # its backward adds and is ranked, and its Linear module is not ranked a second time
    ranked = {(op.kind, op.op, op.phase) for op in result.top_ops}
    assert ("api", "functional.linear", "backward") in ranked
    assert not {(kind, op) for kind, op, phase in ranked if phase == "backward"} & {("module", "Linear")}
    # containers only repeat their children; ops API calls measure are not ranked twice
    assert not {op.module for op in result.top_ops if op.kind != "api"} & {"", "blocks.0", "blocks.1", "blocks.2"}
    assert not any("no record measures the backward of functional.linear" in note for note in result.notes)


@pytest.mark.parametrize("composite", [True, False])
def test_api_level_dumps_say_which_backward_ops_no_record_measures(tmp_path, monkeypatch, composite):
    from probe.capture.eager import api_mode

    # the escape hatch off: composite calls record no grad_input, and the note names them
    monkeypatch.setattr(api_mode, "COMPOSITE_GRAD_INPUT", composite)
    result = compare(_dump(tmp_path / "a", level="api"), _dump(tmp_path / "b", level="api", autocast=True))
    notes = [note for note in result.notes if note.startswith("no record measures the backward of")]
    if composite:
        assert notes == []
    else:
        assert len(notes) == 1
        assert "functional.linear" in notes[0] and "functional.cross_entropy" in notes[0]
        assert 'level "mix" measures them' in notes[0]


def _scaled_backward(model):
    model.blocks[1].fc.register_full_backward_hook(lambda module, grad_in, grad_out: tuple(
        g * 1.01 if g is not None else None for g in grad_in))


def test_a_fault_only_in_backward_is_found_in_backward_with_the_forward_clean(tmp_path):
    result = compare(_dump(tmp_path / "a"), _dump(tmp_path / "b", variant=_scaled_backward))
    first = result.first_divergence
    assert first.phase == "backward" and first.module.startswith("blocks.1") and first.origin == "introduced"
    model_forward = [r for r in result.divergences if r.phase == "forward" and r.seq_a < first.seq_a]
    assert model_forward == []


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


def _custom_function(model):
    act = model.blocks[1].act
    original = act.forward
    act.forward = lambda x: _ScaleGrad.apply(original(x))


def test_a_custom_autograd_function_changing_gradients_is_located_in_backward(tmp_path):
    result = compare(_dump(tmp_path / "a"), _dump(tmp_path / "b", variant=_custom_function))
    first = result.first_divergence
    assert first.phase == "backward" and first.module.startswith("blocks.1") and first.origin == "introduced"
    assert [r for r in result.divergences if r.phase == "forward" and r.seq_a < first.seq_a] == []


def test_fp32_against_fp64_raises_no_dtype_errors(tmp_path):
    result = compare(_dump(tmp_path / "a"), _dump(tmp_path / "b", dtype=torch.float64))
    assert result.verdict == "pass", result.first_divergence and result.first_divergence.reasons
    dtype_notes = [r for r in result.rows if r.dtype_a == "float32" and r.dtype_b == "float64"]
    assert dtype_notes and all(r.status == "match" and "judged as float32" in r.notes[0] for r in dtype_notes)


def test_statistics_dumps_still_locate_a_changed_weight(tmp_path):
    result = compare(_dump(tmp_path / "a", task="statistics"), _dump(tmp_path / "b", task="statistics", variant=_noisy_weight))
    first = result.first_divergence
    assert result.evidence == "statistics" and (first.module, first.origin) == ("blocks.1.fc", "introduced")
    assert any("statistics only" in note for note in result.notes)


def _adamw_dump(path, task, tanh=False, steps=2, level="mix", threads=None, build=_deep):
    """A few AdamW steps of a small residual MLP (optimizer state carried between steps)."""
    debugger = PrecisionDebugger(from_dict({"task": task, "level": level, "dump_path": str(path), "seed": 1}))
    torch.manual_seed(0)
    model, sizes = build()
    if tanh:
        model.blocks[1].act = torch.nn.GELU(approximate="tanh")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    try:
        with _threads(threads):
            for _ in range(steps):
                x, y = make_batch("deepmlp", 32 if build is _wide else 8, generator=data, **sizes)
                debugger.start(model)
                train_step(model, optimizer, x, y)
                debugger.stop()
                debugger.step()
    finally:
        debugger.close()
    return str(path)


@pytest.mark.parametrize("task, level", [("statistics", "mix"), ("tensor", "mix"), ("tensor", "api")])
def test_optimizer_ops_over_several_steps_inherit_the_error_they_are_given(tmp_path, task, level):
    """Optimizer state read in step 1 was written in step 0; at api level the gradients the
    optimizer reads were accumulated by autograd, which no record shows: carried either way."""
    a = _adamw_dump(tmp_path / "a", task, level=level)
    result = compare(a, _adamw_dump(tmp_path / "b", task, tanh=True, level=level))
    first = result.first_divergence
    assert (first.step, first.module, first.op, first.origin) == (0, "blocks.1.act", "functional.gelu", "introduced")
    optimizer = [r for r in result.divergences if r.module == "" and r.kind == "api" and r.divergence == "output"]
    assert [r.key for r in optimizer if r.origin == "introduced"] == []
    # what the optimizer's in-place updates read is never "external" (an entry point of error)
    updates = ("Tensor.lerp_", "Tensor.mul_", "Tensor.addcmul_", "Tensor.addcdiv_", "Tensor.add_")
    in_place = {e["source"] for r in result.rows if r.op in updates and r.io == "out" for e in r.input_errors}
    assert "carried" in in_place and in_place <= {"carried", "param", "param_update", "produced", "unrecorded"}
    ops = [(op.module, op.op, op.index, op.phase) for op in result.top_ops]
    assert ops[0] == ("blocks.1.act", "functional.gelu", 0, "forward") and len(set(ops)) == len(ops)
    assert [op.key for op in result.top_ops if op.module == "" and op.diverged and op.origin == "introduced"] == []
