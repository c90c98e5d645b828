"""Checking an environment before spending a budget on it (``consequence env-check ENV``, issue 37).

The seeds: before a run, check that the environment's reference solutions score the maximum,
that known-bad answers score the minimum, that an instance is reproducible from its seed, and
what a step costs. Each check is one function returning a :class:`CheckResult` (one row of
the report); :func:`run_checks` runs them all on ``tasks`` instances of one split.

Every play goes through the real harness and reward box (``distill.teacher.play_plans``: a
scripted policy's turns rendered in a tokenizer's chat template, parsed back, validated
against the tool schemas, stepped, scored), so an action reaches ``step`` exactly as a
policy's would, and an outcome is what a training run would record. The plays:

- ``reference``: the environment's demonstrator (``Environment.demonstration``) on each task;
  an environment without one reports the check as not available, never as passed;
- ``empty``: a reply with no text; ``malformed``: a tool call whose markup does not parse
  (in the renderer's call format; plain text for a task without tools); ``wrong``: a wrong
  final answer: the demonstration's final call alone, without the work before it, or, when
  the demonstration ends with an answer, that answer with every digit d replaced by
  (d + 1) mod 10 (a different number); without a demonstrator, :data:`WRONG_ANSWER` for an
  environment whose reply ends the episode.

The primary reward component (the first declared; success is exactly 1, docs/environments.md
§3) is the one the reference must max out (1) and a known-bad answer must not earn (at most 0:
what an episode that earned nothing scores; an environment with penalties may go below).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from consequence.envs.api import ANSWER_KEY, Environment, cannot_demonstrate
from consequence.records import Trajectory

__all__ = [
    "BAD_PLAYS",
    "WRONG_ANSWER",
    "CheckResult",
    "Played",
    "check_known_bad",
    "check_reference",
    "check_reset",
    "check_reward_range",
    "check_time",
    "check_tool_schemas",
    "failed",
    "load_tokenizer",
    "malformed_call",
    "run_checks",
    "time_summary",
    "tool_spec_problems",
    "wrong_plan",
]

# A final answer that no task of a shipped environment accepts (no number, no code).
WRONG_ANSWER = "<answer>env-check: a deliberately wrong answer</answer>"
BAD_PLAYS = {"empty": "an empty reply", "malformed": "a malformed tool call", "wrong": "a wrong final answer"}


@dataclass(frozen=True)
class CheckResult:
    """One row of the report.

    Attributes:
        name: the check's id (``reference_max``, ``reset_reproducible``, ...).
        passed: True / False; None when the check is not available or could not run
            (``message`` says why); only False fails ``env-check``.
        value: what was measured, for the table (``"10/10 verified"``).
        message: what failed and how to fix it; for a pass, what was checked.
        data: the measurements as numbers (the JSON report).
    """

    name: str
    passed: bool | None
    value: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A plain-data copy (the JSON report's row)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def failed(results: Sequence[CheckResult]) -> list[CheckResult]:
    """The rows that fail (``passed is False``; not available is not a failure)."""
    return [r for r in results if r.passed is False]


# ---- tool schemas ---------------------------------------------------------------------
def tool_spec_problems(env: Environment) -> list[str]:
    """Every problem of ``env.tools``, one line each (empty when all are valid): each spec is
    ``{"type": "function", "function": {"name", "parameters"}}`` with ``parameters`` a valid
    JSON Schema (Draft 2020-12, checked by the ``jsonschema`` package) of type ``object``,
    and no two tools share a name."""
    import jsonschema

    problems, seen = [], set()
    for i, spec in enumerate(env.tools if isinstance(env.tools, list) else [env.tools]):
        fn = spec.get("function") if isinstance(spec, dict) else None
        if not isinstance(spec, dict) or spec.get("type") != "function" or not isinstance(fn, dict):
            problems.append(f'tools[{i}] is not {{"type": "function", "function": {{...}}}}')
            continue
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            problems.append(f"tools[{i}] has no name (function.name)")
            continue
        if name in seen:
            problems.append(f"tool {name!r} is declared twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        try:
            jsonschema.Draft202012Validator.check_schema(params)
        except jsonschema.SchemaError as e:
            where = "/".join(map(str, e.absolute_path)) or "(top)"
            problems.append(f"tool {name!r}: parameters are not a valid JSON Schema at {where}: {e.message}")
            continue
        if not isinstance(params, dict) or params.get("type") != "object":
            problems.append(
                f"tool {name!r}: parameters must be a JSON Schema of type 'object' (arguments are an object)"
            )
    return problems


def check_tool_schemas(env: Environment) -> CheckResult:
    """Every tool schema is a valid JSON Schema of type object (:func:`tool_spec_problems`)."""
    problems = tool_spec_problems(env)
    n = len(env.tools) if isinstance(env.tools, list) else 1
    if problems:
        return CheckResult(
            "tool_schemas",
            False,
            f"{len(problems)} problem(s) in {n} tool(s)",
            "; ".join(problems) + " — fix the tool's spec in the environment's `tools` (docs/environments.md §1)",
            {"tools": n, "problems": problems},
        )
    return CheckResult(
        "tool_schemas",
        True,
        f"{n} tool(s) valid" if n else "no tools",
        "each tool's parameters: JSON Schema 2020-12, type object"
        if n
        else "a task answered in text: nothing to check",
        {"tools": n},
    )


# ---- reset reproducibility ------------------------------------------------------------
_SKIP = object()  # a value that is not comparable state (a function, a connection, an object)


def _plain(x: Any, depth: int = 0) -> Any:
    """``x`` as comparable plain data: numbers, text, lists, dicts, dataclasses as dicts;
    anything else (functions, sessions, other objects) is :data:`_SKIP`."""
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if depth > 8:
        return _SKIP
    if is_dataclass(x) and not isinstance(x, type):
        return {"<type>": type(x).__name__} | _plain_dict({f.name: getattr(x, f.name) for f in fields(x)}, depth)
    if isinstance(x, dict):
        return _plain_dict(x, depth)
    if isinstance(x, (list, tuple)):
        return [_type_if_skipped(_plain(v, depth + 1), v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted(repr(_plain(v, depth + 1)) for v in x)
    return _SKIP


def _plain_dict(d: dict, depth: int) -> dict:
    out = {str(k): _plain(v, depth + 1) for k, v in d.items()}
    return {k: v for k, v in out.items() if v is not _SKIP}


def _type_if_skipped(p: Any, original: Any) -> Any:
    return f"<{type(original).__name__}>" if p is _SKIP else p


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first place where plain data ``a`` and ``b`` differ: ``(path, a_there, b_there)``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else (path, a, b)


def _snapshot(episode: Any, seed: int) -> dict[str, Any]:
    """What ``reset(seed)`` made: the observation, the info, the episode's comparable state."""
    obs, info = episode.reset(seed=seed)
    state = _plain(dict(vars(episode))) if hasattr(episode, "__dict__") else {}
    return {"observation": obs, "info": _plain(info if isinstance(info, dict) else {"info": info}), "state": state}


