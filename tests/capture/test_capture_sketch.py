"""The per-tensor random-projection sketch: what capture computes and what the dump keeps."""

import numpy as np
import pytest
import torch

from probe.capture.numbers import sketch
from probe.capture.numbers import stats
from probe.capture.recorder import Recorder
from probe.comparison import sketch as estimator
from probe.config import Config, from_dict
from probe.debugger.debugger import PrecisionDebugger
from probe.dump.reader import load
from probe.errors import ConfigError


def _explicit(values: np.ndarray, k: int) -> np.ndarray:
    """R x with R built element by element: R[j, i] = F[r // GROUPS] * S[r % GROUPS, j] * P[c, j]
    for row r = i // BLOCK and column c = i % BLOCK."""
    n = values.size
    index = np.arange(n)
    row, column = index // sketch.BLOCK, index % sketch.BLOCK
    fold = sketch.fold_signs(row.max() // sketch.GROUPS + 1)
    matrix = (fold[row // sketch.GROUPS][:, None] * sketch.row_signs(k)[row % sketch.GROUPS]
              * sketch.column_signs(k)[column])
    return matrix.T @ values.astype(np.float64)


@pytest.mark.parametrize("n", [1, 7, 250, 251, 252, 1000, 16 * 251, 16 * 251 + 1, 64 * 251 + 3, 70_000, 300_000])
def test_sketch_is_the_fixed_projection_of_the_values_for_every_length(n):
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    want = _explicit(x.numpy(), 16)
    assert np.allclose(sketch.sketch(x, 16).numpy(), want, rtol=0, atol=1e-9 * np.linalg.norm(x.numpy()))
    assert np.allclose(sketch.unpack(sketch.host_sketch(x, 16)), want, rtol=0, atol=1e-9 * np.linalg.norm(x.numpy()))


def test_sketch_sizes_share_their_prefix_and_the_tables_never_change():
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    assert np.allclose(sketch.unpack(sketch.host_sketch(x, 32))[:16], sketch.unpack(sketch.host_sketch(x, 16)), rtol=1e-6, atol=1e-5)
    # fixed hash, not a random generator: the same numbers in every process, forever
    assert sketch.column_signs(4)[:3].tolist() == sketch.column_signs(4)[:3].tolist()
    assert abs(sketch.fold_signs(4096).mean()) < 0.05 and abs(sketch.column_signs(16).mean()) < 0.1
    assert (estimator.BLOCK, estimator.GROUPS) == (sketch.BLOCK, sketch.GROUPS)  # compare keeps its own copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.complex64])
@pytest.mark.parametrize("n", [100, 300])  # one row (projected with pre-signed columns), two rows
def test_every_dtype_is_sketched_as_the_values_compare_reads(dtype, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 4
    if dtype == torch.complex64:
        x = torch.complex(x, -x / 2)
        values = torch.view_as_real(x).numpy().reshape(-1)  # (real, imag) pairs
    else:
        x = x.to(dtype)
        values = x.to(torch.float64).numpy()
    got = np.array(sketch.unpack(sketch.host_sketch(x, 16)))
    assert np.allclose(got, _explicit(values, 16), rtol=0, atol=1e-5 * max(1.0, np.linalg.norm(values)))


def test_device_path_gives_the_host_sketch_in_the_same_single_copy():
    """The deferred (GPU) path: the sketch rides in device_stats' tensor, resolved in one copy."""
    x = torch.randn(40, 70, generator=torch.Generator().manual_seed(2))
    values, counts = stats.device_stats(x, 16)
    ((numbers, sketched),) = stats.resolve_device_stats([(values, counts, x.numel())])
    assert numbers == pytest.approx(stats.host_stats(x), rel=1e-6)
    # torch and numpy may sum in other orders (on some CPUs they happen to agree bit for bit):
    # whatever the order, the two sketches agree to float32 rounding, under compare's floor
    norm = float(x.norm())
    host = np.array(sketch.unpack(sketch.host_sketch(x, 16)))
    device = np.array(sketch.unpack(sketched))
    assert np.abs(device - host).max() <= 1e-5 * norm
    found = estimator.estimate(device, host, norm, norm, "float32", "float32")
    assert found.raw_err <= found.floor and found.err_l2 == 0


def test_sketching_moves_no_random_state_and_changes_no_value():
    x = torch.randn(1000)
    before = x.clone()
    state = torch.get_rng_state()
    numpy_state = np.random.get_state()[1].copy()
    sketch.host_sketch(x, 16)
    sketch.sketch(x.view(10, 100).t(), 16)  # non-contiguous
    assert torch.equal(torch.get_rng_state(), state) and (np.random.get_state()[1] == numpy_state).all()
    assert torch.equal(x, before)


def _one_step(path, task, sketch_size=16):
    debugger = PrecisionDebugger(from_dict({"task": task, "level": "mix", "dump_path": str(path),
                                            "sketch_size": sketch_size}))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8, eps=1e-5))
    debugger.start(model)
    model(torch.randn(4, 8)).sum().backward()
    debugger.stop()
    debugger.step()
    debugger.close()
    return load(str(path))


@pytest.mark.parametrize("task", ["statistics", "checksum", "tensor"])
def test_every_task_stores_one_sketch_row_per_record(tmp_path, task):
    with _one_step(tmp_path, task).open(0, 0) as step:
        assert step.schema_version == 2
        table = step.records.sketches()
        assert table.shape == (len(step.records), 16)
        is_tensor = step.records.column("dtype") != ""
        assert np.isfinite(table[is_tensor]).all() and np.isnan(table[~is_tensor]).all()
        assert "sketch" not in step.records.columns  # a 2-D dataset, not a 1-D column


def test_sketch_size_zero_writes_no_sketch(tmp_path):
    with _one_step(tmp_path, "statistics", sketch_size=0).open(0, 0) as step:
        assert step.records.sketches() is None and len(step.records) > 0


def test_recorder_rows_end_with_the_sketch():
    recorder = Recorder(Config(sketch_size=8))
    call = recorder.call("api", "", "torch.neg", 0, "forward", "", 1)
    recorder.add(call, "input.0", "in", torch.ones(3))
    recorder.add(call, "kwarg.alpha", "in", 2.0)
    recorder.resolve()  # CPU statistics are computed a batch at a time (host_batch.py)
    tensor_row, value_row = recorder.rows
    assert len(sketch.unpack(tensor_row[-1])) == 8 and value_row[-1] is None


@pytest.mark.parametrize("value", [-1, 1025, "16", 2.0, True, None])
def test_a_bad_sketch_size_is_one_config_error_naming_the_key(value):
    with pytest.raises(ConfigError) as info:
        from_dict({"sketch_size": value}, "config.json")
    assert "sketch_size" in str(info.value) and "0 .. 1024" in str(info.value)


def test_values_a_sketch_cannot_read_give_no_sketch_instead_of_an_error():
    quantized = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)
    assert sketch.host_sketch(quantized, 16) is None
    values, _ = stats.device_stats(torch.randn(5), 16)
    assert values.numel() == 4 + 16
    # a complex tensor with its negative bit set (a lazy view) is read through its values
    plain = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    assert sketch.unpack(sketch.host_sketch(torch._neg_view(plain), 4)) == pytest.approx(
        sketch.unpack(sketch.host_sketch(-plain, 4)))


