"""The root attribute uninitialized: the records of memory nothing had written yet, read back
as a bool column; files without it (every file written before it existed) read as before."""

import h5py
import pytest

from probe.dump import reader, schema
from probe.errors import DumpFormatError
from scripts_dump.dumpkit import rows_for, write_step


def test_a_file_without_the_attribute_has_no_uninitialized_column(tmp_path):
    path = write_step(tmp_path, 0, rows=rows_for(3))
    with reader.open_step_file(path) as step:
        assert schema.UNINITIALIZED not in step.records.columns
        assert all(schema.UNINITIALIZED not in row for row in step.records)


def test_the_listed_records_read_as_uninitialized_and_the_others_not(tmp_path):
    path = write_step(tmp_path, 0, rows=rows_for(3))
    with reader.open_step_file(path) as step:
        keys = list(step.records.column("key"))
    from probe.dump.writer import StepWriter
    from scripts_dump.dumpkit import root_attrs

    writer = StepWriter(str(tmp_path / "marked"), 0, 0, root_attrs(task="statistics"))
    writer.add_rows(rows_for(3))
    path = writer.close({schema.UNINITIALIZED: [keys[1]]})
    with reader.open_step_file(path) as step:
        assert step.attrs[schema.UNINITIALIZED] == [keys[1]]
        assert list(step.records.column(schema.UNINITIALIZED)) == [False, True, False]
        assert [row[schema.UNINITIALIZED] for row in step.records] == [False, True, False]


def test_an_attribute_that_is_not_a_list_of_keys_is_one_sentence_naming_the_file(tmp_path):
    path = write_step(tmp_path, 0, rows=rows_for(2))
    with h5py.File(path, "r+") as handle:
        handle.attrs[schema.UNINITIALIZED] = "[1, 2]"
    with pytest.raises(DumpFormatError, match="root attribute 'uninitialized' is not a list of record keys"):
        reader.open_step_file(path)
