"""``probe run``: launch a training command with the env vars that only work at start-up.

PYTHONHASHSEED is read once, when an interpreter starts; CUBLAS_WORKSPACE_CONFIG once, when
cuBLAS starts. seed_all() inside the script is too late for both, so this command sets them
for the child and then gets out of the way: stdio is inherited, SIGINT, SIGTERM, SIGHUP,
SIGUSR1 and SIGUSR2 are forwarded, and the child's exit code is returned. The child never
outlives this process: on Linux it asks the kernel (prctl PR_SET_PDEATHSIG) to send it SIGKILL
when its parent dies, even when the parent is killed with SIGKILL. This module does not
import torch.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import click

from probe.config import ENV_CONFIG, ENV_SEED, SEED_MAX, Config, check_dump_path, load
from probe.dump import run_folder
from probe.errors import ProbeError

USAGE = "probe run [-c config.json] [--seed N] -- python train.py [args...]"


def build_env(config: Config | None, seed: int | None, base: dict[str, str],
              command: str = "run") -> dict[str, str]:
    """The child's environment: ``base`` plus the start-up-only variables, and the mark of
    the probe ``command`` launching it (its config's keys then win over a script's own:
    probe/command_config.py)."""
    from probe.command_config import command_env

    env = command_env(base, command)
    chosen = seed if seed is not None else (config or Config()).seed
    env["PYTHONHASHSEED"] = str(chosen)
    if seed is not None:
        env[ENV_SEED] = str(seed)
    if config is not None:
        env[ENV_CONFIG] = os.path.abspath(config.source)
        if config.mode is not False:
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            env["HCCL_DETERMINISTIC"] = "true"
    return env


def _terminal_delivers_sigint() -> bool:
    """True when Ctrl-C from the terminal already reaches the child (same foreground group)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def check_executable(program: str, env: dict[str, str], caller: str = "run") -> None:
    """Fail with one line before anything is printed or started when ``program`` cannot run.
    ``caller``: the probe command whose message it is ("run", "determinism")."""
    if os.sep in program or (os.altsep and os.altsep in program):
        if not os.path.exists(program):
            raise ProbeError(f"{caller}: command not found: {program!r} (no such file)")
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            raise ProbeError(f"{caller}: {program!r} is not executable")
    elif shutil.which(program, path=env.get("PATH")) is None:
        raise ProbeError(f"{caller}: command not found: {program!r} is not on PATH")


#: signals passed on to the child (SIGINT only when the terminal did not deliver it already)
FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in
                          ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
_PR_SET_PDEATHSIG = 1


def _die_with_parent_hook():
    """A preexec_fn making the child die with this process (Linux); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def die_with_parent():
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return die_with_parent


def run_child(command: list[str], env: dict[str, str], stdout=None) -> int:
    """Run ``command`` with ``env``; forward FORWARDED_SIGNALS; return its exit code (128+N if killed).

    stdout: where the child's stdout goes (None: inherited; probe determinism sends it to stderr)."""
    try:
        child = subprocess.Popen(command, env=env, stdout=stdout, preexec_fn=_die_with_parent_hook())
    except FileNotFoundError:
        raise ProbeError(f"run: command not found: {command[0]!r}") from None
    except PermissionError:
        raise ProbeError(f"run: {command[0]!r} is not executable (permission denied)") from None
    except OSError as error:
        raise ProbeError(f"run: cannot start {command[0]!r}: {error.strerror}") from None

    def forward(signum, _frame):
        if signum == signal.SIGINT and _terminal_delivers_sigint():
            return  # the child got this Ctrl-C itself; a second copy would cut its cleanup short
        if child.poll() is None:
            child.send_signal(signum)

    previous = {}
    for signum in FORWARDED_SIGNALS:
        try:
            previous[signum] = signal.signal(signum, forward)
        except ValueError:  # not the main thread: cannot install handlers, just wait
            pass
    try:
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code


class _RunCommand(click.Command):
    """``probe run [options] [--] COMMAND...``: an unknown option before the command is a
    usage error (``--sed 42`` is a typo of ``--seed``, not a program to run)."""

    def parse_args(self, ctx, args):
        takes_value, flags = set(), set()
        for param in self.get_params(ctx):
            if isinstance(param, click.Option):
                (flags if param.is_flag else takes_value).update(param.opts + param.secondary_opts)
        position = 0
        while position < len(args):
            arg = args[position]
            if arg == "--" or not arg.startswith("-") or arg == "-":
                break
            name = arg.split("=", 1)[0]
            if name in takes_value:
                position += 1 if "=" in arg else 2
            elif name in flags:
                position += 1
            else:
                import difflib

                known = sorted(opt for opt in takes_value | flags if opt.startswith("--"))
                raise click.NoSuchOption(name, possibilities=difflib.get_close_matches(name, known),
                                         ctx=ctx)
        return super().parse_args(ctx, args)