def test_sketches_of_two_sizes_in_one_step_are_one_dump_error_and_no_file(tmp_path):
    from scripts_dump.dumpkit import root_attrs

    from probe.dump.writer import StepWriter
    from probe.errors import DumpError

    rows = []
    for k in (4, 8):
        recorder = Recorder(Config(sketch_size=k))
        recorder.add(recorder.call("api", "", "torch.neg", 0, "forward", "", 1), f"input.{k}", "in", torch.ones(3))
        recorder.resolve()
        rows += recorder.rows
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs(task="statistics"))
    writer.add_rows(rows)
    with pytest.raises(DumpError, match=r"sketches of different sizes \[4, 8\]"):
        writer.close()
    assert not list(tmp_path.rglob("*.h5*"))


def test_a_sketch_table_of_the_wrong_length_is_one_dump_format_error(tmp_path):
    import h5py

    from probe.errors import DumpFormatError

    path = _one_step(tmp_path, "statistics").files[(0, 0)]
    with h5py.File(path, "r+") as handle:
        del handle["records/sketch"]
        handle["records/sketch"] = np.zeros((1, 16))
    with load(path).open(0, 0) as step:
        with pytest.raises(DumpFormatError, match=r"sketches have shape \(1, 16\)"):
            step.records.sketches()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_sketching_nan_inf_or_huge_values_warns_nothing(dtype, recwarn):
    values = torch.tensor([1.0, float("inf"), float("nan"), -2.0], dtype=dtype)
    huge = torch.full((300,), torch.finfo(dtype).max / 2, dtype=dtype)
    for tensor in (values, huge):
        numbers, sketched = stats.host_stats_and_sketch(tensor, 16)
        assert len(sketch.unpack(sketched)) == 16
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]


def test_the_written_sketch_table_holds_each_rows_packed_sketch_exactly(tmp_path):
    from scripts_dump.dumpkit import root_attrs

    from probe.dump import reader
    from probe.dump.writer import StepWriter

    recorder = Recorder(Config(sketch_size=8))
    call = recorder.call("api", "", "torch.neg", 0, "forward", "", 1)
    for slot, value in enumerate((torch.randn(300), torch.randn(70_000), 3.0, torch.arange(5))):
        recorder.add(call, f"input.{slot}", "in", value)
    recorder.resolve()
    rows = list(recorder.rows)
    rows[3] = rows[3][:-1] + (sketch.unpack(rows[3][-1]),)  # a sequence of floats is accepted too
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs(task="statistics"))
    writer.add_rows(rows)
    path = writer.close()
    step = reader.open_step_file(path)
    try:
        table = step.records.sketches()
    finally:
        step.close()
    for row, written in zip(rows, table):
        floats = row[-1] if isinstance(row[-1], tuple) else sketch.unpack(row[-1])
        if floats is None:
            assert np.isnan(written).all()
        else:
            assert written.tolist() == list(floats)
