"""A step file's tensors opened through h5py's low-level API (hdf5_reads.py) give what the
high-level path gives: the same dtype, shape and layout, the same bits, the same errors; and
the low-level path is the one taken for every tensor probe writes. Record columns and root
attributes, read the same way, give h5py's values and order, and fall back to h5py's path for
what it does not read (text stored as strings, an empty attribute); a column not 1-D is refused."""

import h5py
import numpy as np
import pytest
import torch

from probe.dump import reader, hdf5_reads
from probe.errors import DumpFormatError
from scripts_dump.dumpkit import write_step


def _tensors():
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=generator),
        torch.randn(4, 6, generator=generator).bfloat16(),  # stored as uint16
        torch.randn(7, generator=generator).half(),
        torch.randn(2, 2, generator=generator, dtype=torch.float64),
        torch.randint(-5, 5, (9,), generator=generator),
        torch.rand(6, generator=generator) > 0.5,
        torch.randn(3, generator=generator, dtype=torch.complex64),
        torch.tensor(3.5),  # 0-d
        torch.zeros(0, 4),  # empty
        torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True),
        torch.randn(70_000, generator=generator),  # large enough to be mapped
    ]


@pytest.fixture(scope="module")
def step_path(tmp_path_factory):
    return write_step(tmp_path_factory.mktemp("datasets"), 0, tensors=_tensors())


def _same(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


@pytest.mark.parametrize("mapped", [False, True])
def test_every_tensor_probe_writes_opens_low_level_with_the_high_level_info_and_bits(step_path, mapped):
    with reader.open_step_file(step_path) as step_file:
        group, count = step_file._tensors, step_file.tensor_count
        assert count == len(_tensors())
        for tensor_id in range(count):
            fast, info = hdf5_reads.open_tensor(group, tensor_id, step_path, count)
            checked, checked_info = hdf5_reads._open_checked(group, tensor_id, step_path, count)
            assert isinstance(fast, h5py.h5d.DatasetID), tensor_id  # the low-level path was taken
            assert info == checked_info, tensor_id
            values = hdf5_reads.read(step_file._file, fast, tensor_id, step_path, mapped)
            assert _same(values, np.asarray(checked[()])), tensor_id
        assert hdf5_reads.open_tensor(group, 9, step_path, count)[1]["layout"] == "sparse_coo"


def test_an_attribute_of_another_type_takes_the_high_level_path_and_reads_the_same(tmp_path):
    path = write_step(tmp_path, 0, tensors=[torch.ones(2, 3)])
    with h5py.File(path, "r+") as handle:
        dataset = handle["tensors/0"]
        del dataset.attrs["dtype"]
        dataset.attrs["dtype"] = np.bytes_(b"float32")  # fixed-length bytes, as another writer may
        del dataset.attrs["shape"]
        dataset.attrs["shape"] = np.array([2, 3], dtype=np.int32)
    with reader.open_step_file(path) as step_file:
        assert step_file.tensor_info(0) == {"dtype": "float32", "shape": [2, 3], "layout": "strided"}
        assert np.array_equal(step_file.tensor(0), np.ones((2, 3), np.float32))


@pytest.mark.parametrize("damage, message", [
    ("missing", "has no tensor 1: it holds ids 0..1"),
    ("group", "has no tensor 1: it holds ids 0..1"),
    ("no shape", "tensor 1 in {path} lacks its dtype/shape attributes"),
])
def test_a_missing_or_malformed_tensor_gives_the_error_it_always_gave(tmp_path, damage, message):
    path = write_step(tmp_path, 0, tensors=[torch.ones(2), torch.ones(3)])
    with h5py.File(path, "r+") as handle:
        if damage == "missing":  # still two tensors, but none with id 1
            handle.move("tensors/1", "tensors/5")
        elif damage == "group":
            del handle["tensors/1"]
            handle.create_group("tensors/1")
        else:
            del handle["tensors/1"].attrs["shape"]
    with reader.open_step_file(path) as step_file, pytest.raises(DumpFormatError) as raised:
        step_file.tensor(1)
    assert message.format(path=path) in str(raised.value)


def test_a_record_column_stored_as_variable_length_strings_reads_as_the_coded_one_does(tmp_path):
    """Record columns are read through the low-level API; a text column another writer stored
    as variable-length strings (not codes into the string table) takes h5py's path and gives
    the same strings."""
    path = write_step(tmp_path, 0, tensors=[torch.ones(2), torch.ones(3)])
    with reader.open_step_file(path) as step_file:
        coded = step_file.records.column("module").tolist()
        numbers = step_file.records.column("norm").copy()
    with h5py.File(path, "r+") as handle:
        del handle["records/module"]
        handle.create_dataset("records/module", data=coded, dtype=h5py.string_dtype())
    with reader.open_step_file(path) as step_file:
        assert step_file.records.column("module").tolist() == coded
        assert np.array_equal(step_file.records.column("norm"), numbers, equal_nan=True)


def test_a_two_dimensional_record_column_is_refused_naming_its_shape(tmp_path):
    path = write_step(tmp_path, 0, tensors=[torch.ones(2)])
    with h5py.File(path, "r+") as handle:
        norms = handle["records/norm"][()]
        del handle["records/norm"]
        handle.create_dataset("records/norm", data=np.stack([norms, norms], axis=1))
    with pytest.raises(DumpFormatError, match=r"record column 'norm' has shape \(\d+, 2\), expected 1-D"):
        reader.open_step_file(path)


def _same_attributes(low: dict, high: dict) -> bool:
    return list(low) == list(high) and all(
        type(low[name]) is type(high[name]) and np.array_equal(low[name], high[name]) for name in high)


def test_a_step_files_root_attributes_read_low_level_are_h5pys_in_its_order(tmp_path):
    path = write_step(tmp_path, 0, tensors=[torch.ones(2)])
    with h5py.File(path, "r") as handle:
        high = {name: handle.attrs[name] for name in handle.attrs}
        low = hdf5_reads.read_attributes(handle.id)
    assert len(high) > 10 and _same_attributes(low, high)


def test_an_empty_attribute_leaves_the_whole_object_to_h5py_and_the_file_still_opens(tmp_path):
    path = write_step(tmp_path, 0, tensors=[torch.ones(2)])
    with h5py.File(path, "r+") as handle:
        handle.attrs["note"] = h5py.Empty("f")
    with h5py.File(path, "r") as handle:
        assert hdf5_reads.read_attributes(handle.id) is None
    with reader.open_step_file(path) as step_file:
        assert step_file.step == 0 and "note" in step_file.attrs
