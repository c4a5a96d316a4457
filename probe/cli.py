"""The ``probe`` command line.

Subcommands live in probe/commands/, one module each, and are imported only when used, so
``probe compare --help`` does not pay for torch. Every ProbeError becomes one line on stderr
and exit code 2; answers go to stdout.

Exit codes: 0 pass, 1 diverged (compare), 2 trouble (usage, config, unreadable input).
A usage error is one line too (``probe: error: ...``, with click's "did you mean" kept).
When the reader of stdout goes away (``probe inspect dump | head``) probe stops quietly
with exit code 141 (128 + SIGPIPE, what a shell shows for a process SIGPIPE killed); Ctrl-C
stops it with one line on stderr and exit code 2, never a traceback.
"""

import os
import sys
from importlib import import_module

import click

from probe._version import __version__
from probe.errors import ProbeError

EXIT_PASS = 0
EXIT_DIVERGED = 1
EXIT_TROUBLE = 2
EXIT_BROKEN_PIPE = 141

# command name -> (module, click command attribute, one-line help for the listing)
_COMMANDS = {
    "run": ("probe.commands.run", "run", "Run a training script with seeding env vars set."),
    "inspect": ("probe.commands.inspect", "inspect", "List the steps, ranks and records of a dump."),
    "compare": ("probe.commands.compare", "compare", "Find where two dumps part."),
    "determinism": ("probe.commands.determinism", "determinism",
                    "Run a script twice and name the first nondeterministic op."),
    "nonfinite": ("probe.commands.nonfinite", "nonfinite", "Find the first NaN/Inf in one dump."),
}


class _StdoutClosed(Exception):
    """stdout's reader went away. Not an OSError, so click's own EPIPE handling (exit 1,
    which would read as "diverged") lets it through to main()."""


class _LazyGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            raise _StdoutClosed() from None

    def list_commands(self, ctx):
        return sorted(_COMMANDS)

    def get_command(self, ctx, name):
        if name not in _COMMANDS:
            return None
        module_name, attribute, _ = _COMMANDS[name]
        return getattr(import_module(module_name), attribute)

    def resolve_command(self, ctx, args):
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in _COMMANDS:
            import difflib

            close = difflib.get_close_matches(name, list(_COMMANDS), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise click.UsageError(
                f"no such command {name!r}{hint} (commands: {', '.join(sorted(_COMMANDS))})", ctx)
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx, formatter):
        rows = [(name, _COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="probe")
def cli():
    """probe: make PyTorch runs repeatable and find where two runs part.

    \b
    Typical use:
      probe run -c config.json -- python train.py   # seeded, dumped run
      probe inspect dump/                           # what was captured
      probe compare ref_dump/ new_dump/             # first op beyond tolerance

    Exit codes: 0 pass, 1 diverged, 2 trouble (bad arguments, config or dump).
    """


def main(argv=None):
    try:
        code = cli.main(args=argv, prog_name="probe", standalone_mode=False)
    except ProbeError as error:
        click.echo(f"probe: error: {error}", err=True)
        return _exit(EXIT_TROUBLE)
    except click.exceptions.Abort as abort:
        if isinstance(abort.__cause__, KeyboardInterrupt):
            click.echo("probe: interrupted", err=True)
            return _exit(EXIT_TROUBLE)
        click.echo("probe: aborted", err=True)
        return _exit(EXIT_TROUBLE)
    except KeyboardInterrupt:
        click.echo("probe: interrupted", err=True)
        return _exit(EXIT_TROUBLE)
    except click.ClickException as error:
        message = " ".join(error.format_message().split())  # one line: "did you mean" joins it
        click.echo(f"probe: error: {_command_prefix(error)}{message}", err=True)
        return _exit(EXIT_TROUBLE if error.exit_code != 0 else 0)
    except click.exceptions.Exit as exit_:
        return _exit(exit_.exit_code)
    except (BrokenPipeError, _StdoutClosed):
        _silence_stdout()
        return _exit(EXIT_BROKEN_PIPE)
    try:
        sys.stdout.flush()  # a broken pipe can also surface only here
    except BrokenPipeError:
        _silence_stdout()
        return _exit(EXIT_BROKEN_PIPE)
    return _exit(code if isinstance(code, int) else 0)


def _command_prefix(error: click.ClickException) -> str:
    """'compare: ' for an error in a subcommand's arguments (the group's own: '')."""
    ctx = getattr(error, "ctx", None)
    if ctx is not None and ctx.parent is not None and ctx.info_name:
        return f"{ctx.info_name}: "
    return ""


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _exit(code):
    sys.exit(code)


if __name__ == "__main__":
    main()
