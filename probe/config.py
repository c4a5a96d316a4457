"""The probe config: one frozen, validated dataclass, loaded from .json, .yaml or .yml.

Every check happens here, once, so the rest of probe can trust a Config. A bad value raises
ConfigError with one sentence naming the file, the key path (``step[2]``), the value found and
what is allowed. This module must not import torch (``probe run`` and ``probe compare`` use it).

Matching conventions (implemented here so capture and docs agree):

* ``scope``: module-path prefixes on dot boundaries. ``"blocks.0"`` matches ``blocks.0`` and
  ``blocks.0.attn`` but not ``blocks.01``. Empty = every module.
* ``list``: a plain string matches when it equals the op name (``"functional.linear"``) or is a
  substring of the record key; a string starting with ``re:`` is a regular expression searched
  in the op name and in the key, compiled at load time. Empty = every op.
* ``data_mode``: ``forward``/``backward`` pick phases, ``input``/``output`` pick directions;
  a dimension nobody names is unrestricted; ``all`` allows everything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from probe.config_values import (  # the value checks, under the names this module uses
    show as _show,
    type_name as _type_name,
    suggest as _suggest,
    bad as _bad,
    choice as _choice,
    bounded_int as _bounded_int,
    selection as _selection,
    strings as _strings,
    mode_flag as _mode,
    yaml_word_hint as _yaml_word_hint,
    compile_list as _compile_list,
)
from probe.errors import ConfigError

TASKS = ("statistics", "tensor", "checksum")
LEVELS = ("module", "api", "mix")
MODES = (False, True, "warn")
DATA_MODES = ("all", "forward", "backward", "input", "output")
SEED_MAX = 2**32 - 1
BUFFER_MB_MAX = 1_048_576
WRITE_ERROR_POLICIES = ("raise", "warn")
#: who writes statistics/checksum step files: a writer process, step() itself, or the process
#: where this process may run on two CPUs or more (probe/dump/background.py)
WRITERS = ("auto", "process", "inline")
#: a config file larger than this is refused before it is parsed (a 120 MB file took 50 s)
MAX_CONFIG_BYTES = 1 << 20
#: sketch_size: numbers per tensor of the random-projection sketch (probe/capture/numbers/sketch.py)
SKETCH_SIZE_MAX = 1024
EXTENSIONS = (".json", ".yaml", ".yml")
#: ``probe run`` exports the absolute config path under this name; the debugger reads it.
ENV_CONFIG = "PROBE_CONFIG"
#: ``probe run --seed N`` exports N under this name; from_env() lets it override the config's seed.
ENV_SEED = "PROBE_SEED"


@dataclass(frozen=True)
class KeySpec:
    """One documented config key: its type in words, default and allowed values."""

    name: str
    type: str
    default: Any
    allowed: str
    doc: str


#: The documented table of config keys, in file order. docs/config.md mirrors it.
KEYS: dict[str, KeySpec] = {
    spec.name: spec
    for spec in (
        KeySpec("task", "string", "statistics", "statistics | tensor | checksum",
                "what to record per tensor: statistics only, full tensors, or a checksum"),
        KeySpec("dump_path", "string", "./probe_dump", "any non-empty path",
                "folder the dump files are written to (relative to the working directory)"),
        KeySpec("level", "string", "api", "module | api | mix",
                "capture nn.Module calls, torch API calls, or both"),
        KeySpec("step", "list of int or 'a-b'", [], "ints >= 0 and inclusive ranges 'a-b'",
                "training steps to capture; [] = all"),
        KeySpec("rank", "list of int or 'a-b'", [], "ints >= 0 and inclusive ranges 'a-b'",
                "distributed ranks to capture; [] = all"),
        KeySpec("seed", "int", 1234, f"0 .. {SEED_MAX}", "seed passed to seed_all"),
        KeySpec("mode", "bool or string", False, 'false | true | "warn"',
                "deterministic algorithms: off, on (error on nondeterministic ops), or warn only"),
        KeySpec("remove_dropout", "bool", False, "false | true",
                "make every dropout a no-op while the debugger runs"),
        KeySpec("scope", "list of string", [], "module-path prefixes such as 'blocks.0'",
                "modules to capture; [] = all"),
        KeySpec("list", "list of string", [], "op names, key substrings, or 're:<regex>'",
                "ops to capture; [] = all"),
        KeySpec("data_mode", "list of string", ["all"], "all | forward | backward | input | output",
                "which phases and directions to record"),
        KeySpec("buffer_mb", "int", 512, f"1 .. {BUFFER_MB_MAX}",
                "MiB of tensor data allowed to wait for the writer (task tensor)"),
        KeySpec("random_on_cpu", "bool", False, "false | true",
                "draw random numbers meant for an accelerator on the CPU generator, then move "
                "them (CPU and GPU runs draw the same numbers; one host-to-device copy per draw)"),
        KeySpec("stop_on_nonfinite", "bool", False, "false | true",
                "raise NonfiniteError at step() after the first step whose records hold NaN/Inf "
                "(the step file is written first)"),
        KeySpec("on_write_error", "string", "raise", "raise | warn",
                "when a step file cannot be written (disk full, ...): raise DumpError at "
                "step(), or warn once and keep training; never raised inside forward/backward"),
        KeySpec("writer", "string", "auto", "auto | process | inline",
                "who writes a statistics/checksum step file: a writer process while the next "
                "step trains (process), step() itself (inline), or process when this process "
                "may use two CPUs or more (auto); task tensor always writes inline"),
        KeySpec("sketch_size", "int", 16, f"0 .. {SKETCH_SIZE_MAX}",
                "numbers per tensor of the random-projection sketch that lets compare measure "
                "errors from a statistics dump; 0 = no sketch"),
        KeySpec("overwrite", "bool", False, "false | true",
                "when dump_path already holds another run's step files: refuse at construction "
                "(false), or remove those files first, whole (true)"),
        KeySpec("fingerprint", "bool", False, "false | true",
                "record at every optimizer step the loss and the statistics and sketch of every "
                "parameter, gradient and optimizer-state tensor to {dump_path}/fingerprints/"
                "rank<R>.h5; with it, step [] captures no step in full"),
        KeySpec("reference", "string", "", "\"\" or the path of a fingerprinted run",
                "compare each step's fingerprint live with this run's (its dump_path, its "
                "fingerprints folder or file); the first step that jumps is captured in full"),
        KeySpec("stop_on_divergence", "bool", False, "false | true",
                "with a reference: step() raises DivergenceError after the first step that "
                "jumped (its full capture is written first)"),
    )
}


def _unknown_key(source: str, name: Any) -> ConfigError:
    hint = _suggest(name, KEYS) or ";"
    shown = repr(name) if isinstance(name, str) else _show(name)
    return ConfigError(f"{source}: unknown key {shown}{hint} valid keys are {', '.join(KEYS)}")


# ---------------------------------------------------------------- the Config


@dataclass(frozen=True)
class Config:
    """A validated probe config. Build with load(), from_dict() or Config(...): all validate."""

    task: str = "statistics"
    dump_path: str = "./probe_dump"
    level: str = "api"
    step: tuple[int, ...] = ()
    rank: tuple[int, ...] = ()
    seed: int = 1234
    mode: bool | str = False
    remove_dropout: bool = False
    scope: tuple[str, ...] = ()
    list: tuple[str, ...] = ()
    data_mode: tuple[str, ...] = ("all",)
    buffer_mb: int = 512
    random_on_cpu: bool = False
    stop_on_nonfinite: bool = False
    on_write_error: str = "raise"
    writer: str = "auto"
    sketch_size: int = 16
    overwrite: bool = False
    fingerprint: bool = False
    reference: str = ""
    stop_on_divergence: bool = False
    source: str = field(default="<defaults>", compare=False)
    _patterns: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        src = self.source if isinstance(self.source, str) else str(self.source)
        values = {
            "task": _choice(src, "task", self.task, TASKS),
            "dump_path": self._dump_path(src),
            "level": _choice(src, "level", self.level, LEVELS),
            "step": _selection(src, "step", self.step),
            "rank": _selection(src, "rank", self.rank),
            "seed": _bounded_int(src, "seed", self.seed, 0, SEED_MAX),
            "mode": _mode(src, self.mode),
            "remove_dropout": self._flag(src, "remove_dropout", self.remove_dropout),
            "scope": _strings(src, "scope", self.scope, "module-path prefixes"),
            "list": _strings(src, "list", self.list, "op names or 're:<regex>'"),
            "data_mode": self._data_mode(src),
            "buffer_mb": _bounded_int(src, "buffer_mb", self.buffer_mb, 1, BUFFER_MB_MAX),
            "random_on_cpu": self._flag(src, "random_on_cpu", self.random_on_cpu),
            "stop_on_nonfinite": self._flag(src, "stop_on_nonfinite", self.stop_on_nonfinite),
            "on_write_error": _choice(src, "on_write_error", self.on_write_error,
                                      WRITE_ERROR_POLICIES),
            "writer": _choice(src, "writer", self.writer, WRITERS),
            "sketch_size": _bounded_int(src, "sketch_size", self.sketch_size, 0, SKETCH_SIZE_MAX),
            "overwrite": self._flag(src, "overwrite", self.overwrite),
            "fingerprint": self._flag(src, "fingerprint", self.fingerprint),
            "reference": self._reference(src),
            "stop_on_divergence": self._flag(src, "stop_on_divergence", self.stop_on_divergence),
            "source": src,
        }
        if values["reference"] and not values["fingerprint"]:
            raise ConfigError(f"{src}: reference is {_show(values['reference'])} but fingerprint is "
                              "false, expected \"fingerprint\": true with a reference (the live "
                              "comparison reads this run's fingerprints)")
        if values["stop_on_divergence"] and not values["reference"]:
            raise ConfigError(f"{src}: stop_on_divergence is true without a reference, expected "
                              "\"reference\": \"<a fingerprinted run>\" (divergence is found "
                              "against it)")
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_patterns", _compile_list(src, values["list"]))

    def _dump_path(self, src: str) -> str:
        value = self.dump_path
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            raise _bad(src, "dump_path", value, "a non-empty path string")
        return value

    def _reference(self, src: str) -> str:
        value = self.reference
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if value is None:
            value = ""
        if not isinstance(value, str) or "\x00" in value:
            raise _bad(src, "reference", value, 'a path string (or "" for none)')
        return value.strip()

    @staticmethod
    def _flag(src: str, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise _bad(src, key, value, "true or false", _yaml_word_hint(value))
        return value

    def _data_mode(self, src: str) -> tuple[str, ...]:
        entries = _strings(src, "data_mode", self.data_mode, "data modes")
        if not entries:
            raise _bad(src, "data_mode", list(entries), 'a non-empty list; use ["all"] for everything')
        single = isinstance(self.data_mode, str)
        for position, entry in enumerate(entries):
            if entry not in DATA_MODES:
                path = "data_mode" if single else f"data_mode[{list(self.data_mode).index(entry)}]"
                allowed = " | ".join(f'"{m}"' for m in DATA_MODES)
                raise _bad(src, path, entry, f"one of {allowed}", _suggest(entry, DATA_MODES))
        return entries

    # ------------------------------------------------------------ public helpers

    def to_dict(self) -> dict[str, Any]:
        """The config keys as a JSON-able dict (tuples become lists); from_dict round-trips it."""
        out: dict[str, Any] = {}
        for name in KEYS:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> "Config":
        """A copy with some keys changed, validated like a fresh load."""
        for name in changes:
            if name not in KEYS and name != "source":
                raise _unknown_key(self.source, name)
        return dataclasses.replace(self, **changes)

    def wants_step(self, step: int) -> bool:
        """Capture this step in full? Every step when ``step`` is [], except with fingerprints
        on: then [] means none (the fingerprints say which step to look at)."""
        if not self.step:
            return not self.fingerprint
        return step in self.step

    def wants_rank(self, rank: int) -> bool:
        return not self.rank or rank in self.rank

    def in_scope(self, module_path: str) -> bool:
        """True when module_path is one of the scope prefixes or below one (dot boundaries)."""
        if not self.scope:
            return True
        return any(module_path == p or module_path.startswith(p + ".") for p in self.scope)

    def matches_list(self, op: str, key: str = "") -> bool:
        """True when op/key is selected by ``list`` (see the module docstring for the rule)."""
        if not self.list:
            return True
        for entry, pattern in zip(self.list, self._patterns):
            if pattern is None:
                if op == entry or (key and entry in key):
                    return True
            elif pattern.search(op) or (key and pattern.search(key)):
                return True
        return False

    def wants_data(self, phase: str, io: str) -> bool:
        """phase "forward"/"backward", io "in"/"out" (or "input"/"output") -> record it?"""
        modes = set(self.data_mode)
        if "all" in modes:
            return True
        phases = modes & {"forward", "backward"}
        directions = modes & {"input", "output"}
        direction = {"in": "input", "out": "output"}.get(io, io)
        return (not phases or phase in phases) and (not directions or direction in directions)


# ---------------------------------------------------------------- loading


def from_dict(data: Any, source: str = "<dict>") -> Config:
    """Validate a mapping of config keys. Unknown keys are errors, with a suggestion."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: the top level is {_type_name(data)}, expected a mapping of keys "
            f"such as {{\"task\": \"statistics\"}}"
        )
    for name in data:
        if name not in KEYS:
            raise _unknown_key(source, name)
    return Config(**dict(data), source=source)


