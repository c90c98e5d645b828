"""The environment API: what a plug-in environment declares, and the episodes it makes.

An :class:`Environment` is one task family (docs/environments.md): it declares its tools
(JSON-schema function specs, OpenAI shape), its system prompt, its reward components and
the rule that sums them, and its task source with train / validation / test splits by
problem. It makes one :class:`Episode` per rollout; an episode has Gymnasium's shape
(Brockman et al. 2016; Gymnasium 1.0 ``Env``):

    reset(seed, options) -> (observation: str, info: dict)
    step(action: dict)   -> (observation: str, reward: float, terminated: bool,
                             truncated: bool, info: dict)

``action`` is either a tool call ``{"name": str, "arguments": dict}`` (already validated
against ``tools``) or, when the model replied without a tool call, ``{"answer": str}``
(the reply's text). With ``answer_ends_episode`` (the default) the harness gives the
answer to ``step`` and the episode may end there (single-turn tasks are the one-step
case); an episode can also reply to an answer and go on (``terminated=False``: its
observation is shown as a user turn). An environment whose replies without a tool call
are just turns (code repair) sets ``answer_ends_episode = False``.

Rewards may arrive at any step: every step's reward is kept, on the model call that
caused it (``ModelCall.reward``), and reaches the credit box through returns-to-go. A step
names its reward's parts in ``info["reward_components"]`` (``{name: value}``, summing to
the step's reward); the trajectory's reward is the sum over steps and components
(``reward_rule = "sum"``), checked finite and inside ``reward_range``. An episode that
raises, or sets ``info["env_error"]``, is an ``env_error``: excluded and counted, never 0.

A group builder (:meth:`Environment.make_group`) makes the G isolated episodes of one
task (default: G calls of :meth:`make_episode`); :meth:`Environment.score_group` may
rescore the finished group jointly (e.g. a pairwise judge) before advantages are taken.

An environment may also demonstrate a solution (:meth:`Environment.demonstration`, optional;
:func:`has_demonstrator` says whether it does): the actions of one solution of a task, in the
episode's action format, which the cold start plays through a fresh episode and keeps only
when the environment's own reward verifies it (docs/distillation.md). A demonstration file
names its tasks by id; :meth:`Environment.find_task` turns an id back into the task.

An environment may also define a potential (:meth:`Environment.potential`, optional;
:func:`has_potential`): Φ of an episode's state, which ``--shaping potential`` turns into a
per-turn reward γΦ(s') − Φ(s) (Ng, Harada & Russell 1999; ``consequence.reward.shaping``).

An environment may also support retries (:meth:`Environment.retry_feedback`, optional;
:func:`has_retries`): after a wrong answer it reopens the episode and gives the verifier's
feedback, so ``--attempts k`` lets the model answer again (``consequence.rollout.attempts``).

:class:`SingleTurnEnvironment` is a single-turn task given as data: a dataset of prompts
and a Python ``reward_fn(prompt, completion, **info) -> float | dict`` whose value gets
the checks of any verifier (:func:`check_reward_fn_value`); ``SingleTurnEnvironment.scoring``
puts a ``reward_fn`` in place of a single-turn environment's own verifier (docs/api.md).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import json
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

__all__ = [
    "Episode",
    "Environment",
    "SPLITS",
    "ANSWER_KEY",
    "source_sha256",
    "answer_in_text",
    "SingleTurnEnvironment",
    "SingleTurnEpisode",
    "SingleTurnTask",
    "check_reward_fn_value",
    "has_demonstrator",
    "has_potential",
    "has_retries",
    "cannot_demonstrate",
]

SPLITS: tuple[str, ...] = ("train", "validation", "test")
ANSWER_KEY = "answer"  # the action of a reply without a tool call: {"answer": text}
# An answer of at least this many characters that occurs whole in a question counts as
# written in it (shorter ones, "1" or "yes", occur in many texts by chance).
ANSWER_IN_TEXT_MIN_CHARS = 3


def answer_in_text(answer: str | None, text: str | None) -> bool:
    """``answer`` (stripped, ≥ ANSWER_IN_TEXT_MIN_CHARS characters) occurs whole in ``text``,
    not inside a longer word on either side: a policy that copies from the question can
    give it (a sorting task whose input is already sorted)."""
    if not answer or text is None:
        return False
    a = answer.strip()
    return len(a) >= ANSWER_IN_TEXT_MIN_CHARS and re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text) is not None


@runtime_checkable
class Episode(Protocol):
    """One rollout's environment (Gymnasium's ``reset`` / ``step``; see the module doc)."""

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]: ...

    def step(self, action: dict) -> tuple[str, float, bool, bool, dict]: ...


class Environment:
    """A task family: tools, system prompt, reward components, task splits, episodes.

    Subclass it, set the class attributes, and implement :meth:`load_splits` and
    :meth:`make_episode`. Options given by the user (``--env-option key=value``, a YAML
    ``env_options:`` section, ``--tasks-file``) arrive as keyword arguments of
    ``__init__``; declare them as parameters so that an unknown option is refused.

    Class attributes:
        name: registry name (``--env NAME``); version: bump it when episodes or scores change.
        system_prompt: the first message of every episode.
        examples: worked examples ``(request, reply)`` shown as earlier user / assistant
            turns after the system prompt (few-shot prompting); context only, never
            trained on. An instance may set its own (e.g. from an option).
        tools: JSON-schema function specs; ``[]`` for a task answered in plain text.
        reward_components: names of the reward's parts, logged separately.
        reward_rule: how parts combine into the reward (only ``"sum"``: over steps and parts).
        reward_range: (low, high) of a trajectory's total reward, checked before use.
        answer_ends_episode: a reply without a tool call is given to ``step`` as ``{"answer": text}``.
        rubric: optional criteria an LLM judge grades an episode by (``train --judge-url``,
            ``consequence judge-check``; ``--judge-rubric FILE`` replaces it); None: none.

    Args:
        split_seed: seed of the problem-level train / validation / test split.

    Raises:
        ValueError: from :meth:`load_splits`: a task source that cannot be read (the
            message names it and the fix).
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "0"
    # Not ClassVar: an environment's options may set these per instance (openenv's tools and
    # reward_range, calculator's system prompt from its budget, reasoning-gym's format component).
    system_prompt: str = ""
    examples: tuple[tuple[str, str], ...] = ()
    tools: list[dict] = []
    reward_components: tuple[str, ...] = ("reward",)
    reward_rule: ClassVar[str] = "sum"
    reward_range: tuple[float, float] = (0.0, 1.0)
    answer_ends_episode: bool = True
    rubric: str | None = None  # what an LLM judge grades by (reward/judge.py); None: give --judge-rubric
    sources: ClassVar[tuple[str, ...]] = ()  # further modules whose code makes the episodes (hashed too)
    # the options registry.load_environment made it with (see `options`); unset on one made directly
    _options: dict[str, Any]

    def __init__(self, split_seed: int = 0, **options: Any):
        if options:
            raise ValueError(
                f"environment {self.name!r} takes no option " + ", ".join(sorted(options)) + " (it declares none)"
            )
        self.split_seed = split_seed
        self.split: dict[str, list] = self.load_splits(split_seed)

    # ---- what a subclass implements -------------------------------------------------
    def load_splits(self, split_seed: int) -> dict[str, list]:
        """``{"train": [...], "validation": [...], "test": [...]}``: tasks split by problem
        (or problems from which :meth:`sample` draws tasks, as ``repair`` does).

        A task is any object with ``task_id`` and ``problem_id`` (str) attributes (a
        dataclass, a NamedTuple or a plain object; the default :meth:`sample` copies it with
        a new ``task_id``); tasks of one problem must all land in the same split (checked)."""
        raise NotImplementedError(f"{type(self).__name__}.load_splits")

    def make_episode(self, task: Any) -> Episode:
        """A fresh, isolated episode of ``task`` (nothing shared with other episodes)."""
        raise NotImplementedError(f"{type(self).__name__}.make_episode")

    # ---- optional ------------------------------------------------------------------
    def make_group(self, task: Any, size: int) -> list[Episode]:
        """The ``size`` isolated episodes of one group (one task, G rollouts)."""
        return [self.make_episode(task) for _ in range(size)]

    def score_group(self, task: Any, trajectories: list) -> None:
        """Rescore a finished group jointly (set ``t.reward`` / ``t.reward_components``); default: nothing."""

    def iteration_metrics(self, trajectories: list) -> dict[str, float]:
        """Metrics of one training iteration's batch that only this environment can compute
        (logged in ``metrics.jsonl`` beside the loop's own); default none."""
        return {}

    def demonstration(self, task: Any, rng: random.Random) -> list[dict]:
        """The actions of one solution of ``task``, in the order they are played (optional).

        Each action is in the episode's action format (the module doc): a tool call
        ``{"name": str, "arguments": dict}`` (one assistant turn), or ``{"answer": text}``
        for a reply without a tool call. The cold start (``consequence sft``,
        ``consequence demos``, the tiny warm start) plays them through a fresh episode of
        ``task`` and keeps the demonstration only when the episode finished and this
        environment's own reward verified it (the primary component is 1): a demonstrator
        is checked before use, never trusted, so it may be wrong sometimes (e.g. mix in a
        wrong first try it then repairs). Draw any randomness from ``rng`` only: the
        demonstrations are then a deterministic function of the draw seed (the caller
        passes one generator to the tasks in order). Cheap and pure: no episode is run here.
        A demonstrator may declare a keyword ``habits`` (a mapping of names to settings of
        its style); the warm start's non-default ``p_*`` settings reach it there.

        Args:
            task: a task of this environment (a train-split instance drawn by :meth:`sample`).
            rng: the random generator of the demonstrations' style.

        Returns:
            the actions, in order.

        Raises:
            NotImplementedError: this environment has no demonstrator (the default), or the
                options of this instance leave it none (e.g. ``calculator`` with
                ``max_calls=0``: its demonstration calls the tool); the message says why.
                Nothing is demonstrated then: use a file of demonstrations or a teacher URL
                instead (docs/distillation.md). :func:`cannot_demonstrate` probes for it
                before any work.
        """
        raise NotImplementedError(
            f"environment {self.label!r} has no demonstrator ({type(self).__name__}.demonstration); "
            "give a file of demonstrations instead (docs/distillation.md)"
        )

    def potential(self, episode: Any) -> float:
        """Φ(s): the potential of ``episode``'s current state, for ``--shaping potential`` (optional).

        The harness asks after ``reset`` (and any scripted opening) for Φ(s_0), then after each
        model call's turn (its tool calls or answer run) for Φ(s_{t+1}); the credit box's turn
        reward then gains F_t = γΦ(s_{t+1}) − Φ(s_t) (Ng, Harada & Russell 1999, "Policy
        invariance under reward transformations", Theorem 1), which leaves the ranking of
        policies unchanged. Return the value of the state as it is, even when the episode has
        just ended: the framework sets Φ(terminal) = 0 itself at a true end (outcome
        ``finished``) and keeps the returned value after a truncation (docs/environments.md).
        The episode object is the state: read what it keeps (e.g. the last test report), never
        run anything costly here (it is called once per turn of every episode).

        Args:
            episode: an episode this environment made (:meth:`make_episode`), mid-run.

        Returns:
            a finite float, in the units of the reward; a value that is not finite, or an
            exception, makes the episode an ``env_error`` (excluded, counted).

        Raises:
            NotImplementedError: this environment defines no potential (the default);
                :func:`has_potential` says so before any work.
        """
        raise NotImplementedError(f"environment {self.label!r} defines no potential ({type(self).__name__}.potential)")

    def retry_feedback(self, episode: Any, info: dict) -> str | None:
        """After an answer that ended ``episode``: reopen it for another attempt (``--attempts k``, optional).

        The harness calls it when a step terminated the episode and attempts are left. Return
        None when the attempt is right (the episode stays ended), else reopen the episode (its
        next ``step`` must work: clear the "over" flag, keep the state the model built, e.g. the
        edited code) and return the feedback the model sees as the answer's result: what the
        verifier found (a wrong value, how many hidden tests failed), never what would give the
        solution away (the reference value, the hidden tests' text).

        Args:
            episode: an episode this environment made (:meth:`make_episode`), just terminated.
            info: the ``info`` dict its terminating ``step`` returned.

        Returns:
            the feedback text, or None (nothing to retry).

        Raises:
            NotImplementedError: this environment supports no retries (the default);
                :func:`has_retries` says so before any work.
        """
        raise NotImplementedError(
            f"environment {self.label!r} supports no retries ({type(self).__name__}.retry_feedback)"
        )

    def find_task(self, task_id: str) -> tuple[str, Any] | None:
        """The split and the task that ``task_id`` names, or None when it names none.

        Used to replay a demonstration read from a file on its own task. Default: the id up to
        its first ``#`` (instances drawn by :meth:`sample` are ``ID#seed-k``) is looked up
        among the task ids of every split, then among the problem ids (only a problem with
        exactly one task); the task comes back under the whole ``task_id`` (a copy, as
        :meth:`sample` makes). An environment whose instances differ from their problem
        (``repair`` renames variables per instance) overrides it.

        Args:
            task_id: a task id as trajectories record it (``Trajectory.task_id``).

        Returns:
            ``(split, task)`` or None.
        """
        base = task_id.split("#", 1)[0]
        for key in ("task_id", "problem_id"):
            found = [(s, t) for s in SPLITS for t in self.split.get(s, []) if getattr(t, key, None) == base]
            if len(found) == 1:
                split, task = found[0]
                return split, task if task.task_id == task_id else _renamed(task, task_id)
            if found:  # a problem of several tasks: the id does not say which
                return None
        return None

    def sample(self, split: str, n: int, seed: int) -> list:
        """``n`` task instances of ``split``, deterministic in ``seed``: a seeded permutation of
        the split, cycled; each copy's ``task_id`` is made unique (``id#seed-k``).

        Raises:
            ValueError: unknown split, or an empty split and ``n > 0``.
        """
        pool = self._pool(split)
        if n > 0 and not pool:
            raise ValueError(f"--env {self.label}: the {split} split has no task to draw from")
        order = list(range(len(pool)))
        random.Random(seed).shuffle(order)
        picked = [pool[order[k % len(order)]] for k in range(n)]
        return [_renamed(task, f"{task.task_id}#{seed}-{k}") for k, task in enumerate(picked)]

    # ---- derived -------------------------------------------------------------------
    def _pool(self, split: str) -> list:
        if split not in self.split:
            raise ValueError(f"unknown split {split!r}; valid: {', '.join(self.split)}")
        return self.split[split]

    def request(self, task: Any) -> str:
        """The opening observation of ``task`` (what ``reset`` shows the policy).

        Raises:
            ValueError: ``make_episode`` or ``reset`` raised, or the observation is not a string.
        """
        try:
            obs = self.make_episode(task).reset(seed=0)[0]
        except Exception as e:  # the environment's code failed before any work: say where
            raise ValueError(
                f"--env {self.label}: making or resetting an episode of task "
                f"{getattr(task, 'task_id', task)!r} raised {type(e).__name__}: {e}"
            ) from None
        if not isinstance(obs, str):
            raise ValueError(
                f"--env {self.label}: reset() must return (observation: str, info: dict); the "
                f"observation is a {type(obs).__name__}"
            )
        return obs

    def check_splits(self, needed: dict[str, str | None]) -> None:
        """Every split that a setting needs holds problems.

        Args:
            needed: split → the option or purpose that needs it (None: not needed).

        Raises:
            ValueError: an empty split (names the environment, the split sizes, and the fix).
        """
        sizes = {k: len(v) for k, v in self.split.items()}
        for split, why in needed.items():
            if why and not sizes.get(split):
                raise ValueError(
                    f"--env {self.label}: the {split} split is empty (split by problem: "
                    + ", ".join(f"{k} {n}" for k, n in sizes.items())
                    + f"), and {why} needs it; "
                    + (
                        "give a split that holds problems, or add problems to the task source"
                        if why.startswith("--split")
                        else f"add problems (about 10 % of them land in validation and 10 % in test) or set {why} 0"
                        if why.startswith("--")
                        else "add problems to the task source"
                    )
                )

    def longest_prompt(self, n_tokens, n: int = 256, seed: int = 0) -> int:
        """Longest ``n_tokens(request)`` among ``n`` train instances (all problems when fewer)."""
        tasks = self.sample("train", min(n, len(self.split["train"])), seed=seed)
        return max((n_tokens(self.request(t)) for t in tasks), default=0)

    def problem_ids(self) -> dict[str, list[str]]:
        """split → problem ids (what ``split.json`` and the manifest record)."""
        return {k: [p.problem_id for p in v] for k, v in self.split.items()}

    @property
    def options(self) -> dict[str, Any]:
        """The options this environment was made with (JSON-able; for the manifest and reports)."""
        return dict(getattr(self, "_options", {}))

    @property
    def label(self) -> str:
        """How reports and the split ledger name this environment and its task source."""
        return self.name

    def describe(self) -> dict[str, Any]:
        """Name, version, class, source hash, options, tools, prompt and reward rule (the manifest's record)."""
        cls = type(self)
        return {
            "name": self.name,
            "version": self.version,
            "class": f"{cls.__module__}:{cls.__qualname__}",
            "source_sha256": source_sha256(cls),
            "options": self.options,
            "label": self.label,
            "split_seed": self.split_seed,
            "tools": [t["function"]["name"] for t in self.tools],
            "system_prompt": self.system_prompt,
            "examples": [list(x) for x in self.examples],
            "reward_components": list(self.reward_components),
            "reward_rule": self.reward_rule,
            "reward_range": list(self.reward_range),
            "answer_ends_episode": self.answer_ends_episode,
        }


