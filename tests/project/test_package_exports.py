"""Each box's ``__init__`` exports what it offers (lazily: importing a package stays cheap):
every name in ``__all__`` resolves to the object of its module, and none shadows a submodule."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

BOXES = ["sandbox", "envs", "policy", "harness", "reward", "rollout", "credit", "update", "distill", "report", "loop"]


@pytest.mark.parametrize("box", BOXES)
def test_every_export_resolves_and_shadows_no_submodule(box):
    pkg = importlib.import_module(f"consequence.{box}")
    submodules = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    assert pkg.__all__ and not set(pkg.__all__) & submodules
    for name in pkg.__all__:
        obj = getattr(pkg, name)
        assert getattr(importlib.import_module(obj.__module__), name) is obj
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        pkg.no_such_name  # noqa: B018


def test_importing_a_box_imports_none_of_its_modules():
    code = "import sys, consequence.update, consequence.loop; print(sorted(m for m in sys.modules if m.startswith('consequence.update.') or m.startswith('consequence.loop.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