def load(path: str | os.PathLike) -> Config:
    """Read and validate a .json, .yaml or .yml config file."""
    return load_with_keys(path)[0]


def load_with_keys(path: str | os.PathLike) -> tuple[Config, tuple[str, ...]]:
    """load(path), and the keys the file writes (the rest are defaults): what a probe
    command's config lays over a script's own (probe/command_config.py)."""
    path = os.fspath(path)
    shown = path
    extension = os.path.splitext(path)[1].lower()
    if extension not in EXTENSIONS:
        raise ConfigError(
            f"{shown}: unsupported file extension {extension or '(none)'!r}, expected "
            f"{', '.join(EXTENSIONS)}"
        )
    text = _read_text(path)
    if not text.strip():
        raise ConfigError(f"{shown}: the file is empty, expected a mapping of config keys")
    data = _parse_json(shown, text) if extension == ".json" else _parse_yaml(shown, text)
    if data is None:
        raise ConfigError(f"{shown}: the file holds no config (null), expected a mapping of keys")
    return from_dict(data, source=shown), tuple(data)


def from_env(environ: Mapping[str, str] | None = None) -> Config | None:
    """The config ``probe run`` handed down: $PROBE_CONFIG, with $PROBE_SEED overriding its seed.

    None when neither is set; defaults plus the seed when only $PROBE_SEED is set.
    """
    environ = os.environ if environ is None else environ
    path = environ.get(ENV_CONFIG, "")
    seed_text = environ.get(ENV_SEED, "")
    if not path and not seed_text:
        return None
    config = load(path) if path else Config(source=f"${ENV_SEED}")
    if seed_text:
        if not seed_text.strip().isdigit():
            raise _bad(f"${ENV_SEED}", "seed", seed_text, f"an int in 0 .. {SEED_MAX}")
        config = config.replace(seed=int(seed_text))
    return config