def _renamed(task: Any, task_id: str) -> Any:
    """A copy of ``task`` under ``task_id`` (a dataclass, a NamedTuple or a plain object)."""
    if dataclasses.is_dataclass(task) and not isinstance(task, type):  # an instance (mypy: not a class)
        return dataclasses.replace(task, task_id=task_id)
    if hasattr(task, "_replace"):  # a NamedTuple
        return task._replace(task_id=task_id)
    twin = copy.copy(task)
    object.__setattr__(twin, "task_id", task_id)
    return twin


def has_demonstrator(env: Environment | type) -> bool:
    """Whether an environment (instance or class) overrides :meth:`Environment.demonstration`."""
    cls = env if isinstance(env, type) else type(env)
    return getattr(cls, "demonstration", None) is not Environment.demonstration


def has_potential(env: Environment | type) -> bool:
    """Whether an environment (instance or class) overrides :meth:`Environment.potential`."""
    cls = env if isinstance(env, type) else type(env)
    return getattr(cls, "potential", None) is not Environment.potential


def has_retries(env: Environment | type) -> bool:
    """Whether an environment (instance or class) overrides :meth:`Environment.retry_feedback`."""
    cls = env if isinstance(env, type) else type(env)
    return getattr(cls, "retry_feedback", None) is not Environment.retry_feedback


