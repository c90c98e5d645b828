"""The Python API: ``import consequence as cq`` (reference and examples: docs/api.md).

A thin layer over what the command line does: :func:`train` runs
:func:`consequence.loop.train.train` with the checks ``consequence train`` makes first and
returns a :class:`Run`; :func:`evaluate` and :func:`compare` run ``consequence eval`` /
``consequence compare`` and return the result dicts they write. What the command line takes
by name, this layer also takes as a Python object: an environment (an
:class:`~consequence.envs.api.Environment` instance, class or factory), a dataset of prompts
with a ``reward_fn`` (a :class:`~consequence.envs.api.SingleTurnEnvironment`), or a
``reward_fn`` that scores a single-turn environment instead of its own verifier.

Such an object is registered in this process (``consequence.envs.registry``) under a key
that the run's config.yaml records: ``module:qualname`` when the class or function can be
imported from its module (a new process re-creates it), else ``python:module:qualname``
(only this process has it: ``train --resume`` and ``reproduce`` in another process say so).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from consequence.config import TrainConfig, saved_settings
from consequence.envs.api import Environment, SingleTurnEnvironment, callable_name
from consequence.envs.registry import IN_PROCESS_PREFIX, _register_in_process, is_in_process, load_environment

__all__ = ["RECIPES", "Run", "compare", "evaluate", "train"]


# ---- the run object ------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """What a training run left in its folder (``Run.open(dir)`` reads any run folder).

    Attributes:
        dir: the run folder (absolute).
        config: the run's settings (config.yaml).
        report: report.json (the final evaluation, warnings, splits touched); ``{}`` while
            the run has not finished.
        metrics: one dict per iteration completed, from metrics.jsonl (``reward_mean``,
            ``success``, ``loss``, ``env_errors``, ...; docs/design.md §7), in order.
        checkpoints: the policy checkpoints written (``checkpoints/iter_NNNN`` at each
            validation, ``checkpoints/final``), in order; resume states are not policies.
        final_checkpoint: ``checkpoints/final`` (a Hugging Face folder), or None.
        report_md, curves: report.md and curves.png, or None where not written.
        manifest: manifest.json (what ran: model, environment, versions, checks, status).
        status: how the run ended, from the manifest: ``finished``, ``interrupted``,
            ``stopped``, ``refused``, ``failed`` (docs/resume.md), ``running`` while it runs.
    """

    dir: Path
    config: TrainConfig
    report: dict[str, Any] = field(repr=False)
    metrics: list[dict[str, Any]] = field(repr=False)
    checkpoints: tuple[Path, ...] = field(repr=False)
    final_checkpoint: Path | None
    report_md: Path | None
    curves: Path | None
    manifest: Path
    status: str

    @classmethod
    def open(cls, run_dir: str | Path) -> Run:
        """The run in ``run_dir``.

        Raises:
            ValueError: no config.yaml or manifest.json there (not a run folder of
                ``consequence train``), or a config that is not a valid training config.
        """
        d = Path(run_dir).resolve()
        for name in ("config.yaml", "manifest.json"):
            if not (d / name).is_file():
                raise ValueError(f"{d}: no {name}; give the folder of a `consequence train` run")
        config = TrainConfig.checked(
            **saved_settings(yaml.safe_load((d / "config.yaml").read_text(encoding="utf-8")) or {})
        )
        metrics_file = d / "metrics.jsonl"
        metrics = (
            [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
            if metrics_file.is_file()
            else []
        )
        report = json.loads((d / "report.json").read_text()) if (d / "report.json").is_file() else {}
        ckpt = d / "checkpoints"
        checkpoints = tuple(sorted(p for p in ckpt.glob("iter_*") if p.is_dir())) + (
            (ckpt / "final",) if (ckpt / "final").is_dir() else ()
        )
        status = json.loads((d / "manifest.json").read_text()).get("status", "unknown")
        return cls(
            dir=d,
            config=config,
            report=report,
            metrics=metrics,
            checkpoints=checkpoints,
            final_checkpoint=ckpt / "final" if (ckpt / "final").is_dir() else None,
            report_md=d / "report.md" if (d / "report.md").is_file() else None,
            curves=d / "curves.png" if (d / "curves.png").is_file() else None,
            manifest=d / "manifest.json",
            status=status,
        )


# ---- environments given as objects -----------------------------------------------------
def _importable(obj: Any) -> str | None:
    """``module:qualname`` when importing it in a new process gives ``obj`` back, else None
    (a class of ``__main__``, of a notebook, or defined inside a function)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # not importable as named: an in-process object
        return None
    return f"{module}:{qualname}" if found is obj else None


