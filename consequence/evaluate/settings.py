"""Which split seed, task source and budgets an evaluation uses, and where each came from.

A policy given as a run folder (``RUN/config.yaml`` beside ``RUN/checkpoints/final``) was
trained on one split of the problems and under given budgets; evaluating it on another
split seed scores "test" problems it trained on, and other budgets measure another
system. So for a run folder these settings are read from its ``config.yaml``:

    env, tasks_file, env_options (the environment and its task source), split_seed,
    max_turns, max_new_tokens, max_total_tokens

(a run written before environments were plug-ins has ``tasks`` instead of ``env``: read as ``env``).

A command-line option that is given (not None) overrides the run's value, and the report
says so. Without a run folder the option or the default applies. For ``compare``, the two
arms share one set of settings: values from both runs must agree, else the comparison is
refused unless the option is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from consequence.config import flat_settings
from consequence.rollout.episodes import Budgets

ENV_KEYS: tuple[str, ...] = ("env", "tasks_file", "env_options")
RUN_KEYS: tuple[str, ...] = (*ENV_KEYS, "split_seed", "max_turns", "max_new_tokens", "max_total_tokens")
DEFAULTS: dict[str, Any] = {
    "env": "repair",
    "tasks_file": None,
    "env_options": {},
    "split_seed": 0,
    "max_turns": Budgets.max_turns,
    "max_new_tokens": Budgets.max_new_tokens,
    "max_total_tokens": Budgets.max_total_tokens,
}
OPTION = {k: "--" + k.replace("_", "-") for k in RUN_KEYS} | {"env_options": "--env-option"}


def run_config(path: str | Path | None) -> tuple[Path, dict[str, Any]] | None:
    """``(path of config.yaml, its mapping)`` when ``path`` is a run folder (``RUN``) or a
    checkpoint of one (``RUN/checkpoints/NAME``), else None.

    Raises:
        ValueError: ``config.yaml`` exists but is not a YAML mapping.
    """
    if path is None:
        return None
    p = Path(path)
    cfg = p / "config.yaml"
    if not cfg.is_file() and p.parent.name == "checkpoints":
        cfg = p.parent.parent / "config.yaml"
    if not cfg.is_file():
        return None
    try:
        data = flat_settings(yaml.safe_load(cfg.read_text(encoding="utf-8")))
    except (yaml.YAMLError, UnicodeDecodeError, OSError, ValueError) as e:
        raise ValueError(f"{cfg}: the run's config is not readable YAML ({e}); fix or remove it") from None
    if not isinstance(data, dict):
        raise ValueError(f"{cfg}: the run's config must be a mapping of option: value")
    if "tasks" in data and "env" not in data:  # written before environments were plug-ins
        old = data.pop("tasks")
        data |= {"env": "jsonl", "tasks_file": old} if str(old).endswith(".jsonl") else {"env": old}
    return cfg, data


@dataclass
class EvalSettings:
    """The settings in force and their origin.

    ``values[k]``: the value used for each of :data:`RUN_KEYS`. ``origin[k]``: ``"run"``
    (from the run's config.yaml), ``"option"`` (given on the command line, overriding a
    run's different value or with no run value) or ``"default"``. ``runs``: arm name ->
    config.yaml path of every policy that is a run folder; ``run_values[k]``: arm -> value.
    """

    values: dict[str, Any]
    origin: dict[str, str]
    runs: dict[str, str] = field(default_factory=dict)
    run_values: dict[str, dict[str, Any]] = field(default_factory=dict)
    keys: tuple[str, ...] = RUN_KEYS

    def budgets(self) -> Budgets:
        """The episode budgets (``max_tool_calls`` keeps its default)."""
        v = self.values
        return Budgets(int(v["max_turns"]), int(v["max_new_tokens"]), int(v["max_total_tokens"]))

    def record(self) -> dict[str, Any]:
        """What the report stores: every key with its value, origin and the runs' values."""
        return {
            "runs": dict(self.runs),
            "keys": {
                k: {"value": self.values[k], "from": self.origin[k], "runs": self.run_values.get(k, {})}
                for k in self.keys
            },
        }


def describe(record: Mapping[str, Any]) -> str:
    """One sentence for reports and the console: which settings came from the run(s),
    which options overrode them, which are defaults."""
    keys = record["keys"]
    name = {
        "env": "environment",
        "tasks_file": "task file",
        "env_options": "environment options",
        "split_seed": "split seed",
    }

    def show(k: str) -> str:
        return f"{name.get(k, k)} {keys[k]['value']}"

    parts = []
    if record["runs"]:
        runs = ", ".join(f"{arm} `{p}`" if arm else f"`{p}`" for arm, p in record["runs"].items())
        taken = [show(k) for k in keys if keys[k]["from"] == "run"]
        parts.append(f"from the run ({runs}): " + (", ".join(taken) if taken else "nothing"))
        over = [
            f"{show(k)} ({OPTION[k]}; run: {', '.join(dict.fromkeys(map(str, keys[k]['runs'].values())))})"
            for k in keys
            if keys[k]["from"] == "option" and keys[k]["runs"]
        ]
        parts.append("overridden on the command line: " + (", ".join(over) if over else "nothing"))
    else:
        parts.append("not a run folder, so nothing is taken from a run")
    given = [
        show(k)
        for k in keys
        if keys[k]["from"] == "option" and not keys[k]["runs"] and keys[k]["value"] not in (None, {}, "")
    ]
    if given:
        parts.append("given on the command line: " + ", ".join(given))
    defaults = [show(k) for k in keys if keys[k]["from"] == "default" and keys[k]["value"] not in (None, {}, "")]
    if defaults:
        parts.append("defaults: " + ", ".join(defaults))
    return "Settings " + "; ".join(parts) + "."


def resolve_settings(
    policies: Sequence[tuple[str, str | Path | None]],
    options: Mapping[str, Any],
    keys: Sequence[str] = RUN_KEYS,
    defaults: Mapping[str, Any] = DEFAULTS,
) -> EvalSettings:
    """Merge the runs' configs (for each ``(arm name, policy path)``) with the options.

    ``options[k]`` is None when not given. A key that two runs set to different values
    needs its option. Only ``keys`` are taken from the runs (HumanEval completion takes
    the split seed, not the multi-turn budgets); ``defaults`` fill the rest.

    Raises:
        ValueError: a run's config.yaml is unreadable, or two runs disagree on a key whose
            option was not given (the message names both values and the option to pass).
    """
    runs: dict[str, str] = {}
    per_key: dict[str, dict[str, Any]] = {k: {} for k in keys}  # key -> arm -> the run's value
    for arm, path in policies:
        found = run_config(path)
        if found is None:
            continue
        runs[arm] = str(found[0])
        for k in keys:
            if k in found[1] and found[1][k] is not None:
                per_key[k][arm] = found[1][k]
    values, origin = {}, {}
    for k in keys:
        given, seen = options.get(k), per_key[k]
        if given is not None:
            values[k], origin[k] = given, "option"
        elif seen and len(set(map(str, seen.values()))) > 1:
            raise ValueError(_disagreement(k, seen))
        elif seen:
            values[k], origin[k] = next(iter(seen.values())), "run"
        else:
            values[k], origin[k] = defaults[k], "default"
    return EvalSettings(values, origin, runs, {k: v for k, v in per_key.items() if v}, tuple(keys))


def check_budgets(values: Mapping[str, Any]) -> None:
    """The budgets in ``values`` (those present) are usable.

    Raises:
        ValueError: a budget below its minimum (turns and tokens per call >= 1, tokens per
            episode >= 16, as in training), naming the option.
    """
    for key, low in (("max_turns", 1), ("max_new_tokens", 1), ("max_total_tokens", 16)):
        v = values.get(key)
        if v is not None and (not isinstance(v, int) or v < low):
            raise ValueError(f"{OPTION[key]} {v}: must be an integer >= {low}")


def _disagreement(key: str, seen: Mapping[str, Any]) -> str:
    what = ", ".join(f"{arm} was trained with {OPTION[key]} {v}" for arm, v in seen.items())
    why = (
        "their splits differ, so one arm's test problems are the other's training problems"
        if key in ("split_seed", *ENV_KEYS)
        else "their budgets differ, so one setting would misjudge the other arm"
    )
    return f"{what}: {why}; pass {OPTION[key]} to evaluate both under one setting"