@click.command(
    "run",
    cls=_RunCommand,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Run a training script with seeding env vars set.",
)
@click.option("-c", "--config", "config_path", metavar="FILE",
              help="probe config (.json/.yaml); exported to the child as PROBE_CONFIG.")
@click.option("--seed", type=click.IntRange(0, SEED_MAX), default=None,
              help="Seed for PYTHONHASHSEED (default: the config's seed, else 1234); "
                   "exported as PROBE_SEED and overrides the config's seed in the child.")
@click.option("-q", "--quiet", is_flag=True, help="Do not print the variables set on stderr.")
@click.option("--no-attach", is_flag=True,
              help="With -c: do not capture a script that builds no PrecisionDebugger "
                   "(also: PROBE_ATTACH=0 in the environment).")
@click.option("--model", "model_class", metavar="CLASS",
              help="With -c: capture the module of this class (its class name) as the model, "
                   "instead of the one found automatically (docs/trainers.md).")
@click.option("--perturb", is_flag=True,
              help="Compute with another device's rounding: matmul, linear, conv, sum and mean "
                   "summed in another order (probe.perturb); a trusted second run for "
                   "probe compare --baseline.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(config_path: str | None, seed: int | None, quiet: bool, no_attach: bool,
        model_class: str | None, perturb: bool, command: tuple[str, ...]) -> int:
    """Run COMMAND with the env vars that must be set before Python and CUDA start.

    \b
    Sets for the child process:
      PYTHONHASHSEED=<seed>                  str/bytes hashes (set order, dict of str) repeat
      CUBLAS_WORKSPACE_CONFIG=:4096:8        when the config's mode is true/"warn" and unset
      HCCL_DETERMINISTIC=true                when the config's mode is true/"warn"
      PROBE_CONFIG=<absolute config path>    PrecisionDebugger() with no argument reads it;
                                             a debugger or callback given its own config
                                             takes every key this file writes from it
      PROBE_SEED=<seed>                      only with --seed
      PROBE_COMMAND=run                      marks a program probe launched
      PROBE_MODEL=<class>                    only with --model
      PROBE_ATTACH=1, PYTHONPATH=<probe's start-up hook>:...
                                             with -c: a script with no probe code is
                                             captured (each optimizer.step() ends a step);
                                             one that builds a PrecisionDebugger
                                             captures by itself (docs/trainers.md)
      PROBE_PERTURB=1                        with --perturb: the same math with another
                                             device's rounding (reductions summed in
                                             another order; probe.perturb), entered when
                                             the program imports torch
    Returns the command's exit code (128+N when killed by signal N); 2 for a bad config or
    a command that cannot be started.

    \b
    Examples:
      probe run -c config.json -- python train.py --epochs 1
      probe run --seed 42 -- python train.py
      probe run -c config.yaml -- torchrun --nproc-per-node 2 train.py
      probe run -c config.json --model ActorCriticPolicy -- python train_ppo.py
      probe run --perturb -c baseline.json -- python train.py
    """
    if not command:
        raise ProbeError(f"run: no command given; usage: {USAGE}")
    if model_class and (config_path is None or no_attach):
        raise ProbeError("run: --model names the model of the automatic capture, which runs "
                         "with -c and without --no-attach")
    config = load(config_path) if config_path is not None else None
    if config is not None:
        check_dump_path(config)  # now, not at the first dumped step hours into training
        # another run's step files: refused (or removed with "overwrite") before any rank starts
        run_folder.claim(config.dump_path, 0, config.overwrite, config.source, started=float("inf"))
    env = build_env(config, seed, dict(os.environ))
    if config is not None and not no_attach:
        from probe.autoattach import attach_env

        env = attach_env(env, model_class)
    if perturb:
        from probe.autoattach import perturb_env

        env = perturb_env(env)
    check_executable(command[0], env)
    if not quiet:
        shown = ("PYTHONHASHSEED", ENV_SEED, ENV_CONFIG, "CUBLAS_WORKSPACE_CONFIG",
                 "HCCL_DETERMINISTIC", "PROBE_ATTACH", "PROBE_MODEL", "PROBE_PERTURB")
        changed = [f"{name}={env[name]}" for name in shown
                   if name in env and os.environ.get(name) != env[name]]
        click.echo(f"probe run: {' '.join(changed) or 'no variables changed'}", err=True)
    return run_child(list(command), env)
