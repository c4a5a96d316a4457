"""reader + decode: numpy-only decoding, discovery, record tables, and one-sentence errors."""

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

import probe
from probe.dump import decode, reader, schema
from probe.errors import DumpFormatError
from scripts_dump.bad_dumps import BAD_DUMPS
from scripts_dump.dumpkit import make_row, rows_for, write_step
from torch_versions import lacks_dtype

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the reader decodes every one on any torch; checking it against torch needs the dtype
FLOAT8 = [pytest.param(name, marks=pytest.mark.skipif(bool(lacks_dtype(name)),
                                                      reason=str(lacks_dtype(name))))
          for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                       "float8_e8m0fnu")]


@pytest.mark.parametrize("name", FLOAT8)
def test_float8_lookup_table_matches_torch_for_all_256_patterns(name):
    expected = torch.arange(256, dtype=torch.uint8).view(getattr(torch, name)).float().numpy()
    table = decode.float8_table(name)
    assert np.array_equal(table, expected, equal_nan=True)
    not_nan = ~np.isnan(expected)
    assert np.array_equal(np.signbit(table[not_nan]), np.signbit(expected[not_nan]))


def test_float8_e8m0fnu_table_is_the_powers_of_two_and_nan_on_any_torch():
    # a dump holding float8_e8m0fnu (made on torch 2.7+) reads on a torch without the dtype
    table = decode.float8_table("float8_e8m0fnu")
    assert np.array_equal(table[:255], np.ldexp(1.0, np.arange(255) - 127).astype(np.float32))
    assert np.isnan(table[255])


def test_bfloat16_decoding_matches_torch_bit_for_bit_for_all_65536_patterns():
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    expected = patterns.view(torch.bfloat16).float().numpy().view(np.uint32)
    decoded = decode.from_storage(patterns.numpy().view(np.uint16), "bfloat16")
    assert decoded.dtype == np.float32
    assert np.array_equal(decoded.view(np.uint32), expected)


def test_decode_refuses_an_array_in_the_wrong_storage_dtype():
    with pytest.raises(ValueError, match="stored as uint16"):
        decode.from_storage(np.zeros(3, np.float32), "bfloat16")
    with pytest.raises(decode.UnknownDtypeError, match="qint8"):
        decode.numpy_dtype_for("qint8")


def test_numpy_dtype_for_names_the_decoded_dtype():
    assert decode.numpy_dtype_for("bfloat16") == np.float32
    assert decode.numpy_dtype_for("complex32") == np.complex64
    assert decode.numpy_dtype_for("int16") == np.int16


def _dump_with_steps(root, steps=(0, 1), ranks=(0, 1)):
    for step in steps:
        for rank in ranks:
            write_step(root, step, rank, rows=rows_for(3, seq_offset=100 * step + 10 * rank))
    return str(root)


def test_discover_accepts_a_dump_root_a_step_folder_and_a_step_file(tmp_path):
    root = _dump_with_steps(tmp_path / "dump")
    found = reader.discover(root)
    assert sorted(found) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert reader.discover(os.path.join(root, "step1")) == {
        (1, 0): os.path.join(root, "step1", "rank0.h5"), (1, 1): os.path.join(root, "step1", "rank1.h5")}
    single = os.path.join(root, "step1", "rank1.h5")
    assert reader.discover(single) == {(1, 1): single}


def test_discover_reads_step_and_rank_of_a_renamed_file_from_its_attributes(tmp_path):
    original = write_step(tmp_path, 7, 3)
    renamed = str(tmp_path / "reference.h5")
    os.rename(original, renamed)
    assert reader.discover(renamed) == {(7, 3): renamed}


def test_discover_skips_partial_files_and_lists_them_as_incomplete(tmp_path):
    root = _dump_with_steps(tmp_path / "dump", steps=(0,), ranks=(0,))
    partial = os.path.join(root, "step1", "rank0" + schema.PARTIAL_SUFFIX)
    os.makedirs(os.path.dirname(partial))
    with open(partial, "wb") as handle:
        handle.write(b"half a file")
    found = reader.discover(root)
    assert list(found) == [(0, 0)]
    assert found.incomplete == [partial]
    dump = probe.load(root)
    assert dump.incomplete == [partial]
    assert dump.incomplete_messages() == [f"step 1 rank 0 is incomplete (process killed mid-step?): {partial}"]


def test_discover_ignores_unrelated_files_and_folders(tmp_path):
    root = _dump_with_steps(tmp_path / "dump", steps=(2,), ranks=(0,))
    (tmp_path / "dump" / "notes.txt").write_text("x")
    os.makedirs(tmp_path / "dump" / "stepX")
    (tmp_path / "dump" / "step2" / "rank0.h5.bak").write_text("x")
    assert list(reader.discover(root)) == [(2, 0)]


