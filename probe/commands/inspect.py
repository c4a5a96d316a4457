"""``probe inspect``: what a dump holds, per step file and per record. Never imports torch."""

from __future__ import annotations

import json
import math
import os
import re

import click

from probe.comparison.structs import json_safe
from probe.dump import formats, reader

_TABLE_COLUMNS = ("seq", "key", "dtype", "shape", "min", "max", "mean", "norm", "nan", "inf")
_NUMERIC = {"seq", "min", "max", "mean", "norm", "nan", "inf"}


def key_matcher(pattern: str | None):
    """None -> match all; 're:REGEX' -> re.search; anything else -> substring."""
    if not pattern:
        return lambda key: True
    if pattern.startswith("re:"):
        try:
            compiled = re.compile(pattern[3:])
        except re.error as error:
            raise click.BadParameter(f"{pattern[3:]!r} is not a valid regular expression: {error}", param_hint="--key")
        return lambda key: compiled.search(key) is not None
    return lambda key: pattern in key


def _number(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def _table_row(record: dict) -> dict:
    if not record["dtype"]:  # a non-tensor argument: show its value instead of statistics
        return {"seq": str(record["seq"]), "key": record["key"], "dtype": "-", "shape": "-",
                "min": f"value={record['value']}", "max": "", "mean": "", "norm": "", "nan": "", "inf": ""}
    if record.get("uninitialized"):  # memory nothing had written yet: no numbers
        return {"seq": str(record["seq"]), "key": record["key"], "dtype": record["dtype"],
                "shape": record["shape"], "min": "uninitialized", "max": "", "mean": "", "norm": "",
                "nan": "", "inf": ""}
    return {
        "seq": str(record["seq"]), "key": record["key"], "dtype": record["dtype"], "shape": record["shape"],
        "min": _number(record["min"]), "max": _number(record["max"]), "mean": _number(record["mean"]),
        "norm": _number(record["norm"]), "nan": str(record["nan_count"]), "inf": str(record["inf_count"]),
    }


def format_table(records: list[dict]) -> list[str]:
    rows = [_table_row(record) for record in records]
    widths = {name: max([len(name)] + [len(row[name]) for row in rows]) for name in _TABLE_COLUMNS}

    def line(cells: dict) -> str:
        parts = [cells[name].rjust(widths[name]) if name in _NUMERIC else cells[name].ljust(widths[name])
                 for name in _TABLE_COLUMNS]
        return "  ".join(parts).rstrip()

    return [line({name: name for name in _TABLE_COLUMNS})] + [line(row) for row in rows]


def summary_line(step_file: reader.StepDump) -> str:
    attrs = step_file.attrs
    seed_report = attrs.get("seed_report")
    config = attrs.get("config")
    seed = None
    if isinstance(seed_report, dict):
        seed = seed_report.get("seed")
    if seed is None and isinstance(config, dict):
        seed = config.get("seed")
    made_by = f"  format {attrs['format']}" if attrs.get("format") else ""
    return (
        f"  records {len(step_file.records)}  tensors {step_file.tensor_count}{made_by}  task {attrs.get('task', '?')}"
        f"  level {attrs.get('level', '?')}  torch {attrs.get('torch_version', '?')}"
        f"  device {attrs.get('device', '?')}  seed {seed if seed is not None else '-'}"
        f"  created {attrs.get('created', '?')}  run {attrs.get('run_id') or '-'}"
    )


def step_cost(step_file: reader.StepDump) -> dict:
    """What capturing the step cost: the file's ``cost`` attribute (host_transfers,
    capture_ms, stale_records; None in files written before probe recorded it) and its bytes
    on disk."""
    recorded = step_file.attrs.get("cost")
    cost = {"host_transfers": None, "capture_ms": None, "stale_records": None}
    if isinstance(recorded, dict):
        cost.update(recorded)
    try:
        if os.path.isdir(step_file.path):  # an msprobe rank folder: its JSON and tensor files
            cost["bytes"] = sum(os.path.getsize(os.path.join(folder, name))
                                for folder, _, names in os.walk(step_file.path) for name in names)
        else:
            cost["bytes"] = os.path.getsize(step_file.path)
    except OSError:
        cost["bytes"] = None
    return cost


def uninitialized_count(step_file: reader.StepDump) -> int:
    """Records of memory nothing had written yet (an empty-family allocation read before its
    first write): listed in the root attribute ``uninitialized``, 0 in older files."""
    return len(step_file.attrs.get("uninitialized") or ())


def cost_line(cost: dict) -> str:
    def shown(value, unit: str) -> str:
        return "?" if value is None else f"{value}{unit}"

    line = (f"  cost: {shown(cost['host_transfers'], '')} device-to-host copies, "
            f"{shown(cost['capture_ms'], ' ms')} in probe, {shown(cost['bytes'], ' bytes')}")
    if cost.get("stale_records"):
        line += f", {cost['stale_records']} record(s) changed before they were read (unknown)"
    return line


@click.command("inspect")
@click.argument("dump", type=click.Path())
@click.option("--step", "step", type=int, default=None, help="Only this step.")
@click.option("--rank", "rank", type=int, default=None, help="Only this rank.")
@click.option("--key", "key", default=None, metavar="TEXT|re:REGEX",
              help="Only records whose key contains TEXT, or matches REGEX when prefixed with 're:'.")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Show at most N records in all.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (NaN -> null) instead of tables.")
def inspect(dump, step, rank, key, limit, as_json):
    """List the steps, ranks and records of a dump.

    DUMP is a dump folder, one step folder (step3/) or one step file (step3/rank0.h5); or
    an msprobe dump (its dump path, a step folder, a rank or proc folder), read as probe reads
    its own.
    Prints a summary per step file (records, tensors, task, level, torch, device, seed),
    what capturing it cost (device-to-host copies, milliseconds in probe, bytes), how many
    records hold memory nothing had written yet (uninitialized, not compared) and a table of
    records with their statistics. Incomplete step files (*.h5.partial,
    left by a process killed mid-step) are reported on stderr and skipped.

    \b
    Examples:
      probe inspect dump/
      probe inspect dump/ --step 0 --rank 0 --key fc1
      probe inspect dump/ --key 're:/backward/.*grad' --limit 20
      probe inspect dump/step0/rank0.h5 --json | python -m json.tool
      probe inspect msprobe_dump/ --step 0 --key fc1
    """
    loaded = formats.load(dump)
    for message in loaded.incomplete_messages():
        click.echo(f"probe: warning: {message}", err=True)
    from probe.comparison.load import mixed_runs

    mixed = mixed_runs(loaded)
    if mixed:
        click.echo(f"probe: warning: {mixed}", err=True)
    selected = [(s, r) for (s, r) in loaded.files if (step is None or s == step) and (rank is None or r == rank)]
    if not selected:
        wanted = " ".join(f"{name} {value}" for name, value in (("step", step), ("rank", rank)) if value is not None)
        raise click.BadParameter(
            f"{dump} has no step file for {wanted} (steps {loaded.steps}, ranks {loaded.ranks})",
            param_hint="--step/--rank",
        )
    matches = key_matcher(key)
    budget = limit
    files, shown, hidden = [], [], 0
    for file_step, file_rank in selected:
        with loaded.open(file_step, file_rank) as step_file:
            records = [record for record in step_file.records.to_dicts() if matches(record["key"])]
            keep = records if budget is None else records[:budget]
            if budget is not None:
                budget -= len(keep)
            hidden += len(records) - len(keep)
            for record in keep:
                record["step"], record["rank"] = file_step, file_rank
            files.append({
                "step": file_step, "rank": file_rank, "path": step_file.path,
                "record_count": len(step_file.records), "tensor_count": step_file.tensor_count,
                "attrs": step_file.attrs, "cost": step_cost(step_file),
                "uninitialized": uninitialized_count(step_file),
                "summary": summary_line(step_file), "records": keep,
            })
            shown.extend(keep)

    if as_json:
        payload = {
            "path": dump,
            "files": [{name: value for name, value in entry.items() if name not in ("summary", "records")}
                      for entry in files],
            "incomplete": [{"path": path, "message": message}
                           for path, message in zip(loaded.incomplete, loaded.incomplete_messages())],
            "records": shown,
            "records_not_shown": hidden,
            "mixed_runs": mixed or None,
        }
        click.echo(json.dumps(json_safe(payload, nan=None, infinite=False), allow_nan=False, ensure_ascii=False))
        return 0

    click.echo(f"{dump}: {len(loaded.files)} step file(s), steps {loaded.steps}, ranks {loaded.ranks}")
    for entry in files:
        click.echo(f"\nstep {entry['step']} rank {entry['rank']}  {entry['path']}")
        click.echo(entry["summary"])
        click.echo(cost_line(entry["cost"]))
        if entry["uninitialized"]:
            click.echo(f"  uninitialized: {entry['uninitialized']} record(s) of memory nothing had written yet "
                       "(an empty-family allocation read before its first write; not compared)")
        if entry["records"]:
            click.echo("")
            for text in format_table(entry["records"]):
                click.echo("  " + text)
    if hidden:
        click.echo(f"probe: {hidden} more matching record(s) not shown (--limit {limit})", err=True)
    return 0
