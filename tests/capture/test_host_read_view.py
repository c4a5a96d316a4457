"""host_read_view: host_array's values, read-only, by DLPack, and the storage left resizable."""

import numpy as np
import pytest
import torch

from probe.capture.numbers.host_view import host_array, host_read_view


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 5),
    lambda: torch.randn(4, 5, dtype=torch.float64).t(),  # strided
    lambda: torch.randn(1, 5).expand(3, 5),  # a zero stride
    lambda: torch.randn(6, requires_grad=True),
    lambda: torch.nn.Parameter(torch.randn(2, 3)),
    lambda: torch.arange(6),  # not a DLPack dtype here: host_array
])
def test_read_view_holds_the_same_values_as_host_array_and_leaves_the_storage_resizable(make):
    tensor = make()
    view = host_read_view(tensor)
    assert view.shape == tuple(tensor.shape) and view.dtype == host_array(tensor).dtype
    assert np.array_equal(view, host_array(tensor))
    del view
    tensor.untyped_storage().resize_(0)  # what FSDP2 does after forward


def test_read_view_refuses_a_negative_view_and_a_storage_without_memory():
    with pytest.raises(RuntimeError):
        host_read_view(torch._neg_view(torch.randn(3)))
    freed = torch.randn(4)
    freed.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError):
        host_read_view(freed)
