"""The human report ``probe compare`` prints: the answer first, then the evidence.

    DIVERGED at step 0 rank 0: blocks.2.act functional.gelu (forward, output.0) -- introduced
      cause    argument kwarg.approximate changed: "none" in A, "tanh" in B
      source   examples/models.py:57
      key      blocks.2.act/functional.gelu#0/forward/output.0
      error    rel L2 1.98e-04  max abs 2.73e-04 ...
      judged   score 8.68: the error is 8.68x the float32 tolerance (rtol 2e-05, atol 1e-06)
      inputs of this call: ...
    likely cause (when the first divergence only inherited its error) ...
    changed parameters and arguments (each once, with the step files where it differs) ...
    top ops by the error they add ...
    counts ... / compared ... / notes
"""

from __future__ import annotations

import math

from probe.comparison import result as R
from probe.comparison import load
from probe.comparison.result import where_text
from probe.report.fmt import err, num

# kept for callers of the old name
_num = num


def _sharded_only(counts: dict) -> str:
    """'(12 of them only a sharded run makes: collectives, reduced gradient shards) ' or ''."""
    found = counts.get("sharded_only", 0)
    return f"({found} of them only a sharded run makes: collectives, reduced gradient shards) " if found else ""


def verdict_line(result: R.CompareResult) -> str:
    counts = result.counts
    if result.verdict == "pass":
        files = len(result.steps)
        where = f"{files} step file{'s' if files != 1 else ''}"
        unmatched = counts["only_a"] + counts["only_b"]
        changed = counts.get("changed", 0)
        extra = f"; {changed} of them {R.SIZE_UNKNOWN}" if changed else ""
        explained = counts.get("explained", 0)
        extra += (f"; {explained} of them beyond their own tolerance but explained (amplified rounding, "
                  "see the notes)") if explained else ""
        sharded = counts.get("sharded_only", 0)
        sharded = f", {sharded} of them only a sharded run makes" if sharded else ""
        extra += f"; {unmatched} without partner (not compared{sharded})" if unmatched else ""
        found = next((note for note in result.notes if note.startswith(R.PRECISION_FINDING)), "")
        extra += f"; {found.split(R.PRECISION_WHY, 1)[0]}" if found else ""
        rounding = R.headline(getattr(result, "envelope", None))
        if rounding:
            return f"PASS: {rounding}: {counts['matched']} records in {where} (evidence: {result.evidence}){extra}"
        return f"PASS: {counts['matched']} records match within tolerance in {where} (evidence: {result.evidence}){extra}"
    first = result.first_divergence
    if first is None and counts["matched"] == 0:
        return (f"NOT A PASS: no record could be compared ({counts['only_a']} records in A, "
                f"{counts['only_b']} in B)")
    if first is None:
        return "DIVERGED"
    origin = f" -- {first.origin}" if first.origin else f" -- {first.status}"
    if getattr(result, "drift", None):  # no op at fault: the runs part through accumulated rounding
        origin = " -- drift (accumulated rounding; no op introduced an error)"
    module = first.module or "<root>"
    line = (f"DIVERGED at step {first.step} rank {first.rank}: {module} {first.op}{updates(first.target)} "
            f"({first.phase}, {first.slot}){origin}")
    if result.replay is not None:  # the replay verdict of the first divergence
        from probe.report.replay_text import headline_suffix

        line += headline_suffix(result)
    return line


def updates(target: str) -> str:
    """" [updates fc1.weight]" for an optimizer record named by its parameter, else ""."""
    return f" [updates {target}]" if target else ""


