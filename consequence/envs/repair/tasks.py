"""The code-repair environments: ``repair``, ``humaneval-repair`` and ``jsonl``.

All three run :class:`~consequence.envs.repair.env.RepairEnv` episodes (four tools, reward
``hidden_tests`` at ``finish``) and differ in their task source:

``repair``: the generated single-line repair problems (``consequence.envs.repair.problems``);
an instance renames variables and redraws test inputs. ``humaneval-repair``: HumanEval
canonical solutions with one injected bug, split by HumanEval task id
(``consequence.envs.humaneval.code_tasks``); an instance is the same task under a new id.
``jsonl``: your own repair tasks in the format of ``docs/tasks.md``
(``consequence.envs.repair.jsonl``), split by ``problem_id`` with the split seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from consequence.envs.api import SPLITS, Environment
from consequence.envs.repair.demonstrator import TeacherHabits, habits_from, plan_actions
from consequence.envs.repair.env import SYSTEM_PROMPT, TOOLS, RepairEnv

__all__ = ["RepairEnvironment", "HumanEvalRepairEnvironment", "JsonlRepairEnvironment"]


class RepairEnvironment(Environment):
    """Generated single-line repair problems (781 problems, 21 families; split 625 / 78 / 78)."""

    name = "repair"
    version = "1"
    system_prompt = SYSTEM_PROMPT
    tools = TOOLS
    reward_components = ("hidden_tests",)
    sources = ("consequence.envs.repair.env", "consequence.envs.humaneval.code_tasks")  # the episode and its verifier
    answer_ends_episode = False  # a reply without a tool call is a turn; the episode ends at finish

    def __init__(self, split_seed: int = 0, split_by: str = "problem"):
        """Args:
            split_by: ``problem`` (default: train, validation and test hold different problems of
                the same 21 families) or ``family`` (validation and test families are never seen
                in training: 15 / 3 / 3 families).

        Raises:
            ValueError: another ``split_by``.
        """
        if split_by not in ("problem", "family"):
            raise ValueError(f"--env-option split_by={split_by}: give problem or family")
        self.split_by = split_by
        self.habits = TeacherHabits()  # the demonstrator's habits (settable; see `demonstration`)
        super().__init__(split_seed)

    def load_splits(self, split_seed: int) -> dict[str, list]:
        from consequence.envs.repair.problems import load_split

        return load_split(split_seed, self.split_by)

    def sample(self, split: str, n: int, seed: int) -> list:
        """``n`` RepairTask instances of ``split`` (variables renamed, inputs redrawn), deterministic in ``seed``."""
        from consequence.envs.repair.problems import make_tasks

        return make_tasks(self._pool(split), n, seed=seed)

    def make_episode(self, task) -> RepairEnv:
        return RepairEnv(task)

    def demonstration(
        self, task: Any, rng: random.Random, habits: TeacherHabits | Mapping[str, float] | None = None
    ) -> list[dict]:
        """A scripted repair of ``task`` with a mix of habits (diagnose first or not, sometimes a
        wrong patch first, verify before finishing or not), always ending with the reference
        patch and ``finish`` (:func:`consequence.envs.repair.demonstrator.plan_episode`).

        Args:
            task: a RepairTask of this environment.
            rng: the generator the habits are drawn from (advanced; the same draws as ever,
                so the bundled warm start's demonstrations stay what they were).
            habits: the habits' probabilities (:class:`TeacherHabits` or a mapping of its
                fields); default ``self.habits`` (settable, default :class:`TeacherHabits`).

        Returns:
            the tool calls ``{"name": ..., "arguments": ...}`` in order.

        Raises:
            ValueError: ``habits`` names no habit or holds no probability.
        """
        return plan_actions(task, rng, self.habits if habits is None else habits_from(habits))

    def find_task(self, task_id: str) -> tuple[str, Any] | None:
        """``PROBLEM_ID#INSTANCE`` → the instance ``make_instance(problem, INSTANCE)`` (variables
        renamed and inputs drawn as :meth:`sample` did for that id) and its problem's split; None
        for an id without ``#`` (the instance is part of the task) or of no problem here."""
        from consequence.envs.repair.problems import make_instance

        problem_id, sep, instance = task_id.partition("#")
        if not sep or not instance:
            return None
        for split in SPLITS:
            for problem in self.split.get(split, []):
                if problem.problem_id == problem_id:
                    return split, make_instance(problem, instance)
        return None

    def potential(self, episode: Any) -> float:
        """Φ(s) = 0.5 × the share of visible tests that passed at the policy's last ``run_tests``
        on the current code (:attr:`RepairEnv.tested_share`), 0 when the current code is
        untested: progress the episode has itself verified, read without running anything.
        In [0, 0.5], below the reward of a fix (1), so it guides without standing in for it."""
        share = episode.tested_share
        return 0.5 * share if share is not None else 0.0

    def retry_feedback(self, episode: Any, info: dict) -> str | None:
        """A failed ``finish`` reopens the episode: "finish: P/N hidden tests passed; ..."
        (:meth:`RepairEnv.retry_feedback`); None after a passing one."""
        return episode.retry_feedback(info)

    def iteration_metrics(self, trajectories: list) -> dict[str, float]:
        """``diagnose_first``: share of episodes whose first call runs the tests or reads the code."""
        first = [t.calls[0].tool_calls if t.calls else [] for t in trajectories]
        hits = sum(bool(c) and c[0]["name"] in ("run_tests", "read_code") for c in first)
        return {"diagnose_first": hits / max(1, len(trajectories))}


