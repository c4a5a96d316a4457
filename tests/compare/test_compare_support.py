"""Synthetic runs for the compare tests: records shaped like the capture writes them.

``SyntheticRun`` builds the records of one step from numpy arrays: each call gets the
next seq, a per-(module, op, phase) index, one record per slot, statistics computed from
the array, and a tensor_id shared by every record of the same array object (the capture
stores each distinct tensor once per step). ``write_step`` stores a run as a real step
file with the project's StepWriter, for tests that need files.
"""

from __future__ import annotations

import json
import math

import numpy as np

from probe.comparison.records import Records, slot_io
from probe.dump import schema


class SyntheticRun:
    def __init__(self, task: str = "tensor"):
        self.task = task
        self.rows: list[dict] = []
        self.tensors: dict[int, np.ndarray] = {}
        self.dtypes: dict[int, str] = {}
        self._ids: dict[int, int] = {}
        self._keep: list = []
        self._counters: dict = {}
        self.seq = 0

    def _tensor_id(self, array: np.ndarray, dtype: str) -> int:
        found = self._ids.get(id(array))
        if found is not None:
            return found
        tensor_id = len(self.tensors)
        self.tensors[tensor_id] = array
        self.dtypes[tensor_id] = dtype
        self._ids[id(array)] = tensor_id
        self._keep.append(array)  # ids stay unique while the run lives
        return tensor_id

    def call(self, module: str, op: str, slots: dict, phase: str = "forward", kind: str = "api",
             source: str = "", dtype: str | None = None) -> int:
        """Add one call; slots maps slot name -> numpy array or a plain value. Returns its seq."""
        counter = (module, op, phase)
        index = self._counters.get(counter, 0)
        self._counters[counter] = index + 1
        seq = self.seq
        self.seq += 1
        for slot, value in slots.items():
            row = {
                "key": schema.make_key(module, op, index, phase, slot), "seq": seq,
                "kind": "param" if slot.startswith(("param.", "param_grad.")) else kind,
                "module": module, "op": op, "index": index, "phase": phase, "slot": slot,
                "io": slot_io(slot), "source": source,
            }
            if isinstance(value, np.ndarray):
                name = dtype or str(value.dtype)
                row.update(_stats(value), dtype=name, shape=json.dumps(list(value.shape)), device="cpu",
                           value="", checksum=_checksum(value) if self.task in ("tensor", "checksum") else "",
                           tensor_id=self._tensor_id(value, name) if self.task == "tensor" else -1)
            else:
                row.update(dtype="", shape="", device="", value=json.dumps(value), min=math.nan, max=math.nan,
                           mean=math.nan, norm=math.nan, nan_count=0, inf_count=0, numel=0, checksum="",
                           tensor_id=-1)
            self.rows.append(row)
        return seq

    def records(self) -> Records:
        return Records.from_dicts(self.rows, "synthetic")

    def fetch(self, tensor_id: int) -> np.ndarray:
        return self.tensors[tensor_id]


def _stats(array: np.ndarray) -> dict:
    values = array.astype(np.float64).reshape(-1)
    nan = math.nan
    return {
        "min": float(values.min()) if values.size else nan,
        "max": float(values.max()) if values.size else nan,
        "mean": float(values.mean()) if values.size else nan,
        "norm": float(np.sqrt(np.dot(values, values))) if values.size else nan,
        "nan_count": int(np.isnan(values).sum()),
        "inf_count": int(np.isinf(values).sum()),
        "numel": int(values.size),
    }


def _checksum(array: np.ndarray) -> str:
    import hashlib

    return hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16).hexdigest()