def _python_key(obj: Any) -> str:
    """The config's record of an in-process object: ``python:module:qualname``."""
    return IN_PROCESS_PREFIX + callable_name(obj)


def _slug(text: str) -> str:
    """A folder-name-safe form of an environment's name (runs/<slug>-default)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_.") or "env"


def _is_dataset(env: Any) -> bool:
    return (
        not isinstance(env, (str, bytes, Mapping, Environment, type))
        and isinstance(env, Iterable)
        and not callable(env)
    )


def _scored(base: str, reward_fn: Any):
    """A factory of the environment ``base`` (a name ``load_environment`` takes) scored by ``reward_fn``."""

    def factory(split_seed: int = 0, **options: Any) -> SingleTurnEnvironment:
        return SingleTurnEnvironment.scoring(load_environment(base, split_seed, options), reward_fn)

    return factory


def environment_key(env: Any, reward_fn: Any = None, default: str = "repair") -> tuple[str, str]:
    """Register ``env`` (and ``reward_fn``) in this process where needed; returns ``(key,
    slug)``: the name the config records (``--env`` takes it in this process) and a short
    name for the default run folder.

    Args:
        env: None (the config's ``env``, ``default``), a name (what ``--env`` takes), a
            dataset (a sequence of dicts with a ``prompt``; needs ``reward_fn``), an
            :class:`Environment` instance, or an Environment class / factory function.
        reward_fn: ``reward_fn(prompt, completion, **info) -> float | dict``: scores a
            single-turn environment (``SingleTurnEnvironment.scoring``) or a dataset.

    Raises:
        ValueError: a dataset without ``reward_fn``; an ``env`` of another kind; a
            ``reward_fn`` that is not callable. A multi-turn environment with ``reward_fn``
            is refused when it is loaded (``SingleTurnEnvironment.scoring``).
    """
    if reward_fn is not None and not callable(reward_fn):
        raise ValueError(
            f"reward_fn must be a function reward_fn(prompt, completion, **info) -> float | dict, got "
            f"{type(reward_fn).__name__}"
        )
    fn_slug = f"-{getattr(reward_fn, '__name__', 'reward_fn')}" if reward_fn is not None else ""
    if env is None or isinstance(env, str):
        name = default if env is None else env
        if reward_fn is None:
            return name, _slug(name.rsplit(":", 1)[-1].rsplit(".", 1)[-1] if ":" in name else name)
        return _register_in_process(_python_key(reward_fn), _scored(name, reward_fn)), _slug(f"{name}{fn_slug}")
    if _is_dataset(env):
        if reward_fn is None:
            raise ValueError(
                "env is a dataset (a sequence of dicts with a 'prompt'): give reward_fn=... to score its "
                "replies, or make a SingleTurnEnvironment(dataset, reward_fn)"
            )
        return _dataset_key(env, reward_fn), _slug(f"{SingleTurnEnvironment.name}{fn_slug}")
    if isinstance(env, Environment):
        if reward_fn is not None:
            env = SingleTurnEnvironment.scoring(env, reward_fn)
        key = _python_key(env.reward_fn if isinstance(env, SingleTurnEnvironment) else type(env))
        return _register_in_process(key, env), _slug(f"{env.name}{fn_slug}")
    if callable(env):
        called = getattr(env, "name", None) if isinstance(env, type) else getattr(env, "__name__", None)
        base = _importable(env) or _register_in_process(_python_key(env), env)
        if reward_fn is None:
            return base, _slug(str(called or "env"))
        return _register_in_process(_python_key(reward_fn), _scored(base, reward_fn)), _slug(f"{called}{fn_slug}")
    raise ValueError(
        f"env must be an environment name, an Environment (class or instance), a function returning "
        f"one, or a dataset (a sequence of dicts with a 'prompt'); got {type(env).__name__}"
    )


def _dataset_key(dataset: Any, reward_fn: Any) -> str:
    """A dataset becomes a SingleTurnEnvironment made anew for each load (with the config's split seed)."""
    records = list(dataset)

    def factory(split_seed: int = 0) -> SingleTurnEnvironment:
        return SingleTurnEnvironment(records, reward_fn, split_seed=split_seed)

    SingleTurnEnvironment(records, reward_fn)  # a malformed dataset is refused now, with its record's index
    return _register_in_process(_python_key(reward_fn), factory)


# ---- train --------------------------------------------------------------------------------
def _config(config: TrainConfig | Mapping[str, Any]) -> tuple[TrainConfig, bool]:
    """``(TrainConfig, whether the run folder was given)``; a mapping is resolved as the
    command line's options are (a ``recipe`` key applies that recipe's settings)."""
    if isinstance(config, TrainConfig):
        return config, "run_dir" in config.model_fields_set
    if isinstance(config, Mapping):
        from consequence.recipes import resolve_config

        return resolve_config(None, dict(config)), "run_dir" in config
    raise ValueError(
        f"config must be a consequence.TrainConfig or a mapping of its options, got {type(config).__name__}"
    )


def train(
    config: TrainConfig | Mapping[str, Any],
    env: Any = None,
    reward_fn: Any = None,
    *,
    resume: bool = False,
    console: Any = None,
) -> Run:
    """Train a policy: ``consequence train`` from Python.

    Args:
        config: a :class:`TrainConfig` (``cq.RECIPES[name].train_config(**overrides)`` starts
            from a recipe), or a mapping of its options (a ``recipe`` key applies that
            recipe's settings, as ``--recipe`` does).
        env: where ``config.env`` names an environment today: None (``config.env``), a
            name, an :class:`Environment` instance (made with ``config.split_seed``; it takes
            no ``env_options``), an Environment class or a function ``(split_seed,
            **options) -> Environment`` (made with ``config.split_seed`` and
            ``config.env_options``), or a dataset (a sequence of dicts with a ``prompt``,
            with ``reward_fn``).
        reward_fn: ``reward_fn(prompt, completion, **info) -> float | dict[str, float]``:
            scores each reply of a single-turn environment (no tools; a reply is the
            answer) instead of its verifier, or of the dataset ``env``; ``info`` holds the
            task's other fields. Checked as any verifier's reward: a raise, NaN, ±inf or a
            total outside ``reward_range`` makes the episode an ``env_error`` naming the
            function (excluded and counted, never scored 0).
        resume: continue ``config.run_dir`` from its newest resume state; ``config`` must
            equal the saved config.yaml (except where rollouts run), as ``train --resume``.
        console: a ``rich.console.Console`` for the progress and the report
            (``Console(quiet=True)`` silences it); default: standard output.

    Without ``config.run_dir`` (and with ``env`` or ``reward_fn``) the run goes to
    ``runs/<environment>-<recipe or default>``, not to the default run's folder.

    Returns:
        The finished :class:`Run`.

    Raises:
        ValueError: a setting, the model, the environment (e.g. ``reward_fn`` with a
            multi-turn environment, a dataset record without ``prompt``), or the run folder
            is refused before any work (nothing written); or bad input found after the run
            started (its manifest says ``refused``). A Hugging Face hub id as ``model`` on a
            machine without hub access (``HF_HUB_OFFLINE=1``) is refused here, naming the id
            and the way on.
        consequence.loop.train.RunStopped: a failed pre-step check, a NaN / ±inf in an update, a
            failed write; the newest resume state is intact (``resume=True`` continues).
        consequence.loop.train.RunInterrupted: Ctrl-C or SIGTERM.
    """
    from rich.console import Console

    from consequence.cli.common import quiet_libraries
    from consequence.cli.train import check_before_work
    from consequence.loop.train import train as run_training
    from consequence.recipes import default_run_dir

    cfg, dir_given = _config(config)
    if env is not None or reward_fn is not None:
        key, slug = environment_key(env, reward_fn, default=cfg.env)
        changes: dict[str, Any] = {"env": key}
        if not dir_given:  # a custom environment does not overwrite the default run's folder
            changes["run_dir"] = default_run_dir(Path(cfg.recipe).stem if cfg.recipe else "default", slug)
        cfg = TrainConfig.checked(**{**cfg.model_dump(), **changes})
    if cfg.rollout_workers and is_in_process(cfg.env):
        raise ValueError(
            f"rollout_workers {cfg.rollout_workers}: the environment {cfg.env} exists only in this Python "
            "process, and rollout workers are other processes that make the environment from the config; "
            "make it importable (give env as module:attr or an installed entry point) or set "
            "rollout_workers=0"
        )
    if resume:
        from consequence.loop.resume import resume_config

        cfg = resume_config(Path(cfg.run_dir), cfg.model_dump(), None)
    check_before_work(cfg)
    quiet_libraries()  # the run's own progress bar is the one to read, as on the command line
    run_training(cfg, console or Console(), resume=resume)
    return Run.open(cfg.run_dir)


# ---- evaluate / compare ---------------------------------------------------------------------
def _ks(k: int | str | Sequence[int]) -> str:
    return str(k) if isinstance(k, (int, str)) else ",".join(str(x) for x in k)


def _env_name(env: Any, reward_fn: Any) -> str | None:
    """What ``--env`` gets for ``env`` (None: the run folder's, or repair)."""
    if env is None and reward_fn is None:
        return None
    if env is None:
        raise ValueError("reward_fn needs env: the single-turn environment (or dataset) whose replies it scores")
    return environment_key(env, reward_fn)[0]


def evaluate(
    model: str | Path | None = None,
    env: Any = None,
    *,
    reward_fn: Any = None,
    split: str = "validation",
    split_seed: int | None = None,
    env_options: Mapping[str, Any] | None = None,
    tasks_file: str | Path | None = None,
    n: int | None = None,
    k: int | str | Sequence[int] = 1,
    problems: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    selection: str | Sequence[str] = ("first", "majority", "visible"),
    recovery: bool = True,
    max_turns: int | None = None,
    max_new_tokens: int | None = None,
    max_total_tokens: int | None = None,
    device: str = "cpu",
    out: str | Path = "runs/eval",
    attempts: int = 1,
) -> dict[str, Any]:
    """Evaluate a policy: ``consequence eval`` from Python (docs/evaluation.md; each
    argument is the option of the same name, ``env_options`` a mapping of ``--env-option``).

    Args:
        model: a checkpoint folder, a run folder (its ``checkpoints/final``; its config.yaml
            supplies the split seed, environment and budgets not given), a registered model
            name or a hub id; None: the bundled tiny model.
        env: as :func:`train`'s ``env`` (a name, an Environment, a class, a dataset with
            ``reward_fn``); None: the run folder's, else repair.
        k: pass@k's k, one or several (each <= n).

    Returns:
        The dict written to ``out/eval.json`` (pass@k and final-selection success with
        bootstrap CIs over problems, outcomes, budgets, cost, env errors, the settings and
        where each came from); its report is printed.

    Raises:
        ValueError: as ``consequence eval`` refuses (a setting, the model, the
            environment), before any work; nothing is written then.
    """
    from consequence.cli.evaluate import run_eval

    path = run_eval(
        None if model is None else str(model),
        _env_name(env, reward_fn),
        None,
        None if tasks_file is None else str(tasks_file),
        None,
        split,
        split_seed,
        max_turns,
        max_new_tokens,
        max_total_tokens,
        n,
        _ks(k),
        problems,
        temperature,
        seed,
        selection if isinstance(selection, str) else ",".join(selection),
        recovery,
        Path(out),
        env_options=dict(env_options) if env_options else None,
        device=device,
        attempts=attempts,
    )
    return json.loads(Path(path).read_text())


def compare(
    a: str | Path,
    b: str | Path,
    env: Any = None,
    *,
    reward_fn: Any = None,
    split: str = "validation",
    split_seed: int | None = None,
    env_options: Mapping[str, Any] | None = None,
    tasks_file: str | Path | None = None,
    n: int = 4,
    k: int | str | Sequence[int] = 1,
    problems: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    recovery: bool = True,
    max_turns: int | None = None,
    max_new_tokens: int | None = None,
    max_total_tokens: int | None = None,
    device: str = "cpu",
    out: str | Path = "runs/compare",
) -> dict[str, Any]:
    """Compare two policies on the same tasks, seeds, split and budgets: ``consequence
    compare`` from Python (docs/evaluation.md; arguments as in :func:`evaluate`).

    Returns:
        The dict written to ``out/compare.json``: each policy's results (``a``, ``b``) and
        ``paired``, the paired difference B − A in success with its 95 % bootstrap CI over
        problems and the problems each wins.

    Raises:
        ValueError: as ``consequence compare`` refuses (the same policy twice, a setting,
            a model, the environment), before any work; nothing is written then.
    """
    from consequence.cli.evaluate import run_compare

    path = run_compare(
        str(a),
        str(b),
        _env_name(env, reward_fn),
        None,
        None if tasks_file is None else str(tasks_file),
        None,
        split,
        split_seed,
        max_turns,
        max_new_tokens,
        max_total_tokens,
        n,
        _ks(k),
        problems,
        temperature,
        seed,
        recovery,
        Path(out),
        env_options=dict(env_options) if env_options else None,
        device=device,
    )
    return json.loads(Path(path).read_text())


# ---- the recipe map -------------------------------------------------------------------------
class _Recipes(Mapping):
    """The bundled recipes, name → :class:`consequence.recipes.Recipe` (read from their YAML on
    each access; ``RECIPES["grpo"].train_config(iterations=1)`` is a TrainConfig)."""

    def __getitem__(self, name: str):
        from consequence.recipes import load_recipe, recipe_names

        if name not in recipe_names():
            raise KeyError(f"{name!r}: not a bundled recipe; bundled: {', '.join(recipe_names())}")
        return load_recipe(name)

    def __iter__(self):
        from consequence.recipes import recipe_names

        return iter(recipe_names())

    def __len__(self) -> int:
        from consequence.recipes import recipe_names

        return len(recipe_names())

    def __repr__(self) -> str:
        return f"RECIPES({', '.join(self)})"


RECIPES: Mapping[str, Any] = _Recipes()
