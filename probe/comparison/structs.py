"""The structs the compare stages hand each other, and the row a compare reports.

Each stage takes the previous stage's struct and returns its own (api.compare_step):

    StepInput (load) --normalize--> NormalizedStep --align--> AlignedStep (Slots)
        --measure--> MeasuredStep (Measurements) --judge--> StepOutcome

and assemble puts the StepOutcomes together into a CompareResult (result.py), with the op
summaries made from the final rows. A ``Slot`` is one slot of a call pair: its RecordRow
and the record rows of A and B (either may be None).
A ``Measurement`` is a paired slot once measured: what it was measured as, its metrics and
tolerance, and what the later stages need to know about its records (the parsed values,
A's content key, the parameter it holds, the statistics an in-place write check compares),
so that no stage after measure reads a record column or parses a value again.

A ``RecordRow`` is what a report shows of one aligned record. Align makes it, measure adds
its tolerance and dtype notes, the judge stage writes its status and origin; the rules over
all step files (story.py: drift, where a 16-bit error entered) may restate an origin before
the result exists, and replay, the one later writer, adds its own section. Data only: nothing
here imports torch or a stage.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import TYPE_CHECKING, Callable

from probe.comparison.metrics import Metrics
from probe.comparison.ops import OpSpec, is_collective_op, spec

if TYPE_CHECKING:
    from probe.comparison.envelope import Operand
    from probe.comparison.records import Call, CallPair, NameMapping, Records
    from probe.comparison.result import PrecisionTally
    from probe.comparison.tolerances import Tolerance

#: the runs of API calls a step file recorded under autocast, [[first_seq, last_seq, dtype], ...]
#: (its root attribute ``autocast``; None where not recorded)
AutocastRuns = list

# row status
MATCH, DIVERGED, ONLY_A, ONLY_B = "match", "diverged", "only_a", "only_b"
#: paired, within tolerance by the statistics, but the checksums differ: the bytes changed by an
#: amount no recorded number can size (record_rules.judge_checksum_change decides CHANGED or DIVERGED)
CHANGED = "changed"
#: paired, beyond its own dtype's tolerance, but explained by differences that were accepted
#: (rounding amplified by the op's conditioning: Adam's division by sqrt(v), a cancelling sum)
#: or without effect: not a divergence (call_rules.judge_call decides; docs/compare-rules.md)
EXPLAINED = "explained"
WITHIN = (MATCH, CHANGED, EXPLAINED)  # paired and accepted: within tolerance or explained
PAIRED = (MATCH, CHANGED, EXPLAINED, DIVERGED)
#: how reports name a record whose checksums differ while its statistics agree
SIZE_UNKNOWN = "changed (checksum differs; statistics agree, size unknown)"
#: the note of a device/placement argument that differs (record_rules.py): counted once per report
PLACEMENT_NOTE = "placement argument"
#: an op's own error must exceed its rounding envelope this many times to be called introduced
FACTOR = 2.0
#: the note of a record of memory nothing had written yet (record_rules.judge_uninitialized)
UNINITIALIZED_NOTE = "not compared: memory nothing had written yet"
# origin of a divergent record
INTRODUCED, INHERITED, AMPLIFIED = "introduced", "inherited", "amplified"
# what kind of divergence a row is
OUTPUT, PARAM, ARGUMENT, INPUT = "output", "param", "argument", "input"
#: an op one run computes in a lower dtype by the model's own casts (comparison/judge.py)
PRECISION = "precision"

#: input kinds (measure.Provenance.kind, call_rules.judge_call): where the tensor an input slot holds came
#: from; CHANGED_INPUT: produced, and changed after its producer made it
PRODUCED, PARAM_INPUT, PARAM_UPDATE, CARRIED, UNRECORDED, EXTERNAL, CHANGED_INPUT = (
    "produced", "param", "param_update", "carried", "unrecorded", "external", "changed")
#: a produced input whose producing call has no partner in the other run
UNPAIRED = "unpaired"
#: a tensor record of the forward of the call whose backward is judged: the values the
#: backward computes from (saved activations, the weight the forward read)
FORWARD = "forward"
#: inputs that pass on an error made upstream, divergent or not; parameters and external
#: inputs carry their error too while within tolerance, and are sources once beyond it
CARRIERS = (PRODUCED, PARAM_UPDATE, CARRIED, UNRECORDED, FORWARD)


def is_carrier(kind: str, status: str) -> bool:
    return kind in CARRIERS or status != DIVERGED


def forward_carriers(forward: list[RecordRow]) -> list[RecordRow]:
    """The tensor records of a call's forward that its backward computes from: paired,
    measured as tensors (not plain values)."""
    return [r for r in forward if r.status in PAIRED and r.metrics is not None and r.metrics.evidence != "value"]


@dataclass
class Side:
    """One run's step file: its records and, once built, its calls."""

    records: Records
    calls: list[Call] = field(default_factory=list)


