"""StepWriter + encode: bit-exact tensors, records, root attributes, failure handling, bounded memory."""

import datetime
import gc
import json
import os
import threading
import time

import h5py
import numpy as np
import pytest
import torch

from probe.dump import encode, reader, schema
from probe.dump.writer import StepWriter
from probe.errors import DumpError
from scripts_dump.dumpkit import make_row, root_attrs, write_step
from torch_versions import lacks_dtype

# Same-width integer dtype to compare raw bits through.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: None}


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor as a numpy uint8 array (what "bit-exact" means)."""
    tensor = tensor.detach().resolve_conj().contiguous()
    if tensor.dtype.is_complex:
        tensor = torch.view_as_real(tensor)
    if tensor.dtype == torch.bool:
        tensor = tensor.to(torch.uint8)
    as_int = tensor.view(_BITS[tensor.element_size()])
    return as_int.numpy().reshape(-1).view(np.uint8)


def _random_bits(dtype: torch.dtype, shape, generator) -> torch.Tensor:
    """Uniformly random bit patterns: covers NaN payloads, infinities and subnormals."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _dtypes(*names, wider=None):
    """torch dtypes by name, as params; one this torch lacks (float8_e8m0fnu before 2.7) is
    skipped with that reason: such a tensor cannot exist there."""
    params = []
    for name in names:
        reason = lacks_dtype(name)
        dtype = getattr(torch, name, None)
        values = (dtype,) if wider is None else (dtype, getattr(torch, wider[name]))
        params.append(pytest.param(*values, id=name,
                                   marks=pytest.mark.skipif(bool(reason), reason=str(reason))))
    return params


ALL_DTYPES = _dtypes(
    "float16", "float32", "float64", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex32", "complex64", "complex128",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool",
)


def _write_and_open(tmp_path, tensors):
    path = write_step(tmp_path, 0, tensors=tensors)
    return reader.open_step_file(path)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_round_trips_bit_exact(tmp_path, dtype):
    generator = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        original = torch.randint(0, 2, (257,), generator=generator).bool()
    else:
        original = _random_bits(dtype, (257,), generator)
    shapes = [original, original[3], original[:0],
              original[:256].reshape(16, 16).t(), original[::3]]
    with _write_and_open(tmp_path, shapes) as step_file:
        for tensor_id, tensor in enumerate(shapes):
            stored, dtype_name = step_file.stored_tensor(tensor_id)
            assert dtype_name == str(dtype).removeprefix("torch.")
            assert np.array_equal(stored.reshape(-1).view(np.uint8), _bits(tensor)), f"tensor {tensor_id} bits differ"
            assert step_file.tensor_info(tensor_id)["shape"] == list(tensor.shape)
            values = step_file.tensor(tensor_id)
            assert values.shape == tuple(tensor.shape)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize(
    "dtype, wider",
    _dtypes("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
            "float8_e8m0fnu", "complex32",
            wider={"complex32": "complex64", **dict.fromkeys(
                ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                 "float8_e5m2fnuz", "float8_e8m0fnu"), "float32")}),
)
def test_decoded_values_equal_torch_upcast(tmp_path, dtype, wider):
    original = _random_bits(dtype, (4096,), torch.Generator().manual_seed(3))
    expected = original.to(wider).numpy()
    with _write_and_open(tmp_path, [original]) as step_file:
        values = step_file.tensor(0)
    assert values.dtype == expected.dtype
    for part in (np.real, np.imag):  # part by part: complex equal_nan would hide a lost inf
        got, want = part(values), part(expected)
        assert np.array_equal(got, want, equal_nan=True)
        assert np.array_equal(np.signbit(got[~np.isnan(want)]), np.signbit(want[~np.isnan(want)]))


def test_nan_payloads_and_signalling_nans_keep_their_bits(tmp_path):
    patterns = np.array([0x7FC00000, 0x7FC00001, 0xFFC12345, 0x7F800001, 0xFF800000, 0x7F800000, 0x80000000, 0x1],
                        dtype=np.uint32)
    original = torch.from_numpy(patterns.view(np.int32).copy()).view(torch.float32)
    with _write_and_open(tmp_path, [original]) as step_file:
        assert np.array_equal(step_file.tensor(0).view(np.uint32), patterns)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex32_with_infinite_and_nan_parts_decodes_part_by_part(tmp_path):
    inf, nan = float("inf"), float("nan")
    parts = torch.tensor([[1.0, inf], [-inf, 2.0], [nan, 3.0], [4.0, -0.0], [inf, inf]], dtype=torch.float16)
    original = torch.view_as_complex(parts.float()).to(torch.complex32)
    with _write_and_open(tmp_path, [original, original[0]]) as step_file:
        values = step_file.tensor(0)
        assert values.dtype == np.complex64 and values.shape == (5,)
        assert np.array_equal(values.real, parts[:, 0].float().numpy(), equal_nan=True)
        assert np.array_equal(values.imag, parts[:, 1].float().numpy(), equal_nan=True)
        assert step_file.tensor(1).shape == () and step_file.tensor(1).imag == inf


