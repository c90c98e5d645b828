"""A box never imports a later box (CONTRIBUTING.md): checked on every import statement."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "consequence"
LAYERS = [
    {"records", "seeding", "figures", "config", "fileio"},
    {"tasks"},
    {"envs"},
    {"policy"},
    {"harness"},
    {"rollout"},
    {"serve"},
    {"reward"},
    {"credit"},
    {"update"},
    {"evaluate"},
    {"distill"},
    {"iteration", "checks", "diagnostics", "resume"},
    {"scale"},
    {"recipes"},
    {"report", "labs"},
    {"train", "warmstart", "reproduce"},
    {"coldstart"},
    {"cli", "api", "__init__", "assets"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _unit(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0].removesuffix(".py")


def test_every_module_belongs_to_a_layer():
    units = {_unit(p) for p in PKG.rglob("*.py")}
    assert units <= set(RANK), f"add to LAYERS in tests/test_layout.py and CONTRIBUTING.md: {units - set(RANK)}"


def test_no_box_imports_a_later_box():
    bad = []
    for path in PKG.rglob("*.py"):
        me = _unit(path)
        for node in ast.walk(ast.parse(path.read_text())):
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
    for path in (PKG / "envs").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or path.stem == "api":
                continue
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            if any(b.endswith("Environment") for b in bases) or {"reset", "step"} <= methods:
                found.add(f"consequence.envs.{path.stem}")
    return found


def test_environment_modules_are_found():
    """Negative control of the rule below: the built-ins are recognised as environments."""
    mods = _environment_modules()
    assert {"consequence.envs.repair_env", "consequence.envs.repair_tasks", "consequence.envs.completion_env"} <= mods
    assert "consequence.envs.sandbox" not in mods and "consequence.envs.registry" not in mods


def test_no_module_outside_envs_imports_a_specific_environment():
    """Environments are plug-ins: the loop reaches them only through envs.api / envs.registry."""
    envs = _environment_modules()
    bad = []
    for path in PKG.rglob("*.py"):
        if _unit(path) == "envs":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad += [f"{path.relative_to(PKG)} imports {n}" for n in names if n in envs]
    assert not bad, "\n".join(bad)