def _close(episode: Any) -> None:
    """End an episode that holds a resource (an OpenEnv session); others have no ``close``."""
    close = getattr(episode, "close", None)
    if callable(close):
        close()


def _reset_difference(env: Environment, task: Any, seed: int) -> str | None:
    """Why two resets of ``task`` with ``seed`` differ (a fresh episode twice, and one episode
    reset twice), or None when they agree."""
    first = env.make_episode(task)
    try:
        a = _snapshot(first, seed)
        again = _snapshot(first, seed)
    finally:
        _close(first)
    second = env.make_episode(task)
    try:
        b = _snapshot(second, seed)
    finally:
        _close(second)
    for what, x, y in (("two fresh episodes", a, b), ("one episode reset twice", a, again)):
        d = _first_difference(x, y, "reset")
        if d:
            return f"{what} differ at {d[0]}: {d[1]!r:.120} vs {d[2]!r:.120}"
    return None


def check_reset(env: Environment, split: str, n: int, seed: int) -> CheckResult:
    """``sample(split, n, seed)`` twice draws the same instances, and ``reset(seed)`` of each
    gives the same observation, info and comparable episode state (plain-data attributes of
    the episode object: numbers, text, lists, dicts, dataclasses) in a fresh episode and when
    one episode is reset again."""
    tasks, twin = env.sample(split, n, seed), env.sample(split, n, seed)
    d = _first_difference(_plain([_fields_of(t) for t in tasks]), _plain([_fields_of(t) for t in twin]), "tasks")
    if d:
        return CheckResult(
            "reset_reproducible",
            False,
            "sample not reproducible",
            f"sample({split!r}, {n}, seed={seed}) twice drew different instances at {d[0]}: {d[1]!r:.120} vs "
            f"{d[2]!r:.120} — draw instances only from the seed (Environment.sample)",
        )
    bad = []
    for task in tasks:
        try:
            why = _reset_difference(env, task, seed)
        except Exception as e:  # the environment's code failed: that is the finding
            why = f"make_episode or reset raised {type(e).__name__}: {e}"
        if why:
            bad.append(f"task {task.task_id}: {why}")
    value = f"{len(tasks) - len(bad)}/{len(tasks)} reproducible"
    if bad:
        return CheckResult(
            "reset_reproducible",
            False,
            value,
            bad[0]
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            + " — derive the instance from the task and the reset seed only (no global random state, "
            "clock or counter; docs/environments.md §1)",
            {"tasks": len(tasks), "not_reproducible": len(bad)},
        )
    return CheckResult(
        "reset_reproducible",
        True,
        value,
        "same seed, same observation, info and episode state",
        {"tasks": len(tasks), "not_reproducible": 0},
    )


