"""``probe compare --csv FILE``: one row per aligned record, in execution order.

Columns are COLUMNS below; empty cells mean "does not apply" (no partner, no tensor data,
...). Floats are written with repr precision; inf/nan as "inf"/"nan". The replay_* columns
(``--replay``) hold the float64 replay verdict of the record's call, on every record of a
replayed call, empty elsewhere.
"""

from __future__ import annotations

import csv
import io
import math

from probe.comparison import result as R

COLUMNS = (
    "step", "rank", "status", "key", "key_b", "module", "op", "index", "phase", "slot", "io", "kind",
    "seq_a", "seq_b", "dtype_a", "dtype_b", "shape_a", "shape_b", "evidence", "tol_dtype", "rtol",
    "atol", "score", "rel_l2", "max_abs", "max_rel", "cosine", "within", "nan_mismatch",
    "inf_mismatch", "ulp_max", "bit_equal", "err_l2", "norm_a", "norm_b", "value_a", "value_b",
    "divergence", "origin", "cause", "reasons", "notes", "source", "paired_by",
    "replay_verdict", "replay_error_a", "replay_error_b", "replay_ulp_a", "replay_ulp_b", "replay_closer",
)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    return str(value)


def row_cells(row: R.RecordRow, replay: dict | None = None) -> list[str]:
    m = row.metrics
    values = {
        "step": row.step, "rank": row.rank, "status": row.status, "key": row.key, "key_b": row.key_b,
        "module": row.module, "op": row.op, "index": row.index, "phase": row.phase, "slot": row.slot,
        "io": row.io, "kind": row.kind, "seq_a": row.seq_a, "seq_b": row.seq_b,
        "dtype_a": row.dtype_a, "dtype_b": row.dtype_b, "shape_a": row.shape_a, "shape_b": row.shape_b,
        "evidence": m.evidence if m else None, "tol_dtype": row.tol_dtype, "rtol": row.rtol,
        "atol": row.atol, "score": row.score,
        "divergence": row.divergence, "origin": row.origin, "cause": row.cause,
        "reasons": "; ".join(row.reasons), "notes": "; ".join(row.notes), "source": row.source,
        "paired_by": row.paired_by,
    }
    if m is not None:
        values.update({
            "rel_l2": m.rel_l2, "max_abs": m.max_abs, "max_rel": m.max_rel, "cosine": m.cosine,
            "within": m.within, "nan_mismatch": m.nan_mismatch, "inf_mismatch": m.inf_mismatch,
            "ulp_max": m.ulp_max, "bit_equal": m.bit_equal, "err_l2": m.err_l2,
            "norm_a": m.ref_norm, "norm_b": m.other_norm, "value_a": m.value_a, "value_b": m.value_b,
        })
    if replay is not None:
        values.update({"replay_" + name: replay.get(name) for name in
                       ("verdict", "error_a", "error_b", "ulp_a", "ulp_b", "closer")})
    return [_cell(values.get(name)) for name in COLUMNS]


def render(result: R.CompareResult) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    replayed = result.replay is not None
    if replayed:
        from probe.report.replay_text import verdict_of
    for row in result.rows:
        verdict = verdict_of(result, row.step, row.rank, row.key_a) if replayed and row.key_a else None
        writer.writerow(row_cells(row, verdict))
    return buffer.getvalue()
