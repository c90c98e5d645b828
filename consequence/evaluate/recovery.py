"""Recovery diagnostic: every policy starts from the same wrong first patch.

Comparing recovery on each policy's own failures is biased: policies fail on different
tasks. Here every episode opens with the same scripted turns — ``replace_line`` with a
plausible wrong patch on the line the fix must change, then ``run_tests`` — and the
policy continues from the failing report it sees. The share of these episodes that end
with a submission passing the hidden tests is the recovery rate. The opening state is
not the natural distribution of states, so the report puts the recovery rate next to
overall success on the same tasks (the seed text's experiment design: "start from the
same wrong patch ... report overall task success together with the diagnostic").

The wrong patch is the task's first decoy on the bug line (decoys are single-line
mutants that fail the hidden tests by construction, ``consequence.envs.repair.problems``); tasks
without a decoy (HumanEval repair, JSONL tasks) are left out and counted.
"""

from __future__ import annotations

from collections.abc import Sequence

Opening = tuple[tuple[str, dict], ...]


def wrong_first_patch(task) -> Opening | None:
    """The scripted opening for ``task``: its wrong patch, then a test run; None without a decoy.

    Prefers a decoy on the line the reference patch changes (the natural wrong first
    attempt); else the first decoy. Line numbers are 1-based, as the tool takes them.
    """
    decoys = sorted(getattr(task, "decoy_patches", ()) or ())
    if not decoys:
        return None
    on_bug_line = [d for d in decoys if d[0] == task.patch[0]]
    line, code = (on_bug_line or decoys)[0]
    return (("replace_line", {"line": int(line), "code": code}), ("run_tests", {}))


def recovery_openings(tasks: Sequence) -> tuple[list, list[Opening]]:
    """The tasks that have a wrong first patch, and those openings (same order).

    Returns:
        (tasks kept, their openings); ``len(tasks) - len(kept)`` tasks had no decoy.
    """
    kept, openings = [], []
    for t in tasks:
        o = wrong_first_patch(t)
        if o is not None:
            kept.append(t)
            openings.append(o)
    return kept, openings