def check_dump_path(config: Config) -> None:
    """Raise ConfigError now when dump_path can never be written: an existing file, or a
    folder (or nearest existing parent) where no file can be created. Called by
    PrecisionDebugger(...) and ``probe run -c``, so the mistake surfaces before training,
    not at the first selected step hours later."""
    path = os.path.abspath(config.dump_path)
    where = f"{config.source}: dump_path {_show(config.dump_path)}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{where} is an existing file, expected a folder (or a path to create)")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{where} cannot be created: {existing} is a file, expected a folder")
    import tempfile  # a real probe: access() says yes to root on read-only mounts and /proc

    try:
        handle, probe_file = tempfile.mkstemp(prefix=".probe-write-check-", dir=existing)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(
            f"{where} is not writable: cannot create a file in {existing} ({reason}); "
            "expected a writable folder"
        ) from None
    os.close(handle)
    os.remove(probe_file)


def _read_text(path: str) -> str:
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0  # open() below says what is wrong
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: the config file is {size} bytes, expected at most {MAX_CONFIG_BYTES} "
            "(a config is a few lines of keys; is this the right file?)"
        )
    try:
        with open(path, encoding="utf-8-sig") as handle:
            return handle.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a config file") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied reading the config file") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (bad byte at offset {error.start}), expected a JSON/YAML file"
        ) from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config file ({error.strerror})") from None


