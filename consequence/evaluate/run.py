"""``consequence eval`` and ``consequence compare``: evaluate policies on a task split.

Multi-turn sources (``repair``, ``humaneval-repair``, a JSONL task file) run n episodes
per task through the training harness with fixed budgets; ``humaneval`` samples n
single-turn completions (``consequence.evaluate.completions``). Results go to an output
folder: ``eval.json`` (every number, the settings and where each came from, the budgets,
the exclusion rule), ``episodes.parquet`` (raw per-episode results), ``report.md`` and
``cost.png`` (``consequence.evaluate.report``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consequence.evaluate.compare import ArmResult, paired_comparison
from consequence.evaluate.episode_eval import (
    EXCLUSION_RULE,
    attempts_vs_samples,
    cost_summary,
    distinct_correct,
    outcome_shares,
    per_task_counts,
    success_under_caps,
    summarize_pass_at_k,
)
from consequence.evaluate.progress import SILENT, Phases
from consequence.evaluate.recovery import recovery_openings
from consequence.evaluate.report import compare_markdown, markdown, write_compare, write_outputs  # noqa: F401
from consequence.evaluate.rollouts import sample_episodes
from consequence.evaluate.selection import SELECTION_RULES, check_rules, summarize_selection
from consequence.evaluate.shortcuts import shortcut_metrics
from consequence.evaluate.splits import record_touch, reuse_warning, weights_sha256
from consequence.harness.renderer import Renderer
from consequence.policy.tiny import load_policy
from consequence.records import Trajectory
from consequence.rollout.attempts import Attempts
from consequence.rollout.episodes import Budgets, opening_prompt_len
from consequence.sandbox.sandbox import ENV_RETRIES, isolation_report, run_tests
from consequence.seeding import seed_of

TOOL_CAPS = (1, 2, 3, 4, 5, 6, 8, 10)
TOKEN_CAPS = (32, 64, 96, 128, 192, 256, 384)


def resolve_model(path: str | None, option: str = "--model") -> Path:
    """A checkpoint folder; a run folder means its ``checkpoints/final``; None = the bundled model;
    a registered model name (``consequence.policy.named``) its converted folder (converted on first use);
    a Hugging Face hub id that names no local path its snapshot (``policy.named.hub_folder``).

    Raises:
        ValueError: the path does not exist or holds no ``config.json`` (nor a LoRA adapter's
            ``adapter_config.json``: ``policy.lora``); a name's package is
            missing (names the pip extra) or its conversion failed; a hub id offline and not
            cached, or its fetch failed.
    """
    if path is None:
        from consequence.policy.tiny import BUNDLED

        return BUNDLED
    from consequence.config import is_hub_id
    from consequence.policy.named import is_named, model_folder

    if is_named(path) or is_hub_id(path):  # resolved in one place (converted, or fetched from the hub)
        return model_folder(path, option=option)
    from consequence.policy.lora import is_model_folder

    p = Path(path)
    if is_model_folder(p / "checkpoints" / "final"):
        return p / "checkpoints" / "final"
    if not is_model_folder(p):
        raise ValueError(
            f"{option} {p}: "
            + (
                "no such folder"
                if not p.exists()
                else "neither a checkpoint folder (config.json, or a LoRA adapter's adapter_config.json) "
                "nor a run folder (checkpoints/final)"
            )
        )
    return p


def check_distinct(a: Path, b: Path) -> None:
    """``compare`` needs two policies.

    Raises:
        ValueError: A and B are the same checkpoint folder, or their weight files are
            identical (sha256), so the comparison would measure nothing.
    """
    if a.resolve() == b.resolve():
        raise ValueError(f"A and B are the same checkpoint folder ({a.resolve()}): give two different policies")
    ha, hb = weights_sha256(a), weights_sha256(b)
    if ha is not None and ha == hb:
        raise ValueError(
            f"A ({a}) and B ({b}) have identical weights (sha256 {ha[:12]}…): the comparison would "
            "measure nothing; give two different policies"
        )


def default_samples(n: int | None, temperature: float) -> int:
    """Samples per task when ``-n`` is not given: 1 for greedy decoding (``temperature == 0``:
    every sample of a task would repeat the same tokens), else 10."""
    if n is not None:
        return n
    return 1 if temperature == 0 else 10


def check_request(
    split: str,
    n: int,
    ks: list[int],
    temperature: float = 1.0,
    problems: int = 0,
    splits: Sequence[str] = ("train", "validation", "test"),
) -> None:
    """Reject a bad request before any work.

    Raises:
        ValueError: a split not in ``splits``, n < 1, some k > n or k < 1, a negative
            temperature or number of problems.
    """
    if temperature < 0:
        raise ValueError(f"--temperature {temperature}: must be >= 0 (0 = greedy)")
    if problems < 0:
        raise ValueError(f"--problems {problems}: must be >= 0 (0 = every problem of the split)")
    if split not in splits:
        raise ValueError(f"--split {split!r}: valid splits are {', '.join(splits)}")
    if n < 1:
        raise ValueError(f"-n must be >= 1 (samples per task), got {n}")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"-k {bad}: every k must be between 1 and n = {n} (pass@k needs n >= k samples)")


def problem_count(env, split: str, problems: int = 0) -> int:
    """How many problems an evaluation of ``split`` runs: every problem of the split
    (``problems`` 0), else ``problems`` but no more than the split holds."""
    pool = env.split[split]
    return min(problems, len(pool)) if problems else len(pool)


def check_problems(env, split: str, purpose: str = "the evaluation") -> None:
    """Refuse, before any work, an evaluation over no problem (a mean over nothing is NaN).

    The environment's own check comes first (``Environment.check_splits``: e.g. the
    calculator's held-out shift, which has no train split, says so and names the fix).

    Raises:
        ValueError: ``split`` of ``env`` holds no problem (names the split, the sizes and the fix).
    """
    env.check_splits({split: f"--split {split}"})
    if not env.split.get(split):  # an override of check_splits that does not refuse it
        sizes = ", ".join(f"{k} {len(v)}" for k, v in env.split.items())
        raise ValueError(
            f"--split {split}: the {split} split of --env {env.label} holds no problem ({sizes}), so "
            f"{purpose} would run over nothing; give a split that holds problems"
        )


@dataclass
class EpisodeEval:
    """One evaluation: the numbers (``result``, what ``eval.json`` holds) and the raw
    scored episodes, plain and (when run) from the recovery diagnostic's opening."""

    result: dict[str, Any]
    episodes: list[Trajectory]
    recovery_episodes: list[Trajectory] = field(default_factory=list)


