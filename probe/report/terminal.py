"""The human report ``probe compare`` prints: the verdict line first, then the evidence.

    DIVERGED at step 0 rank 0: blocks.1.fc functional.linear (forward, output.0) -- introduced
      where    ...
      metrics  ...
      inputs   ...
    likely cause ...
    top ops introducing error ...
    counts ...
"""

from __future__ import annotations

import math

from probe.comparison import result as R
from probe.comparison.groups import where_text


def _num(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    return f"{value:.{digits}g}"


def verdict_line(result: R.CompareResult) -> str:
    counts = result.counts
    if result.verdict == "pass":
        files = len(result.steps)
        where = f"{files} step file{'s' if files != 1 else ''}"
        unmatched = counts["only_a"] + counts["only_b"]
        extra = f"; {unmatched} without partner (not compared)" if unmatched else ""
        return f"PASS: {counts['matched']} records match within tolerance in {where} (evidence: {result.evidence}){extra}"
    first = result.first_divergence
    if first is None:
        return "DIVERGED"
    origin = f" -- {first.origin}" if first.origin else f" -- {first.status}"
    module = first.module or "<root>"
    return f"DIVERGED at step {first.step} rank {first.rank}: {module} {first.op} ({first.phase}, {first.slot}){origin}"


def metrics_line(row: R.RecordRow) -> str:
    m = row.metrics
    if m is None:
        return "; ".join(row.reasons) or "-"
    if m.evidence == "value":
        return f"value {m.value_a} in A, {m.value_b} in B"
    parts = [f"rel L2 {_num(m.rel_l2)}", f"max abs {_num(m.max_abs)}"]
    if m.max_rel is not None:
        parts.append(f"max rel {_num(m.max_rel)}")
    if m.cosine is not None:
        parts.append(f"cosine {_num(m.cosine, 8)}")
    if m.within is not None:
        parts.append(f"within tol {m.within * 100:.1f}%")
    if m.ulp_max is not None:
        parts.append(f"max ULP {m.ulp_max}")
    if m.nan_mismatch:
        parts.append(f"NaN mismatch {m.nan_mismatch}")
    if m.inf_mismatch:
        parts.append(f"Inf mismatch {m.inf_mismatch}")
    if m.bit_equal is not None and m.evidence == "checksum":
        parts.append("bit-equal" if m.bit_equal else "not bit-equal")
    if m.stat_rel:
        parts.append("stat rel diff " + " ".join(f"{k} {_num(v)}" for k, v in m.stat_rel.items()))
    return "  ".join(parts)


def _tolerance(row: R.RecordRow) -> str:
    if not row.tol_dtype:
        return "exact"
    return f"score {_num(row.score)} ({row.tol_dtype}: rtol {row.rtol:g}, atol {row.atol:g}; > 1 fails)"


def _describe(row: R.RecordRow, indent: str = "  ") -> list[str]:
    lines = [
        f"{indent}where    step {row.step}, rank {row.rank}, module {row.module or '<root>'}, op {row.op} "
        f"#{row.index}, {row.phase}, slot {row.slot}",
        f"{indent}key      {row.key}" + (f"  (B: {row.key_b})" if row.key_b and row.key_b != row.key_a else ""),
        f"{indent}source   {row.source or 'unknown'}",
        f"{indent}dtype    {row.dtype_a or '-'} in A, {row.dtype_b or '-'} in B; shape {row.shape_a or row.shape_b or '-'}",
        f"{indent}metrics  {metrics_line(row)}  (evidence: {row.metrics.evidence if row.metrics else '-'})",
        f"{indent}judged   {_tolerance(row)}",
    ]
    if row.cause:
        lines.append(f"{indent}cause    {row.cause}")
    for reason in row.reasons:
        lines.append(f"{indent}why      {reason}")
    for note in row.notes:
        lines.append(f"{indent}note     {note}")
    if row.input_errors:
        lines.append(f"{indent}inputs of this call:")
        for item in row.input_errors:
            lines.append(
                f"{indent}  {item['slot']:<16} {item['status']:<9} rel L2 {_num(item['rel_l2']):<10} "
                f"max abs {_num(item['max_abs']):<10} ({item['source']})"
            )
    return lines


def changes_lines(result: R.CompareResult, limit: int = 5) -> list[str]:
    """Changed parameters and arguments, each once with the step files where it differs."""
    if not result.changes:
        return []
    lines = ["changed parameters and arguments:"]
    for change in result.changes[:limit]:
        if change.kind == R.ARGUMENT:
            what = f"{change.value_a} in A, {change.value_b} in B"
        else:
            what = f"rel L2 {_num(change.rel_l2)}, score {_num(change.score)}"
            if len(change.where) > 1:
                what = f"worst {what} at {where_text([change.worst])}"
        lines.append(f"  {change.kind:<8} {change.key}: {what} (in {where_text(change.where)})")
    if len(result.changes) > limit:
        lines.append(f"  ... and {len(result.changes) - limit} more (see --json or --csv)")
    return lines


def top_ops_lines(result: R.CompareResult) -> list[str]:
    if not result.top_ops:
        return []
    many = len(result.steps) > 1
    lines = ["top ops by the error they introduce (output score minus input score; score 1 = tolerance):"]
    lines.append(f"  {'#':>3}  {'introduced':>10}  {'out relL2':>10}  {'in relL2':>10}  {'ratio':>8}  op")
    for number, op in enumerate(result.top_ops, 1):
        flag = f" [{op.origin}]" if op.diverged and op.origin else (" [beyond tol]" if op.diverged else "")
        where = f" (worst at {where_text([(op.step, op.rank)])}; in {where_text(op.where)})" if many else ""
        lines.append(
            f"  {number:>3}  {_num(op.introduced):>10}  {_num(op.output_rel_l2):>10}  {_num(op.input_rel_l2):>10}  "
            f"{_num(op.ratio):>8}  {op.module or '<root>'} {op.op}#{op.index} ({op.phase}){flag}{where}"
        )
    return lines


def render(result: R.CompareResult, max_divergences: int = 5) -> str:
    """The full terminal report (ends with a newline)."""
    lines = [verdict_line(result), f"  compared {result.path_a} (A, reference) with {result.path_b} (B)"]
    first = result.first_divergence
    if first is not None:
        lines += _describe(first)
        cause = result.likely_cause
        if cause is not None and cause is not first:
            lines.append("likely cause (first divergence that introduced its error):")
            lines.append(
                f"  {cause.module or '<root>'} {cause.op} ({cause.phase}, {cause.slot}) at step {cause.step} rank {cause.rank}"
            )
            lines += _describe(cause, "    ")
    lines += changes_lines(result, max_divergences)
    lines += top_ops_lines(result)
    c = result.counts
    files = ", ".join(f"step {s['step']} rank {s['rank']}: {s['verdict']}" for s in result.steps[:8])
    if len(result.steps) > 8:
        files += f", ... ({len(result.steps)} step files)"
    lines.append(
        f"counts: {c['matched']} matched, {c['diverged']} diverged, {c['only_a']} only in A, "
        f"{c['only_b']} only in B (evidence: {result.evidence}; {files})"
    )
    for item in result.missing:
        lines.append(f"missing: {item}")
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"