def _reject_duplicates(source: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise ConfigError(f"{source}: key {key!r} appears twice, expected each key once")
            result[key] = value
        return result

    return hook


def _parse_json(source: str, text: str) -> Any:
    def no_constant(name: str) -> Any:
        raise ConfigError(f"{source}: {name} is not valid JSON, expected a finite number")

    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates(source),
                          parse_constant=no_constant)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{source}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None


def _parse_yaml(source: str, text: str) -> Any:
    import yaml  # only YAML configs pay for it

    class _StrictLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise ConfigError(
                    f"{source}: key {key!r} appears twice (line {mark.line + 1}, column "
                    f"{mark.column + 1}), expected each key once"
                )
            seen.add(key)
        return loader.construct_mapping(node, deep=True)

    _StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    # YAML 1.1 reads yes/no/on/off (any case) as booleans: `mode: on` would silently mean
    # true. Only true/false are booleans here (YAML 1.2); the rest stay strings, and the
    # key's own check then names the allowed values.
    _StrictLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    _StrictLoader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = error.problem or error.context or "malformed YAML"
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: invalid YAML: {error}") from None


__all__ = [
    "Config", "KeySpec", "KEYS", "load", "load_with_keys", "from_dict", "from_env", "ENV_CONFIG", "ENV_SEED",
    "TASKS", "LEVELS", "MODES", "DATA_MODES", "WRITE_ERROR_POLICIES", "check_dump_path",
]
