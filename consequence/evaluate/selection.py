"""Final-selection success: the system submits ONE of k candidates (docs/design.md §7).

pass@k says a correct candidate exists among k; a user gets only the one the system
picks. Here each task's valid episodes (sample order, environment errors dropped) are cut
into ⌊n/k⌋ disjoint blocks of k; in every block one candidate is chosen by a rule that
sees no hidden test, and only that candidate's hidden-test result counts. The task's
value is the mean over its blocks; the score is the mean over problems with a bootstrap
CI over problems, reported beside pass@k (its upper bound: the oracle pick).

Rules (candidates are the episodes that submitted with ``finish``; an episode that did
not submit is never picked, and a block without a submission is a failure):

- ``first``: the first submitted candidate, as a system without a judge would do;
- ``majority``: the final program submitted most often (compared after stripping
  trailing whitespace of each line), ties to the earliest;
- ``visible``: the candidate passing the most visible tests (run again on its final
  program in the sandbox), ties to the earliest.

Source: the distinction between pass@k and the success of the chosen answer follows the
seed text's section on pass@1, pass@k and final-selection success; majority voting as
as in Wang et al. 2023 (self-consistency), selection by the visible tests as in the
filtering step of Li et al. 2022 (AlphaCode).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from consequence.evaluate.episode_eval import solved
from consequence.evaluate.stats import binomial_se, bootstrap_mean_ci
from consequence.records import Trajectory

SELECTION_RULES: tuple[str, ...] = ("first", "majority", "visible")

# visible_score(trajectory) -> number of visible tests its final program passes.
VisibleScore = Callable[[Trajectory], int]


def check_rules(rules: Sequence[str]) -> list[str]:
    """The rules as a list, checked.

    Raises:
        ValueError: no rule, or one not in :data:`SELECTION_RULES`.
    """
    rules = list(rules)
    if not rules or any(r not in SELECTION_RULES for r in rules):
        raise ValueError(
            f"--selection {','.join(rules)!r}: give one or more of {', '.join(SELECTION_RULES)}, comma-separated"
        )
    return rules


def _program(t: Trajectory) -> str:
    return "\n".join(line.rstrip() for line in (t.final_code or "").split("\n")).strip()


def pick(block: Sequence[Trajectory], rule: str, visible_score: VisibleScore | None = None) -> Trajectory | None:
    """The candidate ``rule`` submits from ``block`` (None when no episode submitted).

    Raises:
        ValueError: unknown rule, or ``visible`` without ``visible_score``.
    """
    if rule not in SELECTION_RULES:
        raise ValueError(f"selection rule {rule!r}: valid rules are {', '.join(SELECTION_RULES)}")
    submitted = [t for t in block if t.outcome == "finished"]
    if not submitted:
        return None
    if rule == "first":
        return submitted[0]
    if rule == "majority":
        votes = Counter(_program(t) for t in submitted)
        best = max(votes.values())
        return next(t for t in submitted if votes[_program(t)] == best)
    if visible_score is None:
        raise ValueError("the 'visible' rule needs visible_score (tests the final program can be run on)")
    scores = [visible_score(t) for t in submitted]
    return submitted[scores.index(max(scores))]


def task_selection_success(
    episodes: Sequence[Trajectory], k: int, rule: str, visible_score: VisibleScore | None = None
) -> float | None:
    """Mean over the ⌊n/k⌋ disjoint blocks of k valid episodes of 1[picked candidate solved].

    ``episodes`` are one task's episodes in sample order. None when fewer than k are valid.
    """
    valid = [t for t in episodes if t.outcome != "env_error"]
    blocks = [valid[i : i + k] for i in range(0, len(valid) - k + 1, k)]
    if not blocks:
        return None
    wins = 0
    for block in blocks:
        chosen = pick(block, rule, visible_score)
        wins += chosen is not None and solved(chosen)
    return wins / len(blocks)


def _once_per_candidate(score: VisibleScore) -> VisibleScore:
    """Every k and block asks again about the same episodes: run the visible tests once each."""
    seen: dict[int, int] = {}

    def cached(t: Trajectory) -> int:
        if id(t) not in seen:
            seen[id(t)] = score(t)
        return seen[id(t)]

    return cached


def summarize_selection(
    trajs: Sequence[Trajectory],
    ks: Sequence[int],
    rules: Sequence[str] = SELECTION_RULES,
    visible_score: VisibleScore | None = None,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """Final-selection success for every rule × k, averaged over problems.

    Episodes are grouped by ``group_id`` (the task) and ordered by ``sample_id``; tasks of
    one problem (``task_id`` before ``#``) are averaged first, and the CI resamples
    problems (percentile bootstrap, :func:`bootstrap_mean_ci`).

    Returns:
        ``{rule: {str(k): {success, low, high, se, problems, tasks, tasks_excluded}}}``.
    """
    by_task: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_task.setdefault(t.group_id, []).append(t)
    if visible_score is not None:
        visible_score = _once_per_candidate(visible_score)
    out: dict[str, Any] = {}
    for rule in rules:
        out[rule] = {}
        for k in ks:
            by_problem: dict[str, list[float]] = {}
            for eps in by_task.values():
                v = task_selection_success(sorted(eps, key=lambda t: t.sample_id), k, rule, visible_score)
                if v is not None:
                    by_problem.setdefault(eps[0].task_id.split("#")[0], []).append(v)
            values = [sum(v) / len(v) for v in by_problem.values()]
            mean = sum(values) / len(values) if values else float("nan")
            low, high = bootstrap_mean_ci(values, confidence, seed=seed) if len(values) >= 2 else (mean, mean)
            tasks = sum(len(v) for v in by_problem.values())
            out[rule][str(k)] = {
                "success": mean,
                "low": low,
                "high": high,
                "se": binomial_se(mean, len(values)) if values else float("nan"),
                "problems": len(values),
                "tasks": tasks,
                "tasks_excluded": len(by_task) - tasks,
            }
    return out
