"""The import structure of probe/ (docs/architecture.md): read from the source with ast, no
module is imported. Every ``import`` counts, at module level or inside a function."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "probe")

#: probe's layers, lowest first: a module may import its own layer and the ones below
LAYERS = [
    {"_version", "errors"},
    {"compat", "config", "config_values"},
    {"seed"},
    {"dump"},
    {"capture", "perturb", "analysis"},
    {"comparison", "fingerprint"},
    {"report", "replay"},
    {"compare_and_replay", "debugger", "autoattach", "integrations"},
    {"commands"},
    {"cli", "__main__", "__init__"},
]

#: the compare pipeline (probe/comparison/), stage by stage: a stage may import its own
#: modules and those of earlier stages, never a later one. "support" is what every stage uses.
COMPARE_STAGES = [
    ("support", {"__init__", "structs", "records", "mapping", "tolerances", "metrics", "sketch", "result",
                 "envelope"}),
    ("load", {"load", "shards", "rank_blocks"}),
    ("normalize", {"normalize"}),
    ("align", {"align", "foreach_pairing"}),
    ("measure", {"measure"}),
    ("judge", {"record_rules", "call_rules", "recheck", "rounding", "judge"}),
    ("attribute", {"attribute"}),
    ("result", {"envelope_summary", "drift_rounding", "shard_entry", "assemble"}),
    ("orchestration", {"engine", "api"}),
]


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = "probe." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _imports(modules: dict[str, str]) -> dict[str, set[str]]:
    """module -> the probe modules it imports (a name imported from a package counts as the
    submodule when there is one of that name, else as the package)."""
    graph = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        targets = set()
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name.split(".")[0] == "probe"}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != "probe":
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else base)
        graph[module] = {target for target in targets if target in modules and target != module}
    return graph


MODULES = _modules()
GRAPH = _imports(MODULES)


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(module: str) -> int:
    top = _top(module)
    for number, names in enumerate(LAYERS):
        if top in names:
            return number
    raise AssertionError(f"{module}: add probe/{top} to a layer in tests/test_architecture.py LAYERS")


def _stage(module: str) -> int:
    name = module.split(".")[2] if module.count(".") >= 2 else "__init__"
    for number, (_, names) in enumerate(COMPARE_STAGES):
        if name in names:
            return number
    raise AssertionError(f"{module}: add it to a stage in tests/test_architecture.py COMPARE_STAGES")


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle, as the modules around it; [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        graph.setdefault(_top(module), set()).update(_top(t) for t in targets if _top(t) != _top(module))
    return graph


def test_the_walk_sees_the_compare_pipeline_imports():
    # the walk itself: a test that reads no edge would pass whatever the code does
    assert "probe.comparison.judge" in GRAPH["probe.comparison.engine"]
    assert "probe.comparison.result" in GRAPH["probe.report.terminal"]


def test_no_module_of_probe_imports_itself_back_through_others():
    circle = _cycle(GRAPH)
    assert not circle, "import circle: " + " -> ".join(circle)


def test_no_package_of_probe_imports_itself_back_through_others():
    circle = _cycle(_package_graph())
    assert not circle, "package import circle: " + " -> ".join(circle)


def test_no_module_imports_from_a_higher_layer():
    wrong = [f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
             for module, targets in sorted(GRAPH.items()) for target in sorted(targets)
             if _layer(target) > _layer(module)]
    assert not wrong, "\n".join(wrong)


def test_compare_stages_import_only_earlier_stages():
    inside = {m: {t for t in targets if t.startswith("probe.comparison")}
              for m, targets in GRAPH.items() if m.startswith("probe.comparison")}
    wrong = [f"{module} ({COMPARE_STAGES[_stage(module)][0]}) imports {target} ({COMPARE_STAGES[_stage(target)][0]})"
             for module, targets in sorted(inside.items()) for target in sorted(targets)
             if _stage(target) > _stage(module)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("lower, higher", [("comparison", "report"), ("comparison", "replay"),
                                           ("report", "replay"), ("capture", "comparison")])
def test_lower_layers_never_reach_the_higher_one(lower, higher):
    """result.py renders nothing and the compare never runs the replay: the renderers and
    the replay import the comparison, not the reverse."""
    reached = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if _top(m) == lower
                     for t in targets if _top(t) == higher)
    assert not reached, reached


#: private names of the standard library probe may use (sys._getframe: the caller's frame,
#: cheaper than inspect's; a namedtuple's _fields)
STDLIB_PRIVATE = {"_getframe", "_fields"}


def _trees() -> dict[str, ast.AST]:
    trees = {}
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as handle:
            trees[module] = ast.parse(handle.read(), path)
    return trees


TREES = _trees()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _probe_private_names() -> set[str]:
    """Every private name probe itself defines: functions, classes, variables, attributes
    it sets (``self._x = ...``) and slot names."""
    names = set()
    for module, tree in TREES.items():
        if module == "probe.compat":  # what compat names is torch's
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                      for t in node.targets):
                names.update(e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant))
    return {name for name in names if _private(name)}


def test_no_module_imports_or_reads_another_modules_private_names():
    wrong = []
    for module, tree in TREES.items():
        imported_modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("probe"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in MODULES:
                        imported_modules[alias.asname or alias.name] = full
                    elif _private(alias.name) and node.module != module:
                        wrong.append(f"{module}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in MODULES and alias.asname:
                        imported_modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in imported_modules):
                wrong.append(f"{module}: {imported_modules[node.value.id]}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_private_torch_api_is_used_in_compat_only():
    """probe/compat/ is the one place that names torch's private API: a new torch release is
    checked there. Elsewhere a private attribute must be one probe defines itself."""
    own = _probe_private_names() | STDLIB_PRIVATE
    wrong = []
    for module, tree in TREES.items():
        if module == "probe.compat":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("probe"):
                named = node.module.split(".") + [alias.name for alias in node.names]
                wrong += [f"{module}: from {node.module} import ..." for part in named[:1]
                          if any(_private(p) for p in named)]
            elif isinstance(node, ast.Import):
                wrong += [f"{module}: import {alias.name}" for alias in node.names
                          if any(_private(p) for p in alias.name.split("."))]
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                wrong.append(f"{module}:{node.lineno}: .{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value) and not node.args[1].value.startswith("_probe")
                  and node.args[1].value not in STDLIB_PRIVATE):
                wrong.append(f"{module}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    assert not wrong, "\n".join(wrong)


def test_the_root_of_probe_shows_the_layers_in_at_most_nine_files():
    files = sorted(name for name in os.listdir(ROOT) if name.endswith(".py"))
    assert len(files) <= 9, files


@pytest.mark.parametrize("wing, never", [("eager", {"compiled"}), ("numbers", {"eager", "compiled", "recorder"})])
def test_capture_wings_import_one_way(wing, never):
    """compiled/ names its calls with eager/'s naming; eager/ never needs compiled/, and
    numbers/ turns tensors into numbers without knowing who asked (docs/architecture.md)."""
    reached = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if m.startswith(f"probe.capture.{wing}.")
                     for t in targets if t.split(".")[2:3] and t.split(".")[2] in never)
    assert not reached, reached


@pytest.mark.parametrize("module", ["judge", "record_rules", "call_rules", "attribute", "assemble"])
def test_no_stage_after_measure_reads_a_record_column(module):
    """The judge, attribute and assemble stages read Measurements and rows, never the records:
    what they need of a record measure read once (docs/architecture.md). recheck.py, the
    amplification recheck, is the named exception: it replays an op from the dumped tensors."""
    import re

    with open(os.path.join(ROOT, "comparison", f"{module}.py"), encoding="utf-8") as handle:
        reads = re.findall(r"columns\[|cols(?:_a|_b)?\[", handle.read())
    assert not reads, f"comparison/{module}.py reads record columns {len(reads)} times"


def test_nothing_outside_capture_imports_its_wings():
    """Code outside probe/capture reaches capture through its face (probe/capture/__init__.py),
    never through eager/, compiled/ or numbers/: one place says what capture offers."""
    wings = ("probe.capture.eager", "probe.capture.compiled", "probe.capture.numbers")
    reached = sorted(f"{module} -> {target}" for module, targets in GRAPH.items()
                     if not module.startswith("probe.capture")
                     for target in targets if target.startswith(wings))
    assert not reached, reached