@dataclass
class NormalizedStep:
    """What the normalize steps hand on: both sides, and the mapping that renames them."""

    a: Side
    b: Side
    mapping: NameMapping | None = None

    @property
    def sides(self) -> tuple[Side, Side]:
        return self.a, self.b


@dataclass(slots=True)
class Slot:
    """One slot of a call pair: its RecordRow and the record rows of A and B (None: that run
    has no record for it)."""

    row: RecordRow
    a: int | None
    b: int | None
    number: int = -1  # the call pair it belongs to

    @property
    def paired(self) -> bool:
        return self.a is not None and self.b is not None


@dataclass
class AlignedStep:
    """The aligned calls of one pair of step files and their slots."""

    step: int
    rank: int
    records_a: Records
    records_b: Records
    calls_a: list[Call]
    pairs: list[CallPair]  # in A's execution order
    per_pair: list[list[Slot]]  # the slots of each pair, in record order
    #: the slots paired on both sides, in A's execution order (a module's output after the API
    #: calls inside it)
    paired: list[Slot]


#: what a paired record was measured as, and so which record rule judges it
TENSOR, VALUE, SCALAR, ABSENT, MIXED, SHAPE = "tensor", "value", "scalar", "absent", "mixed", "shape"


@dataclass(slots=True)
class Measurement:
    """One paired slot, measured: how it compares, and what the judge needs of its records."""

    slot: Slot
    kind: str  # where A's tensor came from (an input kind above)
    producer: int | None  # A's record row that made it, when kind is PRODUCED or a parameter
    order: tuple
    what: str  # TENSOR | VALUE | SCALAR | ABSENT | MIXED | SHAPE
    metrics: Metrics | None = None
    tol: Tolerance | None = None
    #: the plain values of A and B, parsed (VALUE and SCALAR slots), and their text
    values: tuple = (None, None)
    texts: tuple = ("", "")
    #: records.content_key of A's record: its values, comparable across step files
    content_key: int | None = None
    #: the parameter A's tensor is ("fc1.weight"), when it is one or holds one
    param: str | None = None
    #: the statistics of A's and B's record, and of their call's input.0 (None: a run lacks
    #: it), that the in-place write check compares (record_rules.StaleRecords)
    stats: tuple = (None, None)
    input_stats: tuple | None = None
    #: A's recorded tensor, its statistics parsed, as the rounding envelopes read it (None: none)
    operand: Operand | None = None

    @property
    def row(self) -> RecordRow:
        return self.slot.row


@dataclass
class MeasuredStep:
    aligned: AlignedStep
    measurements: list[Measurement]  # in A's execution order
    backward_from: float  # seq where A's backward began (inf: none)
    evidence: set
    bytes_read: int
    #: (device in A, device in B) -> paired tensor records that live on different devices
    devices: dict = field(default_factory=dict)
    #: content_keys of A's step file: what the next step file of the rank may carry over
    content_keys: set = field(default_factory=set)
    #: tensor_id -> array of each run, for the amplification recheck (None: statistics only)
    fetch_a: Callable | None = None
    fetch_b: Callable | None = None


@dataclass
class StepInput:
    """One pair of step files as load hands them over."""

    records_a: Records
    records_b: Records
    fetch_a: Callable | None = None  # tensor_id -> array, None: statistics only
    fetch_b: Callable | None = None
    step: int = 0
    rank: int = 0
    #: the step files' root attribute ``autocast`` (None where not recorded)
    autocast_a: AutocastRuns | None = None
    autocast_b: AutocastRuns | None = None
    #: progress(done_records, total_records, tensor_bytes_read), called as records are measured
    progress: Callable | None = None
    #: A's output key -> what a trusted second run differs from A by there (--baseline), else None
    baseline: dict | None = None


@dataclass
class Carry:
    """What A's previous step file of the same rank hands to the next one."""

    #: records.content_keys of A's previous step file: state carried over (optimizer state,
    #: parameters) is told from new external inputs
    content_keys: set | None = None
    #: StepOutcome.explained of that step file: a record holding the same values as an
    #: accepted difference there carries that accepted difference
    explained: dict | None = None


