"""An experiment file (``consequence experiment PLAN.yaml``): arms × training seeds at one budget.

    base:                 # settings every arm starts from (flat or nested by box, as --config)
      iterations: 6
      tasks_per_iteration: 8
    seeds: [0, 1, 2]      # training seeds (each arm runs each)
    eval_seed: 0          # the evaluation episodes, the same for every run
    budget:
      equalise: episodes  # episodes | generated_tokens: refused when arms differ
      tolerance: 0.0      # relative difference allowed
      allow_unequal: false
      mean_tokens: 100    # L̄ of the generated-token plan (default: each arm's L_max)
    arms:
      warm_start: none    # no training: the starting policy, evaluated on the same episodes
      defaults: {}        # the base settings as they are
      grpo: {recipe: grpo}
      rloo: {recipe: rloo, learning_rate: 1e-4}

An arm's settings are its own keys over ``base`` over its recipe (``recipe:`` in the arm or
in ``base``); ``seed``, ``eval_seed`` and ``run_dir`` are the experiment's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUDGET_KINDS = ("episodes", "generated_tokens")
_KEYS = {"base", "seeds", "eval_seed", "budget", "arms", "name"}
_BUDGET_KEYS = {"equalise", "tolerance", "allow_unequal", "mean_tokens"}
_OWN = ("seed", "eval_seed", "run_dir")  # set by the experiment, per run


@dataclass(frozen=True)
class Arm:
    """One arm: ``settings`` (flat TrainConfig keys, a ``recipe`` among them) or no training."""

    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    trains: bool = True


@dataclass(frozen=True)
class Experiment:
    """A parsed experiment file; ``folder`` holds its runs (``runs/<arm>-seed<k>``) and reports."""

    folder: Path
    base: dict[str, Any]
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    eval_seed: int = 0
    equalise: str = "episodes"
    tolerance: float = 0.0
    allow_unequal: bool = False
    mean_tokens: float | None = None

    def run_dir(self, arm: str, seed: int) -> Path:
        return self.folder / "runs" / f"{arm}-seed{seed}"

    def runs(self) -> list[tuple[Arm, int]]:
        """Every (trained arm, seed) pair, arm by arm."""
        return [(a, s) for a in self.arms if a.trains for s in self.seeds]


def _where(path: Path, key: str) -> str:
    return f"{path}: {key}"


def load_experiment(path: str | Path, folder: str | Path | None = None) -> Experiment:
    """Read and check an experiment file; nothing runs.

    Args:
        path: the YAML file.
        folder: where its runs go (default: ``runs/experiments/<file stem>``).

    Raises:
        ValueError: unreadable YAML, an unknown key, no seed or no trained arm, a duplicate
            seed, an arm that sets ``seed`` / ``eval_seed`` / ``run_dir``, a bad budget; the
            message names the key and the file.
    """
    import yaml

    from consequence.config import flat_settings

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such experiment file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ValueError(f"{path} is not valid YAML{at}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: an experiment file is a mapping with base, seeds, budget and arms")
    if unknown := sorted(set(data) - _KEYS):
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; an experiment has {', '.join(sorted(_KEYS))}")
    base = flat_settings(data.get("base") or {})
    if not isinstance(base, dict):
        raise ValueError(f"{_where(path, 'base')} must be a mapping of training settings")
    seeds = data.get("seeds")
    if not isinstance(seeds, list) or not seeds or not all(type(s) is int and s >= 0 for s in seeds):
        raise ValueError(f"{_where(path, 'seeds')} must be a non-empty list of training seeds (integers >= 0)")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{_where(path, 'seeds')} lists a seed twice: {seeds}")
    arms = _arms(path, data.get("arms"))
    if "recipe" in base and not isinstance(base["recipe"], str):
        raise ValueError(f"{_where(path, 'base.recipe')} must be a recipe name, got {base['recipe']!r}")
    for key in _OWN:
        if key in base:
            raise ValueError(f"{_where(path, 'base.' + key)}: the experiment sets it for every run; drop it")
    budget = data.get("budget") or {}
    if isinstance(budget, str):
        budget = {"equalise": budget}
    if not isinstance(budget, dict):
        raise ValueError(f"{_where(path, 'budget')}: a mapping with {', '.join(sorted(_BUDGET_KEYS))}")
    if unknown := sorted(set(budget) - _BUDGET_KEYS):
        raise ValueError(
            f"{_where(path, 'budget')}: unknown key(s) {', '.join(map(str, unknown))}; it has "
            f"{', '.join(sorted(_BUDGET_KEYS))}"
        )
    equalise = budget.get("equalise", "episodes")
    if equalise not in BUDGET_KINDS:
        extra = (
            "; CPU seconds are known only after a run: equalise episodes or tokens and read the measured "
            "CPU seconds in experiment.md"
            if equalise == "cpu_seconds"
            else ""
        )
        raise ValueError(
            f"{_where(path, 'budget.equalise')}: {equalise!r} is not one of {', '.join(BUDGET_KINDS)}{extra}"
        )
    eval_seed = data.get("eval_seed", 0)
    if type(eval_seed) is not int or eval_seed < 0:
        raise ValueError(f"{_where(path, 'eval_seed')} must be an integer >= 0")
    name = data.get("name", path.stem)
    if "name" in data and not _plain_name(name):
        raise ValueError(f"{_where(path, 'name')} {name!r} must be letters, digits, - and _ (it names a folder)")
    return Experiment(
        folder=Path(folder) if folder else Path("runs") / "experiments" / str(name),
        base=base,
        arms=arms,
        seeds=tuple(seeds),
        eval_seed=eval_seed,
        equalise=equalise,
        tolerance=_number(path, budget, "tolerance", 0.0, low=0.0),
        allow_unequal=_flag(path, budget, "allow_unequal"),
        mean_tokens=_mean_tokens(path, budget, equalise),
    )


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and name.replace("_", "").replace("-", "").isalnum()


def _number(path: Path, budget: dict, key: str, default: float, low: float) -> float:
    """A finite number >= ``low`` under ``budget.key``."""
    import math

    value = budget.get(key, default)
    if type(value) not in (int, float) or not math.isfinite(value) or value < low:
        raise ValueError(f"{_where(path, 'budget.' + key)} must be a finite number >= {low:g}, got {value!r}")
    return float(value)


def _flag(path: Path, budget: dict, key: str) -> bool:
    value = budget.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{_where(path, 'budget.' + key)} must be true or false, got {value!r}")
    return value


def _mean_tokens(path: Path, budget: dict, equalise: str) -> float | None:
    """L̄ of a generated-token budget; refused where nothing reads it."""
    if "mean_tokens" not in budget:
        return None
    if equalise != "generated_tokens":
        raise ValueError(f"{_where(path, 'budget.mean_tokens')} is read only with equalise: generated_tokens; drop it")
    value = _number(path, budget, "mean_tokens", 0.0, low=0.0)
    if value == 0:
        raise ValueError(f"{_where(path, 'budget.mean_tokens')} must be above 0 (generated tokens per trajectory)")
    return value


def _arms(path: Path, arms: Any) -> tuple[Arm, ...]:
    """The arms in file order; ``none`` or ``{train: false}`` is no training, ``{}`` the base as is."""
    from consequence.config import flat_settings

    if not isinstance(arms, dict) or not arms:
        raise ValueError(f"{_where(path, 'arms')} must map arm names to their settings (or none: no training)")
    out = []
    for name, spec in arms.items():
        if not _plain_name(name):
            raise ValueError(f"{_where(path, 'arms')}: arm name {name!r} must be letters, digits, - and _")
        if spec is None:
            raise ValueError(
                f"{_where(path, 'arms.' + name)} is empty: write {{}} to train with the base settings, "
                "or none for no training"
            )
        if spec == "none" or (isinstance(spec, dict) and spec.get("train") is False and len(spec) == 1):
            out.append(Arm(name, {}, trains=False))
            continue
        if isinstance(spec, dict) and "recipe" in spec and not isinstance(spec["recipe"], str):
            raise ValueError(f"{_where(path, f'arms.{name}.recipe')} must be a recipe name, got {spec['recipe']!r}")
        settings = flat_settings(spec)
        if not isinstance(settings, dict):
            raise ValueError(f"{_where(path, 'arms.' + name)} must be a mapping of settings, or none")
        for key in _OWN:
            if key in settings:
                raise ValueError(f"{_where(path, f'arms.{name}.{key}')}: the experiment sets it for every run; drop it")
        out.append(Arm(name, dict(settings)))
    if not any(a.trains for a in out):
        raise ValueError(f"{_where(path, 'arms')}: no arm trains; the no-training arm is evaluated beside trained ones")
    return tuple(out)
