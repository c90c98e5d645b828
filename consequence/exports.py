"""Lazy exports for a package's ``__init__``: each name is imported from its module on first
use (PEP 562 module ``__getattr__``), so importing a package stays cheap and a box's
``__init__`` can list what it offers without importing torch or the box's neighbours."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy(package: str, where: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, which exports ``name`` from the submodule
    ``where[name]`` (relative to the package, e.g. ``"sandbox"``).

    Raises (from the returned ``__getattr__``):
        AttributeError: ``name`` is not one of the package's exports or submodules.
    """

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
