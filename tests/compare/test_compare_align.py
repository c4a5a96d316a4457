"""Call alignment: order-based, robust to extra, missing, fused and reordered calls."""

import json

import pytest

from probe.comparison.align import CLASS, KEY, NAME, SEQUENCE, align_calls
from probe.comparison.records import load_mapping, mapping_from_dict
from probe.comparison.records import Records, build_calls
from probe.errors import CompareError


def _calls(spec, rename=None):
    """spec: list of (module, op, shape, tag[, phase]); tag identifies the call across runs."""
    rows, counters = [], {}
    for seq, item in enumerate(spec):
        module, op, shape, tag = item[:4]
        phase = item[4] if len(item) > 4 else "forward"
        index = counters.get((module, op, phase), 0)
        counters[(module, op, phase)] = index + 1
        rows.append(dict(module=module, op=op, index=index, phase=phase, seq=seq, slot="output.0",
                         shape=json.dumps(shape), source=tag))
    records = Records.from_dicts(rows)
    return records, build_calls(records, rename)


def _pairs(spec_a, spec_b, rename=None):
    rec_a, calls_a = _calls(spec_a, rename)
    rec_b, calls_b = _calls(spec_b, rename)
    out = []
    for pair in align_calls(calls_a, calls_b):
        tag_a = rec_a.get("source", pair.a.first_row) if pair.a else None
        tag_b = rec_b.get("source", pair.b.first_row) if pair.b else None
        out.append((tag_a, tag_b, pair.how))
    return out


BASE = [
    ("fc1", "functional.linear", [4, 8], "l1"),
    ("blk", "Tensor.mul", [4, 8], "m1"),
    ("blk", "torch.relu", [4, 8], "r1"),
    ("blk", "Tensor.mul", [4, 8], "m2"),
    ("blk", "Tensor.add", [4, 8], "a1"),
    ("fc2", "functional.linear", [4, 2], "l2"),
]


def test_identical_runs_pair_every_call_in_order():
    pairs = _pairs(BASE, BASE)
    assert [(a, b) for a, b, _ in pairs] == [(t, t) for *_, t in BASE]
    assert {how for *_, how in pairs} == {SEQUENCE}


def test_an_extra_call_inside_a_module_does_not_shift_the_pairing_of_later_same_op_calls():
    extra = BASE[:2] + [("blk", "Tensor.mul", [4, 8], "EXTRA")] + BASE[2:]
    pairs = _pairs(BASE, extra)
    assert (None, "EXTRA", "") in pairs
    matched = [(a, b) for a, b, _ in pairs if a and b]
    assert matched == [(t, t) for *_, t in BASE]


def test_a_missing_call_is_only_in_a_and_the_rest_still_pairs():
    pairs = _pairs(BASE, BASE[:2] + BASE[3:])
    assert ("r1", None, "") in pairs
    assert [(a, b) for a, b, _ in pairs if a and b] == [(t, t) for *_, t in BASE if t != "r1"]


def test_autocast_casts_present_in_one_run_only_are_unmatched():
    casts = []
    for item in BASE:
        casts.append(("blk" if item[0] == "blk" else item[0], "Tensor.to", item[2], "cast-" + item[3]))
        casts.append(item)
    pairs = _pairs(BASE, casts)
    assert sum(1 for a, b, _ in pairs if a is None) == len(BASE)
    assert [(a, b) for a, b, _ in pairs if a and b] == [(t, t) for *_, t in BASE]


def test_a_fused_op_replacing_two_ops_leaves_both_sides_unmatched():
    fused = BASE[:3] + [("blk", "torch.addcmul", [4, 8], "fused")] + BASE[5:]
    pairs = _pairs(BASE, fused)
    unmatched_a = {a for a, b, _ in pairs if b is None}
    assert unmatched_a == {"m2", "a1"}
    assert (None, "fused", "") in pairs
    assert ("l2", "l2", SEQUENCE) in pairs


def test_a_changed_shape_still_pairs_by_name_and_position():
    changed = list(BASE)
    changed[2] = ("blk", "torch.relu", [4, 9], "r1")
    pairs = _pairs(BASE, changed)
    assert ("r1", "r1", NAME) in pairs


def test_calls_reordered_across_modules_still_pair():
    backward = [("m%d" % i, "Linear", [4, 4], "g%d" % i, "backward") for i in range(4)]
    swapped = [backward[0], backward[2], backward[1], backward[3]]
    pairs = _pairs(backward, swapped)
    assert len(pairs) == 4 and all(a == b for a, b, _ in pairs)


