"""``probe compare A B``: find the first op where two dumps part.

Imports only click at module level, so ``probe compare --help`` stays fast; numpy, h5py
and the compare engine load when a compare actually runs. torch is never imported.
"""

import os
import sys

import click

from probe.comparison import KEEP_ROWS
from probe.parallel.ctrl_c import RememberedCtrlC

EXIT_PASS, EXIT_DIVERGED, EXIT_TROUBLE = 0, 1, 2

_EPILOG = """\b
Examples:
  probe compare ref_dump/ new_dump/                 # folders: pairs steps and ranks
  probe compare ref_dump/step0/rank0.h5 new_dump/step0/rank0.h5
  probe compare ref/ new/ --json > result.json      # one JSON object on stdout
  probe compare ref/ new/ --csv rows.csv --html report.html
  probe compare fp32/ bf16/ --tol bfloat16=1e-2,1e-5 --top 20
  probe compare gpu/ npu/ --mapping map.yaml        # renamed modules / ops
  probe compare gpu/ cpu/ --replay                  # which side is right? (task "tensor" dumps)
  probe compare gpu/ cpu/ --replay --replay-top 50 --replay-budget 300
  probe compare ref/ new/ --jobs 8                  # on 8 processes (default: every core)
  torchrun --nnodes 4 --nproc_per_node 32 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
      -m probe compare ref/ new/                    # over 4 machines: rank 0 prints the report
  probe compare ref_run/fingerprints new_run/fingerprints --html parts.html
                                                    # fingerprinted runs: where they part

\b
A is the reference: relative errors are relative to A. A tensor fails when
||a-b|| > rtol*||a|| + atol*sqrt(n), with the tolerance of the lower-precision
dtype of the pair (docs/compare.md has the table and the reasoning).
Exit codes: 0 no divergence, 1 divergence found, 2 trouble (bad arguments or input,
or interrupted with Ctrl-C).
"""


class _CompareCommand(click.Command):
    """Reads the older ``--replay N`` / ``--replay=N`` as ``--replay --replay-top N``, where N is
    a number and no path of that name exists; anything else after ``--replay`` is A or B."""

    def parse_args(self, ctx, args):
        rewritten, position = [], 0
        while position < len(args):
            arg = args[position]
            if arg == "--":
                rewritten += args[position:]
                break
            if arg.startswith("--replay="):
                rewritten += ["--replay", "--replay-top", arg.split("=", 1)[1]]
            elif (arg == "--replay" and position + 1 < len(args) and args[position + 1].isdigit()
                  and not os.path.exists(args[position + 1])):
                rewritten += ["--replay", "--replay-top", args[position + 1]]
                position += 1
            else:
                rewritten.append(arg)
            position += 1
        return super().parse_args(ctx, rewritten)


@click.command("compare", cls=_CompareCommand, epilog=_EPILOG,
               context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout instead of the report.")
@click.option("--rows", "json_rows", is_flag=True, help="With --json: include every aligned record.")
@click.option("--csv", "csv_path", metavar="FILE", help="Write one CSV row per aligned record.")
@click.option("--html", "html_path", metavar="FILE", help="Write a self-contained HTML report (chart + table).")
@click.option("--rtol", type=float, metavar="R", help="Relative tolerance for every floating dtype.")
@click.option("--atol", type=float, metavar="A", help="Absolute (RMS) tolerance for every floating dtype.")
@click.option("--tol", "tol", multiple=True, metavar="DTYPE=R,A",
              help="Tolerance for one dtype, e.g. bfloat16=1e-2,1e-5 (repeatable; beats --rtol/--atol).")
@click.option("--tol-file", metavar="YAML", help="Tolerances per dtype: {bfloat16: {rtol: R, atol: A}}.")
@click.option("--mapping", metavar="YAML", help="Rename modules/ops of a port: {modules: {old: new}, ops: {old: new}}.")
@click.option("--allow-missing", is_flag=True,
              help="Compare the steps/ranks both dumps have instead of failing when one side lacks some.")
@click.option("--step", "steps", multiple=True, type=int, metavar="N", help="Compare only this step (repeatable).")
@click.option("--rank", "ranks", multiple=True, type=int, metavar="N", help="Compare only this rank (repeatable).")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=0), help="How many top ops to list.")
@click.option("--strict", is_flag=True,
              help="The fixed tolerances decide alone: any difference beyond them fails (no op is cleared as "
                   "within its rounding envelope), and records present on one side only count as a divergence.")
@click.option("--baseline", metavar="C", type=click.Path(),
              help="A second trusted run of A's kind (another thread count, another GPU of the same type, "
                   "probe run --perturb): B - A is judged against C - A per op.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, metavar="N",
              help="Compare on N processes of this machine; the report is the same for any N. "
                   "[default: the cores this process may run on]")
@click.option("--keep-rows", "keep_rows", default=None, metavar="N|all",
              callback=lambda ctx, param, value: _NOT_GIVEN if value is None else _keep_rows(value),
              help="Records whose rows --csv, --html and --json --rows list: past N, the step files that diverged "
                   "first; counts, verdicts, top ops and the story always cover every record. "
                   f"[default: {KEEP_ROWS} with --csv, --html or --rows; else none, the report lists no rows]")
@click.option("--replay", "replay_on", is_flag=True,
              help="Re-run the first divergence, the likely cause and the top ops (--replay-top) in float64 "
                   "from each side's dumped inputs (task 'tensor'): which side is right, and did the op "
                   "introduce the error or only round and pass it on. Imports torch.")
@click.option("--replay-top", "replay_top", type=click.IntRange(min=0), default=None, metavar="N",
              help="With --replay: how many top ops to replay [default: 20]; implies --replay. "
                   "(--replay N, the older form, still works.)")