def check_budget_fits(renderer, env, task_list, budgets: Budgets) -> None:
    """Refuse a token budget in which no episode could make one model call (before any work).

    A prompt too long for the budget is an outcome (``prompt too long``, counted as a
    failure; case 04), but when even the shortest prompt plus ``max_new_tokens`` exceeds
    ``max_total_tokens`` every episode would be empty and the report meaningless.

    Raises:
        ValueError: names ``--max-total-tokens``, the shortest prompt and the smallest budget that fits.
    """
    shortest = min(
        (opening_prompt_len(renderer, env.system_prompt, env.request(t), env.examples) for t in task_list), default=0
    )
    if task_list and shortest + budgets.max_new_tokens > budgets.max_total_tokens:
        raise ValueError(
            f"--max-total-tokens {budgets.max_total_tokens} is too small: the shortest prompt of these "
            f"tasks is {shortest} tokens and a model call may add --max-new-tokens "
            f"{budgets.max_new_tokens}, so no episode could act; raise --max-total-tokens to at least "
            f"{shortest + budgets.max_new_tokens}"
        )


def evaluate_episodes(
    model_path: Path,
    env,
    split: str,
    n: int,
    ks: list[int],
    *,
    problems: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    budgets: Budgets = Budgets(),
    selection: Sequence[str] = SELECTION_RULES,
    recovery: bool = True,
    purpose: str = "consequence eval",
    companions: Sequence[Path] = (),
    provenance: dict[str, Any] | None = None,
    phases: Phases = SILENT,
    label: str = "",
    device: Any = "cpu",
    attempts: Attempts | None = None,
) -> EpisodeEval:
    """n episodes per task of the split's problems of environment ``env`` (an
    :class:`~consequence.envs.api.Environment`, made with its split seed; ``problems`` of
    them, drawn with ``seed``, when > 0).

    Reports pass@k (unbiased, per task then averaged, bootstrap CI over problems),
    final-selection success per rule and k, outcome shares (a prompt that does not fit
    stays in the denominator: case 04), cost and success against caps, environment
    errors with the exclusion rule, the recovery diagnostic (n more episodes per task
    that has a wrong first patch), and the split touch (recorded in the ledger once the
    model has loaded, with a warning by the rule of ``splits.reuse_warning``; the
    ``companions`` — the other arm of a comparison — count as this evaluation's own).
    ``provenance`` (``EvalSettings.record()``) is stored in the settings; ``phases``
    shows each phase's progress (``label`` prefixes the phase names, e.g. ``"A "``).
    ``device`` (a ``torch.device`` or its name, already checked: ``policy.device.resolve_device``)
    is where the model computes. ``attempts`` (``rollout.attempts.check_attempts``, k ≤ n): n more
    episodes per task on the plain episodes' random streams, each answering up to k times with
    the environment's feedback; ``result["attempts"]`` holds success@attempt j beside pass@j
    of the plain episodes (``episode_eval.attempts_vs_samples``), j = 1..k.

    Raises:
        ValueError: unknown selection rule; a split without problems (:func:`check_problems`).
    """
    selection = check_rules(selection)
    split_seed = env.split_seed
    check_problems(env, split)
    count = problem_count(env, split, problems)
    task_list = env.sample(split, count, seed=seed_of(seed, "eval", split))
    model, tok = load_policy(model_path)
    model.to(device)
    renderer = Renderer(tok, env.tools)
    check_budget_fits(renderer, env, task_list, budgets)
    mine = [str(model_path), *map(str, companions)]
    warning = reuse_warning(env.label, split_seed, mine) if split == "test" else None
    touch = record_touch(env.label, split_seed, split, purpose, [str(model_path)])
    t0 = time.perf_counter()
    with phases.phase(f"{label}episodes", len(task_list) * n) as tick:
        trajs = sample_episodes(model, renderer, env, task_list, n, budgets, seed, temperature, progress=tick)
    plain_wall = time.perf_counter() - t0
    counts = per_task_counts(trajs)
    by_id = {t.task_id: t for t in task_list}
    notes = []
    if "visible" in selection and not any(getattr(t, "visible_tests", None) for t in task_list):
        selection = tuple(r for r in selection if r != "visible")
        notes.append("final-selection rule 'visible' left out: these tasks have no visible tests to run")
    visible = _visible_scores(trajs, by_id, phases, label) if "visible" in selection else None
    result = {
        "settings": {
            "model": str(model_path),
            "tasks": env.label,
            "environment": env.describe(),
            "split": split,
            "split_seed": split_seed,
            "problems": count,
            "n": n,
            "ks": ks,
            "temperature": temperature,
            "seed": seed,
            "budgets": vars(budgets),
            "device": str(device),
            "isolation": isolation_report(),
            "provenance": provenance,
        },
        "exclusion_rule": EXCLUSION_RULE,
        "env_errors": sum(d["env_errors"] for d in counts),
        "env_retries": sum(t.env_retries for t in trajs),
        "retry_rule": f"a sandbox that cannot start is re-run (same code, tests, limits) up to {ENV_RETRIES} more "
        "times; still failing, the episode is an env_error",
        "pass_at_k": summarize_pass_at_k(counts, ks, seed=seed),
        "diversity": distinct_correct(trajs),
        "final_selection": summarize_selection(trajs, ks, selection, visible, seed=seed),
        "outcomes": outcome_shares(trajs),
        "cost": cost_summary(trajs, wall_s=plain_wall),
        "shortcuts": shortcut_metrics(trajs),  # tool use, invalid calls, answers (evaluate/shortcuts.py)
        "success_vs_tool_call_cap": dict(
            zip(map(str, TOOL_CAPS), success_under_caps(trajs, "n_tool_calls", TOOL_CAPS))
        ),
        "success_vs_token_cap": dict(
            zip(map(str, TOKEN_CAPS), success_under_caps(trajs, "n_generated_tokens", TOKEN_CAPS))
        ),
        "per_task": counts,
        "splits_touched": [touch],
        "warnings": [warning] if warning else [],
        "notes": notes,
    }
    rtrajs: list[Trajectory] = []
    if recovery:
        kept, openings = recovery_openings(task_list)
        if kept:
            with phases.phase(f"{label}recovery episodes", len(kept) * n) as tick:
                rtrajs = sample_episodes(
                    model,
                    renderer,
                    env,
                    kept,
                    n,
                    budgets,
                    seed_of(seed, "recovery"),
                    temperature,
                    openings=openings,
                    progress=tick,
                )
            result["recovery"] = recovery_summary(trajs, rtrajs, len(task_list), seed)
        else:  # no task has a decoy (question-answer environments): nothing to open with
            result["recovery"] = {"tasks": 0, "tasks_without_wrong_patch": len(task_list), "not_run": True}
    if attempts is not None:  # the same streams as the plain episodes: attempt 1 is their first answer
        with phases.phase(f"{label}episodes with {attempts.k} attempts", len(task_list) * n) as tick:
            atrajs = sample_episodes(
                model, renderer, env, task_list, n, budgets, seed, temperature, progress=tick, attempts=attempts
            )
        result["attempts"] = {
            "k": attempts.k,
            "discount": attempts.discount,
            "episodes": len(atrajs),
            "by_j": attempts_vs_samples(atrajs, trajs, attempts.k),
        }
    result["wall_s"] = time.perf_counter() - t0
    return EpisodeEval(result, trajs, rtrajs)


