"""The config a probe command hands to the program it launches, and when it wins over the
script's own.

``probe run -c config.json`` and ``probe determinism`` start the user's command with
$PROBE_CONFIG (the command's config file), $PROBE_SEED (``probe run --seed``) and
$PROBE_COMMAND (the command's name). In that program, every PrecisionDebugger follows one rule,
whoever builds it (the script, a trainer callback, zero-edit capture):

* ``PrecisionDebugger()`` with no config uses the command's config (the defaults where it
  writes nothing);
* a debugger given a config of the script's own (a path, a dict or a probe.Config: what the
  trainer callbacks are given) takes the script's config with **every key the command's
  config file writes** laid over it, and the seed of ``--seed``: those keys are the
  command's, the others stay the script's. ``probe determinism`` writes task "checksum" and
  each run's own dump_path, plus the keys of its own ``-c`` file; so a script's callback
  keeps its level, scope and seed and records checksums into the run's folder;
* without $PROBE_COMMAND (a script run directly, even with $PROBE_CONFIG exported by hand) a
  config given in the script is used as given.

Where the command's keys change what the script asked for, the program says so on stderr,
once per debugger, and appends the same note to $PROBE_NOTES when the command set it (``probe
determinism`` prints the notes of its runs in its report). This module does not import torch.
"""

from __future__ import annotations

import json
import os
import sys

from probe import config as config_module

#: the probe command that launched this program ("run", "determinism"); unset: none did
ENV_COMMAND = "PROBE_COMMAND"
#: a file the launched program appends its notes to, one JSON object a line
ENV_NOTES = "PROBE_NOTES"


def command_env(env: dict[str, str], command: str, notes: str | None = None) -> dict[str, str]:
    """``env`` plus the mark of the probe command that launches the program (and where its
    notes go)."""
    env = dict(env)
    env[ENV_COMMAND] = command
    if notes is not None:
        env[ENV_NOTES] = notes
    else:
        env.pop(ENV_NOTES, None)
    return env


def launching_command(environ=None) -> str:
    """The probe command that launched this program, "" when none did."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV_COMMAND, "")


def handed_down(environ=None) -> tuple[config_module.Config, tuple[str, ...]] | None:
    """(the command's config, the keys it sets) when a probe command handed one down, else None."""
    environ = os.environ if environ is None else environ
    if not launching_command(environ):
        return None
    path = environ.get(config_module.ENV_CONFIG, "")
    given = config_module.from_env(environ)
    if given is None:
        return None
    keys = config_module.load_with_keys(path)[1] if path else ()
    if environ.get(config_module.ENV_SEED, ""):
        keys += ("seed",)
    return given, keys


def resolve(own: config_module.Config, environ=None) -> config_module.Config:
    """The config a debugger given ``own`` (the script's config) uses: ``own`` with the keys
    the launching command's config sets laid over it; ``own`` itself when no command did."""
    environ = os.environ if environ is None else environ
    found = handed_down(environ)
    if found is None:
        return own
    given, keys = found
    changes = {key: getattr(given, key) for key in keys}
    changed = {key: (getattr(own, key), value) for key, value in changes.items()
               if getattr(own, key) != value}
    if not changed:
        return own
    result = own.replace(**changes, source=given.source)
    command = launching_command(environ)
    shown = ", ".join(f"{key} {_show(new)} (the script's: {_show(old)})"
                      for key, (old, new) in changed.items())
    note("config", f"the script's own config ({own.source}) gives way to probe {command}'s "
                   f"({given.source}) where that one sets a key: {shown}", environ,
         command=command, script=own.source,
         changed={key: [_plain(old), _plain(new)] for key, (old, new) in changed.items()})
    return result


def note(kind: str, text: str, environ=None, **data) -> None:
    """Say ``text`` on stderr (``probe: ...``) and append it to $PROBE_NOTES when set."""
    environ = os.environ if environ is None else environ
    print(f"probe: {text}", file=sys.stderr, flush=True)
    path = environ.get(ENV_NOTES, "")
    if not path:
        return
    entry = {"kind": kind, "text": text, "rank": environ.get("RANK", "0"), **data}
    try:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry, default=str) + "\n")
    except OSError as error:  # the note was said on stderr; the report just lacks it
        print(f"probe: cannot write the note to {path}: {error.strerror}", file=sys.stderr)


def read_notes(path: str) -> list[dict]:
    """The notes a launched program left in ``path``, each text once (every rank writes its
    own), in the order written; [] when there are none."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    found, seen = [], set()
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a process that was killed
        if isinstance(entry, dict) and entry.get("text") not in seen:
            seen.add(entry.get("text"))
            found.append(entry)
    return found


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _show(value) -> str:
    return json.dumps(_plain(value))


__all__ = ["ENV_COMMAND", "ENV_NOTES", "command_env", "launching_command", "handed_down",
           "resolve", "note", "read_notes"]