def metrics_line(row: R.RecordRow) -> str:
    m = row.metrics
    if m is None:
        return "; ".join(row.reasons) or "-"
    if m.evidence == "value":
        return f"value {m.value_a} in A, {m.value_b} in B"
    bound = ">= " if m.evidence == "statistics" or (m.evidence == "checksum" and not m.bit_equal) else ""
    parts = [R.SIZE_UNKNOWN + ":"] if row.size_unknown else []
    if m.sketch is not None:  # measured by the sketches, not bounded
        parts += [f"rel L2 ~{err(m.rel_l2)} {m.sketch['text']}"]
    else:
        parts += [f"rel L2 {bound}{err(m.rel_l2)}"]
    parts += [f"max abs {bound}{err(m.max_abs)}"]
    if m.max_rel is not None:
        parts.append(f"max rel {err(m.max_rel)}")
    if m.cosine is not None:
        parts.append(f"cosine {num(m.cosine, 8)}")
    if m.within is not None:
        parts.append(f"within tol {m.within * 100:.1f}% of elements")
    if m.ulp_max is not None:
        parts.append(f"max ULP {m.ulp_max}")
    if m.nan_mismatch:
        parts.append(f"NaN mismatch {m.nan_mismatch}")
    if m.inf_mismatch:
        parts.append(f"Inf mismatch {m.inf_mismatch}")
    if m.bit_equal is not None and m.evidence == "checksum":
        parts.append("bit-equal" if m.bit_equal else "not bit-equal")
    if m.stat_rel:
        changes = ", ".join(f"{name} {err(value)}" for name, value in m.stat_rel.items())
        what = "statistics" if m.sketch is not None else "lower bounds from the statistics"
        parts.append(f"({what}; relative change of {changes})")
    return "  ".join(parts)


def _judged(row: R.RecordRow) -> str:
    if not row.tol_dtype:
        return "exact comparison"
    if row.rtol is None or row.score is None:
        return "not measured: " + ("; ".join(row.reasons) or "no metrics")
    if row.tol_dtype == "exact" or not math.isfinite(row.score):
        # integers and bools compare exactly (a zero budget too): no ratio to give
        return "exact comparison: the values must be equal" + (", and they differ" if row.score else "")
    return (f"score {num(row.score)}: the error is {num(row.score)}x the {row.tol_dtype} tolerance "
            f"(rtol {row.rtol:g}, atol {row.atol:g}); above 1 fails")


def _rounding(envelope: dict) -> str:
    """Is this gap expected? What rounding alone makes this output differ by, beside what was seen."""
    verdict = {"within": "within its envelope", "beyond": "beyond its envelope: the op's own error",
               "uncertain": "the estimate's band straddles the envelope",
               "unbounded": "its inputs' share cannot be bounded from the records"}.get(envelope["verdict"], "")
    if envelope.get("divergent_inputs") and envelope["verdict"] != "beyond":
        verdict = f"its own error is within its envelope; the rest comes through {', '.join(envelope['divergent_inputs'])}"
    what = f"{envelope['family']}, K={envelope['k']}" if envelope["k"] > 1 else envelope["family"]
    return f"{envelope['text']}; {verdict} ({what}; op's own rounding {err(envelope['rounding'])}, " \
           f"through its inputs {err(envelope['propagated'])})"


def _came_from(item: dict) -> str:
    producer = item.get("producer")
    return {
        "produced": f"made by {producer}" if producer else "made by an earlier op",
        "param": f"a parameter ({producer})" if producer else "a parameter",
        "param_update": "a parameter, read after the backward began (an optimizer update)",
        "carried": "state carried over from the previous step",
        "unrecorded": "made after the backward began by something not recorded (a .grad)",
        "external": (f"buffer {item['buffer']}: no recorded op made it" if item.get("buffer")
                     else "external: no recorded op made it (data, a buffer, a weight)"),
        "changed": f"changed after {producer or 'the op that made it'} made it",
        "unpaired": f"made by {producer or 'a call'}, which the other run does not have",
    }.get(item["source"], item["source"])


def _shown_reasons(row: R.RecordRow) -> list[str]:
    # the tolerance judgement already has its own line
    return [r for r in row.reasons if not (r.startswith("rel L2 ") and " tolerance (score " in r)]