#: a compare holds one RecordRow per record: slots make them smaller and quicker to make and
#: read (9% of a large compare's CPU time); weakly referable, as the memory tests count them
_ROW_SLOTS = {"slots": True, "weakref_slot": True} if sys.version_info >= (3, 11) else {}


@dataclass(**_ROW_SLOTS)
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
    buffer: str = ""  # the model's registered buffer the record holds ("rope.cos"), where capture knew it
    drifting: bool = False  # an introduced error drift explains (story.drift_facts)
    stale: str = ""  # "A" / "B": that run's record holds pre-write values, not compared (record_rules.StaleRecords)
    #: the norm of what this tensor was reduced from (a cancelling sum: a bias gradient), 0 if none
    scale_norm: float = 0.0
    #: its difference is rounding or explained by accepted differences (RecordRow.is_accepted), when
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
    #: what rounding alone can make this output differ by, beside what was seen (rounding.py)
    envelope: dict | None = None
    order: tuple = ()  # execution order within the step (A's seq)

    @property
    def key(self) -> str:
        return self.key_a or self.key_b

    @property
    def spec(self) -> OpSpec:
        """What compare knows of its op (ops.py)."""
        return spec(self.op)

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

    # the row's verdict as the judge's rules read and write it

    @property
    def rounding_ok(self) -> bool:
        """Its difference is within the relative tolerance of its scale (its own norm, or the norm
        of what it was reduced from): rounding, not a small real difference hidden under the
        absolute floor atol."""
        m = self.metrics
        if m is None or m.evidence == "value" or m.err_l2 == 0:
            return True
        if m.nan_mismatch or m.inf_mismatch or not math.isfinite(m.err_l2):
            return False
        # statistics and checksum evidence: the lower bound is all there is (as for the status)
        return m.err_l2 <= (self.rtol or 0.0) * max(m.ref_norm, self.scale_norm)

    @property
    def is_accepted(self) -> bool:
        """Its difference is one a correct run may have: explained, or within tolerance and
        rounding (or explained by accepted differences, as call_rules.judge_call decided)."""
        if self.status == EXPLAINED:
            return True
        if self.status not in WITHIN:
            return False
        return self.accepted if self.accepted is not None else self.rounding_ok

    @property
    def accepted_difference(self) -> bool:
        """An accepted output that differs at all: the next step file accepts the same values
        again when it reads them (a parameter the optimizer updated, judged here with the
        precision of what it was computed from, read there as a float32 parameter)."""
        m = self.metrics
        return self.is_accepted and m is not None and m.evidence != "value" and m.err_l2 > 0

    @property
    def explainable(self) -> bool:
        """A difference that other differences can explain: a sized, finite one (NaN or Inf on
        one side only, a shape change or a tensor against a value never is)."""
        m = self.metrics
        if m is None or m.evidence == "value" or m.nan_mismatch or m.inf_mismatch:
            return False
        if self.size_unknown or (self.shape_a and self.shape_b and self.shape_a != self.shape_b):
            return False
        return math.isfinite(m.rel_l2)

    def explain(self, cause: str, origin: str = AMPLIFIED) -> None:
        """Accept a difference beyond its own tolerance that accepted differences explain."""
        self.status = EXPLAINED
        self.origin = origin
        self.cause = cause
        self.divergence = ""
        kept = [r for r in self.reasons if not (r.startswith("rel L2 ") and " tolerance (score " in r)]
        self.notes.extend(f"{EXPLAINED} ({r})" for r in self.reasons if r not in kept)
        self.reasons = kept

    def unexplain(self, cause: str) -> None:
        """Undo explain(): the output is a divergence its own op introduced."""
        self.status = DIVERGED
        self.origin = INTRODUCED
        self.divergence = OUTPUT
        self.cause = cause
        self.reasons.extend(note.removeprefix(f"{EXPLAINED} (").removesuffix(")") for note in self.notes
                            if note.startswith(f"{EXPLAINED} ("))
        self.notes = [note for note in self.notes if not note.startswith(f"{EXPLAINED} (")]

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

    def __copy__(self) -> "RecordRow":
        # a shallow copy through the constructor: a fifth of copy.copy's time on a slots class
        return RecordRow(*_row_fields(self))


_row_fields = attrgetter(*(found.name for found in fields(RecordRow)))


