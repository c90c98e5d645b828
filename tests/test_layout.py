"""A box never imports a later box (CONTRIBUTING.md): checked on every import statement."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "consequence"
LAYERS = [
    {"records", "seeding", "figures", "config", "fileio"},
    {"tasks"}, {"envs"}, {"policy"}, {"harness"}, {"rollout"}, {"reward"}, {"credit"}, {"update"},
    {"evaluate"}, {"distill"},
    {"iteration", "checks", "diagnostics", "resume"},
    {"recipes"},
    {"report", "labs"},
    {"train", "warmstart", "reproduce"},
    {"cli", "__init__", "assets"},
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