def test_zero_dim_tensor_stays_zero_dim(tmp_path):
    with _write_and_open(tmp_path, [torch.tensor(2.5), torch.tensor(1.0).bfloat16()]) as step_file:
        assert step_file.tensor(0).shape == () and step_file.tensor(0) == 2.5
        assert step_file.tensor(1).shape == () and step_file.tensor(1) == 1.0


def test_views_and_expanded_tensors_store_the_values_the_program_sees(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    views = [base.t(), base[:, 1::2], base[0].expand(5, 4), torch.randn(3, dtype=torch.complex64).conj(), -base.neg()]
    with _write_and_open(tmp_path, views) as step_file:
        for tensor_id, view in enumerate(views):
            assert np.array_equal(step_file.tensor(tensor_id), view.resolve_conj().resolve_neg().numpy())


def test_sparse_tensor_is_stored_dense_with_its_layout_recorded(tmp_path):
    dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, 0.0]])
    with _write_and_open(tmp_path, [dense.to_sparse(), dense.to_sparse_csr(), dense]) as step_file:
        assert step_file.tensor_info(0)["layout"] == "sparse_coo"
        assert step_file.tensor_info(1)["layout"] == "sparse_csr"
        assert step_file.tensor_info(2)["layout"] == "strided"
        for tensor_id in range(3):
            assert np.array_equal(step_file.tensor(tensor_id), dense.numpy())


def test_tensor_requiring_grad_is_stored(tmp_path):
    weight = torch.nn.Parameter(torch.randn(4, 3))
    with _write_and_open(tmp_path, [weight]) as step_file:
        assert np.array_equal(step_file.tensor(0), weight.detach().numpy())


def test_meta_tensor_and_unstorable_dtype_are_refused_on_the_callers_thread(tmp_path):
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs())
    try:
        with pytest.raises(DumpError, match="meta tensor"):
            writer.add_tensor(torch.empty(3, device="meta"))
        quantized = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)
        with pytest.raises(DumpError, match="dtype qint8"):
            writer.add_tensor(quantized)
        assert writer.add_tensor(torch.ones(2)) == 0  # refusals did not consume ids or break the writer
    finally:
        writer.abort()


def test_encode_refuses_meta_tensor_directly():
    with pytest.raises(DumpError, match="holds no data"):
        encode.to_storage(torch.empty(2, device="meta"))


def test_tensor_ids_follow_call_order_and_tensor_count_is_recorded(tmp_path):
    writer = StepWriter(str(tmp_path), 4, 2, root_attrs())
    ids = [writer.add_tensor(torch.full((3,), float(i))) for i in range(5)]
    writer.add_rows([make_row(tensor_id=i, seq=i, module=f"m{i}") for i in ids])
    path = writer.close()
    assert ids == [0, 1, 2, 3, 4]
    assert path == os.path.join(str(tmp_path), "step4", "rank2.h5")
    with reader.open_step_file(path) as step_file:
        assert (step_file.step, step_file.rank, step_file.tensor_count) == (4, 2, 5)
        assert step_file.attrs["tensor_count"] == 5
        for tensor_id in ids:
            assert step_file.tensor(tensor_id).tolist() == [float(tensor_id)] * 3


