"""Procedural reasoning tasks from the ``reasoning-gym`` package as a single-turn environment.

``--env reasoning-gym`` poses one problem of a reasoning-gym generator (Stojanovski et
al. 2025, ``reasoning_gym.create_dataset``) as the user message, under the R1-Zero system
prompt (DeepSeek-R1, Guo et al. 2025, §2.2.3, Table 1): think inside ``<think>…</think>``,
then give the final answer inside ``<answer>…</answer>``. No tools: the whole reply is the
answer (``step({"answer": text})``) and the episode ends there.

Problems and split. The generator is built once with ``size`` items and the fixed seed
:data:`GENERATOR_SEED`; item ``i`` is the problem with task id ``f"{dataset}/{i}"``.
Small settings repeat questions (``tower_of_hanoi`` with its defaults gives 89 distinct
questions in 500 items, ``chain_sum`` with two one-digit terms 187), so a question text
is kept once (its first index) and its problem id is ``f"{dataset}/{sha256(question)[:16]}"``:
the same question can never sit in two splits, and the split ledger sees the same
problem under any size. Problem ids are split 80 / 10 / 10 by
:func:`consequence.envs.repair.jsonl.split_by_problem` with the split seed (the rule of every
other task source): the same ``split_seed`` gives the same split, another seed another.

Reward (rule: sum of the components), the R1-Zero rule-based reward (DeepSeek-R1 §2.2.2):

- ``accuracy`` = ``score_answer(a, entry)`` of the generator itself (a number in [0, 1];
  exact match for most generators, partial credit for some), where ``a`` is the text
  inside the LAST ``<answer>…</answer>`` of the reply, stripped of surrounding white
  space. A reply without one (or with only white space inside) scores 0.0 without
  asking the scorer: some scorers give 0.01 to a missing answer (``countdown``,
  ``fraction_simplification`` score ``None`` 0.01), which would reward answering nothing.
- ``format`` (only when ``format_weight`` > 0) = ``format_weight`` × 1 when the whole reply
  is ``<think>T</think>`` then ``<answer>A</answer>`` (white space around and between
  allowed; T and A hold no such tag; A not blank), else 0.

So ``reward_components`` is ``("accuracy",)`` or ``("accuracy", "format")`` (accuracy
first: the primary component that evaluation calls success when it is 1) and
``reward_range`` is ``(0, 1 + format_weight)``. A scorer that raises makes the episode an
``env_error`` (excluded, never 0).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from consequence.envs.api import ANSWER_KEY, SPLITS, Environment, answer_in_text

__all__ = [
    "SYSTEM_PROMPT",
    "GENERATOR_SEED",
    "ReasoningGymTask",
    "ReasoningGymEpisode",
    "ReasoningGymEnvironment",
    "extract_answer",
    "follows_format",
    "dataset_names",
]

# DeepSeek-R1 (Guo et al. 2025), Table 1: the template of DeepSeek-R1-Zero, as a system prompt.
SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here "
    "</answer>."
)
EXAMPLE_THOUGHT = "I work it out, then give only the final answer."  # the worked examples' reasoning (option shots)
GENERATOR_SEED = 0  # seed of every generator: a problem set is named by (dataset, config, size)
_RESERVED = {
    "seed": f"the generator seed is fixed ({GENERATOR_SEED}) so that a problem set is named by its "
    "dataset, config and size",
    "size": "give the number of problems as the option size (--env-option size=N)",
}

_TAG = r"</?(?:think|answer)>"
_ANSWER_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.S)  # innermost when nested
_FORMAT_RE = re.compile(rf"\s*<think>((?:(?!{_TAG}).)*)</think>\s*<answer>((?:(?!{_TAG}).)*)</answer>\s*", re.S)


def extract_answer(text: str) -> str | None:
    """The stripped text inside the last ``<answer>…</answer>`` of ``text``; None when there
    is none or it is blank.

    >>> extract_answer("<think>2+2</think> <answer> 4 </answer>")
    '4'
    >>> extract_answer("<answer>3</answer> no, <answer>4</answer>"), extract_answer("4"), extract_answer("<answer> </answer>")
    ('4', None, None)
    """
    found = _ANSWER_RE.findall(text)
    answer = found[-1].strip() if found else ""
    return answer or None


def follows_format(text: str) -> bool:
    """The reply is ``<think>…</think>`` then ``<answer>…</answer>`` and nothing else (one of
    each, no tag inside either, the answer not blank).

    >>> follows_format("<think>2+2</think>\\n<answer>4</answer>"), follows_format("<answer>4</answer>")
    (True, False)
    >>> follows_format("<think>a</think><answer>3</answer><answer>4</answer>")
    False
    """
    m = _FORMAT_RE.fullmatch(text)
    return bool(m and m.group(2).strip())


def _registry() -> dict[str, tuple[type, type]]:
    """reasoning_gym's datasets: name → (dataset class, config class)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:  # a dependency of the package; missing only in a broken install
        raise ValueError(
            f"--env reasoning-gym needs the reasoning-gym package ({e}); "
            "pip install reasoning-gym (it is a dependency of consequence)"
        ) from None
    return DATASETS


