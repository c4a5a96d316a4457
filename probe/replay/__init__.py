"""Replay recorded calls in float64 to tell which side of a compare is right.

``probe compare A B --replay [N]`` (``probe.compare(a, b, replay=N)``) re-executes, on the
CPU in float64, the first divergence, the likely cause and the top N ranked calls from each
side's own dumped inputs (task "tensor"), and judges each call: "introduced by A/B",
"rounding" (inherited, amplified with its factor, or own), "precision", or "not replayable"
with the reason (docs/compare.md, "Which side is right?").

This package imports torch; probe.comparison imports it only when replay is asked for, so a
plain ``probe compare`` never does.

    ops.py      recorded op name -> callable (in-place ops out of place)
    calls.py    a call's records from a step file -> args, kwargs, tensors (float64)
    execute.py  one side's float64 replay and its own error (rel L2, ulps)
    judge.py    both sides -> verdict
    session.py  which calls, the time budget, progress, origins overridden
"""

from probe.replay.session import DEFAULT_BUDGET_S, DEFAULT_COUNT, ReplayReport, replay_result

__all__ = ["replay_result", "ReplayReport", "DEFAULT_COUNT", "DEFAULT_BUDGET_S"]