class HumanEvalRepairEnvironment(RepairEnvironment):
    """HumanEval canonical solutions with one injected bug (145 tasks, split by task id)."""

    name = "humaneval-repair"

    def __init__(self, split_seed: int = 0):
        super().__init__(split_seed)  # HumanEval has no families: split_by is not an option here

    def load_splits(self, split_seed: int) -> dict[str, list]:
        from consequence.envs.humaneval.code_tasks import load_humaneval_repair

        return load_humaneval_repair(seed=split_seed)

    sample = Environment.sample
    find_task = Environment.find_task  # the splits hold the tasks themselves


class JsonlRepairEnvironment(RepairEnvironment):
    """Your repair tasks from a JSONL file (docs/tasks.md), split by ``problem_id``.

    Args:
        tasks_file: path of the ``.jsonl`` file (``--tasks-file``).

    Raises:
        ValueError: no file given, a missing or unreadable file, a malformed line (named
            with its line number), no task, or a task whose kind is not ``repair``.
    """

    name = "jsonl"
    sample = Environment.sample
    find_task = Environment.find_task  # the splits hold the tasks themselves

    def __init__(self, split_seed: int = 0, tasks_file: str | None = None):
        if not tasks_file:
            raise ValueError("--env jsonl needs a task file: --tasks-file FILE.jsonl (format: docs/tasks.md)")
        self.path = Path(tasks_file).resolve()
        super().__init__(split_seed)

    @property
    def label(self) -> str:
        return str(self.path)

    def load_splits(self, split_seed: int) -> dict[str, list]:
        from consequence.envs.repair.jsonl import TaskFormatError, as_repair_task, load_jsonl, split_by_problem

        path = self.path
        if not path.is_file():
            raise ValueError(
                f"--tasks-file {path}: "
                + ("is a directory" if path.is_dir() else "no such file")
                + " (give a .jsonl file of tasks in the format of docs/tasks.md)"
            )
        try:
            tasks = load_jsonl(path)
        except TaskFormatError as e:
            raise ValueError(f"--tasks-file {e} (format: docs/tasks.md)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--tasks-file {path}: cannot read it ({e})") from None
        if not tasks:
            raise ValueError(f"--tasks-file {path}: the file holds no task (one JSON object per line, docs/tasks.md)")
        other = [t for t in tasks if t.kind != "repair"]
        if other:
            lines = {
                json.loads(x).get("task_id"): no
                for no, x in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if x.strip()
            }
            t = other[0]
            raise ValueError(
                f"--tasks-file {path}:{lines.get(t.task_id)}: task {t.task_id!r} has kind {t.kind!r}; "
                "the jsonl environment runs multi-turn repair episodes with the tools, so every task "
                f"needs kind 'repair' ({len(other)} of {len(tasks)} tasks are not; evaluate completion "
                "tasks on their own)"
            )
        ids = split_by_problem([t.problem_id for t in tasks], seed=split_seed)
        return {s: [as_repair_task(t) for t in tasks if t.problem_id in ids[s]] for s in SPLITS}
