"""Two checksum dumps of identical runs, compared bit for bit: which op is nondeterministic.

``probe determinism`` runs a script several times with the same seed and config (task
"checksum") and hands the dumps to ``bit_compare``. Identical runs must produce identical
bytes everywhere, so no tolerance applies: a record differs when its checksum (or, for a
non-tensor argument, its value) differs.

A call (the records with the same module, op, index and phase) whose outputs differ while
every one of its inputs is bit-identical *introduced* the difference: that is a
nondeterministic op. A call whose inputs already differ *inherited* it; so does a backward
call whose forward call differed (the backward reads what the forward saved), and a module
call inside which a recorded call had a differing input (a child's parameter, say). Module
calls around an introducing API call (level "mix") are not listed: the API call is the op. The report names the
first introducing call in execution order (step, then the ``seq`` of its first output) and
lists every op that introduced a difference, in order of first appearance. Each rank is
compared on its own (one report per rank under torchrun). Never imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from probe.analysis.nonfinite import CALL_COLUMNS, INHERITED, INTRODUCED

_COLUMNS = ("key", "seq", "kind", "module", "op", "index", "phase", "slot", "io", "dtype",
            "value", "checksum", "min", "max", "mean", "norm", "nan_count", "inf_count", "source",
            "uninitialized")
_STATS = ("min", "max", "mean", "norm", "nan_count", "inf_count")
#: how many differing slots of a call are described value by value
_DESCRIBED = 3
#: ops that draw random numbers: a difference they introduce is an unseeded generator
RANDOM_OPS = ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial",
              "poisson", "rand_like", "randn_like", "randint_like", "normal_", "uniform_",
              "bernoulli_", "exponential_", "random_", "geometric_", "log_normal_", "cauchy_",
              "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
              "feature_alpha_dropout", "rrelu", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d",
              "AlphaDropout", "RReLU")


@dataclass
class DiffCall:
    """One call with at least one record that differs between the two runs."""

    step: int
    rank: int
    order: int  # seq of its first output record (execution order in the step)
    module: str
    op: str
    index: int
    phase: str
    kind: str
    source: str
    origin: str  # INTRODUCED (inputs identical) or INHERITED (an input differed)
    differing_outputs: list[str] = field(default_factory=list)
    differing_inputs: list[str] = field(default_factory=list)
    first_key: str = ""
    #: how its first differing slots differ: {"slot", "io", "a", "b"} (values as text)
    differences: list[dict] = field(default_factory=list)

    @property
    def random(self) -> bool:
        return self.op.rsplit(".", 1)[-1] in RANDOM_OPS

    def name(self) -> str:
        return f"{self.module or '<root>'} {self.op}#{self.index} ({self.phase})"


@dataclass
class RankedOp:
    """An op (module, op, phase) that introduced differences, over all its calls."""

    module: str
    op: str
    phase: str
    calls: int
    first_step: int
    first_order: int
    source: str
    example_key: str


@dataclass
class RankReport:
    """Run 1 against another run, for one rank."""

    rank: int
    run_a: int
    run_b: int
    steps: list[int]
    records: int = 0
    differing: int = 0
    #: records of memory nothing had written yet in either run: never compared
    uninitialized: int = 0
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    first: DiffCall | None = None
    ops: list[RankedOp] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    device: str = ""
    world_size: int = 1
    #: PYTHONHASHSEED of each run ("" where the run's environment did not set it)
    hash_seeds: tuple[str, str] = ("", "")

    @property
    def identical(self) -> bool:
        return not self.differing and not self.only_a and not self.only_b

    @property
    def recorded(self) -> bool:
        """False when neither run recorded anything: identical then means nothing."""
        return bool(self.records or self.only_b)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["identical"] = self.identical
        data["recorded"] = self.recorded
        return data


def _rows(step_file) -> list[dict]:
    records = step_file.records
    present = [name for name in _COLUMNS if name in records.columns]
    columns = {name: records.column(name).tolist() for name in present}
    return [dict(zip(present, values)) for values in zip(*(columns[n] for n in present))]


def _same(a: dict, b: dict) -> bool:
    if a["dtype"] != b["dtype"]:
        return False
    if not a["dtype"]:
        return a["value"] == b["value"]
    if a["checksum"] or b["checksum"]:
        return a["checksum"] == b["checksum"]
    # no checksum (a dump made with another task): exact statistics are the best evidence
    return all(_equal_number(a[n], b[n]) for n in _STATS)


def _equal_number(x, y) -> bool:
    return x == y or (x != x and y != y)


def _call(row: dict) -> tuple:
    return tuple(row[name] for name in CALL_COLUMNS)


def compare_files(file_a, file_b, rank: int, step: int) -> tuple[list[DiffCall], list[str], list[str], int]:
    """Differing calls of one step file pair, keys found in one run only, records compared.
    A record of memory nothing had written yet in either run (column uninitialized) holds
    leftover bytes, not a value of the run: it is neither compared nor counted."""
    rows_a, rows_b = _rows(file_a), _rows(file_b)
    unwritten = {row["key"] for row in rows_a + rows_b if row.get("uninitialized")}
    if unwritten:
        rows_a = [row for row in rows_a if row["key"] not in unwritten]
        rows_b = [row for row in rows_b if row["key"] not in unwritten]
    by_key_b = {row["key"]: row for row in rows_b}
    keys_a = {row["key"] for row in rows_a}
    only_a = [row["key"] for row in rows_a if row["key"] not in by_key_b]
    only_b = [row["key"] for row in rows_b if row["key"] not in keys_a]
    calls: dict[tuple, DiffCall] = {}
    first_out: dict[tuple, int] = {}
    start: dict[tuple, int] = {}  # a module call runs from its inputs' seq to its outputs'
    for row in rows_a:
        call = _call(row)
        start[call] = min(start.get(call, row["seq"]), row["seq"])
        if row["io"] == "out":
            first_out[call] = min(first_out.get(call, row["seq"]), row["seq"])
    for row in rows_a:
        other = by_key_b.get(row["key"])
        if other is None or _same(row, other):
            continue
        call = _call(row)
        diff = calls.get(call)
        if diff is None:
            diff = calls[call] = DiffCall(
                step=step, rank=rank, order=first_out.get(call, row["seq"]), module=row["module"],
                op=row["op"], index=int(row["index"]), phase=row["phase"], kind=row["kind"],
                source=row["source"], origin=INTRODUCED)
        (diff.differing_outputs if row["io"] == "out" else diff.differing_inputs).append(row["slot"])
        if len(diff.differences) < _DESCRIBED:
            diff.differences.append(describe_difference(row, other))
        if row["io"] == "out" and not diff.first_key:
            diff.first_key = row["key"]
            diff.source = row["source"] or diff.source
    for diff in calls.values():
        # a backward computes from what its forward saved (x for pow's 2*x*grad), which its own
        # records do not hold: a forward that differed makes its backward inherit
        forward = calls.get((diff.module, diff.op, diff.index, "forward"))
        if diff.differing_inputs or (diff.phase == "backward" and forward is not None):
            diff.origin = INHERITED
    for call, diff in calls.items():
        if diff.kind == "module" and diff.origin == INTRODUCED and _fed_inside(diff, start[call], calls):
            diff.origin = INHERITED
        if not diff.first_key:
            diff.first_key = f"{diff.module}/{diff.op}#{diff.index}/{diff.phase}/{diff.differing_inputs[0]}"
    ordered = sorted(calls.values(), key=lambda d: d.order)
    return ordered, only_a, only_b, len(rows_a)


def describe_difference(a: dict, b: dict) -> dict:
    """{"slot", "io", "a", "b"}: one differing record of two runs, as text a person can read."""
    if not a["dtype"] or not b["dtype"]:
        shown_a, shown_b = (a["value"] or a["dtype"]), (b["value"] or b["dtype"])
    elif a["dtype"] != b["dtype"]:
        shown_a, shown_b = a["dtype"], b["dtype"]
    else:
        names = [n for n in ("min", "max", "mean", "norm") if not _equal_number(a[n], b[n])]
        if names:
            shown_a, shown_b = (", ".join(f"{n} {row[n]:.9g}" for n in names) for row in (a, b))
        else:  # same statistics, other bytes: values moved or changed in their last bits
            shown_a, shown_b = (f"checksum {row['checksum'] or '?'} (same min, max, mean, norm)"
                                for row in (a, b))
    return {"slot": a["slot"], "io": a["io"], "a": shown_a, "b": shown_b}


def _fed_inside(module: DiffCall, begin: int, calls: dict) -> bool:
    """A module call whose own inputs agree can still be fed a difference inside: a child's
    parameter updated differently at an earlier step, a tensor made before it ran. True when
    a recorded call inside it, while it ran, had a differing input."""
    path = module.module
    for other in calls.values():
        if other is module or not other.differing_inputs or other.step != module.step:
            continue
        inside = path == "" or other.module == path or other.module.startswith(path + ".")
        if inside and begin <= other.order <= module.order:
            return True
    return False


def _innermost(introduced: list[DiffCall]) -> list[DiffCall]:
    """Drop module calls whose difference a recorded API call inside them introduced (level
    "mix": Block and its parents all have identical inputs and differing outputs because of
    the torch.randn inside Block; the op is the randn)."""
    inside = {d.module for d in introduced if d.kind == "api"}

    def explained(diff: DiffCall) -> bool:
        m = diff.module
        return diff.kind == "module" and any(m == "" or a == m or a.startswith(m + ".") for a in inside)

    return [d for d in introduced if not explained(d)]


def _rank_ops(introduced: list[DiffCall]) -> list[RankedOp]:
    ranked: dict[tuple, RankedOp] = {}
    for diff in introduced:
        key = (diff.module, diff.op, diff.phase)
        if key in ranked:
            ranked[key].calls += 1
            continue
        ranked[key] = RankedOp(diff.module, diff.op, diff.phase, 1, diff.step, diff.order,
                               diff.source, diff.first_key)
    return list(ranked.values())  # introduced is already in execution order


def bit_compare(path_a, path_b, run_a: int = 1, run_b: int = 2) -> list[RankReport]:
    """One RankReport per rank of two dumps of identical runs (run numbers for the report)."""
    from probe.dump.reader import load

    dump_a, dump_b = load(os.fspath(path_a)), load(os.fspath(path_b))
    reports = []
    for rank in sorted(set(dump_a.ranks) | set(dump_b.ranks)):
        steps_a = {s for s, r in dump_a.files if r == rank}
        steps_b = {s for s, r in dump_b.files if r == rank}
        report = RankReport(rank=rank, run_a=run_a, run_b=run_b, steps=sorted(steps_a | steps_b))
        report.hash_seeds = (_hash_seed(dump_a, rank), _hash_seed(dump_b, rank))
        report.only_a += [f"step {s} (whole step file)" for s in sorted(steps_a - steps_b)]
        report.only_b += [f"step {s} (whole step file)" for s in sorted(steps_b - steps_a)]
        introduced, differing = [], []
        for step in sorted(steps_a & steps_b):
            with dump_a.open(step, rank) as file_a, dump_b.open(step, rank) as file_b:
                if not report.settings:
                    report.settings = _settings(file_a.attrs)
                    report.device = str(file_a.attrs.get("device", ""))
                    report.world_size = int(file_a.attrs.get("world_size", 1) or 1)
                diffs, only_a, only_b, count = compare_files(file_a, file_b, rank, step)
            report.records += count
            report.uninitialized += _uninitialized(file_a, file_b)
            report.differing += sum(len(d.differing_outputs) + len(d.differing_inputs) for d in diffs)
            report.only_a += [f"step {step}: {key}" for key in only_a]
            report.only_b += [f"step {step}: {key}" for key in only_b]
            differing += diffs
            introduced += _innermost([d for d in diffs if d.origin == INTRODUCED])
        report.first = introduced[0] if introduced else (differing[0] if differing else None)
        report.ops = _rank_ops(introduced)
        reports.append(report)
    return reports


def _uninitialized(file_a, file_b) -> int:
    """Records of memory nothing had written yet in either step file (not compared)."""
    keys = [file.attrs.get("uninitialized") or () for file in (file_a, file_b)]
    return len(set(keys[0]) | set(keys[1]))


def _hash_seed(dump, rank: int) -> str:
    """The PYTHONHASHSEED a run's first step file of this rank recorded ("" if none)."""
    steps = sorted(s for s, r in dump.files if r == rank)
    if not steps:
        return ""
    with dump.open(steps[0], rank) as step_file:
        state = step_file.attrs.get("determinism") or {}
    if "hash_seed_at_start" in state:  # what hashed str in that interpreter
        return str(state["hash_seed_at_start"] or "random")
    return str((state.get("env") or {}).get("PYTHONHASHSEED", ""))  # older dumps: the closest record