def dataset_names() -> list[str]:
    """Every dataset name reasoning_gym registers (what the option ``dataset`` accepts)."""
    return sorted(_registry())


def _rg_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("reasoning-gym")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class ReasoningGymTask:
    """One problem of a generator.

    Attributes:
        task_id: ``f"{dataset}/{index}"`` (instances drawn by ``sample`` add ``#seed-k``).
        problem_id: ``f"{dataset}/{sha256(question)[:16]}"``: what the split is made by.
        dataset, index: the generator and the item's index in it.
        question: the user message; answer: the generator's reference answer (None when
            the generator has no single one and its scorer decides).
        entry: the generator's item (question, answer, metadata), what ``score_answer`` reads.
    """

    task_id: str
    problem_id: str
    dataset: str
    index: int
    question: str
    answer: str | None
    entry: dict = field(default_factory=dict, repr=False, compare=False)


class ReasoningGymEpisode:
    """One problem: ``reset`` shows the question, ``step({"answer": text})`` scores the reply and ends.

    Args:
        task: the problem.
        score: the generator's ``score_answer(answer, entry) -> float``.
        format_weight: weight of the ``format`` component (0: no such component).
    """

    answer_ends_episode = True

    def __init__(self, task: ReasoningGymTask, score: Callable[[str, dict], float], format_weight: float = 0.0):
        self.task = task
        self.score = score
        self.format_weight = format_weight
        self.code: str | None = None  # the extracted answer (the trajectory's final_code)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self.code = None
        return self.task.question, {"task_id": self.task.task_id, "problem_id": self.task.problem_id}

    def step(self, action: dict) -> tuple[str, float, bool, bool, dict]:
        """Score the reply (the module doc's reward) and end the episode.

        Raises:
            ValueError: an action that is not ``{"answer": text}`` (this task has no tools).
        """
        if ANSWER_KEY not in action:
            raise ValueError(f"{self.task.task_id}: reasoning-gym episodes take an answer, not a tool call {action!r}")
        text = action[ANSWER_KEY] or ""
        extracted = extract_answer(text)
        self.code = extracted
        accuracy = 0.0 if extracted is None else float(self.score(extracted, copy.deepcopy(self.task.entry)))
        parts = {"accuracy": accuracy}
        if self.format_weight > 0:
            parts["format"] = self.format_weight * float(follows_format(text))
        info = {"task_id": self.task.task_id, "extracted_answer": extracted, "reward_components": parts}
        return f"accuracy {accuracy:g}", math.fsum(parts.values()), True, False, info


