"""How reports show replay verdicts (``probe compare --replay``); never imports torch.

A verdict is the dict probe.replay.judge makes: verdict, error_a, error_b, ulp_a, ulp_b,
closer, and the details (dtypes, amplification, reason, summary). The CompareResult carries
the replay report as ``result.replay`` (None without --replay); these helpers read it.
"""

from __future__ import annotations

import math

from probe.comparison import result as R

#: the fields every report carries for a replayed call (the --json contract)
CONTRACT = ("verdict", "error_a", "error_b", "ulp_a", "ulp_b", "closer")


def verdict_of(result: R.CompareResult, step: int, rank: int, key: str) -> dict | None:
    """The replay verdict of the call a record key / top-op key belongs to, or None."""
    report = getattr(result, "replay", None)
    if report is None or not key:
        return None
    return report.verdict_for(step, rank, key)


def json_verdict(verdict: dict | None) -> dict | None:
    """The verdict as --json shows it: the contract fields first, then the details."""
    if verdict is None:
        return None
    data = {name: verdict.get(name) for name in CONTRACT}
    data.update({name: value for name, value in verdict.items() if name not in data})
    return R.json_safe(data)


def short(verdict: dict) -> str:
    """'introduced by B (B 1.6e+04 ulps, A 0.3; A is closer)', 'rounding, amplified x350', ..."""
    name = verdict["verdict"]
    if name == "not replayable":
        return f"not replayable ({verdict.get('reason', '')})"
    ulps = f"A {_ulps(verdict.get('ulp_a'))}, B {_ulps(verdict.get('ulp_b'))} ulps"
    closer = {"A": "A is closer", "B": "B is closer", "tie": "tie"}.get(verdict.get("closer"), "")
    if name == "rounding":
        kind = verdict.get("rounding")
        factor = verdict.get("amplification")
        how = f"{kind} x{factor:.3g}" if factor is not None and kind in ("inherited", "amplified") else (kind or "")
        if kind == "enters":
            entry = verdict.get("enters_through") or {}
            how = f"the difference enters here through {entry.get('slot', 'an input')} ({entry.get('source', '')})"
        return f"rounding, {how} ({ulps})"
    if name == "arguments differ":
        return verdict.get("summary", name).split(" (each side")[0] + f" ({ulps})"
    if name == "precision":
        low = verdict.get("lower") or "B"
        return f"precision: {low} rounds to {verdict.get('dtype_' + low.lower())} ({ulps}; {closer})"
    return f"{name} ({ulps}; {closer})"


def headline_suffix(result: R.CompareResult) -> str:
    """Appended to the terminal's first line when the first divergence was replayed."""
    first = result.first_divergence
    if first is None:
        return ""
    verdict = verdict_of(result, first.step, first.rank, first.key_a or first.key)
    return f" [replay: {short(verdict)}]" if verdict is not None else ""


def lines(result: R.CompareResult) -> list[str]:
    """The terminal's replay section: each replayed call with its verdict and the numbers."""
    report = getattr(result, "replay", None)
    if report is None:
        return []
    out = ["which side is right? (replay in float64 on each side's own dumped inputs; errors are rel L2, "
           "ulps of the output's dtype)"]
    if not report.calls:
        out.append("  nothing to replay: no divergence and no ranked op")
    for call in report.calls:
        verdict = call["replay"]
        roles = ", ".join(call["roles"])
        out.append(f"  {call['call']} ({roles}) at step {call['step']} rank {call['rank']}")
        out.append(f"    {verdict.get('summary') or short(verdict)}")
    data = report.to_dict()
    speed = ""
    if data["calls_per_s"] is not None:
        speed = f" ({data['calls_per_s']:.3g} calls/s, {data['mb_per_s']:.3g} MB/s)"
    out.append(f"  replayed {data['replayed']} of {len(report.calls)} calls in {report.elapsed_s:.2f} s{speed}"
               + (f"; {len(report.left)} left at the {report.budget_s:g} s budget" if report.left else ""))
    return out


def progress_line(done: int, total: int, name: str, verdict: dict | None) -> str | None:
    """The stderr line for one finished call (None while a call starts)."""
    if verdict is None:
        return None
    return f"probe: replay {done}/{total} {name}: {short(verdict)}"


def _ulps(value) -> str:
    if value is None:
        return "?"
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return str(value)
    return f"{value:.3g}"

