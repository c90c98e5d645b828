"""consequence: reinforcement learning of language-model agents (the Python API: docs/api.md).

``import consequence as cq`` gives the API; each name is imported on first use (module
``__getattr__``, PEP 562), so ``import consequence`` and the ``consequence`` command stay
as fast as before:

- ``cq.train(config, env=None, reward_fn=None) -> cq.Run``, ``cq.TrainConfig``, ``cq.RECIPES``
- ``cq.evaluate(...)``, ``cq.compare(...)``: ``consequence eval`` / ``compare``, returning their results
- ``cq.Environment``, ``cq.Episode``, ``cq.SingleTurnEnvironment``, ``cq.register_env``

``cq.evaluate`` shares its name with the package ``consequence.evaluate`` (the evaluation
box): that package is made callable, a call runs ``consequence.api.evaluate``, and every
other use of it is as before (``from consequence.evaluate import stats``). The training
loop is ``consequence.loop``, so ``cq.train`` is plainly ``consequence.api.train``.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = [
    "RECIPES",
    "Environment",
    "Episode",
    "Run",
    "SingleTurnEnvironment",
    "TrainConfig",
    "__version__",
    "compare",
    "evaluate",
    "register_env",
    "train",
]

# name -> the module that defines it (imported on first access)
_WHERE = {
    "TrainConfig": "consequence.config",
    "Run": "consequence.api",
    "train": "consequence.api",
    "compare": "consequence.api",
    "RECIPES": "consequence.api",
    "Environment": "consequence.envs.api",
    "Episode": "consequence.envs.api",
    "SingleTurnEnvironment": "consequence.envs.api",
    "register_env": "consequence.envs.registry",
}
_CALLABLE_MODULES = ("evaluate",)  # the submodule whose name is also an API function's


class _CallableModule(types.ModuleType):
    """``consequence.evaluate``: the package as before, and a call of it runs
    ``consequence.api.evaluate`` (what ``help(consequence.api.evaluate)`` documents)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from consequence import api

        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


class _Package(types.ModuleType):
    """The package: the import system binds a submodule with ``setattr``; the one whose name
    is an API function's becomes callable there, whoever imports it first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CALLABLE_MODULES and type(value) is types.ModuleType:
            value.__class__ = _CallableModule
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    import importlib

    if name == "__version__":
        from importlib import metadata

        try:
            value = metadata.version("consequence")
        except metadata.PackageNotFoundError:  # a source tree that was never installed
            value = "0+unknown"
    elif name in _CALLABLE_MODULES:
        return importlib.import_module(f"{__name__}.{name}")  # bound (and made callable) by the import
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
