"""The import structure of probe/ (docs/architecture.md): read from the source with ast, no
module is imported. Every ``import`` counts, at module level or inside a function."""

import ast
import functools
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "probe")

#: probe's layers, lowest first: a module may import its own layer and the ones below
LAYERS = [
    {"_version", "errors"},
    {"compat", "config", "config_values", "command_config"},
    {"seed"},
    {"dump"},
    {"capture", "perturb", "analysis"},
    {"comparison", "fingerprint"},
    {"report", "replay", "parallel"},
    {"compare_and_replay", "debugger", "autoattach", "integrations"},
    {"commands"},
    {"cli", "__main__", "__init__"},
]

#: the compare pipeline (probe/comparison/), stage by stage: a stage may import its own
#: modules and those of earlier stages, never a later one. "support" is what every stage uses.
COMPARE_STAGES = [
    ("support", {"__init__", "structs", "records", "tolerances", "metrics", "sketch", "result",
                 "envelope", "op_envelopes", "ops"}),
    ("load", {"load", "shards"}),
    ("normalize", {"normalize"}),
    ("align", {"align", "foreach_pairing"}),
    ("measure", {"measure"}),
    ("judge", {"record_rules", "call_rules", "rounding", "judge"}),
    ("result", {"story", "assemble", "summary"}),
    ("orchestration", {"api"}),
]


@functools.cache
def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = "probe." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``: imports made for annotations alone."""
    return {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
            and (getattr(node.test, "id", None) or getattr(node.test, "attr", None)) == "TYPE_CHECKING"
            for statement in node.body for inner in ast.walk(statement)}


@functools.cache
def _imports(annotations: bool = False) -> dict[str, set[str]]:
    """module -> the probe modules it imports (a name imported from a package counts as the
    submodule when there is one of that name, else as the package). annotations: only the
    imports made under ``if TYPE_CHECKING:`` (for annotations; never run), instead of the rest."""
    modules, graph = _modules(), {}
    for module, tree in _trees().items():
        path = modules[module]
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        targets = set()
        typing_only = _type_checking_only(tree)
        for node in ast.walk(tree):
            if (id(node) in typing_only) != annotations:
                continue
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


# The source is parsed when a test first asks (not when the file is collected: every test
# process of a parallel run collects every file, and only one runs these tests).


def _graph() -> dict[str, set[str]]:
    return _imports()


def _annotation_graph() -> dict[str, set[str]]:
    """The imports made for annotations only: they may close a circle (never run), not cross a
    layer or stage."""
    return _imports(annotations=True)


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
    for module, targets in _graph().items():
        graph.setdefault(_top(module), set()).update(_top(t) for t in targets if _top(t) != _top(module))
    return graph


def test_the_walk_sees_the_compare_pipeline_imports():
    # the walk itself: a test that reads no edge would pass whatever the code does
    assert "probe.comparison.judge" in _graph()["probe.comparison.api"]
    assert "probe.comparison.result" in _graph()["probe.report.terminal"]


def test_no_module_of_probe_imports_itself_back_through_others():
    circle = _cycle(_graph())
    assert not circle, "import circle: " + " -> ".join(circle)


def test_no_package_of_probe_imports_itself_back_through_others():
    circle = _cycle(_package_graph())
    assert not circle, "package import circle: " + " -> ".join(circle)


def test_no_module_imports_from_a_higher_layer():
    wrong = [f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
             for graph in (_graph(), _annotation_graph())
             for module, targets in sorted(graph.items()) for target in sorted(targets)
             if _layer(target) > _layer(module)]
    assert not wrong, "\n".join(wrong)


def test_compare_stages_import_only_earlier_stages():
    inside = {m: {t for graph in (_graph(), _annotation_graph()) for t in graph[m] if t.startswith("probe.comparison")}
              for m in _graph() if m.startswith("probe.comparison")}
    wrong = [f"{module} ({COMPARE_STAGES[_stage(module)][0]}) imports {target} ({COMPARE_STAGES[_stage(target)][0]})"
             for module, targets in sorted(inside.items()) for target in sorted(targets)
             if _stage(target) > _stage(module)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("lower, higher", [("comparison", "report"), ("comparison", "replay"),
                                           ("report", "replay"), ("capture", "comparison")])
def test_lower_layers_never_reach_the_higher_one(lower, higher):
    """result.py renders nothing and the compare never runs the replay: the renderers and
    the replay import the comparison, not the reverse."""
    reached = sorted(f"{m} -> {t}" for m, targets in _graph().items() if _top(m) == lower
                     for t in targets if _top(t) == higher)
    assert not reached, reached


#: private names of the standard library probe may use (sys._getframe: the caller's frame,
#: cheaper than inspect's; a namedtuple's _fields)
STDLIB_PRIVATE = {"_getframe", "_fields"}


@functools.cache
def _trees() -> dict[str, ast.AST]:
    trees = {}
    for module, path in _modules().items():
        with open(path, encoding="utf-8") as handle:
            trees[module] = ast.parse(handle.read(), path)
    return trees



def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _probe_private_names() -> set[str]:
    """Every private name probe itself defines: functions, classes, variables, attributes
    it sets (``self._x = ...``) and slot names."""
    names = set()
    for module, tree in _trees().items():
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
    for module, tree in _trees().items():
        imported_modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("probe"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in _modules():
                        imported_modules[alias.asname or alias.name] = full
                    elif _private(alias.name) and node.module != module:
                        wrong.append(f"{module}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in _modules() and alias.asname:
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
    for module, tree in _trees().items():
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
    reached = sorted(f"{m} -> {t}" for m, targets in _graph().items() if m.startswith(f"probe.capture.{wing}.")
                     for t in targets if t.split(".")[2:3] and t.split(".")[2] in never)
    assert not reached, reached


@pytest.mark.parametrize("module", ["judge", "record_rules", "call_rules", "story", "assemble"])
def test_no_stage_after_measure_reads_a_record_column(module):
    """The judge and result stages read Measurements and rows, never the records: what they
    need of a record measure read once (docs/architecture.md). The float64 recheck in
    rounding.py is the named exception: it replays an op from the dumped tensors."""
    import re

    with open(os.path.join(ROOT, "comparison", f"{module}.py"), encoding="utf-8") as handle:
        reads = re.findall(r"columns\[|cols(?:_a|_b)?\[", handle.read())
    assert not reads, f"comparison/{module}.py reads record columns {len(reads)} times"


# ---------------------------------------------------------------------------- the figures a merge must keep

#: how many modules the compare pipeline may have (probe/comparison/, its __init__ aside); 23
#: since a unit's summary (summary.py) left api.py, which had held it beside the orchestration
COMPARISON_MODULES = 23
#: the longest a module of probe may be
MODULE_LINES = 520


def test_the_compare_pipeline_has_at_most_23_modules():
    modules = _modules()
    found = sorted(m for m in modules if m.startswith("probe.comparison.") and not modules[m].endswith("__init__.py"))
    assert len(found) <= COMPARISON_MODULES, f"{len(found)} modules: {found}"


def test_no_module_of_probe_is_over_520_lines():
    long = {}
    for module, path in _modules().items():
        with open(path, encoding="utf-8") as handle:
            lines = sum(1 for _ in handle)
        if lines > MODULE_LINES:
            long[module] = lines
    assert not long, long


def _function(module: str, name: str) -> ast.FunctionDef:
    return next(node for node in ast.walk(_trees()[module]) if isinstance(node, ast.FunctionDef) and node.name == name)


def test_compare_step_takes_at_most_4_parameters():
    """What a pair of step files is compared with: its StepInput, the tolerances in force
    (strict included), the name mapping and what the rank's previous step file carries."""
    arguments = _function("probe.comparison.api", "compare_step").args
    count = len(arguments.posonlyargs + arguments.args + arguments.kwonlyargs)
    assert count <= 4, [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]


