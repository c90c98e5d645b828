"""The evaluation inside a training run: periodic validation and the final paired comparison.

Both play the same harness, environment, budgets and verifier as training; the final
comparison runs the starting policy (warm start) and the RL checkpoint on the same
episodes (same task instances, same seeds) so their difference can be paired.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from consequence.evaluate.compare import (
    ArmResult,
    constant_answer_warning,
    copied_answer_warning,
    paired_comparison,
    summarize,
)
from consequence.evaluate.progress import Phases, Tick
from consequence.evaluate.rollouts import run_eval
from consequence.records import write_trajectories
from consequence.seeding import seed_of


def validate(model, renderer, split, budgets, cfg, progress: Tick | None = None) -> dict[str, Any]:
    """Greedy success on ``cfg.val_episodes`` validation tasks (chooses checkpoints, never test);
    ``success`` is None when every episode was an env error (``evaluate.compare.summarize``).

    ``progress(n_done)`` is called with the episodes finished so far.
    """
    tasks = split.sample("validation", cfg.val_episodes, seed=seed_of(cfg.eval_seed, "val"))
    return summarize(run_eval(model, renderer, split, tasks, budgets, cfg.eval_seed, greedy=True, progress=progress))


def final_report(cfg, reference, model, renderer, split, budgets, console, run: Path) -> dict[str, Any]:
    """Warm start vs RL checkpoint on the same episodes: (a) test split, (b) train problems
    (those of ``cfg.final_eval_splits``, in that order).

    Each split is evaluated with every decoding in ``cfg.final_eval_decoding``; sampled
    episodes use the same seeds for both policies. Every (split, decoding, policy) is one
    phase with its progress bar (episodes done / total, episodes/s) on ``console``.
    """
    n = cfg.final_eval_episodes
    sets = {
        "test (unseen problems)": split.sample("test", n, seed=seed_of(cfg.eval_seed, "test")),
        "train problems, new instances (in-distribution)": split.sample(
            "train", n, seed=seed_of(cfg.eval_seed, "fresh")
        ),
    }
    sets = {name: tasks for name, tasks in sets.items() if name.split(" ")[0] in cfg.final_eval_splits}
    out: dict[str, Any] = {
        "episodes_per_split": n,
        "training_seeds": [cfg.seed],  # one run: its CIs cover problems and sampling, not training seeds
        "eval_seed": cfg.eval_seed,
        "budgets": vars(budgets),
        "results": [],
        "evaluation_files": [],
        "answer_warnings": [],
    }
    with Phases(console) as phases:
        for decoding in cfg.final_eval_decoding:
            for name, tasks in sets.items():
                if tasks:
                    res = _compare_arms(
                        cfg,
                        reference,
                        model,
                        renderer,
                        split,
                        budgets,
                        run,
                        phases,
                        name,
                        tasks,
                        decoding,
                        out["evaluation_files"],
                    )
                    out["results"].append(res)
                    for warn in (constant_answer_warning, copied_answer_warning):
                        if w := warn(name.split(" ")[0], decoding, res["warm_start"], res["rl"]):
                            out["answer_warnings"].append(w)
    return out


def _compare_arms(
    cfg,
    reference,
    model,
    renderer,
    env,
    budgets,
    run: Path,
    phases: Phases,
    name: str,
    tasks,
    decoding: str,
    files: list[str],
) -> dict[str, Any]:
    """Both policies on the same episodes of one split and decoding; their raw episodes are written."""
    greedy = decoding == "greedy"
    arms = []
    for label, policy in (("warm start", reference), ("RL", model)):
        with phases.phase(f"final evaluation: {name.split(' ')[0]}, {decoding}, {label}", len(tasks)) as tick:
            # sampled: at the training temperature (the documented rule), not the sampler's default of 1
            arms.append(
                ArmResult(
                    label,
                    run_eval(
                        policy,
                        renderer,
                        env,
                        tasks,
                        budgets,
                        cfg.eval_seed,
                        greedy,
                        temperature=cfg.temperature,
                        progress=tick,
                    ),
                )
            )
    a, b = arms
    for arm, tag in ((a, "warmstart"), (b, "rl")):
        path = run / "eval" / f"{name.split(' ')[0]}-{decoding}-{tag}.parquet"
        write_trajectories(path, arm.trajectories)
        files.append(str(path.relative_to(run)))
    return {
        "split": name,
        "decoding": decoding,
        "comparison": paired_comparison(a, b, seed=cfg.eval_seed),
        "warm_start": summarize(a.trajectories),
        "rl": summarize(b.trajectories),
    }
