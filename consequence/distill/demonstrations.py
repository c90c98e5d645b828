"""Where the cold start's demonstrations come from, and the check that lets them in.

Three sources, exclusive (docs/distillation.md, "Cold start from any demonstrations"):

1. the environment's demonstrator (``Environment.demonstration``; ``consequence envs``
   shows which environments have one): :func:`consequence.distill.warmstart.teacher_demo_set`;
2. a file of demonstrations (:func:`read_demonstration_file`):

   - our trajectories Parquet (``consequence.records.write_trajectories``: ``consequence
     demos``, ``consequence eval --out``, a run's ``trajectories/iter_NNNN.parquet``), or
   - JSONL, one object per line, ``{"task_id": ..., "messages": [...]}`` with the
     conversation in the OpenAI chat shape: ``system`` (or ``developer``, the newer name of
     a system message) / ``user`` messages, ``assistant``
     messages with ``content`` and ``tool_calls`` ``[{"type": "function", "function":
     {"name": ..., "arguments": "<JSON object as a string>"}}]`` (a dict is accepted too),
     and ``tool`` messages with the results;

3. a teacher behind an OpenAI-compatible URL (vLLM, ``consequence serve``) that plays
   train-split episodes of the environment: ``distill/teacher_url.py``; its transcripts are
   read and verified as a file's rows are.

How a file's row becomes a demonstration (:func:`plan_from_messages`): leading ``system``
messages, then the environment's worked examples when the file holds them word for word,
then the request (the first ``user`` message) are the opening, which the environment makes
itself; every later ``assistant`` message is one turn of the plan (its text, then its tool
calls; a turn without a tool call is a reply ``{"answer": text}``), and every later ``tool``
or ``user`` message is an observation, which is NOT read: the environment produces its own.
The row's task is ``env.find_task(task_id)``: by default the id up to its first ``#`` (an
instance drawn by ``Environment.sample`` is ``ID#seed-k``) is a task id or, failing that, a
problem id of the environment; an environment whose instances differ from their problem
re-creates the instance from the whole id (its own ``find_task``). Only train-split tasks are used.

Every demonstration, of any source, is played through a fresh episode of its task in the
student's own tokens (``distill.teacher.verify_plans``: its chat template and tool format;
the targets are the tokens the student would have to sample) and kept only when the episode
finished and the environment's reward verified it (the primary component is 1): nothing
enters training unverified. The rejections are counted by reason (:data:`REASONS`) and the
acceptance rate is logged and recorded.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from consequence.distill.teacher import DemoSet, plan_from_messages, verify_plans
from consequence.distill.warmstart import WarmstartConfig, teacher_demo_set
from consequence.harness.renderer import Renderer
from consequence.records import read_trajectories

if TYPE_CHECKING:
    from consequence.distill.teacher_url import TeacherEndpoint

__all__ = [
    "FORMATS",
    "REASONS",
    "FileDemonstration",
    "check_demonstration_path",
    "collect_demonstrations",
    "file_demo_set",
    "plan_from_messages",
    "read_demonstration_file",
    "write_demonstration_file",
]

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}
REASONS = {
    "unparsable_row": "the row is not a JSON object with a task_id and a list of chat messages",
    "unparsable_tool_call": "an assistant tool call without a name or whose arguments are not a JSON object",
    "no_actions": "no assistant turn after the request",
    "unknown_task": "the task_id names no task of the environment",
    "not_train_split": "the task is in the validation or test split (it would leak into training)",
    "unfinished": "its actions ended before the episode did",
    "not_verified": "the environment's reward did not verify the episode",
    "invalid_tool_call": "verified, but a tool call was refused (an unknown tool or arguments against the schema)",
    "env_error": "the environment failed while replaying it (or, with a teacher URL, while the teacher played)",
    # a teacher behind an OpenAI-compatible URL (distill/teacher_url.py)
    "teacher_http_error": "a call to the teacher failed: an HTTP error status, or the connection broke",
    "teacher_timeout": "a call to the teacher got no reply within the timeout",
    "teacher_unparsable_reply": "a reply of the teacher is not a chat completion (not JSON, no choices[0].message, "
    "content that is not text, tool_calls that is not a list of objects, a message with neither content nor "
    "tool calls)",
    "teacher_max_tokens": "a reply of the teacher was cut at max_tokens (finish_reason length): the harness ends "
    "such an episode truncated",
}
_HOW = (
    'our trajectories .parquet, or .jsonl with one {"task_id": ..., "messages": [...]} object per line '
    "(docs/distillation.md)"
)


@dataclass(frozen=True)
class FileDemonstration:
    """One row of a demonstration file, read but not yet replayed.

    Attributes:
        where: ``FILE:LINE`` (JSONL) or ``FILE[ROW]`` (Parquet), for the log.
        task_id: the row's task id (None when it has none).
        messages: its chat messages (None when the row is unreadable).
        problem: ``(reason, detail)`` when the row cannot be used as it is, else None.
    """

    where: str
    task_id: str | None
    messages: list | None
    problem: tuple[str, str] | None = None


def check_demonstration_path(path: str | Path, option: str = "--demos-file") -> Path:
    """The path of a demonstration file, checked before any work.

    Args:
        path: the file.
        option: the option that gave it (for the message).

    Returns:
        the path.

    Raises:
        ValueError: no such file, a folder, or a name that ends in neither ``.parquet`` nor
            ``.jsonl`` / ``.ndjson``.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{option} {p}: is a folder; give a file: {_HOW}")
    if not p.is_file():
        raise ValueError(f"{option} {p}: no such file; give {_HOW}")
    if p.suffix.lower() not in FORMATS:
        raise ValueError(f"{option} {p}: unknown format {p.suffix or '(no suffix)'!r}; give {_HOW}")
    return p


