"""stats.host_stats_and_sketch, the recorder's CPU path: the exact numbers of host_stats and
sketch.host_sketch, for every layout and dtype (it shares one numpy view between them)."""

import numpy as np
import pytest
import torch

from probe.capture.numbers import sketch, stats

_g = torch.Generator().manual_seed(5)
CASES = {
    "transposed": torch.randn(300, 200, generator=_g).t(),
    "strided slice": torch.randn(64, 64, generator=_g)[:, ::3],
    "folded by torch (350k values)": torch.randn(700, 500, generator=_g),
    "float64 transposed": torch.randn(1100, 300, generator=_g, dtype=torch.float64).t(),
    "folded by numpy": torch.randn(30000, generator=_g),
    "whole rows": torch.randn(7, 251, generator=_g),
    "requires grad": torch.randn(3, generator=_g).requires_grad_(),
    "float16": torch.randn(40, 40, generator=_g).half(),
    "int64 transposed": torch.arange(100).reshape(10, 10).t(),
    "int64 targets": torch.randint(0, 10, (32,), generator=_g),
    "bool mask over rows": torch.rand(8, 100, generator=_g) > 0.5,
    "int32 over many rows": torch.arange(-5000, 5000, 3, dtype=torch.int32),
    "nan": torch.tensor([float("nan"), 1.0]),
    "complex": torch.randn(5, generator=_g, dtype=torch.complex64),
    "empty": torch.zeros(0, 3),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("k", [0, 16])
def test_combined_host_path_gives_exactly_the_separate_numbers(name, k):
    tensor = CASES[name]
    want_sketch = sketch.host_sketch(tensor, k) if tensor.numel() else None
    want = (stats.host_stats(tensor), want_sketch)
    # str: NaN compares equal to NaN, and every bit of every float is in its repr
    assert str(stats.host_stats_and_sketch(tensor, k)) == str(want)


def test_a_torch_folded_tensor_sketches_to_the_same_bits_wherever_its_output_lies():
    # the fold of a large tensor goes through torch.mv (MKL's gemv rounds by the output's
    # alignment): the caller's buffer may start at any 4-byte offset, the bits may not change
    values = torch.randn(700, 500, generator=torch.Generator().manual_seed(1)).reshape(-1).numpy()
    size = sketch.GROUPS * sketch.BLOCK
    folds = set()
    for offset in range(16):
        raw = np.empty(size + 32, dtype=np.float32)
        start = (-raw.ctypes.data // 4) % 16 + offset
        out = raw[start: start + size]
        sketch.fold_into(values, out)
        folds.add(out.tobytes())
    assert len(folds) == 1