def cannot_demonstrate(env: Environment) -> str | None:
    """Why ``env`` cannot demonstrate its tasks, or None when it can (checked before any work).

    It cannot when it has no demonstrator (:func:`has_demonstrator`), or when its options
    leave it none: :meth:`Environment.demonstration` raises ``NotImplementedError`` (its
    message is the reason) on a train instance, probed on one (a demonstration is cheap and
    pure). An empty train split is not probed (None): ``check_splits`` refuses it.
    """
    if not has_demonstrator(env):
        return f"this environment has no demonstrator ({type(env).__name__}.demonstration)"
    if not env.split.get("train"):
        return None
    try:
        env.demonstration(env.sample("train", 1, seed=0)[0], random.Random(0))
    except NotImplementedError as e:
        return str(e) or f"{type(env).__name__}.demonstration raised NotImplementedError"
    return None


def source_sha256(cls: type) -> str | None:
    """sha256 of the source files of ``cls``, of every Environment class it derives from, and
    of the modules it lists in ``sources`` (where its episodes and verifier live); None when
    a source cannot be read (e.g. a class built at run time)."""
    h = hashlib.sha256()
    files: list[str] = []
    for base in cls.__mro__:
        if base in (Environment, object) or not issubclass(base, Environment):
            continue
        try:
            path = inspect.getsourcefile(base)
        except TypeError:
            return None
        if path and path not in files:
            files.append(path)
    import importlib

    for module in getattr(cls, "sources", ()):
        try:
            path = inspect.getsourcefile(importlib.import_module(module))
        except (ImportError, TypeError):
            return None
        if path and path not in files:
            files.append(path)
    for path in files:
        try:
            h.update(Path(path).read_bytes())
        except OSError:
            return None
    return h.hexdigest() if files else None


