"""``probe compare --json``: one JSON object on stdout (strict JSON: no NaN/Infinity).

Fields (docs/compare.md lists them all): verdict, headline, first_divergence, likely_cause,
counts, evidence, tolerances, top_ops, changes, steps, missing, notes, divergences (the first
MAX_DIVERGENCES divergent records in execution order), and with rows=True every aligned
record under "rows". With ``--replay``: ``first_divergence.replay``, ``likely_cause.replay``
and each ``top_ops`` entry's ``replay`` ({verdict, error_a, error_b, ulp_a, ulp_b, closer, ...},
null where the call was not replayed), and ``replay`` = the whole replay report.
"""

from __future__ import annotations

import json

from probe.comparison import result as R

MAX_DIVERGENCES = R.MAX_DIVERGENT


def to_dict(result: R.CompareResult, rows: bool = False) -> dict:
    from probe.report.terminal import verdict_line

    data = result.to_dict(rows=rows)
    # the terminal's first line, for logs and CI summaries
    data = {"verdict": data.pop("verdict"), "headline": verdict_line(result), **data}
    divergent, total = result.first_divergences(MAX_DIVERGENCES)
    data["divergences"] = [R.divergence_dict(row) for row in divergent]
    data["divergences_total"] = total
    if result.replay is not None:
        _add_replay(result, data)
    return data


def _add_replay(result: R.CompareResult, data: dict) -> None:
    from probe.report.replay_text import json_verdict, verdict_of

    for name, row in (("first_divergence", result.first_divergence), ("likely_cause", result.likely_cause)):
        if data.get(name) is not None and row is not None:
            data[name]["replay"] = json_verdict(verdict_of(result, row.step, row.rank, row.key_a or row.key))
    for entry, op in zip(data["top_ops"], result.top_ops):
        entry["replay"] = json_verdict(verdict_of(result, op.step, op.rank, op.key))
    data["replay"] = R.json_safe(result.replay.to_dict())


def render(result: R.CompareResult, rows: bool = False) -> str:
    """The JSON text, one object, newline-terminated."""
    return _ENCODER.encode(to_dict(result, rows=rows)) + "\n"


#: strict JSON (no NaN/Infinity), indented: render() and write() make the same text
_ENCODER = json.JSONEncoder(indent=2, allow_nan=False)
#: characters of JSON text gathered before a write (write())
_BATCH = 1 << 16


def write(result: R.CompareResult, stream, rows: bool = False) -> None:
    """render()'s text written to stream as it is made. An indented dump is made by the pure
    Python encoder, piece by piece, and json.dumps holds every piece before joining them, a
    cost that grows with the rank files while the compare's own memory does not (the peak of
    making the 0.7 MB text of 512 rank files: 6.9 MB with json.dumps, 5.0 here, most of it the
    dict the text is made from). A strict-JSON check first (json's C encoder, one pass,
    compact) keeps the promise that nothing is written for a report holding NaN."""
    data = to_dict(result, rows=rows)
    json.dumps(data, allow_nan=False)
    pieces, size = [], 0
    for piece in _ENCODER.iterencode(data):
        pieces.append(piece)
        size += len(piece)
        if size >= _BATCH:
            stream.write("".join(pieces))
            pieces, size = [], 0
    stream.write("".join(pieces) + "\n")
    stream.flush()
