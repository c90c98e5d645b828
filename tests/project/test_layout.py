"""A box never imports a later box (CONTRIBUTING.md): checked on every import statement."""

import ast
import functools
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "consequence"
LAYERS = [
    {"records", "seeding", "figures", "config", "fileio", "exports"},
    {"sandbox"},
    {"envs"},
    {"policy"},
    {"harness"},
    {"reward"},
    {"rollout"},
    {"serve"},
    {"credit"},
    {"update"},
    {"evaluate"},
    {"distill"},
    {"scale"},
    {"recipes"},
    {"report", "labs"},
    {"loop", "reproduce"},
    {"experiment"},
    {"cli", "api", "__init__", "__main__", "assets"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once per process for all the checks below."""
    return ast.parse(path.read_text())


def _unit(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0].removesuffix(".py")


def test_every_module_belongs_to_a_layer():
    units = {_unit(p) for p in PKG.rglob("*.py")}
    assert units <= set(RANK), f"add to LAYERS in tests/project/test_layout.py and CONTRIBUTING.md: {units - set(RANK)}"


def test_no_box_imports_a_later_box():
    bad = []
    for path in PKG.rglob("*.py"):
        me = _unit(path)
        for node in ast.walk(_parsed(path)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "consequence" and len(parts) > 1 and RANK.get(parts[1], -1) > RANK[me]:
                    bad.append(f"{path.relative_to(PKG)} imports {name}")
    assert not bad, "\n".join(bad)


def _environment_modules() -> set[str]:
    """Modules of consequence/envs/ that define an environment: a subclass of Environment,
    or an episode class (one with both ``reset`` and ``step``)."""
    found = set()
    for path in (PKG / "envs").rglob("*.py"):
        for node in ast.walk(_parsed(path)):
            if not isinstance(node, ast.ClassDef) or path.stem == "api":
                continue
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            if any(b.endswith("Environment") for b in bases) or {"reset", "step"} <= methods:
                found.add("consequence." + ".".join(path.relative_to(PKG).with_suffix("").parts))
    return found


def test_environment_modules_are_found():
    """Negative control of the rule below: the built-ins are recognised as environments."""
    mods = _environment_modules()
    assert {"consequence.envs.repair.env", "consequence.envs.repair.tasks", "consequence.envs.humaneval.env"} <= mods
    assert "consequence.sandbox.sandbox" not in mods and "consequence.envs.registry" not in mods


def test_no_module_outside_envs_imports_a_specific_environment():
    """Environments are plug-ins: the loop reaches them only through envs.api / envs.registry."""
    envs = _environment_modules()
    bad = []
    for path in PKG.rglob("*.py"):
        if _unit(path) == "envs":
            continue
        for node in ast.walk(_parsed(path)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad += [f"{path.relative_to(PKG)} imports {n}" for n in names if n in envs]
    assert not bad, "\n".join(bad)


# ---- import cycles ---------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    """``consequence/policy/tiny.py`` -> ``consequence.policy.tiny``; a package's ``__init__.py``
    is the package."""
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"


def _import_nodes(body: list[ast.stmt], in_functions: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when these statements run: those of nested blocks
    (``try``, ``if``, ``with``, class bodies) too, never those of an ``if TYPE_CHECKING:`` body;
    those inside functions only with ``in_functions`` (they run at call time)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not in_functions:
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            found += _import_nodes(node.orelse, in_functions)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    found += _import_nodes([child], in_functions)
                elif isinstance(child, ast.ExceptHandler | ast.match_case):
                    found += _import_nodes(child.body, in_functions)
    return found


def _imported_modules(name: str, tree: ast.Module, is_package: bool, modules, in_functions: bool) -> set[str]:
    """The modules of ``modules`` that module ``name`` (parsed: ``tree``) imports: ``from P import x``
    is P.x when that is a module, else P; relative imports are resolved against ``name``'s package."""
    out = set()
    for node in _import_nodes(tree.body, in_functions):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            src = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                src = ".".join(package[: len(package) - node.level + 1] + ([src] if src else []))
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
        out |= {t for t in targets if t in modules and t != name}
    return out


def _import_graph(in_functions: bool) -> dict[str, set[str]]:
    return {
        name: _imported_modules(name, _parsed(path), path.name == "__init__.py", MODULES, in_functions)
        for name, path in MODULES.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected component of more than one module
    (Tarjan 1972), starting at its first module in sorted order; [] for an acyclic graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:  # v is the root of a component: the stack above it is the rest
            component = {v}
            while (w := stack.pop()) != v:
                component.add(w)
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # shortest way back to the start inside its component (BFS)
        start = min(component)
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:
            reached = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in came_from:
                        came_from[w] = v
                        reached.append(w)
            frontier = reached
        path, v = [start], came_from[start]
        while v != start:
            path.append(v)
            v = came_from[v]
        cycles.append([start, *reversed(path[1:]), start])
    return sorted(cycles)


def test_cycle_finder_and_import_reader_negative_controls():
    """The checks below can fail: a hand-made cycle is found and reported in order, and the
    reader sees exactly the imports that run at import time (or at call time too)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert _cycles({"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"p"}}) == [["p", "q", "p"], ["x", "y", "x"]]
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.sub", "pkg.sub.e"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import pkg.a\n"
        "from . import b\n"
        "from .. import d\n"
        "from pkg.c import some_name\n"
        "try:\n    import pkg.sub.e\nexcept ImportError:\n    pass\n"
        "if TYPE_CHECKING:\n    import pkg.d\n"
        "def f():\n    from pkg import c\n"
    )
    tree = ast.parse(source)
    at_import = _imported_modules("pkg.sub.mod", tree, False, modules, in_functions=False)
    assert at_import == {"pkg.a", "pkg.sub", "pkg.d", "pkg.c", "pkg.sub.e"}  # `from . import b`: pkg.sub.b is no module
    assert _imported_modules("pkg.sub.mod", tree, False, modules, in_functions=True) == at_import  # pkg.c already in
    deferred = ast.parse("def f():\n    import pkg.b\n")
    assert _imported_modules("pkg.m", deferred, False, modules, in_functions=True) == {"pkg.b"}
    assert _imported_modules("pkg.m", deferred, False, modules, in_functions=False) == set()


def test_no_import_cycle_among_the_modules_at_import_time():
    """No two modules import each other, directly or through others, when they are imported
    (module-level imports; ``if TYPE_CHECKING:`` blocks are never run)."""
    assert _import_graph(in_functions=False)["consequence.policy.tiny"] == {"consequence.policy.checkpoint"}
    cycles = _cycles(_import_graph(in_functions=False))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_cycle_among_the_modules_counting_imports_inside_functions():
    """Nor through the imports inside functions (deferred to keep `import consequence` light):
    such a cycle still ties two modules into one (policy.lora <-> policy.tiny did, until their
    checkpoint code moved into policy.checkpoint)."""
    cycles = _cycles(_import_graph(in_functions=True))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _names_used(module: str, function: str) -> set[str]:
    """Every name (and attribute name) read inside ``function`` of ``consequence/<module>.py``."""
    tree = _parsed(PKG / f"{module}.py")
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
    }


def test_the_algorithm_is_three_calls_from_the_loop():
    """Issue 31: the GRPO advantage and the PPO surrogate are each reachable within 3 calls of
    the loop (docs/design.md §1), so a reader follows the algorithm without the wiring."""
    chains = {
        "GRPO advantage": [
            ("loop/train", "run_loop", "credit"),
            ("loop/learner", "credit", "assign_credit"),
            ("credit/batch", "assign_credit", "group_advantages"),
        ],
        "PPO surrogate": [
            ("loop/train", "run_loop", "update"),
            ("loop/learner", "update", "ppo_step"),
            ("update/step", "ppo_step", "surrogate_objective"),
        ],
    }
    for what, chain in chains.items():
        for module, caller, callee in chain:
            assert callee in _names_used(module, caller), f"{what}: {module}.{caller} no longer calls {callee}"
    assert "surrogate_objective" not in _names_used("loop/learner", "update")  # the negative control