def check_environment(env: Environment) -> None:
    """The declarations a run relies on, before any work.

    Raises:
        ValueError: no name, no split key, a split entry without a string ``problem_id``,
            a problem in two splits, a reward rule other than sum, an empty or reversed
            reward range, or a tool spec that is not JSON-able.
    """
    who = f"environment {type(env).__module__}:{type(env).__qualname__}"
    if not isinstance(env.split, dict):
        raise ValueError(f"{who}: load_splits() returned a {type(env.split).__name__}, not a dict of split → tasks")
    if not (
        isinstance(env.reward_range, (tuple, list))
        and len(env.reward_range) == 2
        and all(isinstance(x, (int, float)) for x in env.reward_range)
    ):
        raise ValueError(f"{who}: reward_range must be (low, high) numbers, got {env.reward_range!r}")
    for i, spec in enumerate(env.tools if isinstance(env.tools, list) else [None]):
        fn = spec.get("function") if isinstance(spec, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f'{who}: tools[{i}] must look like {{"type": "function", "function": '
                f'{{"name": ..., "parameters": {{...}}}}}} (OpenAI function specs), got {spec!r:.80}'
            )
    if not env.name:
        raise ValueError(f"{who} has no `name`; set the class attribute name = '...'")
    missing = [s for s in SPLITS if s not in env.split]
    if missing:
        raise ValueError(
            f"{who}: load_splits() must return the splits {', '.join(SPLITS)}; missing {', '.join(missing)}"
        )
    seen: dict[str, str] = {}
    for split in SPLITS:
        for task in env.split[split]:
            if not isinstance(getattr(task, "problem_id", None), str):
                raise ValueError(f"{who}: an entry of the {split} split has no string `problem_id` ({task!r:.80})")
            other = seen.setdefault(task.problem_id, split)
            if other != split:
                raise ValueError(
                    f"{who}: problem {task.problem_id!r} is in both the {other} and the {split} split; "
                    "split by problem so that no test problem is trained on"
                )
    if env.reward_rule != "sum":
        raise ValueError(f"{who}: reward_rule {env.reward_rule!r} is not supported (only 'sum')")
    low, high = env.reward_range
    if not low <= high:
        raise ValueError(f"{who}: reward_range {env.reward_range} is empty")
    try:
        json.dumps(env.tools)
    except TypeError as e:
        raise ValueError(f"{who}: tools must be JSON (OpenAI function specs): {e}") from None


