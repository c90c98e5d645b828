"""Small environments for the API tests (importable as ``env_fixtures:NAME``, module:attr form)."""

import os
from dataclasses import dataclass
from pathlib import Path

from consequence.envs.api import Environment


@dataclass(frozen=True)
class Word:
    task_id: str
    problem_id: str
    word: str


TOOL = {
    "type": "function",
    "function": {
        "name": "hint",
        "description": "A hint, costs 0.1.",
        "parameters": {"type": "object", "properties": {}},
    },
}


class HintEpisode:
    """Answer with the word reversed; each ``hint`` call gives a per-turn reward of −0.1."""

    def __init__(self, task, boom=None):
        self.task, self.boom = task, boom

    def reset(self, seed=None, options=None):
        if self.boom == "reset" or (self.boom == "rollout-reset" and seed != 0):  # seed 0: the prompt check
            raise RuntimeError("reset broke")
        if (self.boom or "").startswith("die-once:") and seed != 0:  # kills the process (a rollout worker) once
            marker = Path(self.boom.removeprefix("die-once:"))
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os._exit(1)
        return f"Reverse {self.task.word}.", {}

    def step(self, action):
        if self.boom == "step":
            raise RuntimeError("step broke")
        if "answer" not in action:
            return (
                "the first letter is " + self.task.word[-1],
                -0.1,
                False,
                False,
                {"reward_components": {"hints": -0.1}},
            )
        ok = action["answer"].strip() == self.task.word[::-1]
        return "", 1.0 if ok else 0.0, True, False, {"reward_components": {"accuracy": 1.0 if ok else 0.0}}


class ReverseEnvironment(Environment):
    name = "reverse"
    version = "3"
    system_prompt = "Reverse the word."
    tools = [TOOL]
    reward_components = ("accuracy", "hints")
    reward_range = (-1.0, 1.0)

    def __init__(self, split_seed=0, words=("abc", "de", "fgh", "ij"), boom=None):
        self.words, self.boom = tuple(words), boom
        super().__init__(split_seed)

    def load_splits(self, split_seed):
        ws = [Word(f"w{i}", f"p{i}", w) for i, w in enumerate(self.words)]
        return {"train": ws[:2], "validation": ws[2:3], "test": ws[3:]}

    def make_episode(self, task):
        return HintEpisode(task, self.boom)

    def score_group(self, task, trajectories):
        self.scored = getattr(self, "scored", []) + [(task.task_id, len(trajectories))]


class NoOptions(Environment):
    name = "plain"

    def load_splits(self, split_seed):
        return {"train": [], "validation": [], "test": []}


def not_an_environment(split_seed=0):
    return object()


class Plain:
    """A task that is not a dataclass."""

    def __init__(self, i):
        self.task_id, self.problem_id, self.word = f"t{i}", f"p{i}", "ab"


class PlainTasks(ReverseEnvironment):
    def load_splits(self, split_seed):
        return {"train": [Plain(0), Plain(1)], "validation": [Plain(2)], "test": [Plain(3)]}


class LeakyEnvironment(ReverseEnvironment):
    def load_splits(self, split_seed):
        ws = [Word("w0", "p0", "ab"), Word("w1", "p0", "ab")]
        return {"train": ws[:1], "validation": [], "test": ws[1:]}


class ShortGroups(ReverseEnvironment):
    def make_group(self, task, size):
        return [self.make_episode(task)] * size  # one shared episode: not isolated


class BadSums(ReverseEnvironment):
    def make_episode(self, task):
        ep = HintEpisode(task)
        ep.step = lambda action: ("", 1.0, True, False, {"reward_components": {"accuracy": 0.5}})
        return ep


class ParityEpisode:
    """Any reply ends the episode; reward 1 when it is a ``read_code`` call."""

    def __init__(self, task):
        self.task = task

    def reset(self, seed=None, options=None):
        return f"Say something about {self.task.word}.", {}

    def step(self, action):
        win = float(action.get("name") == "read_code")
        return "", win, True, False, {"reward_components": {"parity": win}}


class ParityEnvironment(Environment):
    """Mixed groups from the bundled warm start (its first call is ``run_tests`` or
    ``read_code``, about half and half), so that tiny runs take real optimizer steps in
    subprocesses, where no test can wrap the reward."""

    name = "parity"
    system_prompt = "Answer briefly."
    # the repair task's tool names, which the bundled warm start calls: any valid call ends the episode
    tools = [
        {
            "type": "function",
            "function": {"name": n, "description": n, "parameters": {"type": "object", "properties": {}}},
        }
        for n in ("run_tests", "read_code", "finish")
    ]
    reward_components = ("parity",)

    def load_splits(self, split_seed):
        ws = [Word(f"w{i}", f"p{i}", w) for i, w in enumerate(("abc", "de", "fgh", "ij", "kl", "mno"))]
        return {"train": ws[:4], "validation": ws[4:5], "test": ws[5:]}

    def make_episode(self, task):
        return ParityEpisode(task)
