"""Helpers shared by the dump tests and their subprocess scripts: build real step files
with StepWriter (no debugger needed)."""

from __future__ import annotations

import math

from probe.dump import schema

_DEFAULTS = {
    "key": "",
    "seq": 0,
    "kind": "api",
    "module": "",
    "op": "functional.linear",
    "index": 0,
    "phase": "forward",
    "slot": "output.0",
    "io": "out",
    "dtype": "float32",
    "shape": "[2, 3]",
    "device": "cpu",
    "value": "",
    "min": -1.0,
    "max": 1.0,
    "mean": 0.0,
    "norm": 2.0,
    "nan_count": 0,
    "inf_count": 0,
    "numel": 6,
    "checksum": "",
    "tensor_id": -1,
    "source": "",
}


def root_attrs(task: str = "tensor", **overrides) -> dict:
    attrs = {
        "schema_version": schema.SCHEMA_VERSION,
        "probe_version": "test",
        "torch_version": "2.13.0+cpu",
        "step": 0,
        "rank": 0,
        "world_size": 1,
        "task": task,
        "level": "mix",
        "device": "cpu",
        "config": {"task": task, "level": "mix", "seed": 1234},
        "seed_report": {"seed": 1234, "mode": False},
        "determinism": {"threads": 1},
    }
    attrs.update(overrides)
    return attrs


def make_row(**values) -> tuple:
    unknown = set(values) - set(_DEFAULTS)
    if unknown:
        raise KeyError(f"unknown record columns {sorted(unknown)}")
    row = dict(_DEFAULTS, **values)
    if not row["key"]:
        row["key"] = schema.make_key(row["module"], row["op"], row["index"], row["phase"], row["slot"])
    return tuple(row[name] for name in schema.COLUMN_NAMES)


def rows_for(count: int, seq_offset: int = 0) -> list[tuple]:
    return [
        make_row(module=f"layers.{i}", seq=seq_offset + i, min=float(-i), max=float(i), mean=i / 2,
                 norm=math.sqrt(i))
        for i in range(count)
    ]


def write_step(dump_path, step: int, rank: int = 0, tensors=(), rows=None, task="tensor", **writer_kwargs) -> str:
    from probe.dump.writer import StepWriter

    writer = StepWriter(str(dump_path), step, rank, root_attrs(task=task), **writer_kwargs)
    ids = [writer.add_tensor(tensor) for tensor in tensors]
    if rows is None:
        rows = [make_row(module=f"m{i}", seq=i, tensor_id=tensor_id) for i, tensor_id in enumerate(ids)] or rows_for(3)
    writer.add_rows(rows)
    return writer.close()