@dataclass
class StepOutcome:
    """What one pair of step files gave (api.compare_step): its judged rows; assemble.py
    puts the outcomes of every pair together into a CompareResult."""

    step: int
    rank: int
    rows: list[RecordRow]
    #: (rows, forward rows) of each paired call, in the order they were judged: what the op
    #: summaries are made from once the rules over every step file have run (assemble.py)
    calls: list[tuple[list[RecordRow], list[RecordRow]]] = field(default_factory=list)
    evidence: set = field(default_factory=set)
    tensor_bytes: int = 0
    #: (device in A, device in B) -> records of paired tensors that live on different devices
    devices: dict = field(default_factory=dict)
    #: content_key -> key of A's records whose difference was accepted (EXPLAINED outputs), and
    #: ("param", name) -> the accepted gradient the optimizer updated that parameter from: the
    #: next step file of the rank reads them again and accepts them too (Carry.explained)
    explained: dict = field(default_factory=dict)
    #: PrecisionTally of this pair: lower dtypes on one side, counted (assemble adds them up)
    precision: PrecisionTally | None = None
    #: measure.content_keys of A's step file (Carry.content_keys of the rank's next step file)
    content_keys: set = field(default_factory=set)

    @property
    def diverged(self) -> bool:
        return any(row.status == DIVERGED for row in self.rows)

    def counts(self) -> dict:
        return count_rows(self.rows)


def count_rows(rows) -> dict:
    """matched: paired records; diverged: those beyond tolerance; changed: those within
    tolerance whose checksums differ (size unknown); only_a/only_b: without partner;
    sharded_only: those of only_a/only_b that only a sharded run makes (sharded_only_rows)."""
    counts = {"matched": 0, "only_a": 0, "only_b": 0, "diverged": 0, "changed": 0, "explained": 0}
    for row in rows:
        if row.status in PAIRED:
            counts["matched"] += 1
            if row.status != MATCH:
                counts[row.status] += 1
        else:
            counts[row.status] += 1
    counts["sharded_only"] = len(sharded_only_rows(rows))
    return counts


def sharded_only_rows(rows) -> list:
    """The records without partner that only a sharded run makes, so that one device or DDP
    (whose gradient all-reduce runs in its C++ reducer, unrecorded) has no counterpart to
    them: the records of collectives (FSDP2's all-gathers and reduce-scatters, tensor
    parallel's all-reduces of partial sums) and FSDP2's reduced gradient shards (param_grad
    call 1, where call 0, this rank's gradient before the reduction, paired), with the
    local gradients compare links to such a call as its inputs (slot ``local_grad.<name>``,
    normalize.link_reduced_gradients)."""
    paired = {(row.step, row.rank, row.module, row.slot) for row in rows
              if row.slot.startswith("param_grad.") and row.index == 0 and row.status in PAIRED}
    return [row for row in rows if row.status in (ONLY_A, ONLY_B) and (
        is_collective_op(row.op) or row.slot.startswith("local_grad.")
        or (row.slot.startswith("param_grad.") and row.index > 0
            and (row.step, row.rank, row.module, row.slot) in paired))]


def json_safe(value, nan: object = "nan", infinite: bool = True):
    """Non-finite floats replaced, recursively (JSON has no Infinity/NaN): NaN by ``nan``, an
    infinity by "inf" / "-inf" (by ``nan`` too when ``infinite`` is False)."""
    if isinstance(value, float):
        if math.isnan(value):
            return nan
        if math.isinf(value):
            return ("inf" if value > 0 else "-inf") if infinite else nan
        return value
    if isinstance(value, dict):
        return {key: json_safe(item, nan, infinite) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item, nan, infinite) for item in value]
    return value


def finite(value, otherwise: float = 0.0) -> float:
    """A number as a float when it is a finite one; otherwise (non-finite, None, a JSON-safe
    "inf" string) the fallback."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return otherwise


def sci(value: float) -> str:
    """An error in scientific notation, as every report writes them: 1.15e-04 (0 stays 0)."""
    return "0" if value == 0 else f"{value:.2e}"


def rel_error(row: RecordRow) -> float:
    """The rel L2 error of a row; inf when it diverged without one (NaN/Inf on one side,
    shapes differ, a tensor against a plain value, changed bytes of unknown size)."""
    m = row.metrics
    if row.stale:
        return 0.0  # not compared: its record holds values from before an in-place write (record_rules.StaleRecords)
    if m is None or m.nan_mismatch or m.inf_mismatch or (row.status == DIVERGED and row.size_unknown):
        return math.inf if row.status == DIVERGED else 0.0
    return m.rel_l2
