"""Reward box: call a reward function and check what it returns (docs/design.md §3, §7).

A reward that is not a finite number inside the declared range is an error, never a
score: an exception, NaN/inf or an out-of-range value gives ``value=None`` and an error
text showing the value or the exception, so the trajectory becomes an ``env_error`` and
is excluded from the group statistics and the loss
(docs/cases.md, case 11, docs/cases.md, case 03).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from consequence.records import Trajectory
from consequence.reward.overlong import overlong_penalty


@dataclass
class RewardResult:
    """Outcome of one checked reward call.

    Attributes:
        value: the total reward, or ``None`` when the call failed a check (env_error).
        components: named components when the function returned a dict (their sum is
            ``value``); empty for a scalar reward or on error.
        error: why the reward was rejected (shows the value or the exception), else ``None``.
    """

    value: float | None
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _as_finite(x: object, what: str) -> tuple[float | None, str | None]:
    if isinstance(x, (int, float)) or hasattr(x, "__float__"):
        try:
            v = float(x)
        except (TypeError, ValueError) as e:
            return None, f"{what} {x!r} is not a number ({e})"
        if not math.isfinite(v):
            return None, f"{what} is {x!r}, not a finite number"
        return v, None
    return None, f"{what} {x!r} has type {type(x).__name__}, not a number"


def _returning(value: float | dict[str, float]) -> Callable[[], float | dict[str, float]]:
    """A reward function returning ``value``: a reward already at hand, checked as any other."""
    return lambda: value


def checked_reward(fn: Callable[[], float | dict[str, float]], low: float = 0.0, high: float = 1.0) -> RewardResult:
    """Call ``fn()`` and validate its reward.

    ``fn`` returns either a number or a dict of named components (summed into the
    total). The total must be finite and lie in ``[low, high]``; each component must be
    finite.

    Args:
        fn: zero-argument reward function.
        low, high: declared inclusive range of the total reward.

    Returns:
        RewardResult: ``value`` set and ``error=None`` when valid; otherwise ``value=None``
        and ``error`` naming the exception (type and message) or the offending value.
        Never returns 0 in place of a failure.

    Raises:
        ValueError: ``low > high`` (a bad declaration, not a bad reward).
    """
    if not (low <= high):
        raise ValueError(f"reward range is empty: low={low!r} > high={high!r}")
    try:
        raw = fn()
    except Exception as e:  # the reward function failing is an env_error, not a score
        return RewardResult(None, {}, f"reward function raised {type(e).__name__}: {e}")

    components: dict[str, float] = {}
    if isinstance(raw, dict):
        if not raw:
            return RewardResult(None, {}, "reward function returned an empty dict of components")
        for name, x in raw.items():
            v, err = _as_finite(x, f"component {name!r}")
            if err is not None:
                return RewardResult(None, {}, f"{err} (components {raw!r})")
            components[str(name)] = v  # type: ignore[assignment]
        total = math.fsum(components.values())
        what = f"total of components {components!r}"
    else:
        total_or_none, err = _as_finite(raw, "reward")
        if err is not None:
            return RewardResult(None, {}, err)
        total = total_or_none  # type: ignore[assignment]
        what = "reward"
    if not (low <= total <= high):
        return RewardResult(None, {}, f"{what} = {total!r} is outside the declared range [{low}, {high}]")
    return RewardResult(total, components, None)


def score_trajectories(
    trajs: list[Trajectory],
    overlong_buffer: int = 0,
    max_generated_tokens: int = 0,
    components: tuple[str, ...] = ("hidden_tests",),
    reward_range: tuple[float, float] = (0.0, 1.0),
) -> None:
    """Score each trajectory from what its environment gave: every step's reward, per named
    component and summed over steps (``Trajectory.env_rewards``; a declared component the
    episode never earned counts 0, so an episode that never submitted scores 0), plus with
    ``overlong_buffer`` > 0 DAPO's overlong penalty in [−1, 0] (DAPO §3.4, eq. 13) of the
    tokens the policy generated over all the episode's calls (its target tokens; prompt and
    observation tokens are not its response), against L_max = ``max_generated_tokens``
    (:func:`consequence.config.generation_budget`). The total
    (rule: sum) must be finite and inside ``reward_range`` (lowered by 1 with the overlong
    penalty). A failed environment or a rejected reward is an env_error (reward None),
    never a 0 (docs/cases.md, case 03).

    ``verifier_score`` of a finished episode becomes its first (primary) component, the
    verifier's score that evaluation calls success when it is 1 (divided by
    ``Trajectory.attempt_scale``: ``--attempt-discount`` scaled the final attempt's reward).

    Args:
        overlong_buffer: L_cache in tokens (0 = no overlong shaping).
        max_generated_tokens: L_max in tokens, read only with ``overlong_buffer``.
        components: the environment's declared reward components (``Environment.reward_components``).
        reward_range: its declared (low, high) of the total.

    Raises:
        ValueError: ``overlong_buffer`` > 0 and not in (0, ``max_generated_tokens``].
    """
    low, high = reward_range
    for t in trajs:
        if t.outcome == "env_error":
            t.reward = None
            continue
        parts = {c: 0.0 for c in components} | dict(t.env_rewards)
        if t.env_rewards and t.outcome == "finished":
            t.verifier_score = parts[components[0]]  # the primary component: what success means
            if t.attempt_scale != 1.0:  # --attempt-discount: success is the final attempt's own, undiscounted
                t.verifier_score /= t.attempt_scale
        elif not t.env_rewards and t.outcome == "finished" and t.verifier_score is not None:
            parts[components[0]] = t.verifier_score  # a trajectory recorded without per-step rewards
        if overlong_buffer:  # |y| = generated tokens (0 without a call: penalty 0, component kept)
            parts["overlong"] = overlong_penalty(t.n_generated_tokens, max_generated_tokens, overlong_buffer)
        res = checked_reward(_returning(parts), low=low - 1.0 if overlong_buffer else low, high=high)
        t.reward, t.reward_components = res.value, res.components
        if res.value is None:
            t.outcome, t.error = "env_error", res.error


def rescore_group(env, task, group: list[Trajectory], overlong: bool = False) -> None:
    """``env.score_group(task, group)`` (joint scoring of one group, e.g. a pairwise judge),
    then every total checked again: a rescored reward that is not a finite number inside
    the environment's range (lowered by 1 with the overlong penalty) makes that trajectory
    an env_error, never a score."""
    env.score_group(task, group)
    low, high = env.reward_range
    for t in group:
        if t.reward is None:
            continue
        res = checked_reward(_returning(t.reward), low=low - 1.0 if overlong else low, high=high)
        if res.value is None:
            t.reward, t.outcome, t.error = None, "env_error", f"score_group: {res.error}"
