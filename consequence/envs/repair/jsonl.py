"""Bring-your-own code tasks: one JSON object per line (format in ``docs/tasks.md``).

A :class:`CodeTask` is either ``completion`` (single turn: the model continues
``starting_code``) or ``repair`` (multi-turn with the repair tools: the episode starts
from ``starting_code``; :func:`as_repair_task` makes the :class:`RepairTask` that
``RepairEnv`` runs). Hidden tests are a list of ``{"call", "expected"}`` pairs or a
``check(candidate)`` program (:class:`TestProgram`). HumanEval is loaded through this
format (``consequence.envs.humaneval.problems``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from consequence.envs.repair.problems import RepairTask, TestCase, TestProgram

__all__ = [
    "CodeTask",
    "TaskFormatError",
    "KINDS",
    "FIELDS",
    "parse_record",
    "to_record",
    "load_jsonl",
    "dump_jsonl",
    "split_by_problem",
    "as_repair_task",
    "cycle_tasks",
]

KINDS = ("completion", "repair")
REQUIRED = ("task_id", "kind", "prompt", "starting_code", "entry_point", "visible_tests", "hidden_tests")
OPTIONAL = ("problem_id", "reference_code", "patch", "bug_kind", "source")
FIELDS = REQUIRED + OPTIONAL


@dataclass(frozen=True)
class CodeTask:
    """One task of the JSONL format (field meanings: ``docs/tasks.md``).

    ``patch`` is the 1-based line and its correct text (repair tasks made by bug
    injection; the warm-start teacher uses it). ``problem_id`` groups tasks for splits.
    """

    task_id: str
    problem_id: str
    kind: str
    prompt: str
    starting_code: str
    entry_point: str
    visible_tests: tuple[TestCase, ...]
    hidden_tests: tuple[TestCase, ...] | TestProgram
    reference_code: str | None = None
    patch: tuple[int, str] | None = None
    bug_kind: str | None = None
    source: str = ""


class TaskFormatError(ValueError):
    """A JSONL task record is malformed; the message names the file, line and field."""


def _str(obj: dict, key: str, where: str, empty_ok: bool = True) -> str:
    v = obj[key]
    if not isinstance(v, str) or (not empty_ok and not v):
        raise TaskFormatError(
            f"{where}: field {key!r} must be a{'' if empty_ok else ' non-empty'} string, got {type(v).__name__}"
        )
    return v


def _tests(v: Any, key: str, where: str) -> tuple[TestCase, ...]:
    if not isinstance(v, list):
        raise TaskFormatError(
            f'{where}: field {key!r} must be a list of {{"call": str, "expected": str}}, got {type(v).__name__}'
        )
    out = []
    for i, t in enumerate(v):
        if not (
            isinstance(t, dict)
            and isinstance(t.get("call"), str)
            and isinstance(t.get("expected"), str)
            and set(t) == {"call", "expected"}
        ):
            raise TaskFormatError(
                f'{where}: {key}[{i}] must be {{"call": str, "expected": str}}, got {json.dumps(t)[:80]}'
            )
        out.append(TestCase(t["call"], t["expected"]))
    return tuple(out)


def _hidden(v: Any, entry: str, where: str) -> tuple[TestCase, ...] | TestProgram:
    if isinstance(v, dict):
        extra = set(v) - {"check", "setup"}
        if "check" not in v or extra or not all(isinstance(x, str) for x in v.values()):
            raise TaskFormatError(
                f"{where}: field 'hidden_tests' as an object must be "
                f'{{"check": str, "setup": str (optional)}}; got keys {sorted(v)}'
            )
        if "def check(" not in v["check"]:
            raise TaskFormatError(f"{where}: hidden_tests.check must define check(candidate)")
        return TestProgram(v["check"], entry, v.get("setup", ""))
    tests = _tests(v, "hidden_tests", where)
    if not tests:
        raise TaskFormatError(f"{where}: field 'hidden_tests' is empty; a task needs hidden tests")
    return tests


def parse_record(obj: Any, where: str = "<record>") -> CodeTask:
    """One decoded JSON object -> :class:`CodeTask`.

    Raises:
        TaskFormatError: not an object, a missing / unknown / mistyped field, a bad
            ``kind``, an entry point that is not an identifier, or a bad ``patch``;
            the message starts with ``where`` (e.g. ``"tasks.jsonl:3"``) and names the field.
    """
    if not isinstance(obj, dict):
        raise TaskFormatError(f"{where}: a task must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise TaskFormatError(
            f"{where}: missing field{'s' if len(missing) > 1 else ''} " + ", ".join(repr(k) for k in missing)
        )
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise TaskFormatError(f"{where}: unknown field(s) {unknown}; allowed: {list(FIELDS)}")
    kind = _str(obj, "kind", where)
    if kind not in KINDS:
        raise TaskFormatError(f"{where}: field 'kind' must be one of {KINDS}, got {kind!r}")
    entry = _str(obj, "entry_point", where, empty_ok=False)
    if not entry.isidentifier():
        raise TaskFormatError(f"{where}: field 'entry_point' must be a Python name, got {entry!r}")
    patch = obj.get("patch")
    if patch is not None:
        if not (
            isinstance(patch, list)
            and len(patch) == 2
            and type(patch[0]) is int
            and patch[0] >= 1
            and isinstance(patch[1], str)
        ):
            raise TaskFormatError(f"{where}: field 'patch' must be [line >= 1, code], got {patch!r}")
        patch = (patch[0], patch[1])
    for key in ("reference_code", "bug_kind", "source", "problem_id"):
        if obj.get(key) is not None:
            _str(obj, key, where)
    task_id = _str(obj, "task_id", where, empty_ok=False)
    return CodeTask(
        task_id=task_id,
        problem_id=obj.get("problem_id") or task_id,
        kind=kind,
        prompt=_str(obj, "prompt", where),
        starting_code=_str(obj, "starting_code", where),
        entry_point=entry,
        visible_tests=_tests(obj["visible_tests"], "visible_tests", where),
        hidden_tests=_hidden(obj["hidden_tests"], entry, where),
        reference_code=obj.get("reference_code"),
        patch=patch,
        bug_kind=obj.get("bug_kind"),
        source=obj.get("source") or "",
    )


def to_record(task: CodeTask) -> dict:
    """:class:`CodeTask` -> JSON-ready dict (inverse of :func:`parse_record`)."""
    tests = lambda ts: [{"call": t.call, "expected": t.expected} for t in ts]  # noqa: E731
    h = task.hidden_tests
    rec: dict[str, Any] = {
        "task_id": task.task_id,
        "problem_id": task.problem_id,
        "kind": task.kind,
        "prompt": task.prompt,
        "starting_code": task.starting_code,
        "entry_point": task.entry_point,
        "visible_tests": tests(task.visible_tests),
        "hidden_tests": ({"check": h.check, "setup": h.setup} if isinstance(h, TestProgram) else tests(h)),
    }
    for key in ("reference_code", "bug_kind"):
        if getattr(task, key) is not None:
            rec[key] = getattr(task, key)
    if task.patch is not None:
        rec["patch"] = list(task.patch)
    if task.source:
        rec["source"] = task.source
    return rec


def load_jsonl(path: str | os.PathLike) -> list[CodeTask]:
    """All tasks of a JSONL file (blank lines skipped).

    Raises:
        FileNotFoundError: no such file.
        TaskFormatError: invalid JSON or record (message ``"PATH:LINE: ..."``), or a
            ``task_id`` that repeats an earlier line's.
    """
    path = Path(path)
    tasks: list[CodeTask] = []
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFormatError(
                    f"{where}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
                ) from None
            task = parse_record(obj, where)
            if task.task_id in first_line:
                raise TaskFormatError(
                    f"{where}: task_id {task.task_id!r} already used on line {first_line[task.task_id]}"
                )
            first_line[task.task_id] = no
            tasks.append(task)
    return tasks


def dump_jsonl(tasks: Iterable[CodeTask], path: str | os.PathLike) -> Path:
    """Write ``tasks`` as JSONL atomically (temporary sibling file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for t in tasks:
                f.write(json.dumps(to_record(t), ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def split_by_problem(
    problem_ids: Iterable[str], seed: int = 0, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
) -> dict[str, frozenset[str]]:
    """Assign each distinct problem id to ``train`` / ``validation`` / ``test``.

    Ids are ordered by sha256(f"{seed}|{id}") and cut by ``fractions`` (rounded), so the
    split is deterministic in ``seed``, independent of input order, and every task of one
    problem lands in the same split.

    Raises:
        ValueError: ``fractions`` are not 3 non-negative numbers summing to 1.
    """
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions must be 3 non-negative numbers summing to 1, got {fractions}")
    ids = sorted(set(problem_ids), key=lambda p: hashlib.sha256(f"{seed}|{p}".encode()).hexdigest())
    n_tr, n_va = round(fractions[0] * len(ids)), round(fractions[1] * len(ids))
    return {
        "train": frozenset(ids[:n_tr]),
        "validation": frozenset(ids[n_tr : n_tr + n_va]),
        "test": frozenset(ids[n_tr + n_va :]),
    }


def _summary(prompt: str) -> str:
    return prompt.strip().split("\n")[0].strip() if prompt.strip() else ""


def as_repair_task(task: CodeTask) -> RepairTask:
    """A repair :class:`CodeTask` as the :class:`RepairTask` that ``RepairEnv`` runs.

    The request line shows ``prompt``'s first line as the docstring; ``patch`` defaults
    to ``(0, "")`` (no known fix: the warm-start teacher cannot use such a task).

    Raises:
        ValueError: ``task.kind`` is not ``"repair"``.
    """
    if task.kind != "repair":
        raise ValueError(f"as_repair_task: task {task.task_id!r} has kind {task.kind!r}, not 'repair'")
    return RepairTask(
        task_id=task.task_id,
        problem_id=task.problem_id,
        family=task.source or "jsonl",
        bug_kind=task.bug_kind or "unknown",
        func_name=task.entry_point,
        docstring=_summary(task.prompt),
        buggy_code=task.starting_code,
        reference_code=task.reference_code or "",
        patch=task.patch or (0, ""),
        decoy_patches=(),
        visible_tests=task.visible_tests,
        hidden_tests=task.hidden_tests,
    )


def cycle_tasks(pool: list, n: int, seed: int) -> list:
    """``n`` tasks cycling through a seeded permutation of ``pool`` (like ``make_tasks``).

    Works for :class:`RepairTask` and :class:`CodeTask`; each copy gets the task id
    ``f"{task_id}#{seed}-{k}"`` (k = position), unique across seeds, while ``problem_id``
    is kept. Raises ValueError if ``pool`` is empty and ``n > 0``.
    """
    if n > 0 and not pool:
        raise ValueError("cycle_tasks: no tasks to draw from")
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    return [
        dataclasses.replace(pool[order[k % len(order)]], task_id=f"{pool[order[k % len(order)]].task_id}#{seed}-{k}")
        for k in range(n)
    ]
