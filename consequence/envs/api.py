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
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from pathlib import Path
from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

__all__ = ["Episode", "Environment", "SPLITS", "ANSWER_KEY", "source_sha256", "answer_in_text"]

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

    Args:
        split_seed: seed of the problem-level train / validation / test split.

    Raises:
        ValueError: from :meth:`load_splits`: a task source that cannot be read (the
            message names it and the fix).
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "0"
    system_prompt: ClassVar[str] = ""
    examples: tuple[tuple[str, str], ...] = ()
    tools: ClassVar[list[dict]] = []
    reward_components: ClassVar[tuple[str, ...]] = ("reward",)
    reward_rule: ClassVar[str] = "sum"
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    answer_ends_episode: ClassVar[bool] = True
    sources: ClassVar[tuple[str, ...]] = ()  # further modules whose code makes the episodes (hashed too)

    def __init__(self, split_seed: int = 0, **options: Any):
        if options:
            raise ValueError(f"environment {self.name!r} takes no option "
                             + ", ".join(sorted(options)) + " (it declares none)")
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

    def sample(self, split: str, n: int, seed: int) -> list:
        """``n`` task instances of ``split``, deterministic in ``seed``: a seeded permutation of
        the split, cycled; each copy's ``task_id`` is made unique (``id#seed-k``).

        Raises:
            ValueError: unknown split, or an empty split and ``n > 0``.
        """
        import copy
        import dataclasses
        import random

        pool = self._pool(split)
        if n > 0 and not pool:
            raise ValueError(f"--env {self.label}: the {split} split has no task to draw from")
        order = list(range(len(pool)))
        random.Random(seed).shuffle(order)
        out = []
        for k in range(n):
            task = pool[order[k % len(order)]]
            new_id = f"{task.task_id}#{seed}-{k}"
            if dataclasses.is_dataclass(task):
                out.append(dataclasses.replace(task, task_id=new_id))
            elif hasattr(task, "_replace"):  # a NamedTuple
                out.append(task._replace(task_id=new_id))
            else:
                twin = copy.copy(task)
                object.__setattr__(twin, "task_id", new_id)
                out.append(twin)
        return out

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
            raise ValueError(f"--env {self.label}: making or resetting an episode of task "
                             f"{getattr(task, 'task_id', task)!r} raised {type(e).__name__}: {e}") from None
        if not isinstance(obs, str):
            raise ValueError(f"--env {self.label}: reset() must return (observation: str, info: dict); the "
                             f"observation is a {type(obs).__name__}")
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
                raise ValueError(f"--env {self.label}: the {split} split is empty (split by problem: "
                                 + ", ".join(f"{k} {n}" for k, n in sizes.items()) + f"), and {why} needs it; "
                                 + ("add problems (about 10 % of them land in validation and 10 % in test) or set "
                                    f"{why} 0" if why.startswith("--") else "add problems to the task source"))

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
        return {"name": self.name, "version": self.version, "class": f"{cls.__module__}:{cls.__qualname__}",
                "source_sha256": source_sha256(cls), "options": self.options, "label": self.label,
                "split_seed": self.split_seed, "tools": [t["function"]["name"] for t in self.tools],
                "system_prompt": self.system_prompt, "examples": [list(x) for x in self.examples],
                "reward_components": list(self.reward_components),
                "reward_rule": self.reward_rule, "reward_range": list(self.reward_range),
                "answer_ends_episode": self.answer_ends_episode}


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
    if not (isinstance(env.reward_range, (tuple, list)) and len(env.reward_range) == 2
            and all(isinstance(x, (int, float)) for x in env.reward_range)):
        raise ValueError(f"{who}: reward_range must be (low, high) numbers, got {env.reward_range!r}")
    for i, spec in enumerate(env.tools if isinstance(env.tools, list) else [None]):
        fn = spec.get("function") if isinstance(spec, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{who}: tools[{i}] must look like {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ..., \"parameters\": {{...}}}}}} (OpenAI function specs), got {spec!r:.80}")
    if not env.name:
        raise ValueError(f"{who} has no `name`; set the class attribute name = '...'")
    missing = [s for s in SPLITS if s not in env.split]
    if missing:
        raise ValueError(f"{who}: load_splits() must return the splits {', '.join(SPLITS)}; missing {', '.join(missing)}")
    seen: dict[str, str] = {}
    for split in SPLITS:
        for task in env.split[split]:
            if not isinstance(getattr(task, "problem_id", None), str):
                raise ValueError(f"{who}: an entry of the {split} split has no string `problem_id` ({task!r:.80})")
            other = seen.setdefault(task.problem_id, split)
            if other != split:
                raise ValueError(f"{who}: problem {task.problem_id!r} is in both the {other} and the {split} split; "
                                 "split by problem so that no test problem is trained on")
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