def hash_seed_line(report: RankReport) -> str:
    """What the runs' hash seeds let this check see: identical str hashes hide hash-order
    nondeterminism (iterating a set of str, dict order built from one, hash(name) sharding)."""
    seed_a, seed_b = report.hash_seeds
    if seed_a and seed_a == seed_b and seed_a != "random":
        return (f"PYTHONHASHSEED {seed_a} in both runs: nondeterminism from str hash order (a set "
                "of names iterated, hash(name) % n) cannot show here; `probe determinism "
                "--hash-seed vary` gives each run its own")
    if seed_a and seed_b:
        return (f"PYTHONHASHSEED {seed_a} in run {report.run_a}, {seed_b} in run {report.run_b}: "
                "differences from str hash order show too")
    return ("PYTHONHASHSEED not recorded for both runs: each interpreter may have hashed str "
            "differently (launch with `probe run` or `probe determinism` to fix it)")


def _settings(attrs: dict) -> dict:
    """The determinism settings a run had, from its step file's root attributes."""
    determinism = attrs.get("determinism") or {}
    config = attrs.get("config") or {}
    report = attrs.get("seed_report") or {}
    settings = {name: determinism[name] for name in (
        "deterministic_algorithms", "deterministic_algorithms_warn_only", "cudnn.deterministic",
        "cudnn.benchmark", "cuda.matmul.allow_tf32", "cudnn.allow_tf32", "float32_matmul_precision",
        "num_threads", "dropout_removed") if name in determinism}
    settings["seed"] = report.get("seed", config.get("seed"))
    settings["mode"] = config.get("mode")
    settings["env"] = determinism.get("env", {})
    return settings


