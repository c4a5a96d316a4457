"""Records held in memory, column by column, read as a step file's records are.

Another tool's dump (msprobe_records.py) and a step file seen through a view (formats.py)
hand the compare their records as a ``ColumnTable``: a reader.RecordTable (``len``, ``column``,
``row``, ``to_dicts``, ``index_of``, ``sketches``) whose columns are arrays made from lists
instead of HDF5 datasets.
"""

from __future__ import annotations

import numpy as np

from probe.dump import schema
from probe.dump.reader import RecordTable

_KINDS = dict(schema.ALL_COLUMNS)


def _array(name: str, values) -> np.ndarray:
    if _KINDS.get(name, "str") == "str":
        array = np.empty(len(values), dtype=object)
        array[:] = list(values)
    else:
        array = np.asarray(values, dtype=_KINDS[name])
    array.setflags(write=False)
    return array


class ColumnTable(RecordTable):
    """Every column of schema.ALL_COLUMNS (and any extra one given), one entry per record.
    Nothing is read from a file: the RecordTable's HDF5 side is never set up."""

    def __init__(self, columns: dict[str, list], path: str, sketches: np.ndarray | None = None):
        lengths = {len(values) for values in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"record columns of unequal length for {path}")
        self._count = lengths.pop() if lengths else 0
        self._path = path
        self._columns = {name: _array(name, values) for name, values in columns.items()}
        missing = [name for name in schema.COLUMN_NAMES if name not in self._columns]
        if missing:
            raise ValueError(f"records of {path} lack the columns {missing}")
        for name, _, absent in schema.OPTIONAL_COLUMNS:
            self._columns.setdefault(name, _array(name, [absent] * self._count))
        known = schema.COLUMN_NAMES + schema.OPTIONAL_COLUMN_NAMES
        self.columns: tuple[str, ...] = known + tuple(sorted(set(self._columns) - set(known)))
        self._sketches = sketches
        self._index: dict[str, int] | None = None

    def __repr__(self) -> str:
        return f"ColumnTable({self._count} records from {self._path})"

    def column(self, name: str) -> np.ndarray:
        try:
            return self._columns[name]
        except KeyError:
            raise KeyError(f"no record column {name!r}; columns are {', '.join(self.columns)}") from None

    def sketches(self) -> np.ndarray | None:
        return self._sketches

    def as_lists(self) -> dict[str, list]:
        """Every column as a Python list (a copy to rewrite)."""
        return {name: self._columns[name].tolist() for name in self.columns}
