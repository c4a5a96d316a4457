"""One attention mask in two representations: sdpa takes a bool mask (True: attend), eager
attention an additive float one (0: attend, the dtype's lowest: masked). The same positions
are the same mask; other positions are named, with the representation, in the cause line."""

import pytest
import torch

import probe
from tests import rounding_pairs as P


def _ids():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    return ids, ids.clone()


def _padded(count):
    """The loss of a batch whose second sequence ends in `count` padding positions."""
    def loss(model, ids, labels):
        mask = torch.ones_like(ids)
        mask[1, -count:] = 0
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss
    return loss


@pytest.fixture(scope="module", params=["statistics", "tensor"])
def masked(request, tmp_path_factory):
    from tests.real_models import hf_model
    from tests.torch_versions import transformers_or_skip

    transformers_or_skip()

    root = tmp_path_factory.mktemp(f"masks-{request.param}")
    options = dict(batch=_ids, steps=1, task=request.param)
    sdpa = P.run(root / "sdpa", build=lambda: hf_model("llama", attn="sdpa"), loss=_padded(5), **options)
    eager = P.run(root / "eager", build=lambda: hf_model("llama", attn="eager"), loss=_padded(5), **options)
    other = P.run(root / "other", build=lambda: hf_model("llama", attn="eager"), loss=_padded(6), **options)
    return sdpa, eager, other


def _mask_rows(result):
    return [row for row in result.rows if row.slot == "kwarg.attention_mask" and {row.dtype_a, row.dtype_b} == {
        "bool", "float32"}]


def test_a_bool_mask_and_an_additive_float_mask_of_the_same_positions_are_the_same_mask(masked):
    sdpa, eager, _ = masked
    result = probe.compare(sdpa, eager)
    assert result.verdict == "pass", result.to_text()[:1500]
    rows = _mask_rows(result)
    assert rows and all(row.status == "match" for row in rows)
    assert "the same mask in another form: mask given as bool (True: attend) in A, additive float32" in rows[0].notes[-1]


def test_masks_of_other_positions_in_another_representation_name_both_in_the_cause_line(masked):
    sdpa, _, other = masked
    result = probe.compare(sdpa, other)
    assert "infx" not in result.to_text()  # the loss's integer mask, edited: exact, no ratio to an empty budget
    rows = _mask_rows(result)
    assert rows and all(row.status == "diverged" and row.origin == "introduced" for row in rows)
    cause = rows[0].cause
    assert cause.startswith("mask given as bool (True: attend) in A, additive float32 (0: attend, "), cause
    assert cause.endswith("in B, and they mask other positions (255 masked in A, 261 in B)"), cause