def write_demonstration_file(path: str | Path, trajectories: list, option: str = "--out") -> Path:
    """Write ``trajectories`` (scored, in a student's tokens) as a demonstration file that
    :func:`read_demonstration_file` reads back: ``.parquet``, our trajectories file (tokens
    and scores kept: ``--distill-data``, ``--demos-file``); ``.jsonl`` / ``.ndjson``, one
    ``{"task_id": ..., "messages": [...]}`` per line in the OpenAI chat shape (tool-call
    arguments as JSON strings, each call an ``id`` that its ``tool`` result names in
    ``tool_call_id``): portable to other SFT tools, and replayed and verified again when read.
    Written atomically.

    Raises:
        ValueError: a name that ends in neither (:func:`check_demonstration_out`).
    """
    from consequence.fileio import write_text_atomic
    from consequence.records import write_trajectories

    p = check_demonstration_out(path, option)
    if FORMATS[p.suffix.lower()] == "parquet":
        write_trajectories(p, trajectories)
    else:
        lines = [json.dumps({"task_id": t.task_id, "messages": _openai_messages(t.messages)}) for t in trajectories]
        write_text_atomic(p, "".join(line + "\n" for line in lines))
    return p


def check_demonstration_out(path: str | Path, option: str = "--out") -> Path:
    """The path of a demonstration file to write, checked before any work: its name ends in
    ``.parquet``, ``.jsonl`` or ``.ndjson`` (the format is the suffix's).

    Raises:
        ValueError: another suffix (names ``option`` and the formats).
    """
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise ValueError(
            f"{option} {p}: unknown format {p.suffix or '(no suffix)'!r}; name a .parquet file (our trajectories, "
            "for --distill-data and --demos-file) or a .jsonl file (OpenAI chat messages, one "
            '{"task_id": ..., "messages": [...]} per line)'
        )
    return p


def _openai_messages(messages: list[dict]) -> list[dict]:
    """Our trajectories' messages in the OpenAI chat shape: tool-call arguments as JSON
    strings and ids ``call_K`` on the calls, named by their results (in order) as ``tool_call_id``."""
    out: list[dict] = []
    pending: list[str] = []  # ids of the calls whose results come next, in order
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls: list[dict[str, Any]] = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                if not isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.dumps(fn.get("arguments", {}))
                call_id = c.get("id") or f"call_{sum(len(x.get('tool_calls') or ()) for x in out) + len(calls)}"
                calls.append({"id": call_id, "type": "function", "function": fn})
            m["tool_calls"] = calls
            pending = [str(c["id"]) for c in calls]
        elif m.get("role") == "tool" and pending and "tool_call_id" not in m:
            m["tool_call_id"] = pending.pop(0)
        out.append(m)
    return out


