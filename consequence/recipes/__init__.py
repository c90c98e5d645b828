"""Recipes: every named algorithm as a choice in each box of the one loop.

A recipe is a YAML file with ``name``, ``title``, ``summary``, ``paper``, ``cite`` (box →
paper section that motivates the box's setting) and ``config`` (TrainConfig keys). The
bundled ones live next to this file; ``consequence train --recipe NAME|PATH`` starts from
a recipe's config, and ``consequence explain NAME [NAME]`` shows its boxes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from consequence.config import BOXES, TrainConfig, box_of

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

    def train_config(self, **overrides) -> TrainConfig:
        """The TrainConfig of this recipe (defaults for keys it does not set), with overrides.

        Raises:
            ValueError: a key or value is invalid (names the key).
        """
        return TrainConfig.checked(**{"run_dir": f"runs/repair-{self.name}", "recipe": self.name,
                                      **self.config, **overrides})


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
    if not (p.suffix in (".yaml", ".yml") and p.is_file()):
        p = HERE / f"{name_or_path}.yaml"
        if not p.is_file():
            raise ValueError(f"unknown recipe {str(name_or_path)!r}; bundled recipes: {', '.join(recipe_names())} "
                             "(or give the path of a recipe .yaml file)")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {p} is not valid YAML: {e}") from None
    missing = [k for k in ("name", "title", "summary", "paper", "config") if not isinstance(data, dict) or k not in data]
    if missing:
        raise ValueError(f"recipe {p} lacks {', '.join(missing)}")
    unknown = [k for k in data["config"] if k not in TrainConfig.model_fields]
    if unknown:
        raise ValueError(f"recipe {p}: unknown config key(s) {', '.join(unknown)}; see `consequence train --help`")
    bad_boxes = [b for b in data.get("cite", {}) if b not in BOXES]
    if bad_boxes:
        raise ValueError(f"recipe {p}: cite names unknown box(es) {', '.join(bad_boxes)}; boxes: {', '.join(BOXES)}")
    recipe = Recipe(data["name"], data["title"], data["summary"], data["paper"], dict(data["config"]),
                    dict(data.get("cite", {})))
    recipe.train_config()  # validate the values now, not when training starts
    return recipe


@functools.lru_cache(maxsize=1)
def _bundled_knobs() -> tuple[str, ...]:
    """Config keys that any bundled recipe sets (read once per process)."""
    return tuple(sorted({k for n in recipe_names() for k in load_recipe(n).config}))


def box_settings(recipe: Recipe) -> dict[str, dict[str, Any]]:
    """box → {setting: value} for the settings that define the algorithm.

    A setting is listed when any bundled recipe sets it (the algorithm's knobs); budgets,
    paths and evaluation settings are left out because every recipe shares them.
    """
    cfg = recipe.train_config().model_dump()
    cfg["clip_eps_high"] = cfg["clip_eps_high"] or cfg["clip_eps"]  # show the effective upper range
    knobs = sorted(set(_bundled_knobs()) | set(recipe.config))
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
