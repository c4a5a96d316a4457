"""The value checks behind probe.config: each normalises one kind of config value or raises
ConfigError naming the file, the key path (``step[2]``), the value found and what is allowed.
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any, Iterable

from probe.errors import ConfigError

INDEX_MAX = 2**31 - 1
#: step/rank ranges expand to at most this many numbers, so "0-999999999999" cannot eat memory.
MAX_SELECTED = 1_000_000
REGEX_PREFIX = "re:"


def show(value: Any) -> str:
    """A value as the user wrote it in JSON/YAML (true, "x", [1, 2]), falling back to repr."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "mapping"
    return {int: "int", float: "float", str: "string"}.get(type(value), type(value).__name__)


def suggest(word: Any, choices: Iterable[str]) -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def bad(source: str, path: str, value: Any, allowed: str, hint: str = "") -> ConfigError:
    kind = "" if value is None else f" ({type_name(value)})"
    return ConfigError(f"{source}: {path} is {show(value)}{kind}, expected {allowed}{hint}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def choice(source: str, path: str, value: Any, choices: tuple[str, ...]) -> str:
    allowed = " | ".join(f'"{c}"' for c in choices)
    if not isinstance(value, str):
        raise bad(source, path, value, f"a string, one of {allowed}")
    if value not in choices:
        raise bad(source, path, value, f"one of {allowed}", suggest(value, choices))
    return value


def bounded_int(source: str, path: str, value: Any, low: int, high: int) -> int:
    if not is_int(value):
        raise bad(source, path, value, f"an int in {low} .. {high}")
    if not low <= value <= high:
        raise bad(source, path, value, f"an int in {low} .. {high}")
    return value


_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def selection(source: str, key: str, value: Any) -> tuple[int, ...]:
    """step/rank: ints and inclusive 'a-b' strings -> sorted unique ints."""
    allowed = f"an int in 0 .. {INDEX_MAX} or an inclusive range string like \"0-3\""
    if value is None:
        raise bad(source, key, value, "a list of ints or ranges ([] = all)")
    items = value if isinstance(value, (list, tuple)) else [value]
    single = not isinstance(value, (list, tuple))
    chosen: set[int] = set()
    for position, item in enumerate(items):
        path = key if single else f"{key}[{position}]"
        if is_int(item):
            chosen.add(bounded_int(source, path, item, 0, INDEX_MAX))
        elif isinstance(item, str) and item.strip().isdigit():
            chosen.add(bounded_int(source, path, int(item), 0, INDEX_MAX))
        elif isinstance(item, str) and _RANGE.match(item):
            first, last = (int(g) for g in _RANGE.match(item).groups())
            if last > INDEX_MAX:
                raise bad(source, path, item, f"range ends in 0 .. {INDEX_MAX}")
            if first > last:
                raise bad(source, path, item, f"a range 'a-b' with a <= b, e.g. \"{last}-{first}\"")
            if len(chosen) + (last - first + 1) > MAX_SELECTED:
                raise bad(source, path, item, f"ranges selecting at most {MAX_SELECTED} numbers in all")
            chosen.update(range(first, last + 1))
        else:
            raise bad(source, path, item, allowed)
        if len(chosen) > MAX_SELECTED:
            raise bad(source, path, item, f"at most {MAX_SELECTED} numbers in all")
    return tuple(sorted(chosen))


def strings(source: str, key: str, value: Any, what: str) -> tuple[str, ...]:
    """A string or list of non-empty strings -> tuple of unique strings in the order given."""
    if value is None:
        raise bad(source, key, value, f"a list of {what}")
    single = isinstance(value, str)
    items = [value] if single else value
    if not isinstance(items, (list, tuple)):
        raise bad(source, key, value, f"a list of {what}")
    result: list[str] = []
    for position, item in enumerate(items):
        path = key if single else f"{key}[{position}]"
        if not isinstance(item, str):
            raise bad(source, path, item, f"a string ({what})")
        if not item.strip():
            raise bad(source, path, item, f"a non-empty string ({what}); use [] to select all")
        if item not in result:
            result.append(item)
    return tuple(result)


def mode_flag(source: str, value: Any) -> bool | str:
    if value is True or value is False or value == "warn" and isinstance(value, str):
        return value
    hint = suggest(value, ["warn", "true", "false"]) if isinstance(value, str) else ""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        hint = f"; write {value.lower()} without quotes"
    raise bad(source, "mode", value, 'false, true or "warn"', hint or yaml_word_hint(value))


def yaml_word_hint(value: Any) -> str:
    if isinstance(value, str) and value.lower() in ("yes", "no", "on", "off", "y", "n"):
        return " (yes/no/on/off are not booleans in a probe config: write true or false)"
    return ""


def compile_list(source: str, entries: tuple[str, ...]) -> tuple[re.Pattern | None, ...]:
    patterns: list[re.Pattern | None] = []
    for position, entry in enumerate(entries):
        if not entry.startswith(REGEX_PREFIX):
            patterns.append(None)
            continue
        try:
            patterns.append(re.compile(entry[len(REGEX_PREFIX):]))
        except re.error as error:
            raise bad(source, f"list[{position}]", entry,
                       f"a valid regular expression after 're:' ({error})") from None
    return tuple(patterns)