def advice(report: RankReport) -> list[str]:
    """What to change, from the first nondeterministic op and the settings in force."""
    tips = []
    settings, first = report.settings, report.first
    if first is not None and first.random and first.origin == INTRODUCED:
        tips.append(
            f"{first.op} drew different numbers in identical runs: its generator is not the one "
            "seed_all seeds (a torch.Generator seeded from time or os.urandom, a library's own "
            "RNG); seed it from the config's seed, e.g. torch.Generator().manual_seed(seed)")
    if first is not None and first.origin == INHERITED:
        tips.append(
            f"the first difference was already in the inputs of {first.name()}: it was made by "
            "code probe did not record (before start(), or inside one recorded call); capture "
            "more with level \"mix\" or start() earlier")
        if report.world_size > 1:
            tips.append(
                f"this is one of {report.world_size} ranks: a difference made on another rank "
                "arrives through collectives (DDP's gradient all-reduce runs in C++ and is not "
                "recorded); read the other ranks' reports for the op that made it")
    if settings.get("deterministic_algorithms") is False:
        tips.append(
            'set "mode": true in the config: torch.use_deterministic_algorithms(True) makes '
            "nondeterministic CUDA ops (index_add_, scatter_add_, atomic-add backwards) pick "
            'deterministic kernels or raise naming themselves; "mode": "warn" only warns')
    elif settings.get("deterministic_algorithms_warn_only"):
        tips.append('"mode" is "warn": nondeterministic ops only warn; set "mode": true to make them raise')
    if settings.get("cudnn.benchmark"):
        tips.append("cudnn.benchmark is on (seed_all turns it off; the script turned it back on): "
                    "it picks kernels by timing, so runs differ")
    device = report.device or ""
    if device.startswith("cuda") and "CUBLAS_WORKSPACE_CONFIG" not in settings.get("env", {}):
        tips.append("CUBLAS_WORKSPACE_CONFIG is unset: launch with `probe run` and \"mode\": true "
                    "(it sets :4096:8 before CUDA starts)")
    threads = settings.get("num_threads")
    if first is not None and not first.random and device.startswith("cpu") and isinstance(threads, int) and threads > 1:
        tips.append(f"on CPU with {threads} threads, an op whose float accumulation follows "
                    "thread timing differs run to run: try OMP_NUM_THREADS=1 to confirm")
    return tips


