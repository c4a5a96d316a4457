"""What a compare returns: one row per aligned record, the verdict, and the summaries.

Data only: the renderers (probe/report/) import this module, never the reverse.
``probe.compare`` returns it with its renderers attached (report/rendered.py:
``to_text``, ``to_json`` as ``probe compare --json`` prints it, ``write_html/write_csv/
write_json``). ``to_dict()`` is the JSON without the headline and the divergences list;
non-finite floats become the strings "inf", "-inf" and "nan" so the output stays strict JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from probe.comparison.metrics import Metrics
from probe.comparison.where import where_text

# row status
MATCH, DIVERGED, ONLY_A, ONLY_B = "match", "diverged", "only_a", "only_b"
#: paired, within tolerance by the statistics, but the checksums differ: the bytes changed by an
#: amount no recorded number can size (verdict.judge_checksum_change decides CHANGED or DIVERGED)
CHANGED = "changed"
#: paired, beyond its own dtype's tolerance, but explained by differences that were accepted
#: (rounding amplified by the op's conditioning: Adam's division by sqrt(v), a cancelling sum)
#: or without effect: not a divergence (explain.judge_call decides; docs/compare-rules.md)
EXPLAINED = "explained"
WITHIN = (MATCH, CHANGED, EXPLAINED)  # paired and accepted: within tolerance or explained
PAIRED = (MATCH, CHANGED, EXPLAINED, DIVERGED)
#: how reports name a record whose checksums differ while its statistics agree
SIZE_UNKNOWN = "changed (checksum differs; statistics agree, size unknown)"
#: the note of a device/placement argument that differs (devices.py): counted once per report
PLACEMENT_NOTE = "placement argument"
# origin of a divergent record
INTRODUCED, INHERITED, AMPLIFIED = "introduced", "inherited", "amplified"
# what kind of divergence a row is
OUTPUT, PARAM, ARGUMENT, INPUT = "output", "param", "argument", "input"
#: an op one run computes in a lower dtype by the model's own casts (comparison/precision.py)
PRECISION = "precision"


@dataclass
class RecordRow:
    """One record of A aligned with one record of B (or with nothing)."""

    step: int
    rank: int
    status: str
    module: str
    op: str
    index: int
    phase: str
    slot: str
    io: str
    kind: str
    key_a: str = ""
    key_b: str = ""
    seq_a: int | None = None
    seq_b: int | None = None
    dtype_a: str = ""
    dtype_b: str = ""
    shape_a: str = ""
    shape_b: str = ""
    source: str = ""
    paired_by: str = ""  # how the call pair was made (align.SEQUENCE / NAME / KEY, foreach.FOREACH)
    target: str = ""  # the parameter an optimizer call updates ("fc1.weight"), "" elsewhere
    stale: str = ""  # "A" / "B": that run's record holds pre-write values, not compared (stale.py)
    #: the norm of what this tensor was reduced from (a cancelling sum: a bias gradient), 0 if none
    scale_norm: float = 0.0
    #: its difference is rounding or explained by accepted differences (explain.is_accepted), when
    #: judge_call decided it; None: not decided (accepted() decides from the row alone)
    accepted: bool | None = None
    tol_dtype: str = ""
    rtol: float | None = None
    atol: float | None = None
    metrics: Metrics | None = None
    score: float | None = None  # error / tolerance budget: > 1 is beyond tolerance
    divergence: str = ""  # OUTPUT / PARAM / ARGUMENT / INPUT when status is DIVERGED
    origin: str = ""  # INTRODUCED / INHERITED for divergent outputs
    cause: str = ""  # one line: why this op introduced its error
    reasons: list[str] = field(default_factory=list)  # why the row diverged
    notes: list[str] = field(default_factory=list)  # facts that are not errors (dtype differs)
    input_errors: list[dict] = field(default_factory=list)  # the call's inputs, for outputs
    order: tuple = ()  # execution order within the step (A's seq)
    #: what rounding alone can make this output differ by, beside what was seen (rounding.py)
    envelope: dict | None = None

    @property
    def key(self) -> str:
        return self.key_a or self.key_b

    @property
    def size_unknown(self) -> bool:
        """The checksums differ while the statistics agree within tolerance: the bytes changed,
        but no recorded number says by how much (the rel L2 is only a lower bound)."""
        m = self.metrics
        return (
            m is not None and m.evidence == "checksum" and m.bit_equal is False and not m.nan_mismatch
            and not m.inf_mismatch and self.score is not None and self.score <= 1
            and m.sketch is None  # sketches measure the change
        )

    def to_dict(self) -> dict:
        data = {
            "step": self.step,
            "rank": self.rank,
            "status": self.status,
            "key": self.key,
            "key_b": self.key_b,
            "module": self.module,
            "op": self.op,
            "index": self.index,
            "phase": self.phase,
            "slot": self.slot,
            "io": self.io,
            "kind": self.kind,
            "seq_a": self.seq_a,
            "seq_b": self.seq_b,
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "shape_a": self.shape_a,
            "shape_b": self.shape_b,
            "source": self.source,
            "paired_by": self.paired_by,
            "target": self.target or None,
            "stale": self.stale or None,
            "tolerance": {"dtype": self.tol_dtype, "rtol": self.rtol, "atol": self.atol} if self.tol_dtype else None,
            "score": self.score,
            "divergence": self.divergence or None,
            "origin": self.origin or None,
            "cause": self.cause or None,
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "size_unknown": self.size_unknown,
        }
        if self.metrics is not None:
            data["evidence"] = self.metrics.evidence
            data["metrics"] = self.metrics.to_dict()
        if self.input_errors:
            data["input_errors"] = list(self.input_errors)
        if self.envelope is not None:
            data["envelope"] = dict(self.envelope)
        return json_safe(data)


@dataclass
class OpSummary:
    """One call pair ranked by the error it introduces (top_ops)."""

    step: int
    rank: int
    module: str
    op: str
    index: int
    phase: str
    key: str
    kind: str
    introduced: float  # output score minus the largest score of its produced inputs (tolerance units)
    output_rel_l2: float
    input_rel_l2: float
    ratio: float | None  # output rel L2 / input rel L2 (None when the inputs agree exactly)
    diverged: bool
    origin: str
    source: str = ""
    where: list = field(default_factory=list)  # every (step, rank) where this op adds error
    target: str = ""  # the parameter an optimizer call updates, "" elsewhere
    diverged_in: int = 0  # in how many of those its output is beyond tolerance

    def to_dict(self) -> dict:
        data = dict(self.__dict__)
        where = data.pop("where") or [(self.step, self.rank)]
        data["occurrences"] = len(where)
        data["where"] = [{"step": step, "rank": rank} for step, rank in where]
        data["where_text"] = where_text(where)
        return json_safe(data)


@dataclass
class CompareResult:
    verdict: str  # "pass" | "diverged"
    first_divergence: RecordRow | None
    likely_cause: RecordRow | None
    counts: dict
    rows: list[RecordRow]
    top_ops: list[OpSummary]
    tolerances: dict
    evidence: str  # "tensor" | "checksum" | "statistics" (the weakest used)
    steps: list[dict]  # [{"step", "rank", "verdict", "counts"}] per compared file pair
    path_a: str = ""
    path_b: str = ""
    missing: list[str] = field(default_factory=list)  # steps/ranks on one side only
    notes: list[str] = field(default_factory=list)
    changes: list = field(default_factory=list)  # groups.Change: changed params/arguments, each once
    op_summaries: list[OpSummary] = field(default_factory=list)  # every call pair, before grouping
    # probe.replay.ReplayReport when compare ran with replay=N (float64 replay verdicts per
    # call; report/json_report.py, csv_report.py, html_report.py show them)
    replay: object = None
    #: settings the two runs recorded differently: [{"setting", "a", "b"}] (comparison/run_info.py)
    run_differences: list[dict] = field(default_factory=list)
    #: {step, rank, text} when the runs part through accumulated rounding (comparison/drift.py)
    drift: dict | None = None
    #: the rounding envelopes over every output: {largest_gap, at, step, rank, differ, outputs,
    #: rounding, uncertain, strict} (comparison/envelope_summary.py); None when none was judged
    envelope: dict | None = None

    @property
    def diverged(self) -> bool:
        return self.verdict == "diverged"

    @property
    def divergences(self) -> list[RecordRow]:
        return [row for row in self.rows if row.status == DIVERGED]

    def to_dict(self, rows: bool = False) -> dict:
        """The result's own fields (to_json() adds headline and divergences)."""
        data = {
            "verdict": self.verdict,
            "a": self.path_a,
            "b": self.path_b,
            "reference": "a",
            "first_divergence": divergence_dict(self.first_divergence),
            "likely_cause": divergence_dict(self.likely_cause),
            "counts": dict(self.counts),
            "evidence": self.evidence,
            "tolerances": self.tolerances,
            "top_ops": [op.to_dict() for op in self.top_ops],
            "changes": [change.to_dict() for change in self.changes],
            "steps": list(self.steps),
            "missing": list(self.missing),
            "notes": list(self.notes),
            "run_differences": list(self.run_differences),
            "drift": self.drift,
            "envelope": self.envelope,
        }
        if rows:
            data["rows"] = [row.to_dict() for row in self.rows]
        return json_safe(data)