def test_records_round_trip_every_column_with_unicode(tmp_path):
    rows = [
        make_row(key="blöcks.0/functional.linear#0/forward/output.0", seq=5, kind="api", module="blöcks.0",
                 op="functional.linear", index=0, phase="forward", slot="output.0", io="out", dtype="bfloat16",
                 shape="[2, 3]", device="cuda:1", value="", min=-1.25, max=3.5, mean=float("nan"),
                 norm=float("inf"), nan_count=2, inf_count=1, numel=6, checksum="ab12", tensor_id=-1,
                 source="trän/模型.py:12"),
        make_row(key="/functional.layer_norm#3/forward/kwarg.eps", seq=2**40, kind="module", module="", index=3,
                 phase="backward", slot="kwarg.eps", io="in", dtype="", shape="", device="", value="1e-05",
                 min=float("nan"), nan_count=-0, inf_count=2**62, numel=0, source="😀.py:1"),
    ]
    path = write_step(tmp_path, 0, rows=rows)
    with reader.open_step_file(path) as step_file:
        table = step_file.records
        assert len(table) == 2
        for index, row in enumerate(rows):
            got = table.row(index)
            for (name, kind), want in zip(schema.RECORD_COLUMNS, row):
                value = got[name]
                if kind == "float64" and np.isnan(want):
                    assert np.isnan(value), name
                else:
                    assert value == want and type(value) is type(want), (name, value, want)
        assert list(table.column("source")) == ["trän/模型.py:12", "😀.py:1"]
        assert table.column("seq").dtype == np.int64 and table.column("min").dtype == np.float64


def test_step_without_records_or_tensors_is_a_valid_empty_file(tmp_path):
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs(task="statistics"))
    path = writer.close()
    with reader.open_step_file(path) as step_file:
        assert len(step_file.records) == 0 and step_file.tensor_count == 0
        assert step_file.records.column("key").shape == (0,)


def test_root_attributes_round_trip_with_json_values_and_extras(tmp_path):
    attrs = root_attrs(torch_version=torch.__version__, config={"task": "tensor", "list": ["fc1"], "eps": 1e-5})
    writer = StepWriter(str(tmp_path), 3, 1, attrs)
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    path = writer.close(extra_attrs={"world_size": 8, "note": "résumé", "extra_json": {"a": [1, 2]}})
    with reader.open_step_file(path) as step_file:
        got = step_file.attrs
    assert got["config"] == {"task": "tensor", "list": ["fc1"], "eps": 1e-5}
    assert got["seed_report"] == {"seed": 1234, "mode": False}
    assert got["torch_version"] == str(torch.__version__)
    assert (got["step"], got["rank"], got["world_size"]) == (3, 1, 8)
    assert got["note"] == "résumé" and json.loads(got["extra_json"]) == {"a": [1, 2]}
    assert (got["schema_version"], got["record_count"], got["tensor_count"]) == (schema.SCHEMA_VERSION, 0, 0)
    created = datetime.datetime.fromisoformat(got["created"])
    assert created.utcoffset() == datetime.timedelta(0) and created >= before


def test_root_attrs_missing_a_required_key_is_refused(tmp_path):
    attrs = root_attrs()
    del attrs["determinism"]
    with pytest.raises(ValueError, match="determinism"):
        StepWriter(str(tmp_path), 0, 0, attrs)
    assert not os.path.exists(tmp_path / "step0")


def test_file_is_partial_until_close_and_final_only_after(tmp_path):
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs())
    writer.add_tensor(torch.ones(8))
    final = os.path.join(str(tmp_path), "step0", "rank0.h5")
    assert os.path.exists(writer.partial_path) and not os.path.exists(final)
    assert schema.parse_partial_file(os.path.basename(writer.partial_path)) == 0
    assert writer.close() == final
    assert os.path.exists(final) and not os.path.exists(writer.partial_path)


def test_close_replaces_an_existing_step_file_only_when_finished(tmp_path):
    first = write_step(tmp_path, 0, rows=[make_row(module=f"old{i}") for i in range(3)])
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs())
    writer.add_rows([make_row(module="new")])
    with reader.open_step_file(first) as step_file:
        assert len(step_file.records) == 3  # the old file is intact while the new one is written
    assert writer.close() == first
    with reader.open_step_file(first) as step_file:
        assert list(step_file.records.column("module")) == ["new"]


def test_close_twice_returns_the_same_path_and_adding_after_close_fails(tmp_path):
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs())
    path = writer.close()
    assert writer.close() == path
    with pytest.raises(DumpError, match="already closed"):
        writer.add_tensor(torch.ones(1))
    with pytest.raises(DumpError, match="already closed"):
        writer.add_rows([make_row()])


def test_abort_removes_the_partial_file_and_never_raises(tmp_path):
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs())
    for _ in range(4):
        writer.add_tensor(torch.ones(1000))
    writer.abort()
    writer.abort()
    assert os.listdir(tmp_path / "step0") == []
    assert not writer._thread.is_alive()
    with pytest.raises(DumpError, match="aborted"):
        writer.close()