@click.option("--replay-budget", "replay_budget", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, metavar="SECONDS", help="Stop replaying after this long; a note lists what was left.")
def compare(a, b, as_json, json_rows, csv_path, html_path, rtol, atol, tol, tol_file, mapping,
            allow_missing, steps, ranks, top, strict, baseline, jobs, keep_rows, replay_on, replay_top, replay_budget):
    """Find where two dumps part: the first op beyond tolerance, introduced or inherited.

    A and B are dump folders (written by PrecisionDebugger) or single step files
    (step<N>/rank<R>.h5); either may be an msprobe dump (docs/msprobe.md). Calls are aligned by execution order, so extra or missing calls
    on one side (autocast casts, a fused op) do not shift the pairing of the others.
    """
    from probe.fingerprint.command import is_fingerprints

    if is_fingerprints(a, b):
        return _compare_fingerprints(a, b, as_json, html_path, ranks)

    from probe.compare_and_replay import compare as run_compare
    from probe.report import output, progress

    replay = replay_top if replay_top is not None else (_REPLAY_TOP if replay_on else None)

    # fail on unwritable destinations before the (possibly long) compare
    # and on a report that would overwrite an input or another report: nothing is written
    requested = {option: path for option, path in (("--csv", csv_path), ("--html", html_path))
                 if path is not None}
    destinations = {option.lstrip("-"): full for option, full in
                    output.check_destinations(requested, inputs=(a, b) + ((baseline,) if baseline else ())).items()}

    if keep_rows is _NOT_GIVEN:  # the text and plain JSON reports list no rows: hold none
        keep_rows = KEEP_ROWS if csv_path or html_path or json_rows else 0
    runner = _runner(jobs)
    bar = progress.Progress(sys.stderr, units=lambda: (runner.done, runner.total)) \
        if getattr(runner, "finishes", True) else None
    try:
        with RememberedCtrlC():  # a Ctrl-C Python drops (in a weakref callback) is raised again
            result = run_compare(
                a, b, rtol=rtol, atol=atol, tol=tol, tol_file=tol_file, mapping=mapping,
                allow_missing=allow_missing, steps=steps or None, ranks=ranks or None, top=top,
                strict=strict, baseline=baseline, progress=bar, replay=replay, replay_budget=replay_budget,
                replay_progress=_replay_progress if replay is not None else None,
                keep_rows=keep_rows, runner=runner,
            )
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        done = (f"after comparing {runner.done} of {runner.total} units (step files, or a sharded "
                "step's group of ranks)" if runner.total else "before comparing (while the dumps were read)")
        click.echo(f"probe: interrupted {done}; no report written", err=True)
        raise click.exceptions.Exit(EXIT_TROUBLE) from None
    finally:
        if bar is not None:
            bar.close()
    if result is None:  # a torchrun process other than rank 0: rank 0 prints the report
        return runner.share_exit(None)
    if result.replay is not None:
        data = result.replay.to_dict()
        click.echo(f"probe: replayed {data['replayed']} of {len(data['calls'])} calls in {data['elapsed_s']:.2f} s"
                   + (f"; {len(data['left'])} left at the {replay_budget:g} s budget" if data["left"] else ""), err=True)

    if "csv" in destinations:
        from probe.report import csv_report

        output.write_atomic(destinations["csv"], csv_report.render(result), "--csv")
        click.echo(f"probe: wrote {len(result.rows)} CSV rows to {csv_path}", err=True)
    if "html" in destinations:
        from probe.report import html_report

        output.write_atomic(destinations["html"], html_report.render(result), "--html")
        click.echo(f"probe: wrote the HTML report to {html_path}", err=True)
    if as_json:
        from probe.report import json_report

        json_report.write(result, click.get_text_stream("stdout"), rows=json_rows)
    else:
        from probe.report import terminal

        click.echo(terminal.render(result), nl=False)
    return runner.share_exit(EXIT_DIVERGED if result.diverged else EXIT_PASS)


def _runner(jobs):
    """torchrun's processes split the units between them; otherwise --jobs processes of this machine."""
    from probe.parallel.torchrun import under_torchrun

    if under_torchrun():
        from probe.parallel.torchrun import TorchrunRunner

        return TorchrunRunner()
    from probe.parallel.workers import LocalRunner

    return LocalRunner(jobs)


_NOT_GIVEN = object()


def _keep_rows(text: str):
    """--keep-rows: a count of records, or "all" (None)."""
    if text.strip().lower() == "all":
        return None
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise click.BadParameter(f"expected a number of records >= 0 or 'all', found {text!r}",
                                 param_hint="'--keep-rows'")
    return count


def _compare_fingerprints(a, b, as_json, html_path, ranks):
    """Two fingerprinted runs: the first step where they part, jump or drift (exit 1 on a jump)."""
    from probe.fingerprint import command, report as fingerprint_report
    from probe.report import output

    destinations = output.check_destinations({"--html": html_path} if html_path else {}, inputs=(a, b))
    primary, results = command.run(a, b, ranks=ranks or None)
    if html_path:
        output.write_atomic(destinations["--html"], fingerprint_report.render_html(primary), "--html")
        click.echo(f"probe: wrote the HTML report to {html_path}", err=True)
    click.echo(command.render(primary, results, as_json, command.shared_note(a, b)), nl=False)
    return EXIT_DIVERGED if any(r.diverged for r in results) else EXIT_PASS


#: how many top ops --replay replays without --replay-top
_REPLAY_TOP = 20


def _replay_progress(done, total, name, verdict):
    """One stderr line per replayed call."""
    from probe.report.replay_text import progress_line

    line = progress_line(done, total, name, verdict)
    if line is not None:
        click.echo(line, err=True)