def format_report(report: RankReport, top: int = 10) -> list[str]:
    """Terminal lines for one rank."""
    pair = f"run {report.run_a} vs run {report.run_b}"
    head = f"rank {report.rank}, {pair}"
    unwritten = (f"; {report.uninitialized} of memory nothing had written yet not compared"
                 if report.uninitialized else "")
    if not report.recorded:
        lines = [f"{head}: nothing was recorded (0 records over steps {_steps(report.steps)}): "
                 "nothing was checked"]
    elif report.identical:
        lines = [f"{head}: bit-identical ({report.records} records over steps {_steps(report.steps)}"
                 f"{unwritten})"]
    else:
        lines = [f"{head}: NOT bit-identical ({report.differing} of {report.records} records differ"
                 f"{unwritten})"]
        first = report.first
        if first is not None:
            word = ("nondeterministic op" if first.origin == INTRODUCED
                    else "first difference (inherited: its inputs already differed)")
            lines.append(f"  {word}: {first.name()} at step {first.step}")
            lines.append(f"    record: {first.first_key}")
            lines.append(f"    source: {first.source or 'unknown'}")
            if first.origin == INTRODUCED:
                lines.append("    its inputs were bit-identical in both runs; its output was not")
            for diff in sorted(first.differences, key=lambda d: d["io"] != "in"):
                what = "input" if diff["io"] == "in" else "output"
                lines.append(f"    {what} {diff['slot']} differs: {diff['a']} in run {report.run_a}, "
                             f"{diff['b']} in run {report.run_b}")
        if report.only_a or report.only_b:
            shown = (report.only_a or report.only_b)[0]
            lines.append(f"  the runs took different paths: {len(report.only_a)} records only in run "
                         f"{report.run_a}, {len(report.only_b)} only in run {report.run_b} (first: {shown})")
        if report.ops:
            lines.append("  ops that introduced differences (execution order):")
            for position, op in enumerate(report.ops[:top], 1):
                calls = f"{op.calls} call{'s' if op.calls != 1 else ''}"
                lines.append(f"    {position}. {op.module or '<root>'} {op.op} ({op.phase}): {calls}, "
                             f"first at step {op.first_step}; {op.source or 'source unknown'}")
            if len(report.ops) > top:
                lines.append(f"    ... and {len(report.ops) - top} more")
    lines.append("  determinism settings in force:")
    lines += [f"    {line}" for line in _settings_lines(report.settings)]
    lines.append(f"    {hash_seed_line(report)}")
    tips = advice(report) if not report.identical else []
    if tips:
        lines.append("  what to change:")
        lines += [f"    - {tip}" for tip in tips]
    return lines