def _visible_scores(trajs: Sequence[Trajectory], tasks_by_id: dict, phases: Phases, label: str = ""):
    """Visible tests passed by each submitted episode's final program, run in the sandbox
    on 4 threads up front (the ``visible`` rule's signal); returns ``score(trajectory)``."""
    todo = [t for t in trajs if t.outcome == "finished" and getattr(tasks_by_id[t.task_id], "visible_tests", None)]
    scores: dict[int, int] = {}
    with (
        phases.phase(f"{label}visible tests (selection)", len(todo), "programs") as tick,
        ThreadPoolExecutor(4, thread_name_prefix="visible") as ex,
    ):
        add = phases.counter(tick)

        def one(t: Trajectory) -> None:
            scores[id(t)] = run_tests(t.final_code or "", tasks_by_id[t.task_id].visible_tests).passed
            add(1)

        list(ex.map(one, todo))

    def score(t: Trajectory) -> int:
        return scores.get(id(t), 0)

    return score


def recovery_summary(
    trajs: Sequence[Trajectory], recovery_trajs: Sequence[Trajectory], n_tasks: int, seed: int = 0
) -> dict[str, Any]:
    """Recovery rate from the wrong first patch beside the plain success on the same tasks.

    Both are the mean over problems of the per-task success rate (pass@1), with a
    bootstrap CI over problems; environment errors are excluded by the same rule.
    """
    ids = {t.group_id for t in recovery_trajs}
    plain = summarize_pass_at_k(per_task_counts([t for t in trajs if t.group_id in ids]), [1], seed=seed)["1"]
    rec = summarize_pass_at_k(per_task_counts(recovery_trajs), [1], seed=seed)["1"]
    return {
        "opening": "replace_line with the task's first decoy on the bug line, then run_tests",
        "tasks": len(ids),
        "tasks_without_wrong_patch": n_tasks - len(ids),
        "env_errors": sum(t.outcome == "env_error" for t in recovery_trajs),
        "recovery": rec,
        "plain_success_same_tasks": plain,
    }


