"""Rollout box: recovery with feedback — up to k attempts at the answer within one episode.

With ``--attempts k`` (k > 1), an answer that ends the episode wrongly does not end it: the
environment's :meth:`~consequence.envs.api.Environment.retry_feedback` reopens the episode
and its feedback (the verifier's message: a wrong value, how many hidden tests failed) is
the answer's result the model sees; the model tries again, up to k attempts (the turn and
token budgets still bound the whole episode). ``Trajectory.attempts`` counts the attempts
made; an episode solved at its last attempt j is solved *at attempt j*
(:func:`consequence.evaluate.episode_eval.success_at_attempt`).

Reward (``--attempt-discount d``, default 1): the terminal step of attempt j is scaled by
d**(j−1), its reward components with it (they still sum to the step's reward); the terminal
step of a wrong attempt that is retried counts 0, so wrong attempts never add up (an
episode's reward stays within the environment's range). With a right answer worth 1 and no
other reward, success at attempt j gives exactly d**(j−1). Steps that end no attempt (tool
calls and their costs) count as they are. The verifier score (what evaluation calls solved)
is the final attempt's own, undiscounted.

Self-Refine variant (``--attempt-feedback self-refine``; Madaan et al. 2023, "Self-Refine:
Iterative Refinement with Self-Feedback", §2): after a wrong answer the verifier's message is
NOT shown; the model gets :data:`SELF_REFINE_PROMPT` instead, asking it to critique its own
answer and then answer again. Here the critique and the corrected answer are one reply (one
model turn, trained like any other: its sampled ids are targets), so the episode's turns and
rows are those of the verifier variant; only the text the model sees differs. That a retry
happens at all still tells the model the answer was wrong (one bit, unlike the paper's
verifier-free loop, where the model also decides when to stop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from consequence.envs.api import Environment, has_retries

__all__ = ["Attempts", "FEEDBACK_MODES", "SELF_REFINE_PROMPT", "check_attempts", "attempt_step", "final_verifier_score"]

FEEDBACK_MODES: tuple[str, ...] = ("verifier", "self-refine")
SELF_REFINE_PROMPT = (
    "Your answer was not accepted. First critique it: check each step of your reasoning and say what "
    "may be wrong. Then give your corrected final answer."
)


@dataclass(frozen=True)
class Attempts:
    """The retry policy of an episode (``EpisodeSpec.attempts``).

    Attributes:
        k: attempts allowed per episode (>= 2; one attempt is no policy: ``None``).
        discount: d in (0, 1]: success at attempt j is scaled by d**(j−1).
        feedback: ``Environment.retry_feedback`` bound to the environment: (episode, info)
            → the feedback text after a wrong answer (reopening the episode), or None.
        mode: ``verifier`` (the model sees that text) or ``self-refine`` (it sees
            :data:`SELF_REFINE_PROMPT` instead; the module doc).
    """

    k: int
    discount: float
    feedback: Callable[[Any, dict], str | None]
    mode: str = "verifier"


def check_attempts(env: Environment, k: int, discount: float = 1.0, mode: str = "verifier") -> Attempts | None:
    """The retry policy of ``--attempts k`` for ``env`` (None for k = 1: today's episodes), checked before any work.

    Raises:
        ValueError: k < 1; ``discount`` outside (0, 1]; an unknown ``mode``; k > 1 for an
            environment without :meth:`Environment.retry_feedback` (each names the option and the fix).
    """
    if k < 1:
        raise ValueError(f"--attempts {k}: give a number of attempts >= 1 (1 = no retry)")
    if not 0.0 < discount <= 1.0:
        raise ValueError(f"--attempt-discount {discount}: give a discount in (0, 1] (1 = no discount)")
    if mode not in FEEDBACK_MODES:
        raise ValueError(f"--attempt-feedback {mode}: give one of {', '.join(FEEDBACK_MODES)}")
    if k == 1:
        return None
    if not has_retries(env):
        raise ValueError(
            f"--attempts {k}: environment {env.label!r} does not support retries "
            f"({type(env).__name__}.retry_feedback, docs/environments.md); drop --attempts or implement it"
        )
    return Attempts(k, float(discount), env.retry_feedback, mode)


def attempt_step(
    policy: Attempts | None, episode: Any, attempt: int, terminated: bool, info: dict
) -> tuple[str | None, float]:
    """After one environment step of attempt ``attempt`` (1-based): (feedback, reward scale).

    ``feedback`` is the environment's text (self-refine: :data:`SELF_REFINE_PROMPT`) when the
    step ended a wrong attempt and another is allowed (the episode is then reopened); None otherwise. The scale is 0 for such a retried
    attempt's step, d**(attempt−1) for a step that ends the episode, 1 for any other step
    (and always 1 without a policy: today's rewards, bit for bit).

    Raises:
        anything ``retry_feedback`` raises (the caller makes it an env_error).
    """
    if policy is None or not terminated or info.get("env_error"):
        return None, 1.0
    if attempt < policy.k:
        text = policy.feedback(episode, info)
        if text is not None:  # self-refine: the verifier's text is not shown, the critique request is
            return (SELF_REFINE_PROMPT if policy.mode == "self-refine" else str(text)), 0.0
    return None, policy.discount ** (attempt - 1)


def final_verifier_score(total: float, step_reward: float, scale: float) -> float:
    """The verifier score of an episode whose last step's reward ``step_reward`` entered its
    calls' ``total`` scaled by ``scale``: ``total`` with that step counted undiscounted."""
    return total if scale == 1.0 else total - step_reward * scale + step_reward