def _describe(row: R.RecordRow, indent: str = "  ") -> list[str]:
    lines = []
    if row.cause:
        lines.append(f"{indent}cause    {row.cause}")
    lines.append(f"{indent}source   {row.source or 'unknown (no user code line was recorded)'}")
    lines.append(f"{indent}key      {row.key}" + (f"  (B: {row.key_b})" if row.key_b and row.key_b != row.key_a else ""))
    if row.target:
        lines.append(f"{indent}updates  parameter {row.target} (an optimizer record, named by the parameter it updates)")
    evidence = f" (evidence: {row.metrics.evidence})" if row.metrics else ""
    lines.append(f"{indent}error    {metrics_line(row)}{evidence}")
    lines.append(f"{indent}judged   {_judged(row)}")
    if row.envelope is not None:
        lines.append(f"{indent}rounding {_rounding(row.envelope)}")
    shape = row.shape_a or row.shape_b or "-"
    if row.dtype_a == row.dtype_b:
        lines.append(f"{indent}tensor   {row.dtype_a or 'value'} {shape} in both runs")
    else:
        lines.append(f"{indent}tensor   {row.dtype_a or '-'} in A, {row.dtype_b or '-'} in B; shape {shape}")
    for reason in _shown_reasons(row):
        lines.append(f"{indent}why      {reason}")
    for note in row.notes:
        lines.append(f"{indent}note     {note}")
    if row.input_errors:
        width = max(len("slot"), *(len(item["slot"]) for item in row.input_errors))
        lines.append(f"{indent}inputs of this call:")
        lines.append(f"{indent}  {'slot':<{width}}  {'status':<8}  {'rel L2':>9}  {'max abs':>9}  where it came from")
        for item in row.input_errors:
            unknown = item.get("size_unknown")
            rel, big = ("unknown", "unknown") if unknown else (err(item["rel_l2"]), err(item["max_abs"]))
            lines.append(
                f"{indent}  {item['slot']:<{width}}  {item['status']:<8}  {rel:>9}  {big:>9}  {_came_from(item)}"
                + (" (checksum differs)" if unknown else "")
            )
    return lines


def _where(result: R.CompareResult, pairs) -> str:
    return where_text(pairs)


def changes_lines(result: R.CompareResult, limit: int = 5) -> list[str]:
    """Changed parameters and arguments, each once with the step files where it differs."""
    if not result.changes:
        return []
    many = len(result.steps) > 1
    title = " (each once, with the step files where it differs)" if many else ""
    lines = [f"changed parameters and arguments{title}:"]
    for change in result.changes[:limit]:
        if change.kind == R.ARGUMENT:
            what = f"{change.value_a} in A, {change.value_b} in B"
        elif change.size_unknown:
            what = R.SIZE_UNKNOWN
        else:
            what = f"rel L2 {err(change.rel_l2)}, score {num(change.score)}"
            if len(change.where) > 1:
                what = f"worst {what} at {_where(result, [change.worst])}"
        where = f" (in {_where(result, change.where)})" if many else ""
        lines.append(f"  {change.kind:<8}  {change.key}: {what}{where}")
    if len(result.changes) > limit:
        lines.append(f"  ... and {len(result.changes) - limit} more (see --json: changes)")
    return lines


def _judgement(op: R.OpSummary) -> str:
    if op.origin == R.AMPLIFIED:
        return "amplified"
    if not op.diverged:
        return "within tol"
    return op.origin or "beyond tol"


def _op_where(op: R.OpSummary, one_rank: bool, files: int) -> str:
    """Where an op adds error: "0-4 (5 of 5, worst 1)" over the steps of one rank, else
    the steps and ranks, in how many of the step files, and its worst step and rank."""
    where = op.where or [(op.step, op.rank)]
    share = f"{len(where)} of {files}"
    if one_rank:
        steps = where_text(where).split(", rank")[0].removeprefix("steps ").removeprefix("step ")
        return f"{steps} ({share}, worst {op.step})"
    return f"{where_text(where)} ({share}, worst step {op.step}, rank {op.rank})"


