"""``probe nonfinite DUMP``: the first NaN/Inf of one run and where it came from. No torch."""

from __future__ import annotations

import json

import click

from probe.dump.reader import load
from probe.analysis.nonfinite import find_nonfinite


@click.command("nonfinite", short_help="Find the first NaN/Inf in one dump.")
@click.argument("dump", metavar="DUMP")
@click.option("--rank", type=click.IntRange(0), default=None, help="Only this rank.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def nonfinite(dump: str, rank: int | None, as_json: bool) -> int:
    """Find the first record, in execution order across steps, whose tensor holds NaN or Inf.

    Needs no reference run: every record's NaN and Inf counts are in the dump (any task).
    Says whether the op introduced it (its inputs were finite) or inherited it (a NaN/Inf was
    already in its inputs), with the op, module, source line and counts, and names a
    float16/bfloat16 overflow as such. One finding per rank.

    \b
    Exit codes: 0 none found, 1 found, 2 trouble (missing or unreadable dump).

    \b
    Examples:
      probe nonfinite probe_dump/
      probe nonfinite probe_dump/step3/rank0.h5 --json
    """
    loaded = load(dump)
    for message in loaded.incomplete_messages():  # skipped: a killed run's last step
        click.echo(f"probe nonfinite: note: {message}", err=True)
    findings = find_nonfinite(loaded, rank=rank)
    if as_json:
        click.echo(json.dumps({
            "found": bool(findings),
            "first": min(findings.values(), key=_order).to_dict() if findings else None,
            "by_rank": {str(r): f.to_dict() for r, f in findings.items()},
        }, indent=2))
    elif not findings:
        click.echo(f"none found: every record in {dump} is finite")
    else:
        click.echo("\n\n".join(finding.describe() for finding in findings.values()))
    return 1 if findings else 0


def _order(finding):
    return (finding.step, finding.rank, finding.seq)