def first_reward_parts(components: Sequence[str]) -> dict[str, float]:
    """``{name: 0.0}`` for each declared component: the reward of an episode that earned nothing."""
    return {c: 0.0 for c in components}


# ---- a single-turn task from a dataset and a Python reward function ------------------
def callable_name(fn: Any) -> str:
    """``module:qualname`` of a function (what error messages and the manifest call it)."""
    return f"{getattr(fn, '__module__', None) or '?'}:{getattr(fn, '__qualname__', None) or type(fn).__qualname__}"


def _finite(x: Any) -> float | None:
    """``x`` as a finite float, or None (a bool is not a reward: True is not 1.0 by accident)."""
    if isinstance(x, bool) or not (isinstance(x, (int, float)) or hasattr(x, "__float__")):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def check_reward_fn_value(
    raw: Any, components: Sequence[str], low: float, high: float
) -> tuple[dict[str, float] | None, str | None]:
    """What a ``reward_fn`` returned, as named components, with the checks of any verifier
    (docs/design.md §3, docs/cases.md, case 03): every value a finite number, the total
    inside ``[low, high]``.

    Args:
        raw: a number (it becomes the primary component ``components[0]``) or a dict
            ``{component: number}`` whose names are among ``components``.
        components: the environment's declared reward components.
        low, high: the declared inclusive range of the total.

    Returns:
        ``(parts, None)`` when valid, else ``(None, error)``: the error shows the value.
    """
    if isinstance(raw, dict):
        if not raw:
            return None, "returned an empty dict of components"
        unknown = [k for k in raw if k not in components]
        if unknown:
            return None, (
                f"returned components {', '.join(map(repr, unknown))}, which the environment does not "
                f"declare (reward_components={tuple(components)!r}; declare them)"
            )
        parts = {str(k): _finite(v) for k, v in raw.items()}
        bad = {k: raw[k] for k, v in parts.items() if v is None}
        if bad:
            return None, f"returned {bad!r}, not finite numbers (components {raw!r})"
    else:
        v = _finite(raw)
        if v is None:
            return None, f"returned {raw!r} ({type(raw).__name__}), not a finite number"
        parts = {components[0]: v}
    total = math.fsum(parts.values())  # type: ignore[arg-type]
    if not low <= total <= high:
        return None, (
            f"returned a total of {total!r}, outside the declared reward_range [{low}, {high}] "
            "(declare reward_range=(low, high))"
        )
    return parts, None  # type: ignore[return-value]


