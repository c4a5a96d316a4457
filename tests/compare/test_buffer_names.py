"""A tensor the model registered as a buffer is named where compare names an input no recorded
op made: capture knows the model's buffers by identity (model.named_buffers() at start()) and
names their records in the step file (root attribute buffers); files without it compare as
before."""

import h5py
import pytest
import torch

import probe
from probe.dump import schema
from probe.dump.reader import load


class Rotary(torch.nn.Module):
    """A rotary-style table kept as a registered buffer, read by an elementwise product."""

    def __init__(self, width: int, scale: float):
        super().__init__()
        self.register_buffer("cos", torch.cos(torch.linspace(0, 1, width)) * scale, persistent=False)

    def forward(self, x):
        return x * self.cos


class WithBuffer(torch.nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.rope = Rotary(8, scale)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.rope(self.fc(x)))


def _run(path, scale):
    torch.manual_seed(0)
    model = WithBuffer(scale)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    debugger = probe.PrecisionDebugger({"task": "statistics", "level": "mix", "dump_path": str(path)})
    debugger.start(model)
    model(x).sum().backward()
    debugger.stop()
    debugger.step()
    debugger.close()
    return str(path)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("buffers")
    return _run(folder / "a", 1.0), _run(folder / "b", 1.001)


def test_the_step_file_names_the_records_of_a_registered_buffer(dumps):
    with load(dumps[0]).open(step=0, rank=0) as step:
        records = step.records
        named = {key: name for key, name in zip(records.column("key"), records.column(schema.BUFFER)) if name}
    assert named == {"rope/Tensor.mul#0/forward/input.1": "rope.cos"}


def test_a_differing_buffer_is_named_as_the_buffer_in_the_cause(dumps):
    result = probe.compare(*dumps)
    cause = result.likely_cause or result.first_divergence
    assert cause.op == "Tensor.mul" and cause.module == "rope", result.to_text()[:2000]
    assert "it is buffer rope.cos, which the model registered" in cause.cause
    assert "data, a buffer, a weight" not in cause.cause
    assert "buffer rope.cos: no recorded op made it" in result.to_text()


def test_a_step_file_without_buffer_names_compares_with_the_old_words(dumps, tmp_path):
    import shutil

    old = []
    for side, path in zip("ab", dumps):
        copy = tmp_path / side
        shutil.copytree(path, copy)
        for step_file in copy.rglob("rank*.h5"):
            with h5py.File(step_file, "r+") as handle:
                del handle.attrs[schema.BUFFERS]
        old.append(str(copy))
    with load(old[0]).open(step=0, rank=0) as step:
        assert schema.BUFFER not in step.records.columns
    result = probe.compare(*old)
    cause = result.likely_cause or result.first_divergence
    assert cause.op == "Tensor.mul" and "(data, a buffer, a weight not recorded as a parameter)" in cause.cause