def _settings_lines(settings: dict) -> list[str]:
    if not settings:
        return ["(unknown: no step file was compared)"]
    shown = [f"seed {settings.get('seed')}, mode {_json(settings.get('mode'))}"]
    names = [n for n in settings if n not in ("seed", "mode", "env")]
    shown += [", ".join(f"{n} {_json(settings[n])}" for n in names[i:i + 3]) for i in range(0, len(names), 3)]
    env = settings.get("env") or {}
    shown.append("env: " + (" ".join(f"{k}={v}" for k, v in sorted(env.items())) or "(none of the relevant variables set)"))
    return shown


def _json(value) -> str:
    """A setting as it is written in a config file (true, false, "warn")."""
    return json.dumps(value) if isinstance(value, (bool, str)) or value is None else str(value)


def _steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 2:
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


def holds_records(path) -> bool:
    """True when some step file of the dump at ``path`` holds a record (a run that recorded
    nothing leaves nothing for later runs to be compared with)."""
    from probe.dump.reader import load

    dump = load(os.fspath(path))
    for step, rank in dump.files:
        with dump.open(step, rank) as step_file:
            if len(step_file.records):
                return True
    return False


def nothing_recorded(reports: list[RankReport]) -> bool:
    """True when no run recorded a single record: a check that looked at nothing."""
    return not any(report.recorded for report in reports)


__all__ = ["bit_compare", "compare_files", "advice", "format_report", "RankReport", "DiffCall",
           "RankedOp", "RANDOM_OPS", "holds_records", "nothing_recorded", "describe_difference", "hash_seed_line"]
