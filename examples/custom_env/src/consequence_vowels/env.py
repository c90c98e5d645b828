"""vowel-count: how many vowels does a word have? A plug-in environment for consequence.

One problem is one made-up word (drawn from a fixed seed, so every install has the same
words). The policy may call the tool ``spell`` (the word letter by letter: what a
tokenizer hides from a small model) and then replies with the count in plain text; that
reply without a tool call is the answer and ends the episode. Rewards: ``accuracy`` 1.0
when the last integer of the answer is the count (the primary component: success), and
``format`` 0.1 when the answer is nothing but that integer.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from consequence.envs.api import Environment

VOWELS, CONSONANTS = "aeiou", "bcdfghjklmnpqrstvwxyz"
SPELL = {
    "type": "function",
    "function": {
        "name": "spell",
        "description": "Show a word letter by letter.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


@dataclass(frozen=True)
class VowelTask:
    task_id: str  # unique per instance (``sample`` adds a suffix to each copy)
    problem_id: str  # the word: the unit of the train / validation / test split
    word: str


class VowelEpisode:
    def __init__(self, task: VowelTask):
        self.task = task

    def reset(self, seed=None, options=None) -> tuple[str, dict]:
        return (f'How many vowels (a, e, i, o, u) are in the word "{self.task.word}"? Reply with the number only.'), {
            "task_id": self.task.task_id
        }

    def step(self, action: dict) -> tuple[str, float, bool, bool, dict]:
        if "answer" not in action:  # the one tool, arguments already checked against SPELL
            return " ".join(str(action["arguments"]["word"])), 0.0, False, False, {}
        text, count = action["answer"].strip(), sum(c in VOWELS for c in self.task.word)
        numbers = re.findall(r"\d+", text)
        parts = {
            "accuracy": float(bool(numbers) and int(numbers[-1]) == count),
            "format": 0.1 if re.fullmatch(r"\d+", text) else 0.0,
        }
        obs = "correct" if parts["accuracy"] else f"wrong: {count}"
        return obs, sum(parts.values()), True, False, {"reward_components": parts}


class VowelCountEnvironment(Environment):
    """Count the vowels of a made-up word; ``n_words`` problems of 3..``max_length`` letters."""

    name = "vowel-count"
    version = "1"
    system_prompt = "You count letters. You may call spell to see a word's letters. Answer with a number."
    tools = [SPELL]
    reward_components = ("accuracy", "format")
    reward_range = (0.0, 1.1)

    def __init__(self, split_seed: int = 0, n_words: int = 300, max_length: int = 8):
        if n_words < 10 or not 3 <= max_length <= 20:
            raise ValueError(
                f"vowel-count: need n_words >= 10 and 3 <= max_length <= 20, "
                f"got n_words={n_words}, max_length={max_length}"
            )
        self.n_words, self.max_length = n_words, max_length
        super().__init__(split_seed)  # calls load_splits

    def load_splits(self, split_seed: int) -> dict[str, list]:
        rng, words = random.Random(1234), set()
        while len(words) < self.n_words:
            words.add(
                "".join(
                    rng.choice(VOWELS) if rng.random() < 0.4 else rng.choice(CONSONANTS)
                    for _ in range(rng.randint(3, self.max_length))
                )
            )
        order = sorted(words, key=lambda w: hashlib.sha256(f"{split_seed}|{w}".encode()).hexdigest())
        cut = [0, round(0.8 * len(order)), round(0.9 * len(order)), len(order)]
        return {
            s: [VowelTask(w, w, w) for w in order[cut[k] : cut[k + 1]]]
            for k, s in enumerate(("train", "validation", "test"))
        }

    def make_episode(self, task: VowelTask) -> VowelEpisode:
        return VowelEpisode(task)