def _fields_of(task: Any) -> Any:
    """A task's fields (a dataclass, a NamedTuple or a plain object) as a dict to compare."""
    if is_dataclass(task) and not isinstance(task, type):
        return {f.name: getattr(task, f.name) for f in fields(task)}
    if hasattr(task, "_asdict"):
        return dict(task._asdict())
    return dict(getattr(task, "__dict__", {"repr": repr(task)}))


# ---- plays through the harness --------------------------------------------------------
@dataclass
class Played:
    """One kind of play on every task: its episodes (scored) and the environment's time.

    Attributes:
        kind: ``reference``, ``empty``, ``malformed`` or ``wrong``.
        trajectories: one scored trajectory per task, in task order.
        step_s: seconds of each ``step`` call (the environment's own time, not the harness's).
        episode_s: per episode, seconds of its ``reset`` plus its ``step`` calls.
    """

    kind: str
    trajectories: list[Trajectory]
    step_s: list[float] = field(default_factory=list)
    episode_s: list[float] = field(default_factory=list)


class _TimedEpisode:
    """An episode whose ``reset`` and ``step`` are timed; everything else is the episode's."""

    def __init__(self, episode: Any, clock: Callable[[], float]):
        self._episode, self._clock = episode, clock
        self.step_s: list[float] = []
        self.reset_s = 0.0

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        t0 = self._clock()
        try:
            return self._episode.reset(seed=seed, options=options)
        finally:
            self.reset_s += self._clock() - t0

    def step(self, action: dict) -> tuple[str, float, bool, bool, dict]:
        t0 = self._clock()
        try:
            return self._episode.step(action)
        finally:
            self.step_s.append(self._clock() - t0)

    def __getattr__(self, name: str) -> Any:  # code, answer_ends_episode, close, ...
        if name.startswith("__") or name == "_episode":  # a copy's lookups before __init__: no recursion
            raise AttributeError(name)
        return getattr(self._episode, name)


class _TimedEnvironment:
    """What ``play_plans`` reads of an environment, with every episode it makes timed."""

    def __init__(self, env: Environment, clock: Callable[[], float]):
        self.env, self.clock = env, clock
        self.made: list[_TimedEpisode] = []

    def make_episode(self, task: Any) -> _TimedEpisode:
        episode = _TimedEpisode(self.env.make_episode(task), self.clock)
        self.made.append(episode)
        return episode

    def __getattr__(self, name: str) -> Any:  # system_prompt, examples, tools, reward_range, ...
        if name.startswith("__") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)


def play(env: Environment, kind: str, tasks: Sequence[Any], plans: Sequence[Sequence[Any]], renderer, seed: int,
         clock: Callable[[], float] = time.perf_counter) -> Played:  # fmt: skip
    """Play ``plans`` on ``tasks`` through the harness and the reward box, timing the environment.

    Raises:
        ValueError: as ``distill.teacher.play_plans`` (an action it refuses).
    """
    from consequence.distill.teacher import play_plans

    timed = _TimedEnvironment(env, clock)
    trajs = play_plans(timed, tasks, plans, renderer, seed=seed)
    for e in timed.made:
        _close(e)
    return Played(
        kind, trajs, [s for e in timed.made for s in e.step_s], [e.reset_s + sum(e.step_s) for e in timed.made]
    )


