"""Direct preference optimisation as credit (credit box): DPO's gradient as per-episode advantages.

Pairs (:func:`consequence.reward.preferences.preference_pairs`). Within a group (G episodes
of one task), every verified episode (the verifier scored it 1 and it finished:
:func:`consequence.records.verified`) is *chosen* against
every credited episode that is not (a wrong answer, or cut by a budget) as *rejected*; a
group of only successes or only failures gives no pair. Multi-turn: an episode's
log-probability is the sum over its sampled tokens only, across all its training rows, so
observation (tool output) and prompt tokens are masked exactly as in RL.

The loss (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7), with the margin

    h = [log π_θ(y_w) − log π_ref(y_w)] − [log π_θ(y_l) − log π_ref(y_l)]

is ℓ(h) = −(1 − ε)·log σ(β h) − ε·log σ(−β h) per pair (ε = label smoothing, conservative
DPO: Mitchell 2023, "A note on DPO with noisy preferences"; ε = 0 is eq. 7), or for IPO
(Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
Preferences", eq. 17, τ = β) ℓ(h) = (h − 1/(2β))². The step's loss is the mean over the
P pairs.

Why advantages. ∇L = (1/P) Σ_pairs ℓ'(h)·(∇log π_θ(y_w) − ∇log π_θ(y_l)): a sum of each
episode's ∇log π_θ times a scalar. So DPO is the plain policy gradient (``--surrogate pg``,
objective A·log π per sampled token) with episode τ's advantage

    A_τ = −(N_seq / P) · Σ_{pairs p ∋ τ} ±ℓ'(h_p)     (+ when τ is chosen in p, − when rejected)

under the reduction Σ tokens / (1 · N_seq) (``--reduction seq_mean_token_sum_norm
--norm-const 1``, N_seq = the step's rows with a target), which makes the update's gradient
exactly ∇L. On fresh samples log π_θ = log μ, the sampler's recorded log-probs (the
pre-step check holds the ratio at 1), so the margin needs only the reference's forward pass;
the coefficient depends on θ, so it is exact for one optimizer step per batch (the config
refuses more). Implicit rewards r = β·(log π_θ − log π_ref) give the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from consequence.records import TrainingRow, Trajectory
from consequence.reward.preferences import preference_pairs

__all__ = ["DPO_LOSSES", "dpo_advantages", "pair_loss"]

DPO_LOSSES = ("sigmoid", "ipo")


def _log_sigmoid(x: float) -> float:
    """log σ(x), stable for large |x|."""
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    return math.exp(_log_sigmoid(x))


def pair_loss(h: float, beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0) -> tuple[float, float]:
    """ℓ(h) and dℓ/dh for one pair's log-ratio margin ``h`` (nats); formulas in the module doc.

    Raises:
        ValueError: an unknown ``loss`` (valid: :data:`DPO_LOSSES`).
    """
    if loss == "sigmoid":
        e = label_smoothing
        value = -(1 - e) * _log_sigmoid(beta * h) - e * _log_sigmoid(-beta * h)
        return value, -beta * ((1 - e) * _sigmoid(-beta * h) - e * _sigmoid(beta * h))
    if loss == "ipo":
        d = h - 1.0 / (2.0 * beta)
        return d * d, 2.0 * d
    raise ValueError(f"unknown DPO loss {loss!r}; valid: {', '.join(DPO_LOSSES)}")


def _sequence_sums(rows: Sequence[TrainingRow], owner: Sequence[int], values: Sequence[Sequence[float]], n: int):
    """Per trajectory: the sum of ``values`` over its rows' sampled tokens."""
    out = [0.0] * n
    for r, i, v in zip(rows, owner, values):
        out[i] += math.fsum(x for x, m in zip(v, r.loss_mask) if m)
    return out


def dpo_advantages(
    trajs: Sequence[Trajectory],
    rows: Sequence[TrainingRow],
    owner: Sequence[int],
    ref_logprobs: Sequence[Sequence[float]],
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    policy_logprobs: Sequence[Sequence[float]] | None = None,
) -> tuple[list[float], dict[str, float | None]]:
    """Each trajectory's advantage A_τ (module doc; 0 outside every pair) and the DPO metrics.

    Args:
        rows: the training rows (``old_logprobs`` = log μ of each sampled token, which is
            log π_θ on fresh samples); ``owner[j]``: the trajectory of ``rows[j]``.
        ref_logprobs: per row, log π_ref of every position, aligned with ``input_ids``.
        beta: β > 0, the inverse strength of the implicit KL to π_ref.
        policy_logprobs: per row, log π_θ of every position, for episodes the policy did not
            just sample (stored pairs: ``--distill-data``), whose ``old_logprobs`` are another
            sampler's; default: the rows' ``old_logprobs``.

    Returns:
        (advantages per trajectory, metrics): ``dpo_pairs``; ``dpo_loss`` (mean ℓ),
        ``dpo_reward_margin`` (mean β·h), ``dpo_reward_accuracy`` (share of pairs with h > 0),
        ``dpo_chosen_reward`` / ``dpo_rejected_reward`` (mean β·(log π_θ − log π_ref)),
        ``dpo_chosen_logp`` / ``dpo_rejected_logp`` (mean log π_θ of the episode, nats):
        None without a pair.
    """
    n = len(trajs)
    has_rows = [False] * n
    for i in owner:
        has_rows[i] = True
    pairs = preference_pairs(trajs, has_rows)
    mine = [r.old_logprobs for r in rows] if policy_logprobs is None else policy_logprobs
    logp = _sequence_sums(rows, owner, mine, n)
    ref = _sequence_sums(rows, owner, ref_logprobs, n)
    ratio = [a - b for a, b in zip(logp, ref)]
    n_seq = sum(1 for r in rows if any(r.loss_mask[1:]))
    adv = [0.0] * n
    losses, margins = [], []
    for w, r in pairs:
        h = ratio[w] - ratio[r]
        value, slope = pair_loss(h, beta, loss, label_smoothing)
        losses.append(value)
        margins.append(h)
        adv[w] -= slope * n_seq / len(pairs)
        adv[r] += slope * n_seq / len(pairs)
    return adv, _metrics(pairs, losses, margins, logp, ratio, beta)


def _metrics(pairs, losses, margins, logp, ratio, beta) -> dict[str, float | None]:
    def mean(xs: list[float]) -> float | None:
        return math.fsum(xs) / len(xs) if xs else None

    chosen, rejected = [w for w, _ in pairs], [r for _, r in pairs]
    return {
        "dpo_pairs": float(len(pairs)),
        "dpo_loss": mean(losses),
        "dpo_reward_margin": mean([beta * h for h in margins]),
        "dpo_reward_accuracy": mean([float(h > 0) for h in margins]),
        "dpo_chosen_reward": mean([beta * ratio[i] for i in chosen]),
        "dpo_rejected_reward": mean([beta * ratio[i] for i in rejected]),
        "dpo_chosen_logp": mean([logp[i] for i in chosen]),
        "dpo_rejected_logp": mean([logp[i] for i in rejected]),
    }