@dataclass(frozen=True)
class SingleTurnTask:
    """One record of a :class:`SingleTurnEnvironment`'s dataset.

    Attributes:
        task_id: ``str(index)`` in the dataset (instances drawn by ``sample`` add ``#seed-k``).
        problem_id: the record's ``problem_id`` when it has one, else ``sha256(prompt)[:16]``
            (the same prompt twice is one problem: it never sits in two splits).
        prompt: the user message.
        info: the record's other fields, given to ``reward_fn`` as keyword arguments.
    """

    task_id: str
    problem_id: str
    prompt: str
    info: dict = field(default_factory=dict, repr=False, compare=False)


class SingleTurnEpisode:
    """One prompt, one reply: ``reset`` shows the prompt, ``step({"answer": text})`` scores
    ``reward_fn(prompt, text, **info)`` and ends the episode.

    A ``reward_fn`` that raises, or returns what :func:`check_reward_fn_value` rejects (NaN,
    ±inf, not a number, outside the range, an undeclared component), makes the episode an
    ``env_error`` (excluded and counted, never scored 0) whose error names the function.
    """

    answer_ends_episode = True

    def __init__(
        self,
        task: Any,
        prompt: str,
        info: dict,
        reward_fn: Any,
        components: Sequence[str],
        reward_range: tuple[float, float],
        opening: Any = None,
    ):
        self.task, self.prompt, self.info, self.reward_fn = task, prompt, info, reward_fn
        self.components, self.reward_range = tuple(components), reward_range
        self.opening = opening  # the wrapped environment's episode (its reset makes the prompt)
        self.code: str | None = None  # the reply (the trajectory's final_code)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self.code = None
        if self.opening is not None:
            self.prompt = self.opening.reset(seed=seed, options=options)[0]
        return self.prompt, {"task_id": self.task.task_id, "problem_id": self.task.problem_id}

    def step(self, action: dict) -> tuple[str, float, bool, bool, dict]:
        """Score the reply with ``reward_fn`` (see the class doc).

        Raises:
            ValueError: an action that is not ``{"answer": text}`` (this task has no tools).
        """
        if ANSWER_KEY not in action:
            raise ValueError(f"{self.task.task_id}: single-turn episodes take an answer, not a tool call {action!r}")
        completion = action[ANSWER_KEY] or ""
        self.code = completion
        info: dict[str, Any] = {"task_id": self.task.task_id}
        who = f"reward_fn {callable_name(self.reward_fn)}"
        try:  # the user's function gets its own copy: it cannot change the task for later episodes
            raw = self.reward_fn(self.prompt, completion, **copy.deepcopy(self.info))
        except Exception as e:  # the scorer failing is an env_error, never a 0
            info["env_error"] = f"{who} raised {type(e).__name__}: {e}"
            return "", 0.0, True, False, info
        parts, error = check_reward_fn_value(raw, self.components, *self.reward_range)
        if error is not None:
            info["env_error"] = f"{who} {error}"
            return "", 0.0, True, False, info
        info["reward_components"] = parts
        return "", math.fsum(parts.values()), True, False, info  # type: ignore[union-attr]


