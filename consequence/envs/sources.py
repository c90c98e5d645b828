"""Task sources for training and evaluation: one interface over our repair problems and
HumanEval repair.

``repair``: the generated single-line repair problems (``consequence.tasks.repair``);
an instance renames variables and redraws test inputs. ``humaneval-repair``: HumanEval
canonical solutions with one injected bug, split by HumanEval task id
(``consequence.envs.code_tasks``); an instance is the same task under a new id. A path
to a ``.jsonl`` file: your own repair tasks in the format of ``docs/tasks.md``
(``consequence.tasks.jsonl``), split by ``problem_id`` with the split seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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

    def check_splits(self, needed: dict[str, str | None]) -> None:
        """Every split that a setting needs holds problems.

        Args:
            needed: split → the option or purpose that needs it (None: not needed).

        Raises:
            ValueError: an empty split (names the source, the split sizes, and the fix).
        """
        sizes = {k: len(v) for k, v in self.split.items()}
        for name, why in needed.items():
            if why and not sizes.get(name):
                raise ValueError(f"--tasks {self.name}: the {name} split is empty (split by problem: "
                                 + ", ".join(f"{k} {n}" for k, n in sizes.items()) + f"), and {why} needs it; "
                                 + ("add problems (about 10 % of them land in validation and 10 % in test) or set "
                                    f"{why} 0" if why.startswith("--") else "add problems to the file"))

    def longest_prompt(self, n_tokens, n: int = 256, seed: int = 0) -> int:
        """Length of the longest opening request among ``n`` train instances (all problems
        when there are fewer), as ``n_tokens(request_text)`` counts it (e.g. the rendered
        prompt with the system message)."""
        tasks = self.sample("train", min(n, len(self.split["train"])), seed=seed)
        return max(opening_lengths(tasks, n_tokens), default=0)

    def problem_ids(self) -> dict[str, list[str]]:
        """split → problem ids (what ``split.json`` and the manifest record)."""
        return {k: [p.problem_id for p in v] for k, v in self.split.items()}


def opening_lengths(tasks, n_tokens) -> list[int]:
    """``n_tokens(request_text)`` of each task's opening request (what ``reset`` shows the policy)."""
    from consequence.envs.repair_env import RepairEnv

    return [n_tokens(RepairEnv(t).reset(seed=0)[0]) for t in tasks]


def load_task_source(name: str, split_seed: int = 0) -> TaskSource:
    """The task source ``name`` with its train / validation / test split.

    ``name`` is ``repair``, ``humaneval-repair`` or the path of a ``.jsonl`` task file.

    Raises:
        ValueError: unknown source (lists the valid ones), or a task file that is missing,
            malformed (the message names the file and line), empty or holds a task that is
            not a repair task.
    """
    if name.endswith(".jsonl"):
        return _jsonl_source(Path(name), split_seed)
    if name == "repair":
        from consequence.tasks.repair import load_split

        return TaskSource(name, load_split(split_seed))
    if name == "humaneval-repair":
        from consequence.envs.code_tasks import load_humaneval_repair

        return TaskSource(name, load_humaneval_repair(seed=split_seed))
    raise ValueError(f"unknown task source {name!r}; valid: {', '.join(TASK_SOURCES)}, or a .jsonl task file")


def _jsonl_source(path: Path, split_seed: int) -> TaskSource:
    """Repair tasks of a JSONL file, split by problem id (``split_by_problem``, ``split_seed``)."""
    import json

    from consequence.tasks.jsonl import TaskFormatError, as_repair_task, load_jsonl, split_by_problem

    if not path.is_file():
        raise ValueError(f"--tasks {path}: " + ("is a directory" if path.is_dir() else "no such file")
                         + " (give a .jsonl file of tasks in the format of docs/tasks.md)")
    try:
        tasks = load_jsonl(path)
    except TaskFormatError as e:
        raise ValueError(f"--tasks {e} (format: docs/tasks.md)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--tasks {path}: cannot read it ({e})") from None
    if not tasks:
        raise ValueError(f"--tasks {path}: the file holds no task (one JSON object per line, docs/tasks.md)")
    other = [t for t in tasks if t.kind != "repair"]
    if other:
        lines = {json.loads(x).get("task_id"): no for no, x in
                 enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if x.strip()}
        t = other[0]
        raise ValueError(f"--tasks {path}:{lines.get(t.task_id)}: task {t.task_id!r} has kind {t.kind!r}; training "
                         "runs multi-turn repair episodes with the tools, so every task needs kind 'repair' "
                         f"({len(other)} of {len(tasks)} tasks are not; evaluate completion tasks on their own)")
    ids = split_by_problem([t.problem_id for t in tasks], seed=split_seed)
    return TaskSource(str(path), {s: [as_repair_task(t) for t in tasks if t.problem_id in ids[s]] for s in SPLITS})
