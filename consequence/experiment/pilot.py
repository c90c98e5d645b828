"""A pilot before an experiment: each arm's starting policy on a few train tasks, to measure
what the budget arithmetic assumes (the seeds: check the environment and the acceptance rate
on 50–100 tasks before the real run).

Per arm: N train tasks × G samples at the arm's temperature and budgets (``consequence eval``
underneath), giving the mixed-group fraction (the share of tasks whose G samples neither all
succeed nor all fail: dynamic sampling's α), the verified share (rejection sampling's α), the
truncation rate and L̄; then the arm's budget planned with them. Arms with the same model,
environment, budgets and temperature share one pilot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from consequence.experiment.spec import Experiment


def pilot_measures(result: dict[str, Any]) -> dict[str, float]:
    """What a pilot measures, from a ``consequence eval`` result (``eval.json``):

    ``mixed_group_fraction`` = tasks with 0 < c < n / tasks with n > 0 (c successes of n valid
    samples); ``verified_share`` = Σc / Σn; ``truncated`` = the share of episodes whose outcome
    is a truncation; ``mean_tokens`` = generated tokens per episode.

    Raises:
        ValueError: no task with a valid sample.
    """
    tasks = [t for t in result["per_task"] if t["n"] > 0]
    if not tasks:
        raise ValueError("the pilot has no task with a valid episode (every one was an environment error)")
    shares = result["outcomes"]["shares"]
    return {
        "tasks": float(len(tasks)),
        "mixed_group_fraction": sum(0 < t["c"] < t["n"] for t in tasks) / len(tasks),
        "verified_share": sum(t["c"] for t in tasks) / sum(t["n"] for t in tasks),
        "truncated": sum(v for k, v in shares.items() if k.startswith("truncated")),
        "mean_tokens": float(result["cost"]["gen_tokens_per_episode"]),
    }


def acceptance_of(cfg, measured: dict[str, float]) -> float:
    """The α the arm's plan needs: the mixed-group fraction under dynamic sampling, the
    verified share under rejection sampling, else 1 (everything generated is kept)."""
    if cfg.dynamic_sampling:
        return measured["mixed_group_fraction"]
    if cfg.advantage == "rejection":
        return measured["verified_share"]
    return 1.0


def run_pilot(exp: Experiment, n_tasks: int, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Each trained arm's pilot measures, its α, and its planned budget with them.

    Returns:
        arm → ``{"measured": ..., "acceptance_rate": α, "planned": [BudgetLine dicts], "pilot": folder}``.

    Raises:
        ValueError: ``n_tasks`` < 1, or an arm's evaluation is refused.
    """
    from consequence import api
    from consequence.experiment.budget import plan_lines
    from consequence.experiment.run import run_config

    if n_tasks < 1:
        raise ValueError(f"--pilot {n_tasks}: give the number of train tasks (e.g. 64)")
    done: dict[tuple, tuple[dict[str, float], Path]] = {}
    out = {}
    for arm in (a for a in exp.arms if a.trains):
        cfg = run_config(exp, arm, exp.seeds[0])
        key = (cfg.model, cfg.env, tuple(sorted(cfg.env_options.items())), cfg.tasks_file, cfg.split_seed,
               cfg.group_size, cfg.temperature, cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens)  # fmt: skip
        if key not in done:
            folder = exp.folder / "pilot" / arm.name
            result = api.evaluate(
                cfg.model,
                cfg.env,
                split="train",
                split_seed=cfg.split_seed,
                env_options=cfg.env_options,
                tasks_file=cfg.tasks_file,
                n=cfg.group_size,
                problems=n_tasks,
                temperature=cfg.temperature,
                seed=seed,
                selection="first",
                recovery=False,
                max_turns=cfg.max_turns,
                max_new_tokens=cfg.max_new_tokens,
                max_total_tokens=cfg.max_total_tokens,
                out=folder,
            )
            done[key] = (pilot_measures(result), folder)
        measured, folder = done[key]
        alpha = acceptance_of(cfg, measured)
        lines = plan_lines(cfg, measured["mean_tokens"], alpha) if alpha > 0 or cfg.dynamic_sampling else []
        out[arm.name] = {
            "measured": measured,
            "acceptance_rate": alpha,
            "planned": [vars(x) for x in lines],
            "pilot": str(folder),
        }
    return out
