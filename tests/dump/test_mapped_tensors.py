"""StepDump.tensor(mapped=True) (compare's read): the values a copy gives, straight from the
file's pages; never a page past the end of the file; each array its own mapping, which lives
as long as the array and goes when it is dropped."""

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from probe.dump import mapped, reader
from scripts_dump.dumpkit import write_step

BIG = mapped.MIN_BYTES  # elements: a tensor of BIG elements is mapped (one of bool too)


def _tensors():
    generator = torch.Generator().manual_seed(0)
    special = torch.randn(BIG, generator=generator)
    special[::7], special[1::11], special[2::13] = float("nan"), float("inf"), -float("inf")
    return [
        torch.randn(BIG, generator=generator),
        torch.randn(4, BIG // 4, generator=generator).bfloat16(),  # stored as uint16, decoded to float32
        torch.randn(BIG, generator=generator).half(),
        torch.randn(BIG, generator=generator, dtype=torch.float64),
        special,
        torch.randint(-5, 5, (BIG,), generator=generator),
        torch.rand(BIG, generator=generator) > 0.5,
        torch.tensor(3.5),  # 0-d
        torch.zeros(0, 4),  # empty
        torch.ones(3),  # small: read, not mapped
    ]


@pytest.fixture(scope="module")
def step_path(tmp_path_factory):
    return write_step(tmp_path_factory.mktemp("mapped"), 0, tensors=_tensors())


def _same(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def test_mapped_values_are_the_copied_values_bit_for_bit_for_every_dtype(step_path):
    with reader.open_step_file(step_path) as step_file:
        copies = [step_file.tensor(i) for i in range(step_file.tensor_count)]
        views = [step_file.tensor(i, mapped=True) for i in range(step_file.tensor_count)]
        assert all(_same(view, copy) for view, copy in zip(views, copies))
        # the wide native tensors map the file (read-only); bfloat16 is decoded into a new array
        assert [i for i, view in enumerate(views) if not view.flags.writeable] == [0, 2, 3, 4, 5, 6]
        assert all(copy.flags.writeable for copy in copies)
    # every array read so far is held at once (more than any read-ahead depth): none was
    # reused for another tensor, and each outlives the closed file
    assert all(_same(view, copy) for view, copy in zip(views, copies))


def test_a_big_endian_tensor_is_mapped_and_comes_back_in_native_order(tmp_path):
    path = write_step(tmp_path, 0, tensors=[torch.ones(1)])
    values = np.random.default_rng(0).standard_normal(BIG).astype(">f4")
    with h5py.File(path, "r+") as handle:
        del handle["tensors/0"]
        handle.create_dataset("tensors/0", data=values)
        handle["tensors/0"].attrs["dtype"] = "float32"
        handle["tensors/0"].attrs["shape"] = np.array([BIG])
    with reader.open_step_file(path) as step_file:
        assert mapped.view(step_file._file, step_file._tensors["0"]) is not None
        read = step_file.tensor(0, mapped=True)
        assert read.dtype == np.float32 and read.dtype.isnative and np.array_equal(read, values)


_TRUNCATED = r"""
import os, sys
from probe.dump import reader
path = sys.argv[1]
step_file = reader.open_step_file(path)
last = step_file.tensor_count - 1
os.truncate(path, step_file._tensors[str(last)].id.get_offset() + 1000)  # cut inside its data
copy = step_file.tensor(last)
view = step_file.tensor(last, mapped=True)  # a mapped page past the end would raise SIGBUS here
print(view.tobytes() == copy.tobytes(), float(abs(view).sum()) == float(abs(copy).sum()))
"""


def test_a_file_cut_short_after_opening_is_read_like_a_copy_not_mapped_past_its_end(tmp_path):
    path = write_step(tmp_path, 0, tensors=[torch.ones(BIG), torch.randn(BIG)])
    done = subprocess.run([sys.executable, "-c", _TRUNCATED, path], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7: killed by SIGBUS
    assert done.stdout.split() == ["True", "True"]


def _resident_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="reads the resident memory from /proc/self/status, which only Linux has")
def test_a_mapped_tensor_leaves_resident_memory_when_dropped(tmp_path):
    count, elements = 24, 1 << 18  # 24 tensors of 1 MB
    path = write_step(tmp_path, 0, tensors=[torch.full((elements,), float(i)) for i in range(count)])
    with reader.open_step_file(path) as step_file:
        before = _resident_mb()
        for i in range(count):
            values = step_file.tensor(i, mapped=True)
            assert not values.flags.writeable and values[-1] == i
            del values
        dropped = _resident_mb() - before
        held = [step_file.tensor(i, mapped=True) for i in range(count)]
        holding = _resident_mb() - before
        del held
        released = _resident_mb() - before
    assert dropped < 6, dropped  # one tensor at a time, not 24 MB
    assert holding > 18, holding  # (the measure sees mapped pages)
    assert released < 6, released