class SingleTurnEnvironment(Environment):
    """A single-turn task given as data: a dataset of prompts and a Python reward function
    (as TRL's ``reward_funcs``). Each episode shows one prompt; the policy's reply (no tools)
    is scored by ``reward_fn(prompt, completion, **info)`` and the episode ends.

    Args:
        dataset: a sequence (or any iterable) of mappings, each with at least ``prompt`` (a
            non-empty str); its other fields (e.g. ``answer``) reach ``reward_fn`` as keyword
            arguments. An optional ``problem_id`` (str) groups records into one problem;
            otherwise records with the same prompt are one problem.
        reward_fn: ``reward_fn(prompt: str, completion: str, **info) -> float | dict[str, float]``;
            a dict names the reward's components (all among ``reward_components``), a number
            is the first component.
        system_prompt: the system message of every episode ("" = none).
        split_seed: seed of the problem-level split: problems are split 80 / 10 / 10 into
            train / validation / test by :func:`consequence.envs.repair.jsonl.split_by_problem`
            (the rule of every built-in task source).
        name: the environment's name (reports, the manifest, the split ledger's label with
            the dataset's hash).
        reward_range: inclusive (low, high) of a reply's total reward; checked on every reply.
        reward_components: the names of the reward's parts; the first is the primary one
            (evaluation calls a reply a success when it is 1).
        examples: worked examples ``(request, reply)`` shown before each prompt (few-shot).

    Raises:
        ValueError: an empty dataset, a record that is not a mapping, without a non-empty
            str ``prompt``, or with a non-str ``problem_id``; a ``reward_fn`` that is not
            callable; no reward component (each names the record and the fix).
    """

    name = "single-turn"
    version = "1"
    tools = []
    answer_ends_episode = True
    reward_fn_wrapper = True  # `consequence.train(reward_fn=...)` knows it scores by a Python function

    def __init__(
        self,
        dataset: Iterable[Mapping[str, Any]],
        reward_fn: Any,
        system_prompt: str = "",
        split_seed: int = 0,
        *,
        name: str = "single-turn",
        reward_range: tuple[float, float] = (0.0, 1.0),
        reward_components: Sequence[str] = ("reward",),
        examples: Sequence[tuple[str, str]] = (),
    ):
        who = "SingleTurnEnvironment"
        if not callable(reward_fn):
            raise ValueError(
                f"{who}: reward_fn must be a function reward_fn(prompt, completion, **info) -> float "
                f"| dict, got {type(reward_fn).__name__}"
            )
        if isinstance(dataset, (str, bytes, Mapping)) or not isinstance(dataset, Iterable):
            raise ValueError(
                f"{who}: dataset must be a sequence of dicts with a 'prompt', got {type(dataset).__name__}"
            )
        records = list(dataset)
        if not records:
            raise ValueError(f"{who}: the dataset is empty; give a sequence of dicts with a 'prompt'")
        for i, r in enumerate(records):
            if not isinstance(r, Mapping):
                raise ValueError(f"{who}: dataset[{i}] is a {type(r).__name__}, not a dict with a 'prompt'")
            if not isinstance(r.get("prompt"), str) or not r["prompt"].strip():
                raise ValueError(
                    f"{who}: dataset[{i}] has no 'prompt' (a non-empty str); its keys: "
                    f"{', '.join(map(str, r)) or 'none'}"
                )
            if "problem_id" in r and not isinstance(r["problem_id"], str):
                raise ValueError(f"{who}: dataset[{i}]['problem_id'] must be a str, got {r['problem_id']!r}")
        if isinstance(reward_components, str) or not reward_components:
            raise ValueError(
                f"{who}: reward_components must be a non-empty sequence of names, got {reward_components!r}"
            )
        self.records = [dict(r) for r in records]
        self.reward_fn = reward_fn
        self.base: Environment | None = None
        # per-instance declarations (the class attributes are the defaults), as reasoning-gym's and calculator's
        self.system_prompt, self.name = system_prompt, name  # type: ignore[misc]
        # a list from YAML or JSON becomes a tuple; its length and values are checked with every reward
        self.reward_range = cast(tuple[float, float], tuple(reward_range))
        self.reward_components = tuple(reward_components)
        # pairs from YAML or JSON arrive as lists; the annotation is the contract (a pair unpacks as q, a)
        self.examples = cast(tuple[tuple[str, str], ...], tuple(tuple(x) for x in examples))
        super().__init__(split_seed)

    @classmethod
    def scoring(cls, env: Environment, reward_fn: Any) -> SingleTurnEnvironment:
        """The single-turn environment ``env`` (no tools, a reply is its answer) scored by
        ``reward_fn`` instead of its own verifier: the same splits, prompts (its episodes'
        ``reset``), system prompt, examples, reward components and range; ``info`` is the
        task's fields (a dataclass's, else its attributes), ``prompt`` and ``completion`` left out.

        Raises:
            ValueError: ``env`` has tools or replies without a tool call do not end its
                episodes (a multi-turn task: score it in its ``Episode.step``), or it is
                itself a reward_fn environment.
        """
        where = f"reward_fn {callable_name(reward_fn)}"
        if not callable(reward_fn):
            raise ValueError(
                f"reward_fn must be a function reward_fn(prompt, completion, **info) -> float | dict, "
                f"got {type(reward_fn).__name__}"
            )
        if getattr(env, "reward_fn_wrapper", False):
            raise ValueError(
                f"{where}: environment {env.label!r} is already scored by reward_fn "
                f"{callable_name(getattr(env, 'reward_fn', None))}; give the reward function once"
            )
        if env.tools or not env.answer_ends_episode:
            why = (
                f"it has tools ({', '.join(t['function']['name'] for t in env.tools)})"
                if env.tools
                else "a reply without a tool call does not end its episodes"
            )
            raise ValueError(
                f"{where}: a reward_fn scores a single-turn task (one prompt, one reply), and environment "
                f"{env.label!r} is multi-turn: {why}. Score a multi-turn environment in its "
                "Episode.step (docs/api.md), or give a single-turn one (a dataset of prompts, "
                "reasoning-gym, humaneval)"
            )
        self = cls.__new__(cls)
        self.base, self.records, self.reward_fn = env, [], reward_fn
        self.name, self.system_prompt, self.examples = env.name, env.system_prompt, tuple(env.examples)  # type: ignore[misc]
        self.reward_range = cast(tuple[float, float], tuple(env.reward_range))
        self.reward_components = tuple(env.reward_components)
        Environment.__init__(self, env.split_seed)
        return self

    def load_splits(self, split_seed: int) -> dict[str, list]:
        if self.base is not None:
            return {k: list(v) for k, v in self.base.split.items()}
        from consequence.envs.repair.jsonl import split_by_problem

        tasks = [
            SingleTurnTask(
                str(i),
                r.get("problem_id") or hashlib.sha256(r["prompt"].encode()).hexdigest()[:16],
                r["prompt"],
                {k: v for k, v in r.items() if k != "prompt"},
            )
            for i, r in enumerate(self.records)
        ]
        ids = split_by_problem([t.problem_id for t in tasks], seed=split_seed)
        return {s: [t for t in tasks if t.problem_id in ids[s]] for s in SPLITS}

    def make_episode(self, task: Any) -> SingleTurnEpisode:
        if self.base is None:
            return SingleTurnEpisode(
                task, task.prompt, task.info, self.reward_fn, self.reward_components, self.reward_range
            )
        fields = (
            {f.name: getattr(task, f.name) for f in dataclasses.fields(task)}
            if dataclasses.is_dataclass(task)
            else dict(getattr(task, "__dict__", {}))
        )
        info = {k: v for k, v in fields.items() if k not in ("prompt", "completion")}
        return SingleTurnEpisode(
            task,
            "",
            info,
            self.reward_fn,
            self.reward_components,
            self.reward_range,
            opening=self.base.make_episode(task),
        )

    def dataset_sha256(self) -> str | None:
        """sha256 of the dataset as canonical JSON (None for a wrapped environment: its own record names its source)."""
        if self.base is not None:
            return None
        text = json.dumps(self.records, sort_keys=True, default=repr, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def label(self) -> str:
        """``NAME:SHA12`` of the dataset (another dataset is another task source in the split
        ledger); a wrapped environment keeps its own label (the same problems)."""
        return self.base.label if self.base is not None else f"{self.name}:{self.dataset_sha256()[:12]}"  # type: ignore[index]

    def describe(self) -> dict[str, Any]:
        """The base record plus the reward function, the dataset's size and hash, or the wrapped environment's record."""
        out = super().describe() | {
            "reward_fn": callable_name(self.reward_fn),
            "reward_fn_sha256": _code_sha256(self.reward_fn),
        }
        if self.base is not None:
            return out | {"scored_environment": self.base.describe()}
        return out | {"dataset_records": len(self.records), "dataset_sha256": self.dataset_sha256()}


def _code_sha256(fn: Any) -> str | None:
    """sha256 of a function's source text (None when it cannot be read, e.g. a builtin)."""
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        return None