def compare_policies(
    a: Path,
    b: Path,
    env,
    split: str,
    n: int,
    *,
    ks: Sequence[int] = (1,),
    problems: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    budgets: Budgets = Budgets(),
    recovery: bool = True,
    provenance: dict[str, Any] | None = None,
    phases: Phases = SILENT,
    device: Any = "cpu",
) -> dict[str, Any]:
    """Both policies on the same task instances with the same seeds, split seed and budgets;
    paired difference of success (b − a) with a bootstrap CI over problems, and per-problem
    wins; with ``recovery`` the same for the recovery diagnostic (same openings, same
    seeds). Each policy's own report (pass@k and final selection at ``ks``) is kept under
    "a" / "b"."""
    kw: dict[str, Any] = dict(  # the same settings for both policies
        problems=problems,
        temperature=temperature,
        seed=seed,
        budgets=budgets,
        recovery=recovery,
        purpose="consequence compare",
        provenance=provenance,
        phases=phases,
        device=device,
    )
    ea = evaluate_episodes(a, env, split, n, list(ks), companions=[b], label="A ", **kw)
    eb = evaluate_episodes(b, env, split, n, list(ks), companions=[a], label="B ", **kw)
    out = {
        "a": ea.result,
        "b": eb.result,
        "paired": paired_comparison(ArmResult(str(a), ea.episodes), ArmResult(str(b), eb.episodes), seed=seed),
    }
    if recovery and ea.recovery_episodes:
        out["paired_recovery"] = paired_comparison(
            ArmResult(str(a), ea.recovery_episodes), ArmResult(str(b), eb.recovery_episodes), seed=seed
        )
    return out