class ReasoningGymEnvironment(Environment):
    """A reasoning-gym generator's problems, answered in one reply (module doc: split, reward).

    Args:
        split_seed: seed of the problem-level train / validation / test split.
        dataset: the reasoning_gym dataset name (``dataset_names()``; e.g. ``basic_arithmetic``,
            ``chain_sum``, ``leg_counting``).
        config: the generator's settings, i.e. the difficulty (keyword arguments of the
            dataset's config class, e.g. ``{"min_terms": 2, "max_terms": 3}`` for
            ``basic_arithmetic``); ``seed`` and ``size`` are not settings here (see ``size``).
        size: items drawn from the generator (indices ``0 … size-1``); repeated questions
            are kept once, so the environment may hold fewer problems.
        format_weight: weight (≥ 0) of the ``format`` component; 0 leaves it out.
        shots: worked examples shown before each question as earlier user / assistant turns
            (few-shot prompting; a small instruct model rarely finds the answer format
            without them). They are the first ``shots`` problems of the train split,
            answered ``<think>…</think> <answer>ANSWER</answer>`` with the generator's own
            answer, and are then removed from the train split (no problem is trained on
            with its answer in the context; validation and test never supply examples).
        drop_answer_in_question: leave out every problem whose answer occurs whole in its
            question (``envs.api.answer_in_text``), before the split: a policy that copies
            from the question (word_sorting given words already in order) then never wins;
            the number left out is in ``describe()``.

    Raises:
        ValueError: an unknown dataset (lists the valid ones), a config that is not a
            mapping, a config key the generator does not take (names it and lists the valid
            ones), settings the generator rejects (its message), a size that is not a
            positive integer, a format_weight that is not a finite number ≥ 0, shots that
            is not an integer ≥ 0 or leaves no train problem. All before any problem is
            generated (shots: right after).
    """

    name = "reasoning-gym"
    version = "1"
    system_prompt = SYSTEM_PROMPT
    tools: list[dict] = []
    reward_components: tuple[str, ...] = ("accuracy",)  # ("accuracy", "format") with a format_weight
    answer_ends_episode = True

    def __init__(
        self,
        split_seed: int = 0,
        dataset: str = "basic_arithmetic",
        config: dict | None = None,
        size: int = 500,
        format_weight: float = 0.0,
        shots: int = 0,
        drop_answer_in_question: bool = False,
    ):
        where = "--env reasoning-gym: option"
        registry = _registry()
        if not isinstance(dataset, str) or dataset not in registry:
            raise ValueError(
                f"{where} dataset {dataset!r} is not a reasoning-gym dataset (reasoning_gym "
                f"{_rg_version()}); valid: {', '.join(sorted(registry))}"
            )
        if config is None:
            config = {}
        if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
            raise ValueError(
                f"{where} config must be a mapping of generator settings, e.g. --env-option "
                f"'config={{min_terms: 2, max_terms: 3}}'; got {config!r}"
            )
        config_cls = registry[dataset][1]
        takes = (
            [f.name for f in dataclasses.fields(config_cls) if f.name not in _RESERVED]
            if dataclasses.is_dataclass(config_cls)
            else None
        )
        for key in config:
            if key in _RESERVED:
                raise ValueError(f"{where} config: key {key!r} is not a generator setting here; {_RESERVED[key]}")
        if takes is not None and (bad := [k for k in config if k not in takes]):
            raise ValueError(
                f"{where} config: dataset {dataset!r} has no setting {', '.join(map(repr, bad))}; "
                f"its settings are {', '.join(takes) or 'none'}"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{where} size must be a positive integer (items drawn from the generator), got {size!r}")
        if (
            isinstance(format_weight, bool)
            or not isinstance(format_weight, (int, float))
            or not math.isfinite(format_weight)
            or format_weight < 0
        ):
            raise ValueError(
                f"{where} format_weight must be a finite number >= 0 (0: no format component), got {format_weight!r}"
            )
        if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
            raise ValueError(
                f"{where} shots must be an integer >= 0 (worked examples before each question), got {shots!r}"
            )
        if not isinstance(drop_answer_in_question, bool):
            raise ValueError(f"{where} drop_answer_in_question must be true or false, got {drop_answer_in_question!r}")
        self.drop_answer_in_question = drop_answer_in_question
        self.dropped_answer_in_question = 0
        self.shots = shots
        self.dataset = dataset
        self.config = copy.deepcopy(config)
        self.size = size
        self.format_weight = float(format_weight)
        self.reward_components = ("accuracy", "format") if self.format_weight > 0 else ("accuracy",)
        self.reward_range = (0.0, 1.0 + self.format_weight)
        self.generator = self._create(where)
        super().__init__(split_seed)

    def _create(self, where: str) -> Any:
        """The generator (settings checked by reasoning_gym; its rejection becomes a ValueError)."""
        import reasoning_gym

        try:
            return reasoning_gym.create_dataset(
                self.dataset, seed=GENERATOR_SEED, size=self.size, **copy.deepcopy(self.config)
            )
        except (AssertionError, TypeError, ValueError) as e:
            raise ValueError(
                f"{where} config: reasoning_gym rejects the settings {self.config!r} of dataset "
                f"{self.dataset!r}: {type(e).__name__}: {e}"
            ) from None

    @property
    def label(self) -> str:
        """``reasoning-gym:DATASET{config} size=N reasoning_gym==V`` (`` drop_answer_in_question`` when
        on): the problems (not the reward weights)."""
        settings = json.dumps(self.config, sort_keys=True, separators=(",", ":"), default=str)
        drop = " drop_answer_in_question" if self.drop_answer_in_question else ""
        return f"{self.name}:{self.dataset}{settings} size={self.size}{drop} reasoning_gym=={_rg_version()}"

    def load_splits(self, split_seed: int) -> dict[str, list]:
        from consequence.envs.repair.jsonl import split_by_problem

        tasks: dict[str, ReasoningGymTask] = {}
        dropped: set[str] = set()
        for i in range(self.size):
            entry = self.generator[i]
            question = str(entry["question"])
            pid = f"{self.dataset}/{hashlib.sha256(question.encode()).hexdigest()[:16]}"
            if pid not in tasks:  # a repeated question is the same problem: kept once
                answer = entry.get("answer")
                if self.drop_answer_in_question and answer is not None and answer_in_text(str(answer), question):
                    dropped.add(pid)
                    continue
                tasks[pid] = ReasoningGymTask(
                    f"{self.dataset}/{i}",
                    pid,
                    self.dataset,
                    i,
                    question,
                    None if answer is None else str(answer),
                    entry,
                )
        self.dropped_answer_in_question = len(dropped)
        ids = split_by_problem(tasks, seed=split_seed)
        split = {s: [t for pid, t in tasks.items() if pid in ids[s]] for s in SPLITS}
        if self.shots:
            if self.shots >= len(split["train"]):
                raise ValueError(
                    f"--env reasoning-gym: option shots={self.shots} would take every one of the "
                    f"{len(split['train'])} train problems as an example; lower shots or raise size"
                )
            shown, split["train"] = split["train"][: self.shots], split["train"][self.shots :]
            self.examples = tuple(
                (t.question, f"<think>{EXAMPLE_THOUGHT}</think> <answer>{t.answer}</answer>") for t in shown
            )
        return split

    def make_episode(self, task: ReasoningGymTask) -> ReasoningGymEpisode:
        return ReasoningGymEpisode(task, self.generator.score_answer, self.format_weight)

    def describe(self) -> dict[str, Any]:
        """The base record plus the reasoning_gym version and the number of distinct problems."""
        return super().describe() | {
            "reasoning_gym_version": _rg_version(),
            "problems": sum(len(v) for v in self.split.values()),
            "dropped_answer_in_question": self.dropped_answer_in_question,
        }