def test_bad_record_row_is_refused_and_bad_column_value_fails_close_cleanly(tmp_path):
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs())
    with pytest.raises(ValueError, match="expected 23"):
        writer.add_rows([("only", "three", "values")])
    row = list(make_row())
    row[schema.COLUMN_NAMES.index("seq")] = "not an int"
    writer.add_rows([tuple(row)])
    with pytest.raises(DumpError, match="'seq'") as raised:
        writer.close()
    assert str(tmp_path / "step0" / "rank0.h5") in str(raised.value)
    assert os.listdir(tmp_path / "step0") == []


def test_file_where_the_dump_folder_should_be_gives_dump_error_naming_it(tmp_path):
    blocker = tmp_path / "dump"
    blocker.write_text("not a folder")
    with pytest.raises(DumpError) as raised:
        StepWriter(str(blocker), 0, 0, root_attrs())
    assert str(blocker) in str(raised.value)
    assert blocker.read_text() == "not a folder"


def test_dump_path_under_a_regular_file_gives_dump_error_with_the_os_reason(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DumpError, match="Not a directory") as raised:
        StepWriter(str(blocker / "dump"), 0, 0, root_attrs())
    assert str(blocker / "dump") in str(raised.value)


def test_dump_path_in_proc_gives_dump_error(tmp_path):
    # /proc refuses new folders even for root, unlike a chmod-ed folder
    with pytest.raises(DumpError, match="/proc/probe_dump"):
        StepWriter("/proc/probe_dump", 0, 0, root_attrs())


def test_folder_where_the_step_file_should_be_gives_dump_error(tmp_path):
    os.makedirs(tmp_path / "step0" / "rank0.h5")
    with pytest.raises(DumpError, match="folder is in the way"):
        StepWriter(str(tmp_path), 0, 0, root_attrs())


def test_add_tensor_blocks_while_queued_bytes_exceed_the_buffer(tmp_path):
    # Holding h5py's global lock stops the writer thread in the middle of its first write,
    # so the queue cannot drain: the third add_tensor must wait until the lock is released.
    tensor_bytes = 4096 * 4
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs(), buffer_bytes=2 * tensor_bytes)
    returned = []

    def producer():
        for _ in range(3):
            returned.append(writer.add_tensor(torch.ones(4096)))

    # no garbage collection while the lock is held: collecting an unreachable h5py object needs
    # that lock, and a collection inside another thread's start-up (which holds threading's own
    # lock) deadlocked this test once in a full run
    gc.collect()
    gc.disable()
    try:
        with h5py._objects.phil:
            thread = threading.Thread(target=producer)
            thread.start()
            deadline = time.monotonic() + 5
            while len(returned) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            assert returned == [0, 1], "the third add_tensor did not wait for the queue to drain"
            assert writer.pending_bytes == 2 * tensor_bytes
    finally:
        gc.enable()
    thread.join(timeout=10)
    assert returned == [0, 1, 2]
    path = writer.close()
    assert writer.peak_pending_bytes <= 2 * tensor_bytes
    with reader.open_step_file(path) as step_file:
        assert step_file.tensor_count == 3


def test_queued_bytes_never_exceed_the_buffer_over_many_tensors(tmp_path):
    tensor_bytes = 64 * 1024 * 4
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs(), buffer_bytes=3 * tensor_bytes)
    for i in range(40):
        writer.add_tensor(torch.full((64 * 1024,), float(i)))
        assert writer.pending_bytes <= 3 * tensor_bytes
    writer.close()
    assert 0 < writer.peak_pending_bytes <= 3 * tensor_bytes
    assert writer.pending_bytes == 0


def test_a_tensor_larger_than_the_buffer_still_goes_through_alone(tmp_path):
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs(), buffer_bytes=1024)
    big = torch.arange(10_000, dtype=torch.float32)
    for _ in range(3):
        writer.add_tensor(big)
    path = writer.close()
    assert writer.peak_pending_bytes == big.numel() * 4
    with reader.open_step_file(path) as step_file:
        assert np.array_equal(step_file.tensor(2), big.numpy())