def test_calls_reordered_inside_a_module_pair_by_key_when_their_stream_agrees():
    a = [("m", "torch.mul", [2], "x"), ("m", "torch.add", [3], "y"), ("m", "torch.sub", [3], "z")]
    b = [("m", "torch.add", [3], "y"), ("m", "torch.mul", [2], "x"), ("m", "torch.sub", [3], "z")]
    pairs = _pairs(a, b)
    assert len(pairs) == 3 and all(x == y for x, y, _ in pairs)
    assert any(how == KEY for *_, how in pairs)


def test_key_pass_never_pairs_calls_of_a_stream_that_changed():
    a = [("blk", "Tensor.mul", [2], "x0"), ("blk", "Tensor.mul", [3], "x1"), ("blk", "op", [1], "o")]
    b = [("blk", "op", [1], "o"), ("blk", "Tensor.mul", [3], "y0"), ("blk", "Tensor.mul", [2], "y1"),
         ("blk", "Tensor.mul", [3], "y2")]
    pairs = _pairs(a, b)
    assert ("o", "o", KEY) in pairs  # moved, and its stream is unchanged: recovered
    for tag_a, tag_b, how in pairs:
        if tag_a != "o":
            assert how != KEY


def test_casts_sprinkled_through_a_whole_model_leave_every_real_call_paired():
    spec = [("layers.%d" % (i // 10), ["linear", "add", "gelu"][i % 3], [4, 4], "c%d" % i) for i in range(6000)]
    casts = []
    for i, item in enumerate(spec):
        if i % 7 == 0:
            casts.append((item[0], "Tensor.to", [4, 4], "cast%d" % i))
        casts.append(item)
    pairs = _pairs(spec, casts)
    assert sum(1 for a, b, _ in pairs if a is None) == len(casts) - len(spec)
    assert [(a, b) for a, b, _ in pairs if a and b] == [(t, t) for *_, t in spec]


def test_forward_and_backward_align_separately_and_keep_execution_order():
    spec = [("m", "Linear", [2], "f0"), ("m", "Linear", [2], "b0", "backward"), ("m", "Linear", [2], "f1")]
    pairs = _pairs(spec, spec)
    assert [a for a, _, _ in pairs] == ["f0", "b0", "f1"]


def test_mapping_renames_module_prefixes_and_ops_on_both_sides():
    old = [("encoder.layer.0", "npu_fusion_attention", [4], "att"), ("encoder.layer.0.fc", "functional.linear", [4], "fc")]
    new = [("model.layers.0", "functional.scaled_dot_product_attention", [4], "att"),
           ("model.layers.0.fc", "functional.linear", [4], "fc")]
    mapping = mapping_from_dict({"modules": {"encoder.layer": "model.layers"},
                                 "ops": {"npu_fusion_attention": "functional.scaled_dot_product_attention"}})
    assert [(a, b) for a, b, _ in _pairs(old, new, mapping.rename)] == [("att", "att"), ("fc", "fc")]
    unmapped = _pairs(old, new)
    assert all(a is None or b is None for a, b, _ in unmapped)


def test_mapping_prefixes_match_on_dot_boundaries_and_the_longest_wins():
    mapping = mapping_from_dict({"modules": {"enc": "E", "enc.layer": "L"}, "ops": {"fa": "attn"}})
    assert mapping.module("enc.layer.3") == "L.3"
    assert mapping.module("enc.other") == "E.other"
    assert mapping.module("encoder") == "encoder"
    assert mapping.op("torch_npu.fa") == "attn" and mapping.op("fa") == "attn" and mapping.op("fab") == "fab"


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("modules: [a, b]\n", "must map names to names"),
        ("module: {a: b}\n", "unknown key 'module'"),
        ("ops: {a: 1}\n", "must map a string to a string"),
        ("ops: {a: b\n", "not valid YAML"),
        ("", "is empty"),
        ("- a\n", "must be a mapping"),
    ],
)
def test_bad_mapping_file_is_one_compare_error(tmp_path, content, fragment):
    path = tmp_path / "map.yaml"
    path.write_text(content)
    with pytest.raises(CompareError) as info:
        load_mapping(str(path))
    assert fragment in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_mapping_file_names_the_path(tmp_path):
    with pytest.raises(CompareError, match="does not exist"):
        load_mapping(str(tmp_path / "nope.yaml"))


def _slotted(calls):
    """calls: [(module, op, kind, {slot: shape list or a value string})], one call each, in order."""
    rows, counters = [], {}
    for seq, (module, op, kind, slots) in enumerate(calls):
        index = counters.get((module, op), 0)
        counters[(module, op)] = index + 1
        for slot, what in slots.items():
            row = dict(module=module, op=op, index=index, seq=seq, slot=slot, kind=kind, source=f"{op}#{index}")
            row.update(value=what) if isinstance(what, str) else row.update(shape=json.dumps(what))
            rows.append(row)
    records = Records.from_dicts(rows)
    return records, build_calls(records)


def _slotted_pairs(calls_a, calls_b):
    (rec_a, a), (rec_b, b) = _slotted(calls_a), _slotted(calls_b)
    return [(rec_a.get("source", p.a.first_row) if p.a else None, rec_b.get("source", p.b.first_row) if p.b else None,
             p.how) for p in align_calls(a, b)]


def test_calls_whose_arguments_differ_in_kind_and_whose_outputs_differ_in_shape_are_never_paired():
    """transformers' masking_utils runs mask[:, -1] only when not tracing; the compiled run indexes
    with two index tensors at that place instead: the same op and input, not the same call."""
    eager = [("model", "Tensor.__getitem__", "api", {"input.0": [4, 16], "input.1.0": '"slice(None, None, None)"',
                                                     "input.1.1": "-1", "output.0": [4]})]
    compiled = [("model", "Tensor.__getitem__", "api", {"input.0": [4, 16], "input.1.0": [4, 1, 1, 1],
                                                        "input.1.1": [1, 1, 1, 16], "output.0": [4, 1, 1, 16]})]
    assert sorted(_slotted_pairs(eager, compiled), key=str) == [
        ("Tensor.__getitem__#0", None, ""), (None, "Tensor.__getitem__#0", "")]
    # the same kinds of argument with another shape are one call whose shape changed
    wider = [("model", "Tensor.__getitem__", "api", {"input.0": [4, 32], "input.1.0": '"slice(None, None, None)"',
                                                     "input.1.1": "-1", "output.0": [4]})]
    assert _slotted_pairs(eager, wider) == [("Tensor.__getitem__#0", "Tensor.__getitem__#0", NAME)]


def test_a_module_replaced_by_another_class_at_the_same_path_pairs_with_it():
    """BERT's GELUActivation in one run, NewGELUActivation (tanh GELU from pow, tanh, mul) in the
    other: the module calls pair (their inner calls do not), so the change is named there."""
    act = "layer.0.intermediate.intermediate_act_fn"
    a = [(act, "GELUActivation", "module", {"input.0": [2, 8, 64], "output.0": [2, 8, 64]}),
         (act, "functional.gelu", "api", {"input.0": [2, 8, 64], "output.0": [2, 8, 64]})]
    b = [(act, "NewGELUActivation", "module", {"input.0": [2, 8, 64], "output.0": [2, 8, 64]}),
         (act, "torch.pow", "api", {"input.0": [2, 8, 64], "input.1": "3.0", "output.0": [2, 8, 64]}),
         (act, "torch.tanh", "api", {"input.0": [2, 8, 64], "output.0": [2, 8, 64]})]
    pairs = _slotted_pairs(a, b)
    assert ("GELUActivation#0", "NewGELUActivation#0", CLASS) in pairs
    assert {(x, y) for x, y, _ in pairs if x is None or y is None} == {
        ("functional.gelu#0", None), (None, "torch.pow#0"), (None, "torch.tanh#0")}


def test_a_bert_layer_whose_gelu_becomes_gelu_new_is_named_at_its_activation_module(tmp_path):
    """transformers' GELUActivation against NewGELUActivation in one layer of a tiny BERT: the
    module calls pair across the class change and the change is named there, not at the next
    Linear that reads what the unpaired inner calls made."""
    import probe
    from tests import rounding_pairs as P
    from tests.real_models import hf_model, lm_loss, token_batch
    from tests.torch_versions import transformers_or_skip

    transformers_or_skip()

    def gelu_new(model):
        from transformers.activations import ACT2FN

        model.bert.encoder.layer[0].intermediate.intermediate_act_fn = ACT2FN["gelu_new"]

    options = dict(build=lambda: hf_model("bert"), batch=token_batch, steps=1, task="statistics", loss=lm_loss)
    result = probe.compare(P.run(tmp_path / "a", **options), P.run(tmp_path / "b", fault=gelu_new, **options))
    cause = result.likely_cause
    assert (cause.module, cause.op, cause.origin) == (
        "bert.encoder.layer.0.intermediate.intermediate_act_fn", "GELUActivation", "introduced"), result.to_text()[:1500]
    assert cause.cause.startswith("module class changed: GELUActivation in A, NewGELUActivation in B")
