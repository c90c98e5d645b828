"""Token-level credit: returns-to-go and GAE over the generated tokens of one row.

A multi-turn row interleaves generated tokens (target mask 1) with prompt and
observation tokens (mask 0). Time advances only on generated tokens: the running return
and the GAE estimate skip over observation positions instead of restarting there
(docs/cases.md, case 10). With mask [1, 1, 0, 0, 1, 1], γ = 1
and reward 1 on the last token, every generated token has return 1.

Positions are those of the row's tokens (``len(row.input_ids)``); masked-out positions
get 0 in every output.
"""

from __future__ import annotations

from collections.abc import Sequence


def _targets(mask: Sequence[float], n: int, name: str) -> list[int]:
    if len(mask) != n:
        raise ValueError(f"{name} has {n} positions but the mask has {len(mask)}")
    return [t for t, m in enumerate(mask) if m]


def discounted_returns(rewards: Sequence[float], mask: Sequence[float], gamma: float = 1.0) -> list[float]:
    """G_t = Σ_{l≥0} γ^l r_{t_l} over the generated positions t = t_0 < t_1 < … (returns-to-go).

    Args:
        rewards: [T] float per position (e.g. the outcome reward on the last generated
            token, a shaping term on the last token of each call); rewards on masked-out
            positions are an error, since no action earned them.
        mask: [T] target mask (1 = generated token).
        gamma: discount per generated token, in [0, 1].

    Returns:
        [T] floats: G at generated positions, 0 elsewhere.

    Raises:
        ValueError: lengths differ, gamma outside [0, 1], or a reward sits on a masked-out
            position.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    targets = _targets(mask, len(rewards), "rewards")
    _no_reward_outside(rewards, mask)
    out = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(targets):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def gae(
    rewards: Sequence[float],
    values: Sequence[float],
    mask: Sequence[float],
    gamma: float = 1.0,
    lam: float = 0.95,
    last_value: float = 0.0,
) -> tuple[list[float], list[float]]:
    """Generalised advantage estimation over the generated positions of one row.

    δ_k = r_k + γ V_{k+1} − V_k and A_k = Σ_l (γλ)^l δ_{k+l} over the k-th, (k+1)-th, …
    generated tokens (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    GAE", eq. 16). V_k is the value of the state in which token k was generated; across
    an observation, V_{k+1} is the value after the observation, so the estimate carries
    through it. After the last token V = ``last_value``: 0 after a true terminal
    (episode finished), the critic's value of the final state after a truncation.

    Args:
        rewards: [T] float per position (non-zero only on generated positions).
        values: [T] float, V of the state before each generated token (ignored elsewhere).
        mask: [T] target mask.
        gamma, lam: discount and GAE λ, each in [0, 1].
        last_value: V after the last generated token (bootstrap).

    Returns:
        (advantages [T], returns [T] = advantages + values), 0 on masked-out positions;
        the returns are the value targets.

    Raises:
        ValueError: lengths differ, gamma or lam outside [0, 1], or a reward on a
            masked-out position.
    """
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {x}")
    targets = _targets(mask, len(rewards), "rewards")
    if len(values) != len(rewards):
        raise ValueError(f"values has {len(values)} positions, rewards {len(rewards)}")
    _no_reward_outside(rewards, mask)
    adv = [0.0] * len(rewards)
    ret = [0.0] * len(rewards)
    running = 0.0
    next_value = float(last_value)
    for t in reversed(targets):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
        ret[t] = running + values[t]
        next_value = values[t]
    return adv, ret


def _no_reward_outside(rewards: Sequence[float], mask: Sequence[float]) -> None:
    for t, (r, m) in enumerate(zip(rewards, mask)):
        if r and not m:
            raise ValueError(
                f"reward {r} at position {t}, which is not a generated token; put each reward "
                "on the last generated token of the call that earned it"
            )
