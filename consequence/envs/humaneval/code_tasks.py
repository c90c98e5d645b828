"""The scoring function of :class:`CodeTask` tasks, and HumanEval task sets built with it.

:func:`run_hidden` is the ONE scoring function for training reward and evaluation of a
code task: test lists go to :func:`consequence.sandbox.judge.run_cases`, ``check``
programs to :func:`consequence.sandbox.judge.run_program` (both: verdict from a judge
process the candidate cannot reach). ``RepairEnv.verify`` and :func:`verify_completion`
both call it. Visible tests (feedback to the policy, never a reward) may use the faster
single-process :func:`consequence.sandbox.sandbox.run_tests`.

``humaneval-repair`` keeps a bug-injected canonical solution only if the official
``check`` FAILS on it in the judge (status ``ok``, 0 passed); equivalent mutants (check
passes) and mutants that time out or crash are dropped. Building takes ~10-20 s on two
cores, so the result is cached as JSONL (atomic write) keyed by seed, settings and the
digests of the HumanEval file and of the generating code.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from consequence.envs.humaneval import problems as _he
from consequence.envs.repair import bugs as _bugs
from consequence.envs.repair.jsonl import CodeTask, as_repair_task, dump_jsonl, load_jsonl, split_by_problem
from consequence.envs.repair.problems import RepairTask, TestCase, TestProgram
from consequence.fileio import cache_root, write_text_atomic
from consequence.sandbox.judge import PROGRAM_LIMITS, run_cases, run_program
from consequence.sandbox.sandbox import SandboxLimits, TestReport, run_tests, with_retries

__all__ = [
    "CHAT_INSTRUCTION",
    "STOP_SEQUENCES",
    "chat_request",
    "extract_completion",
    "run_hidden",
    "verify_completion",
    "build_humaneval_repair",
    "humaneval_repair_tasks",
    "humaneval_split",
    "load_humaneval",
    "load_humaneval_repair",
    "BUILD_LIMITS",
    "SPLITS",
]

SPLITS = ("train", "validation", "test")
# Building runs every kept mutant once; a canonical check takes <= 0.5 s here, so a
# mutant still running after 2 CPU seconds is an infinite loop, not a slow bug.
BUILD_LIMITS = SandboxLimits(wall_s=4.0, cpu_s=2, memory_mb=512)


CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in one ```python code block.\n\n"
)
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")


def chat_request(task: CodeTask) -> str:
    """The user message of a completion task in chat mode: instruction + fenced prompt."""
    return f"{CHAT_INSTRUCTION}```python\n{task.prompt}```"


def extract_completion(text: str, task: CodeTask, mode: str) -> str:
    """The text appended to ``task.starting_code`` for one sampled reply (see module doc).

    ``raw`` mode (base models fed the prompt itself) cuts at the Codex stop sequences.

    Raises:
        ValueError: unknown ``mode`` (``"raw"`` or ``"chat"``).
    """
    if mode == "raw":
        cut = min([i for s in STOP_SEQUENCES if (i := text.find(s)) >= 0], default=len(text))
        return text[:cut]
    if mode != "chat":
        raise ValueError(f"unknown prompt mode {mode!r}; expected 'raw' or 'chat'")
    blocks = re.findall(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|$)", text, re.S)
    defines = [b for b in blocks if re.search(rf"^\s*def {re.escape(task.entry_point)}\(", b, re.M)]
    code = (defines or blocks or [text])[0]
    if re.search(rf"^\s*def {re.escape(task.entry_point)}\(", code, re.M):
        return "\n" + code  # a full definition after the prompt replaces the stub
    return code


def run_hidden(code: str, tests: Sequence[TestCase] | TestProgram, limits: SandboxLimits | None = None) -> TestReport:
    """Score ``code`` on hidden ``tests`` (a TestCase list or a ``check`` program).

    ``limits=None`` uses each mode's default (``SandboxLimits()`` for test lists,
    ``PROGRAM_LIMITS`` for programs). Status ``'sandbox_error'``: exclude, never score 0.
    """
    if isinstance(tests, TestProgram):
        return run_program(code, tests, limits or PROGRAM_LIMITS)
    return run_cases(code, tests, limits or SandboxLimits())


def verify_completion(task: CodeTask, completion: str, limits: SandboxLimits | None = None) -> TestReport:
    """Score a single-turn completion: ``task.starting_code + completion`` on the hidden
    tests (HumanEval: prompt + generated body, then the official ``check``)."""
    return run_hidden(task.starting_code + completion, task.hidden_tests, limits)


def _try_problem(
    cands: list[CodeTask], keep: int, max_tries: int, limits: SandboxLimits
) -> tuple[list[CodeTask], dict[str, int]]:
    kept: list[CodeTask] = []
    seen = {"tried": 0, "killed": 0, "equivalent": 0, "timeout_or_crash": 0, "visible_fail": 0}
    for task in cands[:max_tries]:
        if len(kept) >= keep:
            break
        rep = with_retries(functools.partial(run_hidden, task.starting_code, task.hidden_tests, limits))
        if rep.status == "sandbox_error":
            raise RuntimeError(f"sandbox failed while building {task.task_id}: {rep.error}")
        seen["tried"] += 1
        if rep.status != "ok":
            seen["timeout_or_crash"] += 1
        elif rep.passed == 0:
            seen["killed"] += 1
            kept.append(task)
            vis = run_tests(task.starting_code, task.visible_tests, limits)
            seen["visible_fail"] += bool(task.visible_tests) and not vis.all_passed
        else:
            seen["equivalent"] += 1
    return kept, seen


def build_humaneval_repair(
    seed: int = 0,
    bugs_per_problem: int = 1,
    max_tries: int = 12,
    workers: int | None = None,
    limits: SandboxLimits = BUILD_LIMITS,
    task_ids: Collection[str] | None = None,
) -> tuple[list[CodeTask], dict]:
    """Filter :func:`consequence.envs.humaneval.problems.repair_candidates` through the judge.

    Per problem, candidates are tried in their seeded order until ``bugs_per_problem``
    fail the official check or ``max_tries`` were run. Problems run on ``workers``
    threads (each run is its own processes; default ``min(4, cpu_count)``). ``task_ids``
    restricts the build to those HumanEval problems (tests; default all 164).

    Returns:
        (tasks in HumanEval order, stats) with stats keys ``problems``,
        ``with_candidates``, ``with_bug`` (problems that kept >= 1 bug), ``tasks``,
        ``tried``, ``killed``, ``equivalent``, ``timeout_or_crash``, ``by_kind``,
        ``with_visible`` (kept tasks with >= 1 visible test) and ``visible_fail`` (kept
        tasks whose visible tests already fail on the buggy code).

    Raises:
        RuntimeError: the sandbox itself failed, after ``sandbox.ENV_RETRIES`` re-runs
            (nothing is cached).
    """
    cands = _he.repair_candidates(seed)
    if task_ids is not None:
        cands = {k: v for k, v in cands.items() if k in set(task_ids)}
    workers = workers or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(lambda c: _try_problem(c, bugs_per_problem, max_tries, limits), cands.values()))
    tasks = [t for kept, _ in results for t in kept]
    stats: dict = {
        "problems": len(cands),
        "with_candidates": sum(1 for c in cands.values() if c),
        "with_bug": sum(1 for kept, _ in results if kept),
        "tasks": len(tasks),
    }
    for key in ("tried", "killed", "equivalent", "timeout_or_crash"):
        stats[key] = sum(seen[key] for _, seen in results)
    stats["by_kind"] = {k: sum(1 for t in tasks if t.bug_kind == k) for k in _bugs.BUG_KINDS}
    stats["with_visible"] = sum(1 for t in tasks if t.visible_tests)
    stats["visible_fail"] = sum(seen["visible_fail"] for _, seen in results)
    return tasks, stats


def _code_digest() -> str:
    srcs = [Path(inspect.getfile(m)).read_bytes() for m in (_bugs, _he)]
    return hashlib.sha256(b"".join(srcs) + _he.data_digest().encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=8)
def _cached(
    seed: int, bugs_per_problem: int, max_tries: int, cache_dir: str | None, use_disk: bool
) -> tuple[tuple[CodeTask, ...], str]:
    stem = f"humaneval-repair-s{seed}-b{bugs_per_problem}-t{max_tries}-{_code_digest()}"
    path = (Path(cache_dir) if cache_dir is not None else cache_root()) / "humaneval" / f"{stem}.jsonl"
    if use_disk and path.exists():
        return tuple(load_jsonl(path)), json.dumps({"cache": str(path)})
    tasks, stats = build_humaneval_repair(seed, bugs_per_problem, max_tries)
    if use_disk:
        dump_jsonl(tasks, path)
        write_text_atomic(path.with_suffix(".stats.json"), json.dumps(stats, indent=1))
    return tuple(tasks), json.dumps(stats)


def humaneval_repair_tasks(
    seed: int = 0,
    bugs_per_problem: int = 1,
    max_tries: int = 12,
    cache_dir: str | os.PathLike | None = None,
    use_disk: bool = True,
) -> list[CodeTask]:
    """The filtered ``humaneval-repair`` tasks (all splits), built once and cached.

    Disk cache: ``cache_dir`` (default ``$CONSEQUENCE_CACHE`` or
    ``~/.cache/consequence``, as the warm start), file ``humaneval/humaneval-repair-s{seed}
    -b{bugs}-t{tries}-{digest}.jsonl`` plus ``.stats.json`` (the build's stats). The
    digest covers the HumanEval file and the generating code, so edits rebuild.
    """
    key = None if cache_dir is None else str(cache_dir)
    return list(_cached(seed, bugs_per_problem, max_tries, key, use_disk)[0])


def humaneval_split(
    seed: int = 0, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
) -> dict[str, frozenset[str]]:
    """HumanEval task ids per split (131 / 16 / 17 with the default fractions); the same
    split serves ``humaneval`` and ``humaneval-repair``, so no test problem of either
    shares a task id with a train problem of either."""
    return split_by_problem((r["task_id"] for r in _he.records()), seed, fractions)


def load_humaneval(split: str = "all", seed: int = 0) -> list[CodeTask]:
    """``humaneval`` completion tasks of one split (``"all"``: the 164 problems).

    Raises:
        ValueError: unknown split.
    """
    tasks = _he.completion_tasks()
    if split == "all":
        return tasks
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected 'all' or one of {SPLITS}")
    ids = humaneval_split(seed)[split]
    return [t for t in tasks if t.problem_id in ids]


def load_humaneval_repair(
    seed: int = 0, bugs_per_problem: int = 1, cache_dir: str | os.PathLike | None = None
) -> dict[str, list[RepairTask]]:
    """``humaneval-repair`` as ``{"train", "validation", "test"}`` lists of RepairTask,
    ready for ``RepairEnv`` (same shape as ``consequence.envs.repair.problems.load_split``; draw
    episodes with ``consequence.envs.repair.jsonl.cycle_tasks``). Split by HumanEval task id
    with :func:`humaneval_split` (``seed``); bugs chosen with the same ``seed``."""
    ids = humaneval_split(seed)
    tasks = humaneval_repair_tasks(seed, bugs_per_problem, cache_dir=cache_dir)
    return {s: [as_repair_task(t) for t in tasks if t.problem_id in ids[s]] for s in SPLITS}
