"""``probe determinism -- python train.py``: run a script twice, name its nondeterministic op.

Each run is a fresh process started the way ``probe run -c`` starts one: PYTHONHASHSEED,
PROBE_CONFIG pointing at a config forced to task "checksum" with the run's own dump_path and
fingerprints off (and the keys of the ``-c`` file), and zero-edit capture (probe/autoattach), so a script without
probe code is captured as ``probe run`` captures it, and a script that builds its own
debugger or trainer callback records with the command's keys laid over its own config
(probe/command_config.py). The dumps are then compared bit for bit
(probe/analysis/determinism.py). This module does not import torch.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import click

from probe.commands.run import check_executable, build_env, run_child
from probe.config import Config, load, load_with_keys
from probe.analysis.determinism import bit_compare, format_report, holds_records, nothing_recorded
from probe.command_config import ENV_NOTES, read_notes
from probe.errors import DumpFormatError, NothingRecordedError, ProbeError

USAGE = ("probe determinism [-c config.json] [--runs 2] [--dump DIR] [--hash-seed same|vary] "
         "[--model CLASS] [--no-attach] -- python train.py [args...]")
#: PYTHONHASHSEED takes 0 to 4294967295
_HASH_SEEDS = 1 << 32


@click.command(
    "determinism",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Run a script twice and name the first nondeterministic op.",
)
@click.option("-c", "--config", "config_path", metavar="FILE",
              help="probe config (.json/.yaml); its task is forced to checksum, the rest is kept.")
@click.option("--runs", type=click.IntRange(2, 100), default=2, show_default=True,
              help="How many identical runs (each later run is compared with run 1).")
@click.option("--dump", "dump_dir", metavar="DIR",
              help="Keep the dumps in DIR/run1, DIR/run2, ... (default: a temporary folder, removed).")
@click.option("--top", type=click.IntRange(0), default=10, show_default=True,
              help="How many introducing ops to list per rank.")
@click.option("--hash-seed", "hash_seed", type=click.Choice(["same", "vary"]), default="same",
              show_default=True,
              help="PYTHONHASHSEED of each run: 'same' (the config's seed in every run: str hash "
                   "order cannot differ) or 'vary' (run N gets seed + N - 1: shows nondeterminism "
                   "from hash order, a set of names iterated, hash(name) sharding).")
@click.option("--model", "model_class", metavar="CLASS",
              help="Capture the module of this class as the model, instead of the one found "
                   "automatically (a script without probe code; docs/trainers.md).")
@click.option("--no-attach", is_flag=True,
              help="Do not capture a script without probe code (it must build its own "
                   "PrecisionDebugger or trainer callback).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def determinism(config_path, runs, dump_dir, top, hash_seed, model_class, no_attach, as_json,
                command) -> int:
    """Run COMMAND several times with the same seed and report whether it repeats bit for bit.

    The script needs no probe code: as under ``probe run -c``, the model is found at its
    first training forward and every optimizer.step() ends a step (torchrun included). A
    script that builds its own PrecisionDebugger or trainer callback records with this
    command's config laid over its own (task checksum, each run's own dump folder, the keys
    of -c), and the report says so. Every run dumps checksums of every recorded tensor; the
    first op whose output differs while its inputs are bit-identical is the
    nondeterministic op. Also prints the determinism settings in force and what to change.
    One report per rank under torchrun. The script's own stdout goes to stderr, so stdout
    holds only the report.

    Every run gets the same PYTHONHASHSEED unless --hash-seed vary: then nondeterminism from
    str hash order (iterating a set of names, hash(name) % n) can show too.

    \b
    Exit codes: 0 bit-identical, 1 not, 2 trouble (no command, a command not found, a run
    that fails on its own, a script that writes no dump, nothing recorded, a bad config).

    \b
    Examples:
      probe determinism -- python train.py --steps 3
      probe determinism -c config.json --runs 3 --dump det_dumps -- python train.py
      probe determinism --hash-seed vary -- python train.py
      probe determinism -- torchrun --nproc-per-node 2 train.py
    """
    if not command:
        raise ProbeError(f"determinism: no command given after --; usage: {USAGE}")
    if model_class and no_attach:
        raise ProbeError("determinism: --model names the model of the automatic capture, which "
                         "--no-attach turns off")
    base, keys = load_with_keys(config_path) if config_path is not None else (Config(), ())
    check_executable(command[0], dict(os.environ), "determinism")
    folder = os.path.abspath(dump_dir) if dump_dir else tempfile.mkdtemp(prefix="probe-determinism-")
    launch = _Launch(command, base, keys, folder, runs, hash_seed, model_class, not no_attach)
    try:
        dumps = [launch.run(1)]
        # a first run that recorded nothing leaves nothing to check: the other runs would only
        # cost their time
        if not holds_records(dumps[0]):
            later = "run 2 was" if runs == 2 else f"runs 2 to {runs} were"
            raise NothingRecordedError(_nothing_recorded_message(
                base, f"run 1's step files hold 0 records ({later} not started)"))
        dumps += [launch.run(run) for run in range(2, runs + 1)]
        notes = launch.notes(1)
        reports = [report for run in range(2, runs + 1)
                   for report in bit_compare(dumps[0], dumps[run - 1], 1, run)]
    finally:
        if not dump_dir:
            shutil.rmtree(folder, ignore_errors=True)
    if nothing_recorded(reports):
        raise NothingRecordedError(_nothing_recorded_message(base, f"the step files of all {runs} runs hold "
                                                     "0 records"))
    identical = all(report.identical for report in reports)
    if as_json:
        click.echo(json.dumps({
            "verdict": "identical" if identical else "nondeterministic",
            "runs": runs,
            "hash_seed": hash_seed,
            "dumps": dumps if dump_dir else [],
            "notes": [entry.get("text", "") for entry in notes],
            "reports": [report.to_dict() for report in reports],
        }, indent=2, default=str))
    else:
        lines = [f"note (run 1): {entry.get('text', '')}" for entry in notes]
        for report in reports:
            lines += format_report(report, top)
        verdict = ("the runs are bit-identical" if identical
                   else "the runs differ: the script is not deterministic")
        lines.append(f"verdict: {verdict} ({runs} runs)")
        if dump_dir:
            lines.append(f"dumps: {' '.join(dumps)}")
        click.echo("\n".join(lines))
    return 0 if identical else 1


def _nothing_recorded_message(base: Config, what: str) -> str:
    return (f"determinism: nothing was recorded: {what}, so nothing was checked; the config's scope "
            f"{list(base.scope)} and list {list(base.list)} select no call of the script's model "
            "(check them for typos), or start() is not called around the steps")


class _Launch:
    """Starts the runs: each a fresh process with its own config file, dump folder and notes."""

    def __init__(self, command, base: Config, keys: tuple, folder: str, runs: int, hash_seed: str,
                 model_class: str | None, attach: bool) -> None:
        self.command, self.base, self.keys, self.folder = command, base, keys, folder
        self.runs, self.hash_seed = runs, hash_seed
        self.model_class, self.attach = model_class, attach

    def notes(self, run: int) -> list[dict]:
        """What the program said about its capture in that run (command_config.note)."""
        return read_notes(os.path.join(self.folder, f"run{run}.notes.jsonl"))

    def run(self, run: int) -> str:
        """One run of the command into folder/run<N>; returns that dump folder."""
        folder, command = self.folder, self.command
        dump = os.path.join(folder, f"run{run}")
        if os.path.isdir(dump) and os.listdir(dump):
            raise ProbeError(f"determinism: {dump} already holds files; give --dump an empty or "
                             "new folder")
        os.makedirs(folder, exist_ok=True)
        # the keys the -c file writes, and those this command sets: what wins over a config
        # the script gives its own debugger or callback. Fingerprints off: with them, step []
        # would capture no step in full, and the runs are compared by their step files
        given = self.base.to_dict()
        forced = {key: given[key] for key in self.keys}
        forced.update(task="checksum", dump_path=dump, fingerprint=False, reference="",
                      stop_on_divergence=False)
        config_file = os.path.join(folder, f"run{run}.config.json")
        with open(config_file, "w", encoding="utf-8") as handle:
            json.dump(forced, handle, indent=2)
        config = load(config_file)
        notes = os.path.join(folder, f"run{run}.notes.jsonl")
        env = build_env(config, None, dict(os.environ), command="determinism")
        env[ENV_NOTES] = notes  # what the program says about its capture, for the report
        if self.attach:
            from probe.autoattach import attach_env

            env = attach_env(env, self.model_class)
        if self.hash_seed == "vary":
            env["PYTHONHASHSEED"] = str((config.seed + run - 1) % _HASH_SEEDS)
        check_executable(command[0], env, "determinism")
        shown = " ".join(command)
        click.echo(f"probe determinism: run {run} of {self.runs}: {shown}", err=True)
        sys.stderr.flush()
        code = run_child(list(command), env, stdout=sys.stderr)
        if code != 0:
            raise ProbeError(f"determinism: run {run} of `{shown}` failed on its own with exit "
                             f"code {code} (its output is above); make it run cleanly first")
        from probe.dump.reader import discover

        try:
            discover(dump)
        except DumpFormatError:
            raise ProbeError(
                f"determinism: run {run} of `{shown}` wrote no dump under {dump}: "
                + ("no training step was seen (no module with trainable parameters ran a "
                   "forward with gradients enabled and then an optimizer.step()), and the "
                   "script built no probe.PrecisionDebugger() nor trainer callback that "
                   "records; a Python started with -I, -E or -S is not captured either"
                   if self.attach else
                   "with --no-attach the script must build a probe.PrecisionDebugger() or a "
                   "trainer callback and capture its steps")) from None
        return dump