def divergence_dict(row: RecordRow | None) -> dict | None:
    """The contract form of a divergence: where, what, and every metric at the top level."""
    if row is None:
        return None
    data = {
        "step": row.step,
        "rank": row.rank,
        "key": row.key,
        "module": row.module,
        "op": row.op,
        "index": row.index,
        "phase": row.phase,
        "slot": row.slot,
        "io": row.io,
        "kind": row.divergence,
        "origin": row.origin or None,
        "cause": row.cause or None,
        "source": row.source,
        "target": row.target or None,
        "dtype_a": row.dtype_a,
        "dtype_b": row.dtype_b,
        "shape": row.shape_a or row.shape_b,
        "score": row.score,
        "size_unknown": row.size_unknown,
        "reasons": list(row.reasons),
        "input_errors": list(row.input_errors),
        "envelope": dict(row.envelope) if row.envelope is not None else None,
    }
    if row.metrics is not None:
        data["evidence"] = row.metrics.evidence
        metrics = row.metrics.to_dict()
        metrics.pop("evidence", None)
        metrics.pop("notes", None)
        data.update(metrics)
    return json_safe(data)


def json_safe(value):
    """Replace non-finite floats by strings, recursively (JSON has no Infinity/NaN)."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


@dataclass
class StepOutcome:
    """What one pair of step files gave (engine.compare_step): its rows and call summaries;
    assemble.py puts the outcomes of every pair together into a CompareResult."""

    step: int
    rank: int
    rows: list[RecordRow]
    summaries: list[OpSummary]
    evidence: set = field(default_factory=set)
    tensor_bytes: int = 0
    #: (device in A, device in B) -> records of paired tensors that live on different devices
    devices: dict = field(default_factory=dict)
    #: content_key -> key of A's records whose difference was accepted (EXPLAINED outputs):
    #: the next step reads them again (a parameter the optimizer updated) and accepts them too
    explained: dict = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return any(row.status == DIVERGED for row in self.rows)

    def counts(self) -> dict:
        return count_rows(self.rows)


def count_rows(rows) -> dict:
    """matched: paired records; diverged: those beyond tolerance; changed: those within
    tolerance whose checksums differ (size unknown); only_a/only_b: without partner."""
    counts = {"matched": 0, "only_a": 0, "only_b": 0, "diverged": 0, "changed": 0, "explained": 0}
    for row in rows:
        if row.status in PAIRED:
            counts["matched"] += 1
            if row.status != MATCH:
                counts[row.status] += 1
        else:
            counts[row.status] += 1
    return counts
