"""Task sources for training and evaluation: one interface over our repair problems and
HumanEval repair.

``repair``: the generated single-line repair problems (``consequence.tasks.repair``);
an instance renames variables and redraws test inputs. ``humaneval-repair``: HumanEval
canonical solutions with one injected bug, split by HumanEval task id
(``consequence.envs.code_tasks``); an instance is the same task under a new id.
"""

from __future__ import annotations

from dataclasses import dataclass

TASK_SOURCES: tuple[str, ...] = ("repair", "humaneval-repair")
SPLITS: tuple[str, ...] = ("train", "validation", "test")


@dataclass
class TaskSource:
    """A named pool per split and a way to draw task instances from it."""

    name: str
    split: dict[str, list]  # split → problems (repair) or tasks (humaneval-repair)

    def sample(self, split: str, n: int, seed: int) -> list:
        """``n`` RepairTask instances of split ``split``, deterministic in ``seed``.

        Raises:
            ValueError: unknown split.
        """
        if split not in self.split:
            raise ValueError(f"unknown split {split!r}; valid: {', '.join(self.split)}")
        if self.name == "repair":
            from consequence.tasks.repair import make_tasks

            return make_tasks(self.split[split], n, seed=seed)
        from consequence.tasks.jsonl import cycle_tasks

        return cycle_tasks(self.split[split], n, seed)

    def problem_ids(self) -> dict[str, list[str]]:
        """split → problem ids (what ``split.json`` and the manifest record)."""
        return {k: [p.problem_id for p in v] for k, v in self.split.items()}


def load_task_source(name: str, split_seed: int = 0) -> TaskSource:
    """The task source ``name`` with its train / validation / test split.

    Raises:
        ValueError: unknown source (lists the valid ones).
    """
    if name == "repair":
        from consequence.tasks.repair import load_split

        return TaskSource(name, load_split(split_seed))
    if name == "humaneval-repair":
        from consequence.envs.code_tasks import load_humaneval_repair

        return TaskSource(name, load_humaneval_repair(seed=split_seed))
    raise ValueError(f"unknown task source {name!r}; valid: {', '.join(TASK_SOURCES)}")