def read_demonstration_file(path: str | Path, option: str = "--demos-file") -> list[FileDemonstration]:
    """The rows of a demonstration file (the module doc gives the formats).

    A row that cannot be read (not JSON, not an object, no ``task_id`` or ``messages``) is
    returned with its ``problem`` set, to be counted, not raised.

    Args:
        path: a ``.parquet`` trajectories file or a ``.jsonl`` file of messages.
        option: the option that gave it (for messages).

    Returns:
        one :class:`FileDemonstration` per row (blank JSONL lines skipped), in file order.

    Raises:
        ValueError: as :func:`check_demonstration_path`; a file that cannot be read (not a
            trajectories Parquet file, not UTF-8 text) or that holds no row.
    """
    p = check_demonstration_path(path, option)
    rows: list[FileDemonstration] = []
    if FORMATS[p.suffix.lower()] == "parquet":
        try:
            trajs = read_trajectories(p)
        except Exception as e:  # pyarrow's own message says what is wrong with the file
            raise ValueError(
                f"{option} {p}: not a trajectories parquet file ({type(e).__name__}: {e}); give {_HOW}"
            ) from None
        rows = [_row(f"{p}[{k}]", t.task_id, t.messages) for k, t in enumerate(trajs)]
    else:
        try:
            lines = p.read_text(encoding="utf-8-sig").splitlines()  # a UTF-8 BOM (Windows editors) is dropped
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{option} {p}: cannot read it ({e}); give {_HOW}") from None
        for no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{p}:{no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                rows.append(FileDemonstration(where, None, None, ("unparsable_row", f"not JSON ({e.msg})")))
                continue
            if not isinstance(obj, dict):
                rows.append(
                    FileDemonstration(where, None, None, ("unparsable_row", f"a {type(obj).__name__}, not an object"))
                )
                continue
            rows.append(_row(where, obj.get("task_id"), obj.get("messages")))
    if not rows:
        raise ValueError(f"{option} {p}: the file holds no demonstration; give {_HOW}")
    return rows


def _row(where: str, task_id: Any, messages: Any) -> FileDemonstration:
    if isinstance(task_id, int) and not isinstance(task_id, bool):
        task_id = str(task_id)
    if not isinstance(task_id, str) or not task_id:
        return FileDemonstration(where, None, None, ("unparsable_row", f"no task_id (a string), got {task_id!r:.60}"))
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return FileDemonstration(where, task_id, None, ("unparsable_row", "no messages (a list of objects)"))
    return FileDemonstration(where, task_id, messages)


def file_demo_set(
    path: str | Path,
    env: Any,
    renderer: Renderer,
    seed: int = 0,
    log: Callable[[str], None] = print,
    option: str = "--demos-file",
) -> DemoSet:
    """The verified demonstrations of a file, replayed on ``env`` in ``renderer``'s tokens.

    Args:
        path: the file (:func:`read_demonstration_file`).
        env: the environment whose train tasks the rows name.
        renderer: the student's renderer.
        seed: each episode's reset seed.
        log: the counts, then each rejection reason's first case.
        option: the option that gave the file (for messages).

    Returns:
        the :class:`~consequence.distill.teacher.DemoSet`: ``total`` = rows; a kept episode's
        ``sample_id`` counts the earlier kept demonstrations of its task.

    Raises:
        ValueError: as :func:`read_demonstration_file`.
    """
    rows = read_demonstration_file(path, option)
    demos = DemoSet(source={"kind": "file", "path": str(Path(path).resolve()), "environment": env.label})
    tasks, plans, where = [], [], []
    for row in rows:
        if row.problem is None:
            plan, problem = plan_from_messages(row.messages or [], tuple(env.examples))
        else:
            plan, problem = None, row.problem
        if problem is not None or plan is None:
            reason, detail = problem or ("unparsable_row", "unreadable")
            demos.total += 1
            demos.reject(reason, f"{row.where}: {detail}")
            continue
        found = env.find_task(row.task_id)
        if found is None:
            demos.total += 1
            demos.reject("unknown_task", f"{row.where}: task {row.task_id!r} is no task of --env {env.label}")
            continue
        split, task = found
        if split != "train":
            demos.total += 1
            demos.reject("not_train_split", f"{row.where}: task {row.task_id!r} is in the {split} split (train only)")
            continue
        tasks.append(task)
        plans.append(plan)
        where.append(f"{row.where} (task {row.task_id})")
    verify_plans(env, tasks, plans, renderer, seed, where, demos)
    seen: Counter = Counter()
    for t in demos.kept:
        t.sample_id = seen[t.task_id]
        seen[t.task_id] += 1
    log(f"demonstrations of {path}: {demos.summary()}")
    _log_first(demos, log)
    return demos


def _log_first(demos: DemoSet, log: Callable[[str], None]) -> None:
    for reason, first in sorted(demos.first.items()):
        log(f"  {reason} ({demos.rejected[reason]}), first: {first}")


def collect_demonstrations(
    env: Any,
    renderer: Renderer,
    *,
    demos_file: str | Path | None = None,
    episodes: int | None = None,
    seed: int = 0,
    draw_seed: int | None = None,
    log: Callable[[str], None] = print,
    option: str = "--demos-file",
    teacher: TeacherEndpoint | None = None,
) -> DemoSet:
    """The verified demonstrations of one source, in ``renderer``'s tokens (the module doc).

    Args:
        env: the environment.
        renderer: the student's renderer.
        demos_file: a file of demonstrations; None: the environment's demonstrator, or
            ``teacher``.
        episodes: the demonstrator's (or the teacher's) episodes (train instances drawn);
            not with a file.
        seed: the split seed (each episode's reset seed).
        draw_seed: the demonstrator's (or the teacher's) draw seed (default ``seed``); not
            with a file.
        log: the counts and each rejection reason's first case.
        option: the option that gave the file (for messages).
        teacher: a teacher behind an OpenAI-compatible URL instead of the demonstrator
            (:func:`consequence.distill.teacher_url.teacher_url_demo_set`); not with a file.

    Returns:
        the :class:`~consequence.distill.teacher.DemoSet`, with at least one kept episode.

    Raises:
        ValueError: a file together with ``episodes``, ``draw_seed`` or ``teacher`` (the
            sources are exclusive); neither a file nor ``episodes``; an environment without a
            demonstrator and neither a file nor a teacher (names the fix); a bad file
            (:func:`read_demonstration_file`); a teacher that cannot be reached at the start
            (:func:`consequence.distill.teacher_url.probe_teacher`); no demonstration
            verified (the message gives the rejections by reason); an environment without a
            train split (every source plays or replays train tasks; ``Environment.check_splits``).
    """
    env.check_splits({"train": "a cold start's demonstrations"})
    if demos_file is not None:
        if teacher is not None:
            raise ValueError(
                f"{option} and --teacher-url are two sources of demonstrations (a file, or a teacher's "
                "episodes); give one"
            )
        if episodes is not None or draw_seed is not None:
            raise ValueError(
                f"{option} replays the demonstrations of a file; the number of episodes and the draw seed "
                "are the environment demonstrator's: give one source"
            )
        demos = file_demo_set(demos_file, env, renderer, seed, log, option)
        what = f"the {demos.total} demonstrations of {demos_file}"
    elif teacher is not None:
        from consequence.distill.teacher_url import teacher_url_demo_set

        if episodes is None or episodes < 1:
            raise ValueError("give the number of teacher episodes (>= 1)")
        demos = teacher_url_demo_set(env, renderer, teacher, episodes, seed, draw_seed, log)
        _log_first(demos, log)
        what = f"the {episodes} episodes of the teacher at {teacher.url}"
    else:
        if episodes is None or episodes < 1:
            raise ValueError(f"give the number of demonstrator episodes (>= 1), or {option} FILE")
        cfg = WarmstartConfig(seed=seed, n_demos=episodes)
        demos = teacher_demo_set(cfg, log, env, draw_seed, renderer)
        _log_first(demos, log)
        what = f"the {episodes} episodes of --env {env.label}'s demonstrator"
    if not demos.kept:
        first = "; ".join(f"{r}: {w}" for r, w in sorted(demos.first.items()))
        raise ValueError(f"none of {what} was verified by the environment ({demos.summary()}); first of each: {first}")
    return demos
