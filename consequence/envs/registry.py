"""Environments by name: built-ins, installed plug-ins (entry points), ``module:attr`` paths.

``--env NAME`` resolves, in order:

1. a built-in name (:data:`BUILTINS`);
2. a name registered by an installed package under the entry point group
   ``consequence.environments`` (``[project.entry-points."consequence.environments"]
   my-env = "my_pkg.env:MyEnvironment"`` in its pyproject.toml);
3. ``module:attr``, importable from the current Python path (``attr`` may be dotted);
4. a path ending in ``.jsonl``: the ``jsonl`` environment on that file.

Beside these, a Python process may register environments of its own (in process only):
:func:`register_env` under a name, and ``consequence.train(env=...)`` an object, class or
function that cannot be imported by ``module:attr`` under the key ``python:MODULE:QUALNAME``,
which is what the run's config.yaml records. Another process (``train --resume``,
``reproduce``) cannot re-create such an environment from the config, and says so.

The object found is an :class:`~consequence.envs.api.Environment` subclass, or a
function returning an instance; it is called with ``split_seed`` and the options.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from consequence.envs.api import Environment, check_environment

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "IN_PROCESS_PREFIX",
    "available",
    "is_in_process",
    "load_environment",
    "register_env",
    "resolve",
]

ENTRY_POINT_GROUP = "consequence.environments"
BUILTINS: dict[str, str] = {
    "repair": "consequence.envs.repair.tasks:RepairEnvironment",
    "humaneval-repair": "consequence.envs.repair.tasks:HumanEvalRepairEnvironment",
    "jsonl": "consequence.envs.repair.tasks:JsonlRepairEnvironment",
    "humaneval": "consequence.envs.humaneval.env:HumanEvalEnvironment",
    "reasoning-gym": "consequence.envs.reasoning_gym.env:ReasoningGymEnvironment",
    "calculator": "consequence.envs.calculator.env:CalculatorEnvironment",
    "openenv": "consequence.envs.openenv.env:OpenEnvEnvironment",
}


IN_PROCESS_PREFIX = "python:"  # the key of an environment object given to consequence.train(env=...)
# Environments registered in this process: register_env's names and python: keys -> factory.
_IN_PROCESS: dict[str, Any] = {}


def register_env(name: str, factory: Any) -> None:
    """Make ``factory`` usable as ``--env NAME`` / ``env: NAME`` / ``consequence.train(env=NAME)``
    in this Python process (a script that registers, then trains or calls the CLI's ``app()``).

    Args:
        name: the name; not a built-in's, without ``:`` (kept for ``module:attr``), not
            ending in ``.jsonl``. Registering a name again replaces the earlier factory.
        factory: an :class:`Environment` subclass or a function ``(split_seed, **options)
            -> Environment`` (both made anew for every load, with the config's split seed and
            options), or an :class:`Environment` instance (used as it is: it takes no options,
            and the config's ``split_seed`` must be the one it was made with).

    Raises:
        ValueError: a name that is empty, a built-in's, has ``:`` or ends in ``.jsonl``; a
            factory that is none of the above.
    """
    if not isinstance(name, str) or not name.strip() or ":" in name or name.endswith(".jsonl"):
        raise ValueError(
            f"register_env: name {name!r} must be a non-empty str without ':' (kept for module:attr) "
            "and not a .jsonl path"
        )
    if name in BUILTINS:
        raise ValueError(f"register_env: {name!r} is a built-in environment; register under another name")
    _IN_PROCESS[name] = _factory_of(factory, name)


def _factory_of(obj: Any, name: str) -> Any:
    """A factory that :func:`load_environment` can call: a class or function as it is; an
    instance wrapped in one that returns it (refusing options and another split seed)."""
    if isinstance(obj, Environment):

        def the_instance(split_seed: int = obj.split_seed) -> Environment:
            if split_seed != obj.split_seed:
                raise ValueError(
                    f"--env {name}: the environment object was made with split_seed {obj.split_seed} "
                    f"and the config asks for split_seed {split_seed}; make them agree (set "
                    f"split_seed={obj.split_seed} in the config, or make the object with "
                    f"split_seed={split_seed})"
                )
            return obj

        return the_instance
    if isinstance(obj, type) and not issubclass(obj, Environment):
        raise ValueError(
            f"{name}: {obj.__qualname__} is not a consequence.envs.api.Environment subclass "
            "(subclass it; docs/environments.md)"
        )
    if not callable(obj):
        raise ValueError(f"{name}: {obj!r} is neither an Environment (class or instance) nor a function returning one")
    return obj


def _register_in_process(key: str, factory: Any) -> str:
    """Register ``factory`` under ``key`` (a ``python:`` key of :mod:`consequence.api`); returns the key."""
    _IN_PROCESS[key] = _factory_of(factory, key)
    return key


def is_in_process(name: str) -> bool:
    """``name`` is an environment only this process has (:func:`register_env`'s, or a ``python:`` key)."""
    return name in _IN_PROCESS or name.startswith(IN_PROCESS_PREFIX)


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available() -> dict[str, str]:
    """Every name ``--env`` accepts → where it comes from (``module:attr``), built-ins first."""
    out = dict(BUILTINS)
    for name, factory in _IN_PROCESS.items():
        if not name.startswith(IN_PROCESS_PREFIX):
            out.setdefault(
                name,
                f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', '?')} "
                "(registered in this process)",
            )
    for name, ep in _entry_points().items():
        out.setdefault(name, ep.value)
    return out


def _import(target: str, what: str) -> Any:
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"--env {what}: give module:attr, e.g. my_pkg.env:MyEnvironment (an Environment subclass)")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(
            f"--env {what}: cannot import module {module!r} ({e}); check the spelling, or "
            "install the package that provides it"
        ) from None
    except Exception as e:  # the module itself is broken: name the error, not a traceback
        raise ValueError(f"--env {what}: importing module {module!r} raised {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"--env {what}: module {module!r} has no attribute {attr!r}") from None
    return obj


def resolve(name: str) -> Any:
    """The Environment class (or factory) that ``name`` stands for.

    Raises:
        ValueError: an unknown name (lists the valid ones), a module that does not import,
            a missing attribute, or an entry point that fails to load.
    """
    if name in BUILTINS:
        return _import(BUILTINS[name], name)
    if name in _IN_PROCESS:
        return _IN_PROCESS[name]
    if name.startswith(IN_PROCESS_PREFIX):
        raise ValueError(
            f"--env {name}: this run's environment was a Python object given to consequence.train(env=...) "
            "or reward_fn=... in another process; it cannot be re-created from the run's config. Resume or "
            "reproduce it from Python with the same environment (consequence.train(config, env=..., "
            "resume=True)), or make it importable (module:attr, an entry point) for the command line"
        )
    eps = _entry_points()
    if name in eps:
        try:
            return eps[name].load()
        except Exception as e:  # a broken plug-in is the plug-in's fault: say which
            raise ValueError(
                f"--env {name}: the entry point {eps[name].value!r} of group "
                f"{ENTRY_POINT_GROUP} failed to load: {type(e).__name__}: {e}"
            ) from None
    if ":" in name:
        return _import(name, name)
    raise ValueError(
        f"--env {name!r}: unknown environment; valid: "
        + ", ".join(available())
        + ", a module:attr path, or a .jsonl task file (docs/environments.md); a name given to "
        "consequence.register_env exists only in the Python process that registered it"
    )


def load_environment(name: str, split_seed: int = 0, options: dict[str, Any] | None = None) -> Environment:
    """The environment ``name`` with its splits, made with ``options``.

    Args:
        name: see the module doc; a ``.jsonl`` path means ``jsonl`` with ``tasks_file=name``.
        split_seed: seed of the problem-level split.
        options: environment-specific options (keyword arguments of its ``__init__``).

    Raises:
        ValueError: unknown name, an option the environment does not take (lists the ones
            it takes), bad declarations, or a task source that cannot be read.
    """
    options = dict(options or {})
    if name.endswith(".jsonl"):
        name, options = "jsonl", {"tasks_file": str(Path(name).resolve()), **options}
    factory = resolve(name)
    _check_options(factory, name, options)
    try:
        env = factory(split_seed=split_seed, **options)
    except ValueError:
        raise
    except Exception as e:  # the user's environment failed while loading its tasks
        raise ValueError(f"--env {name}: making the environment raised {type(e).__name__}: {e}") from e
    if not isinstance(env, Environment):
        raise ValueError(
            f"--env {name}: {factory!r} made a {type(env).__name__}, not a "
            "consequence.envs.api.Environment (subclass it; docs/environments.md)"
        )
    env._options = options  # what the manifest and reports record
    check_environment(env)
    return env


def _check_options(factory: Any, name: str, options: dict[str, Any]) -> None:
    """Refuse an option the factory does not declare (applied or refused, never dropped)."""
    try:
        params: Mapping[str, inspect.Parameter] = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    # (only a subclass of Environment can have its __init__; issubclass lets mypy see a class)
    if isinstance(factory, type) and issubclass(factory, Environment) and factory.__init__ is Environment.__init__:
        params = {}  # the base class takes no option
    elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # the environment checks its own options
    takes = [
        k
        for k, p in params.items()
        if k != "split_seed" and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    bad = [k for k in options if k not in takes]
    if bad == ["tasks_file"]:
        raise ValueError(
            f"--tasks-file: environment {name!r} takes no task file (jsonl does: --env jsonl --tasks-file FILE)"
        )
    if bad:
        raise ValueError(
            f"--env {name}: unknown option{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}; "
            + (f"it takes {', '.join(takes)}" if takes else "it takes none")
            + " (--env-option key=value, or env_options: in a --config YAML)"
        )


def environment_options(env_options: dict[str, Any] | None, tasks_file: str | None) -> dict[str, Any]:
    """The keyword arguments an environment is made with: its options plus ``tasks_file`` when given."""
    return {**(env_options or {}), **({"tasks_file": tasks_file} if tasks_file else {})}


def env_of(cfg) -> Environment:
    """The environment of a training config (``env``, ``split_seed``, ``env_options``,
    ``tasks_file``), its train split cut to ``train_problems`` when given.

    Raises:
        ValueError: see :func:`load_environment` and :func:`nested_train_subset`.
    """
    env = load_environment(cfg.env, cfg.split_seed, environment_options(cfg.env_options, cfg.tasks_file))
    if getattr(cfg, "train_problems", None):
        env.split["train"] = nested_train_subset(env.split["train"], cfg.train_problems, cfg.split_seed)
    return env


def problem_key(task: Any) -> str:
    """A split entry's identity: its ``task_id``, or a generated problem's ``problem_id``."""
    return str(getattr(task, "task_id", None) or getattr(task, "problem_id", None) or repr(task))


def nested_train_subset(pool: list, n: int, split_seed: int) -> list:
    """The first ``n`` problems of ``pool`` in one fixed order (by task id, then a permutation
    seeded by the split seed): the subsets of every ``n`` are nested, so a scale sweep over n
    trains each size on the smaller sizes' problems plus new ones.

    Raises:
        ValueError: ``n`` above the train split's size.
    """
    import random

    from consequence.seeding import seed_of

    if n > len(pool):
        raise ValueError(
            f"--train-problems {n}: the train split has only {len(pool)} problems; give at most {len(pool)}"
        )
    order = sorted(pool, key=problem_key)
    random.Random(seed_of(split_seed, "train-problems")).shuffle(order)
    return order[:n]