def malformed_call(renderer, tools: list[dict]) -> str:
    """A tool call whose markup does not parse in the renderer's call format: the first tool's
    call with its last ``}`` (JSON formats) or ``)`` (pythonic) removed, else cut in half; the
    first candidate the renderer's parser refuses. Without tools: that text as plain text."""
    name = tools[0]["function"]["name"] if tools else "a_tool"
    full = renderer.format_call(name, {})
    candidates = [full[:i] + full[i + 1 :] for i in (full.rfind("}"), full.rfind(")")) if i >= 0]
    candidates.append(full[: len(full) // 2])
    if tools:
        for text in candidates:
            if renderer.format.split(text, tools)[2]:  # (content, calls, parse_error)
                return text
    return candidates[0]


def _shift_digits(text: str) -> str:
    return "".join(str((int(c) + 1) % 10) if c.isdigit() else c for c in text)


def wrong_plan(env: Environment, reference: Sequence[Any] | None) -> tuple[list[Any] | None, str]:
    """A wrong final answer for one task, and how it was made (module doc); ``(None, why)``
    when there is none: no demonstrator and replies do not end the episode."""
    if reference:
        last = reference[-1]
        if isinstance(last, dict) and ANSWER_KEY in last:
            shifted = _shift_digits(last[ANSWER_KEY])
            if shifted != last[ANSWER_KEY]:
                return [{ANSWER_KEY: shifted}], "the demonstrated answer, digits shifted"
            return [{ANSWER_KEY: WRONG_ANSWER}], f"the reply {WRONG_ANSWER!r} (the demonstrated answer has no digit)"
        return [last], "the demonstration's final call alone, without the work before it"
    if env.answer_ends_episode:
        return [{ANSWER_KEY: WRONG_ANSWER}], f"the reply {WRONG_ANSWER!r}"
    return (
        None,
        "no demonstrator to derive a wrong final answer from, and a reply without a tool call does not end its episodes",
    )


def _outcome(t: Trajectory, primary: str) -> str:
    value = t.reward_components.get(primary)
    return (
        f"{t.outcome}"
        + (f" ({t.truncation_reason})" if t.truncation_reason else "")
        + (f", {primary}={value:g}" if value is not None else "")
        + (f", error: {t.error}" if t.error else "")
    )


def check_reference(env: Environment, played: Played | None, why_not: str | None) -> CheckResult:
    """The demonstrator's solutions score the maximum: every episode finished with the
    primary component 1 (``solved``). Not available (None) without a demonstrator."""
    from consequence.evaluate.episode_eval import solved

    if played is None:
        return CheckResult("reference_max", None, "not available", why_not or "no reference solutions")
    primary = env.reward_components[0]
    trajs = played.trajectories
    bad = [t for t in trajs if not solved(t)]
    value = f"{len(trajs) - len(bad)}/{len(trajs)} verified"
    data = {"episodes": len(trajs), "not_max": len(bad)}
    if bad:
        t = bad[0]
        return CheckResult(
            "reference_max",
            False,
            value,
            f"the demonstration of task {t.task_id} ended {_outcome(t, primary)}, not finished with {primary}=1"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            + " — the demonstrator and the verifier disagree: fix Environment.demonstration or the reward in step()",
            data,
        )
    return CheckResult("reference_max", True, value, f"every demonstration finished with {primary}=1", data)


def check_known_bad(env: Environment, kind: str, played: Played | None, how: str) -> CheckResult:
    """A known-bad play (``kind``: empty, malformed, wrong) never ends as ``env_error`` and its
    primary component is at most 0 (never a success). Not available (None) when there is no
    such play; ``how`` says how the bad answer was made, or why there is none."""
    name = f"{kind}_min"
    if played is None:
        return CheckResult(name, None, "not available", how)
    label, primary = BAD_PLAYS[kind], env.reward_components[0]
    trajs = played.trajectories
    errors = [t for t in trajs if t.outcome == "env_error"]
    earned = [t for t in trajs if t.outcome != "env_error" and t.reward_components.get(primary, 0.0) > 0.0]
    data = {"episodes": len(trajs), "env_errors": len(errors), "above_min": len(earned)}
    value = f"{len(trajs) - len(errors) - len(earned)}/{len(trajs)} at the minimum"
    if errors:
        t = errors[0]
        return CheckResult(
            name,
            False,
            value,
            f"{label} ({how}) on task {t.task_id} ended env_error: {t.error} — a bad answer is the policy's "
            "fault: score it (0), never fail the episode (docs/environments.md §4)",
            data,
        )
    if earned:
        t = earned[0]
        return CheckResult(
            name,
            False,
            value,
            f"{label} ({how}) on task {t.task_id} earned {primary}="
            f"{t.reward_components[primary]:g} > 0 — the verifier rewards a bad answer: make it score 0",
            data,
        )
    return CheckResult(name, True, value, f"{label} ({how}): {primary} <= 0, no env_error", data)


def check_reward_range(env: Environment, plays: Sequence[Played]) -> CheckResult:
    """Every played episode's total (the environment's rewards summed over its steps and
    components, before the reward box) is a finite number inside ``reward_range``."""
    low, high = env.reward_range
    totals = [(p.kind, t, math.fsum(t.env_rewards.values())) for p in plays for t in p.trajectories]
    bad = [(k, t, x) for k, t, x in totals if not (math.isfinite(x) and low <= x <= high)]
    seen = [x for _, _, x in totals]
    data = {"episodes": len(totals), "out_of_range": len(bad), "low": low, "high": high}
    if seen:
        data |= {"min_total": min(seen), "max_total": max(seen)}
    value = f"{len(totals) - len(bad)}/{len(totals)} in [{low:g}, {high:g}]"
    if not totals:
        return CheckResult("reward_range", None, "no episode", "no episode was played", data)
    if bad:
        kind, t, x = bad[0]
        return CheckResult(
            "reward_range",
            False,
            value,
            f"the {kind} play of task {t.task_id} totals {x!r}, outside the declared reward_range [{low}, {high}]"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            + " — declare the range the rewards can reach, or fix the reward (docs/environments.md §3)",
            data,
        )
    return CheckResult("reward_range", True, value, f"observed totals from {min(seen):g} to {max(seen):g}", data)


def time_summary(seconds: Sequence[float]) -> dict[str, float]:
    """``{"n", "median_s", "max_s"}`` of a list of durations (median: ``statistics.median``)."""
    if not seconds:
        return {"n": 0, "median_s": math.nan, "max_s": math.nan}
    return {"n": len(seconds), "median_s": statistics.median(seconds), "max_s": max(seconds)}


def check_time(what: str, seconds: Sequence[float]) -> CheckResult:
    """The environment's wall time per ``step`` or per episode (``what``): median and max. A
    measurement, not a pass / fail rule (it passes whenever something was timed)."""
    s = time_summary(seconds)
    name = f"{what}_time"
    if not s["n"]:
        return CheckResult(name, None, "nothing timed", f"no {what} was played", s)
    value = f"median {_ms(s['median_s'])}, max {_ms(s['max_s'])} ({s['n']} {what}s)"
    unit = "reset + steps of one episode" if what == "episode" else "one step() call"
    return CheckResult(name, True, value, f"the environment's own time for {unit}", s)


def _ms(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


# ---- all checks -----------------------------------------------------------------------
def load_tokenizer(model_path=None):
    """The tokenizer whose chat template renders the scripted plays: ``model_path``'s (a
    checkpoint folder), else the bundled tiny model's (``consequence/assets/tiny-repair``)."""
    from transformers import AutoTokenizer

    from consequence.policy.tiny import BUNDLED

    return AutoTokenizer.from_pretrained(str(model_path or BUNDLED))


def _reference(env: Environment, tasks: Sequence[Any], seed: int) -> tuple[list[list[Any]] | None, str | None]:
    """The demonstrator's plans of ``tasks`` (drawn with ``random.Random(seed)``), or
    ``(None, why)`` when it has none here.

    Raises:
        ValueError: the demonstrator returned something that is not a plan (names the task).
    """
    from consequence.distill.teacher import demonstration_plans

    why = cannot_demonstrate(env)
    if why is not None:
        return None, why
    return demonstration_plans(env, tasks, random.Random(seed)), None


def run_checks(
    env: Environment,
    tokenizer,
    *,
    tasks: int = 10,
    seed: int = 0,
    split: str = "train",
    clock: Callable[[], float] = time.perf_counter,
) -> list[CheckResult]:
    """Every check of ``env`` on ``tasks`` instances of ``split`` drawn with ``seed``.

    Args:
        env: the environment (made by ``envs.registry.load_environment``).
        tokenizer: a tokenizer with a chat template (:func:`load_tokenizer`); the plays are
            rendered in it and parsed back, as a policy's turns would be.
        tasks: instances to check (each is played four times: reference, empty, malformed, wrong).
        seed: draws the instances, the demonstrations' style and every reset.
        split: the split the instances come from.
        clock: the timer of ``reset`` / ``step`` (seconds).

    Returns:
        the rows, in order: tool_schemas, reset_reproducible, reference_max, empty_min,
        malformed_min, wrong_min, reward_range, step_time, episode_time.

    Raises:
        ValueError: ``tasks`` < 1, or ``split`` holds no task.
    """
    if tasks < 1:
        raise ValueError(f"--tasks {tasks}: give the number of task instances to check (>= 1)")
    env.check_splits({split: f"--split {split}"})
    try:
        task_list = env.sample(split, tasks, seed)
    except ValueError:
        raise
    except Exception as e:  # the environment's own code: name it, never a traceback
        raise ValueError(
            f"--env {env.label}: sample({split!r}, {tasks}, seed={seed}) raised {type(e).__name__}: {e}"
        ) from None
    results = [check_tool_schemas(env), check_reset(env, split, tasks, seed)]
    return results + _play_checks(env, tokenizer, task_list, seed, clock, results[0])


def _play_checks(env, tokenizer, task_list, seed, clock, schemas: CheckResult) -> list[CheckResult]:
    """The checks that play episodes (reference, known-bad, range, time); not run (None, with
    the reason) when the tool schemas are invalid; when the renderer or the demonstrator
    fails, ``reference_max`` fails with the reason and the rest are not run."""
    names = ["reference_max", "empty_min", "malformed_min", "wrong_min", "reward_range", "step_time", "episode_time"]
    if not schemas.passed:
        return [CheckResult(n, None, "not run", "not run: the tool schemas are invalid (tool_schemas)") for n in names]
    from consequence.harness.renderer import Renderer

    try:
        renderer = Renderer(tokenizer, env.tools)
    except ValueError as e:
        return _not_played(names, "the chat template cannot render the tools", e)
    try:
        reference, why_not = _reference(env, task_list, seed)
    except Exception as e:  # the environment's demonstrator failed: a finding, never a traceback
        return _not_played(names, "the demonstrator failed", e)
    plays = (
        {} if reference is None else {"reference": play(env, "reference", task_list, reference, renderer, seed, clock)}
    )
    bad = _bad_plans(env, renderer, task_list, reference)
    for kind, (plans, _how) in bad.items():
        if plans is not None:
            plays[kind] = play(env, kind, task_list, plans, renderer, seed, clock)
    rows = [check_reference(env, plays.get("reference"), why_not)]
    rows += [check_known_bad(env, kind, plays.get(kind), how) for kind, (_p, how) in bad.items()]
    everything = list(plays.values())
    rows.append(check_reward_range(env, everything))
    rows.append(check_time("step", [s for p in everything for s in p.step_s]))
    rows.append(check_time("episode", [s for p in everything for s in p.episode_s]))
    return rows


def _not_played(names: list[str], why: str, e: Exception) -> list[CheckResult]:
    """Nothing could be played: the reference fails with the reason, the rest are not run."""
    first = CheckResult("reference_max", False, "not played", f"{why}: {type(e).__name__}: {e}")
    return [first] + [CheckResult(n, None, "not run", f"not run: {why} (reference_max)") for n in names[1:]]


def _bad_plans(env, renderer, task_list, reference) -> dict[str, tuple[list | None, str]]:
    """kind → (one plan per task, or None; how the bad answer is made)."""
    out: dict[str, tuple[list | None, str]] = {
        "empty": ([[{ANSWER_KEY: ""}] for _ in task_list], "no text"),
        "malformed": (
            [[{ANSWER_KEY: malformed_call(renderer, env.tools)}] for _ in task_list],
            "markup that does not parse" if env.tools else "call markup in a task without tools",
        ),
    }
    wrong = [wrong_plan(env, reference[i] if reference else None) for i in range(len(task_list))]
    out["wrong"] = (None if wrong[0][0] is None else [p for p, _ in wrong], wrong[0][1])
    return out
