"""Recipes: every named algorithm as a choice in each box of the one loop.

A recipe is a YAML file with ``name``, ``title``, ``summary``, ``paper``, ``cite`` (box →
paper section that motivates the box's setting) and ``config`` (TrainConfig keys). The
bundled ones live next to this file; ``consequence train --recipe NAME|PATH`` (or
``recipe:`` in a ``--config`` file) starts from a recipe's config, and
``consequence explain NAME [NAME]`` shows its boxes.

A recipe means the same thing wherever it is named: :func:`resolve_config` layers the
recipe's settings < the ``--config`` YAML < command-line options, for ``train`` and for
``explain`` of a train-config file alike; :func:`run_label` names what a config is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from consequence.config import BOXES, TrainConfig, absolute, box_of, yaml_problem

HERE = Path(__file__).parent
BASELINE = "reinforce"  # the recipe every other one is explained against


@dataclass(frozen=True)
class Recipe:
    """One algorithm: its settings and where they come from."""

    name: str
    title: str
    summary: str
    paper: str
    config: dict[str, Any]
    cite: dict[str, str] = field(default_factory=dict)
    ref: str = ""  # what config.yaml records as ``recipe``: the bundled name, or the file's absolute path
    run_command: str = ""  # how to run it (``explain`` prints it); default ``consequence train --recipe REF``

    def train_config(self, **overrides) -> TrainConfig:
        """The TrainConfig of this recipe (defaults for keys it does not set), with overrides.

        A distillation recipe names no teacher: without a ``teacher`` override the config
        holds the placeholder ``TEACHER_DIR`` (for explain and validation; a run from the
        command line goes through :func:`resolve_config`, which refuses a missing --teacher).

        Raises:
            ValueError: a key or value is invalid (names the key).
        """
        teaches = self.config.get("advantage") == "reverse_kl" or self.config.get("distill_loss", "none") != "none"
        placeholder = {"teacher": "TEACHER_DIR"} if teaches else {}
        return TrainConfig.checked(
            **{
                "run_dir": default_run_dir(self.name),
                "recipe": self.ref or self.name,
                **placeholder,
                **self.config,
                **overrides,
            }
        )


def default_run_dir(name: str, env: str = "repair") -> str:
    """The run folder when none is given: ``runs/<env>-<recipe>``, ``runs/<env>-default``
    without a recipe (the default run: ``runs/repair-default``)."""
    return f"runs/{env}-{name}"


def recipe_names() -> list[str]:
    """Names of the bundled recipes, sorted."""
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A bundled recipe by name, or a recipe YAML file by path.

    Raises:
        ValueError: no such recipe (lists the bundled ones), or the file is malformed
            (missing field, config key that TrainConfig does not have, bad value).
    """
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ValueError(
                f"recipe file {p} "
                + ("is a directory" if p.is_dir() else "does not exist")
                + f"; bundled recipes: {', '.join(recipe_names())}"
            )
        ref = absolute(p)
    else:
        ref, p = str(name_or_path), HERE / f"{name_or_path}.yaml"
        # a bundled name means the bundled recipe, whatever folder of that name the working
        # directory holds (a user's `grpo/` of outputs must not break `--recipe grpo`)
        if str(name_or_path) not in recipe_names() and Path(name_or_path).is_dir():
            raise ValueError(
                f"{name_or_path} is a directory, not a recipe name or recipe .yaml file; "
                f"bundled recipes: {', '.join(recipe_names())}"
            )
        if not p.is_file():
            raise ValueError(
                f"unknown recipe {str(name_or_path)!r}; bundled recipes: {', '.join(recipe_names())} "
                "(or give the path of a recipe .yaml file)"
            )
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {p} is not valid YAML ({yaml_problem(e)})") from None
    missing = [
        k for k in ("name", "title", "summary", "paper", "config") if not isinstance(data, dict) or k not in data
    ]
    if missing:
        raise ValueError(f"recipe {p} lacks {', '.join(missing)}")
    if not isinstance(data["config"], dict):
        raise ValueError(f"recipe {p}: config must be a mapping of option: value")
    unknown = [k for k in data["config"] if k not in TrainConfig.model_fields]
    if unknown:
        raise ValueError(f"recipe {p}: unknown config key(s) {', '.join(unknown)}; see `consequence train --help`")
    not_algorithm = [k for k in data["config"] if box_of(k) not in BOXES]
    if not_algorithm:
        raise ValueError(
            f"recipe {p}: config sets {', '.join(not_algorithm)}, which belong to a run, not to an "
            "algorithm; put them in a --config file or on the command line"
        )
    bad_boxes = [b for b in data.get("cite", {}) if b not in BOXES]
    if bad_boxes:
        raise ValueError(f"recipe {p}: cite names unknown box(es) {', '.join(bad_boxes)}; boxes: {', '.join(BOXES)}")
    recipe = Recipe(
        data["name"],
        data["title"],
        data["summary"],
        data["paper"],
        dict(data["config"]),
        dict(data.get("cite", {})),
        ref=ref,
        run_command=str(data.get("run_command", "")),
    )
    recipe.train_config()  # validate the values now, not when training starts
    return recipe