def test_load_lists_steps_and_ranks_and_records_adds_step_and_rank(tmp_path):
    dump = probe.load(_dump_with_steps(tmp_path / "dump"))
    assert (dump.steps, dump.ranks) == ([0, 1], [0, 1])
    rows = dump.records()
    assert len(rows) == 12
    assert {(row["step"], row["rank"]) for row in rows} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    only = dump.records(step=1, rank=0)
    assert [row["seq"] for row in only] == [100, 101, 102] and all(row["step"] == 1 for row in only)
    with pytest.raises(DumpFormatError, match="no step file for step 5"):
        dump.records(step=5)
    with pytest.raises(DumpFormatError, match="has no step 9 rank 0"):
        dump.open(9, 0)


def test_record_table_columns_rows_iteration_and_index_of(tmp_path):
    rows = [make_row(module=f"layer{i}", seq=i, min=float(i), tensor_id=-1) for i in range(5)]
    with reader.open_step_file(write_step(tmp_path, 0, rows=rows)) as step_file:
        table = step_file.records
        assert len(table) == 5 and table.columns[:len(schema.COLUMN_NAMES)] == schema.COLUMN_NAMES
        assert table.column("min").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert table.column("module").tolist() == [f"layer{i}" for i in range(5)]
        assert table.row(-1)["module"] == "layer4"
        assert [row["seq"] for row in table] == [0, 1, 2, 3, 4]
        key = table.row(3)["key"]
        assert table.index_of(key) == 3
        with pytest.raises(KeyError, match="no record with key"):
            table.index_of("nope")
        with pytest.raises(KeyError, match="no record column"):
            table.column("nope")
        with pytest.raises(IndexError):
            table.row(5)
        with pytest.raises(ValueError):
            table.column("key")[0] = "changed"  # cached columns are read-only


def test_tensor_id_that_does_not_exist_is_a_dump_format_error_naming_the_file(tmp_path):
    path = write_step(tmp_path, 0, tensors=[torch.ones(2), torch.zeros(3)])
    with reader.open_step_file(path) as step_file:
        for bad in (2, -1, 10**9):
            with pytest.raises(DumpFormatError, match="holds ids 0..1") as raised:
                step_file.tensor(bad)
            assert path in str(raised.value)
    stats_only = write_step(tmp_path / "stats", 0, task="statistics")
    with reader.open_step_file(stats_only) as step_file:
        with pytest.raises(DumpFormatError, match="no tensors"):
            step_file.tensor(0)


def test_reading_after_close_says_the_file_was_closed(tmp_path):
    step_file = reader.open_step_file(write_step(tmp_path, 0, tensors=[torch.ones(2)]))
    step_file.close()
    step_file.close()
    with pytest.raises(ValueError, match="was closed"):
        step_file.tensor(0)
    with pytest.raises(ValueError, match="was closed"):
        step_file.records.column("key")


def test_tensor_with_a_shape_attribute_that_disagrees_is_rejected(tmp_path):
    path = write_step(tmp_path, 0, tensors=[torch.ones(2, 3)])
    with h5py.File(path, "r+") as handle:
        handle["tensors/0"].attrs["shape"] = np.array([3, 3])
    with reader.open_step_file(path) as step_file:
        with pytest.raises(DumpFormatError, match=r"shape attribute says \[3, 3\]"):
            step_file.tensor(0)


@pytest.mark.parametrize("case", sorted(BAD_DUMPS))
def test_bad_input_gives_one_sentence_dump_format_error_naming_the_path(tmp_path, case):
    build, fragment = BAD_DUMPS[case]
    path = build(str(tmp_path))
    with pytest.raises(DumpFormatError) as raised:
        dump = probe.load(path)
        with dump.open(*next(iter(dump.files))) as step_file:
            step_file.records.to_dicts()
    message = str(raised.value)
    assert fragment in message
    assert path in message
    assert "\n" not in message


def test_reader_imports_no_torch(tmp_path):
    path = write_step(tmp_path, 0, tensors=[torch.ones(2).bfloat16()])
    code = (
        "import sys, probe\n"
        "import probe.dump.reader\n"
        f"dump = probe.load({str(tmp_path)!r})\n"
        "with dump.open(0, 0) as step: values = step.tensor(0); rows = step.records.to_dicts()\n"
        "assert values.tolist() == [1.0, 1.0], values\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert os.path.exists(path)