def test_op_summaries_are_made_once_and_never_written_by_hand():
    """An op summary is frozen, made in one place (result.summarize_call, after the last rule)
    and never copied with another origin or diverged flag inside the compare or its reports
    (the float64 replay, a later stage with its own evidence, is the one that may)."""
    summary = next(node for node in ast.walk(_trees()["probe.comparison.result"])
                   if isinstance(node, ast.ClassDef) and node.name == "OpSummary")
    assert any(isinstance(d, ast.Call) and any(k.arg == "frozen" and getattr(k.value, "value", False) for k in d.keywords)
               for d in summary.decorator_list), "OpSummary must be a frozen dataclass"
    made, rewritten = [], []
    for module, tree in _trees().items():
        if not module.startswith(("probe.comparison", "probe.report")):
            continue
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(function):
                if not isinstance(node, ast.Call):
                    continue
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name == "OpSummary":
                    made.append(f"{module}.{function.name}")
                if name == "replace" and {k.arg for k in node.keywords} & {"origin", "diverged", "introduced"}:
                    rewritten.append(f"{module}.{function.name}")
    assert made == ["probe.comparison.result.summarize_call"], made
    assert not rewritten, rewritten


#: words that name an op and also a dtype, a statistic or a field: not op knowledge
NOT_OP_NAMES = {"mean", "where", "float", "half", "double", "bfloat16"}
#: how ops are spelled (ops.op_name undoes it)
OP_SPELLINGS = ("torch._foreach_", "torch._fused_", "_foreach_", "_fused_", "distributed.", "ops._c10d")


def _op_names() -> set[str]:
    """Every op name comparison/ops.py keeps a spec or an alias under (read from its source)."""
    names = set()
    for node in ast.walk(_trees()["probe.comparison.ops"]):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_specs":
            names.update(node.args[1].value.split())
        elif isinstance(node, ast.Dict):
            names.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return names - {"", None}


def test_what_compare_knows_of_an_op_is_in_ops_py_alone():
    """One spec per op (envelope family, amplifies, sums, float64 replay) and one name
    normalizer: no other module of the compare spells an op's name or how it is spelled."""
    names = _op_names()
    assert {"linear", "addcdiv", "sum", "sqrt", "vector_norm"} <= names  # the walk reads the table
    found = []
    for module, tree in _trees().items():
        if not module.startswith("probe.comparison.") or module == "probe.comparison.ops":
            continue
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and ((node.value in names and node.value not in NOT_OP_NAMES) or node.value.startswith(OP_SPELLINGS)):
                found.append(f"{module}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)


def test_nothing_outside_capture_imports_its_wings():
    """Code outside probe/capture reaches capture through its face (probe/capture/__init__.py),
    never through eager/, compiled/ or numbers/: one place says what capture offers."""
    wings = ("probe.capture.eager", "probe.capture.compiled", "probe.capture.numbers")
    reached = sorted(f"{module} -> {target}" for module, targets in _graph().items()
                     if not module.startswith("probe.capture")
                     for target in targets if target.startswith(wings))
    assert not reached, reached