# The batch shape is a budget that every recipe shares; a recipe that sets it (cross-stage
# distillation's G = 1) still counts it among its own settings, the others do not.
BATCH_SHAPE = ("tasks_per_iteration", "group_size")


@functools.lru_cache(maxsize=1)
def _bundled_knobs() -> tuple[str, ...]:
    """Config keys that any bundled recipe sets, the batch shape aside (read once per process)."""
    return tuple(sorted({k for n in recipe_names() for k in load_recipe(n).config} - set(BATCH_SHAPE)))


def box_settings(recipe: Recipe) -> dict[str, dict[str, Any]]:
    """box → {setting: value} for the settings that define the algorithm.

    A setting is listed when any bundled recipe sets it (the algorithm's knobs); budgets,
    paths and evaluation settings are left out because every recipe shares them.
    """
    cfg = recipe.train_config().model_dump()
    cfg["clip_eps_high"] = cfg["clip_eps_high"] or cfg["clip_eps"]  # show the effective upper range
    knobs = [k for k in sorted(set(_bundled_knobs()) | set(recipe.config)) if box_of(k) in BOXES]
    out: dict[str, dict[str, Any]] = {b: {} for b in BOXES}
    for k in knobs:
        out[box_of(k)][k] = cfg[k]
    return out


def differences(a: Recipe, b: Recipe) -> dict[str, dict[str, tuple[Any, Any]]]:
    """box → {setting: (value in a, value in b)} where the two recipes differ."""
    sa, sb = box_settings(a), box_settings(b)
    out: dict[str, dict[str, tuple[Any, Any]]] = {}
    for box in BOXES:
        keys = sorted(set(sa[box]) | set(sb[box]))
        diff = {k: (sa[box].get(k), sb[box].get(k)) for k in keys if sa[box].get(k) != sb[box].get(k)}
        if diff:
            out[box] = diff
    return out


# ---- layers: recipe < --config YAML < command line ------------------------------------------
def resolve_config(config_file: str | Path | None = None, given: dict[str, Any] | None = None) -> TrainConfig:
    """The TrainConfig of ``consequence train [--config FILE] [options]``.

    The recipe named on the command line (``given["recipe"]``), else in the YAML file,
    supplies the base (its settings); the YAML file's keys override it, and command-line
    options override both. Without a ``run_dir`` the run goes to ``runs/<env>-<recipe>``
    (``runs/<env>-default`` without a recipe).

    Raises:
        ValueError: bad file, unknown recipe (says where it was named), bad key or value.
    """
    given = dict(given or {})
    data = TrainConfig.read_yaml(config_file) if config_file else {}
    named = given.get("recipe") or data.get("recipe")
    base: dict[str, Any] = {}
    if named:
        where = "--recipe" if given.get("recipe") else f"recipe: in {config_file}"
        try:
            recipe = load_recipe(named)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        base = {"run_dir": default_run_dir(recipe.name), **recipe.config}
        given["recipe"] = recipe.ref
    if data:  # the file's own values are checked even where the command line overrides them (with the
        # command line's other settings: a file without `teacher` is fine for a distillation recipe given --teacher)
        TrainConfig.checked(
            **{
                **base,
                **{k: v for k, v in given.items() if k not in data},
                **data,
                **({"recipe": given["recipe"]} if named else {}),
            }
        )
    merged = {**base, **data, **given}
    if isinstance(data.get("env_options"), dict) and isinstance(given.get("env_options"), dict):
        merged["env_options"] = {**data["env_options"], **given["env_options"]}  # key by key, like every layer
    if "run_dir" not in data and "run_dir" not in given:  # a run is named by its environment and recipe
        merged["run_dir"] = default_run_dir(recipe.name if named else "default", _env_name(merged))
    return TrainConfig.checked(**merged)