def top_ops_lines(result: R.CompareResult) -> list[str]:
    if not result.top_ops:
        return []
    many = len(result.steps) > 1
    names = [f"{op.module or '<root>'} {op.op}#{op.index}{updates(op.target)} ({op.phase})" for op in result.top_ops]
    one_rank = len({step["rank"] for step in result.steps}) <= 1
    label = "steps" if one_rank else "where"
    wheres = [_op_where(op, one_rank, len(result.steps)) for op in result.top_ops]
    name_width = max(len("op"), *(len(name) for name in names))
    where_width = max(len(label), *(len(where) for where in wheres))
    lines = [
        "top ops by the error they add (added: the part of an op's output error that its inputs do not explain,",
        "in units of the tolerance; 1 = the whole tolerance):",
    ]
    head = f"  {'#':>3}  {'added':>8}  {'out rel L2':>10}  {'in rel L2':>10}  {'ratio':>6}  {'judged':<10}  {'op':<{name_width}}"
    lines.append(head + (f"  {label:<{where_width}}" if many else "") + "  source")
    for number, (op, name, where) in enumerate(zip(result.top_ops, names, wheres), 1):
        line = (f"  {number:>3}  {num(op.introduced):>8}  {err(op.output_rel_l2):>10}  {err(op.input_rel_l2):>10}  "
                f"{num(op.ratio):>6}  {_judgement(op):<10}  {name:<{name_width}}")
        if many:
            line += f"  {where:<{where_width}}"
        lines.append(line + f"  {op.source or '-'}")
    return lines


def counts_lines(result: R.CompareResult) -> list[str]:
    c = result.counts
    files = len(result.steps)
    within = c["matched"] - c["diverged"]
    changed = c.get("changed", 0)
    bytes_differ = f" ({changed} of them not bit-equal: checksums differ, size unknown)" if changed else ""
    if c.get("explained"):
        bytes_differ += f" ({c['explained']} of them explained: amplified rounding)"
    lines = [
        f"counts: {c['matched']} records paired in {files} step file{'s' if files != 1 else ''}: {within} within "
        f"tolerance{bytes_differ}, {c['diverged']} diverged; {c['only_a']} only in A, {c['only_b']} only in B "
        f"{_sharded_only(c)}(evidence: {result.evidence})"
    ]
    if files > 1:
        diverged = [(s["step"], s["rank"]) for s in result.steps if s["verdict"] != "pass"]
        passed = [(s["step"], s["rank"]) for s in result.steps if s["verdict"] == "pass"]
        parts = [f"diverged in {_where(result, diverged)}"] if diverged else []
        parts += [f"pass in {_where(result, passed)}"] if passed else []
        lines.append(f"step files: {'; '.join(parts)}")
    lines.append(f"compared: A = {result.path_a} (the reference: relative errors are relative to A), "
                 f"B = {result.path_b}")
    return lines


def render(result: R.CompareResult, max_divergences: int = 5) -> str:
    """The full terminal report (ends with a newline)."""
    lines = [verdict_line(result)]
    first = result.first_divergence
    if first is not None:
        lines += _describe(first)
        cause = result.likely_cause
        if cause is first and first.origin == R.INHERITED and not any(
                op.diverged and op.origin == R.INTRODUCED for op in result.top_ops):
            lines.append("likely cause: no single op introduced an error beyond tolerance; it grew over several ops "
                         "(the top ops below add the most)")
        elif cause is not None and cause is not first:
            lines.append("likely cause (the first divergence that introduced its error):")
            lines.append(
                f"  {cause.module or '<root>'} {cause.op}{updates(cause.target)} ({cause.phase}, {cause.slot}) "
                f"at step {cause.step} rank {cause.rank}"
            )
            lines += _describe(cause, "    ")
    lines += load.block_lines(getattr(result, "run_differences", []))
    lines += changes_lines(result, max_divergences)
    lines += top_ops_lines(result)
    if result.replay is not None:  # which side is right, per replayed call
        from probe.report.replay_text import lines as replay_lines

        lines += replay_lines(result)
    lines += counts_lines(result)
    for item in result.missing:
        lines.append(f"missing: {item}")
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"
