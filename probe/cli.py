"""The ``probe`` command line.

Subcommands live in probe/commands/, one module each, and are imported only when used, so
``probe compare --help`` does not pay for torch. Every ProbeError becomes one line on stderr
and exit code 2; answers go to stdout.

Exit codes: 0 pass, 1 diverged (compare), 2 trouble (usage, config, unreadable input).
"""

import sys
from importlib import import_module

import click

from probe._version import __version__
from probe.errors import ProbeError

EXIT_PASS = 0
EXIT_DIVERGED = 1
EXIT_TROUBLE = 2

# command name -> (module, click command attribute, one-line help for the listing)
_COMMANDS = {
    "run": ("probe.commands.run", "run", "Run a training script with seeding env vars set."),
    "inspect": ("probe.commands.inspect", "inspect", "List the steps, ranks and records of a dump."),
    "compare": ("probe.commands.compare", "compare", "Find where two dumps part."),
    "determinism": ("probe.commands.determinism", "determinism",
                    "Run a script twice and name the first nondeterministic op."),
    "nonfinite": ("probe.commands.nonfinite", "nonfinite", "Find the first NaN/Inf in one dump."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(_COMMANDS)

    def get_command(self, ctx, name):
        if name not in _COMMANDS:
            return None
        module_name, attribute, _ = _COMMANDS[name]
        return getattr(import_module(module_name), attribute)

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
    except click.exceptions.Abort:
        click.echo("probe: aborted", err=True)
        return _exit(EXIT_TROUBLE)
    except click.ClickException as error:
        error.show()
        return _exit(EXIT_TROUBLE if error.exit_code != 0 else 0)
    except click.exceptions.Exit as exit_:
        return _exit(exit_.exit_code)
    return _exit(code if isinstance(code, int) else 0)


def _exit(code):
    sys.exit(code)


if __name__ == "__main__":
    main()
