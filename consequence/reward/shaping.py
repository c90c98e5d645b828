"""Potential-based reward shaping (reward box; ``train --shaping potential``).

Ng, Harada & Russell 1999, "Policy invariance under reward transformations", Theorem 1: a
shaping reward F(s, s') = γΦ(s') − Φ(s) added to every transition leaves the optimal
policies unchanged, for any potential Φ of the states, provided Φ(terminal) = 0 (the
telescoping below). Here a transition is one turn of an episode: s_0 is the state after
``reset`` (and any scripted opening), s_{t+1} the state after call t's tool calls or answer
ran, and Φ is the environment's :meth:`consequence.envs.api.Environment.potential`, recorded
by the harness in ``Trajectory.potentials`` (T calls, T + 1 values).

Turn t's reward gains F_t = γΦ(s_{t+1}) − Φ(s_t) (on its call: ``ModelCall.reward``, which GAE
places on the turn's last sampled token), and the trajectory's reward gains Σ_t F_t as the
component ``shaping`` (what the outcome-level estimators, GRPO, RLOO, …, see). The sum
telescopes: Σ_{t<T} γ^t F_t = γ^T Φ(s_T) − Φ(s_0); the undiscounted Σ_t F_t does so at γ = 1.

- A finished episode (outcome ``finished``) ended in the terminal state: Φ(s_T) = 0 whatever
  the environment says, so at γ = 1 its shaping sums to −Φ(s_0), a constant of the task's
  start: in a group whose members start from the same state it shifts every reward equally
  and cancels in the group baseline (GRPO's advantages are unchanged).
- A truncated episode (outcome ``truncated``: a budget or the environment cut it) keeps the
  environment's Φ(s_T): it did not reach a terminal state, it was stopped in s_T, from which
  the task would have gone on. Theorem 1 needs Φ = 0 only at true ends (setting it at a cut
  would charge Φ(s_T) to the last turn, a penalty for progress made when the budget runs
  out); GAE bootstraps from the critic's V(s_T) there for the same reason. An outcome-level
  estimator takes the cut return as final, so a truncated member's Φ(s_T) is not cancelled
  by its group's baseline.

With ``--advantage gae`` the discount γ of the run is per generated token while F uses γ per
turn: the two agree at γ = 1 (the default), where the invariance is exact for every
estimator; below 1 the shaping is the per-turn form of the theorem, not the per-token one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from consequence.envs.api import Environment, has_potential
from consequence.records import Trajectory

__all__ = ["SHAPING_COMPONENT", "check_potential", "shaping_terms", "apply_potential_shaping", "shaping_return_mean"]

SHAPING_COMPONENT = "shaping"  # the reward component that holds an episode's Σ_t F_t


def check_potential(env: Environment) -> None:
    """Refuse ``--shaping potential`` for an environment without a potential (before any work).

    Raises:
        ValueError: ``env`` does not define :meth:`Environment.potential` (names it and the fix).
    """
    if not has_potential(env):
        raise ValueError(
            f"--shaping potential: environment {env.label!r} defines no potential "
            f"({type(env).__name__}.potential, docs/environments.md); implement it or drop --shaping"
        )


def shaping_terms(potentials: Sequence[float], outcome: str, gamma: float) -> list[float]:
    """F_t = γΦ(s_{t+1}) − Φ(s_t) for the turns t = 0 … T−1 of one episode (module doc).

    Args:
        potentials: Φ(s_0), …, Φ(s_T) as the environment gave them (T + 1 floats, T ≥ 0).
        outcome: the episode's outcome; ``finished`` sets Φ(s_T) = 0 (a true end, T ≥ 1),
            ``truncated`` keeps the environment's Φ(s_T).
        gamma: the discount per turn, in [0, 1].

    Returns:
        T floats; Σ_t γ^t F_t = γ^T Φ(s_T) − Φ(s_0) (Φ(s_T) = 0 when finished).

    Raises:
        ValueError: no potential, an ``env_error`` outcome (such an episode is not scored),
            or ``gamma`` outside [0, 1].
    """
    if not potentials:
        raise ValueError("shaping needs Φ(s_0): no potential was recorded")
    if outcome not in ("finished", "truncated"):
        raise ValueError(f"an episode with outcome {outcome!r} is not scored, so it gets no shaping")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"the shaping discount γ must be in [0, 1], got {gamma}")
    phi = [float(p) for p in potentials]
    if outcome == "finished" and len(phi) > 1:
        phi[-1] = 0.0  # Φ(terminal) = 0: the framework's rule, not the environment's
    return [gamma * phi[t + 1] - phi[t] for t in range(len(phi) - 1)]


def apply_potential_shaping(trajs: Sequence[Trajectory], gamma: float) -> None:
    """Add each turn's F_t to its call's reward and Σ_t F_t to the trajectory's reward, as the
    component :data:`SHAPING_COMPONENT` (module doc). Trajectories without a reward (env
    errors) are left as they are.

    Args:
        trajs: scored trajectories whose ``potentials`` the harness recorded (one more than calls).
        gamma: the discount per turn, in [0, 1].

    Raises:
        ValueError: a scored trajectory whose potentials do not number its calls + 1 (the
            episodes were not played by the harness with the environment's potential).
    """
    for t in trajs:
        if t.reward is None:
            continue
        if len(t.potentials) != len(t.calls) + 1:
            raise ValueError(
                f"--shaping potential: trajectory {t.task_id} (sample {t.sample_id}) holds {len(t.potentials)} "
                f"potentials for {len(t.calls)} model calls (needs calls + 1: Φ(s_0) and Φ after each turn, "
                "recorded by the in-process harness)"
            )
        terms = shaping_terms(t.potentials, t.outcome, gamma)
        for call, f in zip(t.calls, terms):
            call.reward += f
        total = math.fsum(terms)
        t.reward_components[SHAPING_COMPONENT] = total
        t.reward += total


def shaping_return_mean(trajs: Sequence[Trajectory]) -> float | None:
    """Mean Σ_t F_t (the ``shaping`` component) over the trajectories that carry it; None when none does."""
    got = [t.reward_components[SHAPING_COMPONENT] for t in trajs if SHAPING_COMPONENT in t.reward_components]
    return math.fsum(got) / len(got) if got else None