def _env_name(values: dict[str, Any]) -> str:
    """The environment part of a default run folder: a name, a module:attr's attribute, a task file's stem."""
    env = str(values.get("env") or values.get("tasks") or "repair")
    if env.endswith(".jsonl"):
        return "jsonl"
    return env.rsplit(":", 1)[-1].rsplit(".", 1)[-1] if ":" in env else env


def _knobs(recipe: Recipe | None = None) -> list[str]:
    return sorted(set(_bundled_knobs()) | set(recipe.config if recipe else ()))


def overrides(cfg: TrainConfig, recipe: Recipe) -> dict[str, tuple[Any, Any]]:
    """Algorithm settings where ``cfg`` departs from ``recipe``: {key: (recipe's, cfg's)}."""
    mine, theirs = cfg.model_dump(), recipe.train_config().model_dump()
    return {k: (theirs[k], mine[k]) for k in _knobs(recipe) if mine[k] != theirs[k]}


def run_label(cfg: TrainConfig) -> str:
    """What a run is, in a few words: the recipe's name when the settings are the recipe's,
    ``NAME (modified: k=v, ...)`` when a recipe's settings were changed, else the advantage,
    surrogate and reduction of the default loop (e.g. ``grpo advantages, ppo_clip, token_mean``).

    A config without a recipe whose algorithm settings equal a bundled recipe's is named
    after that recipe.
    """
    if cfg.recipe:
        try:
            recipe = load_recipe(cfg.recipe)
        except ValueError:
            return f"{cfg.recipe} (recipe not found)"
        changed = overrides(cfg, recipe)
        return recipe.name + (
            " (modified: " + ", ".join(f"{k}={_short(v)}" for k, (_, v) in changed.items()) + ")" if changed else ""
        )
    for name in recipe_names():
        if not overrides(cfg, load_recipe(name)):
            return name
    return f"{cfg.advantage} advantages, {cfg.surrogate}, {cfg.reduction}" + (
        f", KL β {cfg.kl_coef:g}" if cfg.kl_coef else ""
    )


def _short(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def recipe_of_train_config(path: str | Path) -> Recipe:
    """A train-config YAML (``consequence train --config PATH``) as a Recipe for ``explain``:
    its resolved settings (recipe < file) box by box, with the recipe's paper and sections.

    Raises:
        ValueError: the file is not a valid train config.
    """
    data = TrainConfig.read_yaml(path)
    cfg = resolve_config(path, {})
    base = load_recipe(cfg.recipe) if cfg.recipe else None
    keys = [
        k
        for k in TrainConfig.model_fields
        if box_of(k) in BOXES and (k in data or (base is not None and k in base.config))
    ]
    dumped = cfg.model_dump()
    return Recipe(
        name=Path(path).name,
        title=run_label(cfg),
        summary=(f"train config on recipe {base.name}: " + base.summary)
        if base
        else "train config without a recipe (the default loop with the file's settings)",
        paper=base.paper if base else "none (no recipe)",
        config={k: dumped[k] for k in keys},
        cite=dict(base.cite) if base else {},
        ref=cfg.recipe or "",
        run_command=f"consequence train --config {path}",
    )


def load_for_explain(name_or_path: str) -> Recipe:
    """A bundled recipe, a recipe file, or a train-config file (``recipe_of_train_config``).

    Raises:
        ValueError: unknown name, or a file that is neither a recipe nor a train config.
    """
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"{p} is not valid YAML ({yaml_problem(e)})") from None
        if isinstance(data, dict) and "config" not in data:
            return recipe_of_train_config(p)
    return load_recipe(name_or_path)