def mlp_run(weight_noise: float = 0.0, extra_call: bool = False, gelu_tanh: bool = False, seed: int = 0,
            task: str = "tensor", dtype=np.float32) -> SyntheticRun:
    """Forward of Linear -> GELU -> Linear in numpy, recorded at mix level (api + module)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 16)).astype(dtype)
    w1 = (rng.standard_normal((16, 16)) / 4).astype(dtype)
    w2 = (rng.standard_normal((16, 4)) / 4).astype(dtype)
    if weight_noise:
        w1 = (w1 + np.random.default_rng(99).standard_normal(w1.shape) * weight_noise).astype(dtype)
    run = SyntheticRun(task)
    h = (x @ w1).astype(dtype)
    run.call("fc1", "functional.linear", {"input.0": x, "input.1": w1, "output.0": h}, source="model.py:10")
    run.call("fc1", "Linear", {"input.0": x, "param.weight": w1, "output.0": h}, kind="module")
    if extra_call:
        copy = h.copy()
        run.call("act", "Tensor.clone", {"input.0": h, "output.0": copy})
        h = copy
    g = _gelu(h, gelu_tanh).astype(dtype)
    run.call("act", "functional.gelu", {"input.0": h, "kwarg.approximate": "tanh" if gelu_tanh else "none",
                                        "output.0": g}, source="model.py:11")
    run.call("act", "GELU", {"input.0": h, "output.0": g}, kind="module")
    y = (g @ w2).astype(dtype)
    run.call("fc2", "functional.linear", {"input.0": g, "input.1": w2, "output.0": y}, source="model.py:12")
    run.call("fc2", "Linear", {"input.0": g, "param.weight": w2, "output.0": y}, kind="module")
    return run


def linear_checksum_run(weight, x=None, noise=0.0):
    """One linear at mix level with checksums; noise perturbs the output by float32 rounding."""
    run = SyntheticRun("checksum")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32) if x is None else x
    out = (x @ weight).astype(np.float32)
    if noise:
        out = (out * (1 + noise * rng.standard_normal(out.shape))).astype(np.float32)
    run.call("fc", "Linear", {"input.0": x, "param.weight": weight}, kind="module")
    run.call("fc", "functional.linear", {"input.0": x, "input.1": weight, "output.0": out})
    return run


def square_weight():
    return (np.random.default_rng(1).standard_normal((8, 8)) / 4).astype(np.float32)


def _gelu(x: np.ndarray, tanh: bool) -> np.ndarray:
    x = x.astype(np.float64)
    if tanh:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))


def write_step(run: SyntheticRun, dump_path, step: int = 0, rank: int = 0, **attrs) -> str:
    """Store a synthetic run as a real step file with StepWriter; returns the file path."""
    import torch

    from probe.dump.writer import StepWriter

    root = {
        "probe_version": "test", "torch_version": torch.__version__, "world_size": 1, "task": run.task,
        "level": "mix", "device": "cpu", "config": {}, "seed_report": None, "determinism": {},
        "schema_version": schema.SCHEMA_VERSION, "step": step, "rank": rank,
    }
    root.update(attrs)
    writer = StepWriter(str(dump_path), step, rank, root)
    ids = {}
    for tensor_id in sorted(run.tensors):
        array = run.tensors[tensor_id]
        tensor = torch.from_numpy(np.ascontiguousarray(array).copy())
        if run.dtypes[tensor_id] == "bfloat16":
            tensor = tensor.to(torch.bfloat16)
        ids[tensor_id] = writer.add_tensor(tensor)
    rows = []
    for row in run.rows:
        row = dict(row)
        if row["tensor_id"] >= 0:
            row["tensor_id"] = ids[row["tensor_id"]]
        rows.append(tuple(row[name] for name in schema.COLUMN_NAMES))
    writer.add_rows(rows)
    return writer.close()


def test_synthetic_run_shares_tensor_ids_between_producer_and_consumer():
    run = mlp_run()
    records = run.records()
    cols = records.columns
    out_fc1 = cols["tensor_id"][cols["key"].index("fc1/functional.linear#0/forward/output.0")]
    in_act = cols["tensor_id"][cols["key"].index("act/functional.gelu#0/forward/input.0")]
    assert out_fc1 == in_act >= 0
    assert len(set(cols["seq"])) == 6


def test_synthetic_gelu_variants_differ_by_the_documented_bound():
    x = np.linspace(-6, 6, 2001)
    gap = np.abs(_gelu(x, False) - _gelu(x, True)).max()
    assert 3e-4 < gap < 6e-4