def test_concurrent_close_from_two_threads_finishes_the_file_once(tmp_path):
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs())
    for i in range(20):
        writer.add_tensor(torch.full((50_000,), float(i)))
    writer.add_rows([make_row()])
    results, errors = [], []

    def close():
        try:
            results.append(writer.close())
        except Exception as error:  # pragma: no cover - the assertion below reports it
            errors.append(error)

    threads = [threading.Thread(target=close) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == [] and results == [writer.path, writer.path]
    with reader.open_step_file(writer.path) as step_file:
        assert step_file.tensor_count == 20 and step_file.tensor(19)[0] == 19.0


def test_strings_utf8_cannot_hold_are_stored_escaped_and_nul_round_trips(tmp_path):
    rows = [make_row(module="ok", source="trän.py:1"), make_row(module="nul", value='"a\x00b"'),
            make_row(module="surrogate", source="/data/caf\udce9.py:3")]
    with reader.open_step_file(write_step(tmp_path, 0, rows=rows)) as step_file:
        assert list(step_file.records.column("source")) == ["trän.py:1", "", "/data/caf\\udce9.py:3"]
        assert step_file.records.column("value")[1] == '"a\x00b"'
        assert step_file.records.column("module").tolist() == ["ok", "nul", "surrogate"]


# float4_e2m1fn_x2 (two fp4 values per byte, torch 2.8+) and bits8 have no storage dtype in
# the schema yet
@pytest.mark.parametrize("dtype", _dtypes("float4_e2m1fn_x2", "bits8"))
def test_dtype_without_bit_exact_storage_is_refused_and_leaves_no_file(tmp_path, dtype):
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs())
    unstorable = torch.zeros(4, dtype=torch.uint8).view(dtype)
    with pytest.raises(DumpError, match=f"dtype {str(dtype).removeprefix('torch.')}"):
        writer.add_tensor(unstorable)
    writer.abort()
    assert os.listdir(tmp_path / "step0") == []


def test_writer_without_tensors_starts_no_thread_and_stores_text_columns_as_codes(tmp_path):
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs())
    writer.add_rows([make_row(module="a"), make_row(module="b"), make_row(module="a")])
    path = writer.close()
    assert writer._thread is None
    with h5py.File(path, "r") as handle:
        codes = handle["records/module"][()]
        assert codes.dtype == np.int32 and codes[0] == codes[2] != codes[1]
    with reader.open_step_file(path) as step_file:
        assert step_file.records.column("module").tolist() == ["a", "b", "a"]
        assert all(type(value) is str for value in step_file.records.column("key"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64])
def test_large_tensors_written_around_hdf5_read_back_bit_exact(tmp_path, dtype):
    from probe.dump import writer as writer_module

    generator = torch.Generator().manual_seed(11)
    big = _random_bits(dtype, (writer_module.DIRECT_WRITE_BYTES // 2 + 7, 3), generator)
    if dtype == torch.bool:
        big = torch.randint(0, 2, big.shape, generator=generator).bool()
    small = _random_bits(torch.float32, (5,), generator)
    with _write_and_open(tmp_path, [big, small, big.t()]) as step_file:
        for tensor_id, tensor in enumerate([big, small, big.t()]):
            stored, _ = step_file.stored_tensor(tensor_id)
            assert np.array_equal(stored.reshape(-1).view(np.uint8), _bits(tensor)), tensor_id


@pytest.mark.parametrize("rows,small,large", [(1, 0, 0), (20_000, 0, 0), (0, 400, 0), (300, 30, 2)])
def test_hdf5_never_outgrows_the_space_reserved_for_it(tmp_path, monkeypatch, rows, small, large):
    # force the allocating path (as on a nearly full disk) and check HDF5 stayed inside it
    from probe.dump import space

    monkeypatch.setattr(space, "PLENTY_FREE_BYTES", 1 << 62)
    writer = StepWriter(str(tmp_path), 0, 0, root_attrs())
    for i in range(small):
        writer.add_tensor(torch.full((i % 50 + 1,), float(i)))
    for _ in range(large):
        writer.add_tensor(torch.ones(300_000))
    writer.add_rows([make_row(module=f"m{i}", seq=i) for i in range(rows)])
    path = writer.close()
    assert writer._space.extended and writer._space.overshoot <= 0
    with reader.open_step_file(path) as step_file:  # cut back to HDF5's size, and whole
        assert len(step_file.records) == rows and step_file.tensor_count == small + large
        for tensor_id in range(step_file.tensor_count):
            step_file.tensor(tensor_id)
    assert os.path.getsize(path) < writer._space.reserved
