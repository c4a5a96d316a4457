"""Name mapping for ports whose module paths or op names differ (``--mapping map.yaml``).

    modules:
      encoder.layer: model.layers        # module-path prefix in one run: prefix in the other
    ops:
      npu_fusion_attention: functional.scaled_dot_product_attention

Module prefixes match on dot boundaries ("encoder.layer" matches "encoder.layer.3.attn",
not "encoder.layers"); the longest matching prefix wins. An op key matches an op name
exactly, or, when the key has no dot, the op name's last dotted part
("npu_fusion_attention" matches "torch_npu.npu_fusion_attention").

The renames apply to both dumps before alignment, so the file works whichever run is A.
They only decide which calls pair up; reports show each run's own names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from probe.errors import CompareError

ALLOWED_KEYS = ("modules", "ops")


@dataclass(frozen=True)
class NameMapping:
    modules: tuple[tuple[str, str], ...] = ()  # (prefix, replacement), longest prefix first
    ops: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.modules or self.ops)

    def module(self, path: str) -> str:
        for prefix, replacement in self.modules:
            if prefix == "":
                return f"{replacement}.{path}" if path else replacement
            if path == prefix:
                return replacement
            if path.startswith(prefix + "."):
                return replacement + path[len(prefix):]
        return path

    def op(self, name: str) -> str:
        if name in self.ops:
            return self.ops[name]
        last = name.rsplit(".", 1)[-1]
        if last != name and last in self.ops and "." not in last:
            return self.ops[last]
        return name

    def rename(self, module: str, op: str) -> tuple[str, str]:
        return self.module(module), self.op(op)

    def to_dict(self) -> dict:
        return {"modules": dict(self.modules), "ops": dict(self.ops)}


def mapping_from_dict(data, where: str = "mapping") -> NameMapping:
    """Validate the parsed YAML/dict form; raise CompareError naming the bad entry."""
    if data is None:
        return NameMapping()
    if not isinstance(data, dict):
        raise CompareError(f"{where} must be a mapping with keys {' and '.join(ALLOWED_KEYS)}, found {type(data).__name__}")
    unknown = [key for key in data if key not in ALLOWED_KEYS]
    if unknown:
        raise CompareError(f"{where} has unknown key {unknown[0]!r}; allowed keys: {', '.join(ALLOWED_KEYS)}")
    modules = _string_map(data.get("modules"), f"{where} modules")
    ops = _string_map(data.get("ops"), f"{where} ops")
    for name in ops:
        if name == "":
            raise CompareError(f"{where} ops has an empty op name")
    ordered = tuple(sorted(modules.items(), key=lambda item: len(item[0]), reverse=True))
    return NameMapping(modules=ordered, ops=ops)


def _string_map(value, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CompareError(f"{where} must map names to names, found {type(value).__name__}")
    result = {}
    for key, target in value.items():
        if key is None:
            key = ""
        if not isinstance(key, str) or not isinstance(target, str):
            raise CompareError(f"{where} entry {key!r}: {target!r} must map a string to a string")
        result[key] = target
    return result


def load_mapping(path: str) -> NameMapping:
    """Read a mapping YAML file; every problem is one CompareError sentence."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise CompareError(f"mapping file {path} does not exist") from None
    except IsADirectoryError:
        raise CompareError(f"mapping file {path} is a folder, expected a YAML file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise CompareError(f"mapping file {path} cannot be read: {getattr(error, 'strerror', None) or error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise CompareError(f"mapping file {path} is not valid YAML{where}") from None
    if data is None:
        raise CompareError(f"mapping file {path} is empty; expected keys {' and '.join(ALLOWED_KEYS)}")
    return mapping_from_dict(data, f"mapping file {path}")
