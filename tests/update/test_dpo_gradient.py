"""--advantage dpo: the update's gradient is the gradient of DPO's loss (Rafailov et al. 2023,
eq. 7), computed directly with autograd from the paper's formula, for multi-row episodes and a
pair that shares a long prefix."""

import math

import pytest
import torch

from consequence.credit.dpo import dpo_advantages
from consequence.records import TrainingRow, Trajectory
from consequence.update.step import UpdateConfig
from tiny_lm import TinyLM, V, grads_of, ref_logprobs

BETA = 0.5


def _logprobs(model, ids):
    """log ``model`` of every position of ``ids`` (0 at position 0, which nothing predicts)."""
    t = torch.tensor(ids)
    with torch.no_grad():
        lp, _ = ref_logprobs(model, t[None], torch.ones(1, len(ids), dtype=torch.long))
    return [0.0, *lp[0].tolist()]


def _row(ids, n_prompt, sampler, traj):
    """A row whose targets are every token after ``n_prompt`` context tokens, sampled by ``sampler``."""
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
    old = [x if m else 0.0 for x, m in zip(_logprobs(sampler, ids), mask)]
    return TrainingRow(list(ids), mask, old, traj_index=traj)


def _episodes(model):
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(1, V, (n,), generator=g).tolist()

    prefix = ids(24)  # a long prompt + first turn shared by episodes 0 and 1
    trajs = [
        Trajectory("a", "a", 0, 0, 0, reward=1.0, verifier_score=1.0),  # chosen
        Trajectory("a", "a", 1, 0, 0, reward=0.0, verifier_score=0.0),  # rejected
        Trajectory("a", "a", 2, 0, 0, reward=1.0, verifier_score=1.0),  # chosen, two rows (a prefix break)
        Trajectory("a", "a", 3, 0, 0, reward=0.0, verifier_score=0.0, outcome="truncated"),  # rejected
        Trajectory("b", "b", 0, 0, 0, reward=1.0, verifier_score=1.0),  # alone in its group: no pair
    ]
    rows = [
        _row(prefix + ids(5), 20, model, 0),
        _row(prefix + ids(7), 20, model, 1),
        _row(ids(9), 4, model, 2),
        _row(ids(11), 6, model, 2),
        _row(ids(8), 3, model, 3),
        _row(ids(6), 2, model, 4),
    ]
    return trajs, rows, [r.traj_index for r in rows]


def _direct_loss(model, reference, rows, owner, pairs, loss, eps):
    """Eq. 7 (and IPO's eq. 17) written out: sequence log-probs summed over each episode's targets."""
    seq = {}
    for r, i in zip(rows, owner):
        ids = torch.tensor(r.input_ids)[None]
        mask = torch.tensor(r.loss_mask[1:], dtype=torch.float64)
        lp, _ = ref_logprobs(model, ids, torch.ones_like(ids))
        with torch.no_grad():
            lr, _ = ref_logprobs(reference, ids, torch.ones_like(ids))
        seq[i] = seq.get(i, 0.0) + ((lp[0].double() - lr[0].double()) * mask).sum()
    terms = []
    for w, r in pairs:
        h = seq[w] - seq[r]
        if loss == "ipo":
            terms.append((h - 1 / (2 * BETA)) ** 2)
        else:
            logsig = torch.nn.functional.logsigmoid
            terms.append(-(1 - eps) * logsig(BETA * h) - eps * logsig(-BETA * h))
    return torch.stack(terms).mean()


@pytest.mark.parametrize(
    ("loss", "eps", "stored"),
    [("sigmoid", 0.0, False), ("sigmoid", 0.2, False), ("ipo", 0.0, False), ("sigmoid", 0.0, True)],
)
def test_dpo_advantages_give_the_gradient_of_the_dpo_loss(loss, eps, stored):
    """``stored``: the episodes were sampled by another policy (--distill-data), so the rows'
    old log-probs are not π_θ's and the credit box is given π_θ's own."""
    model, reference = TinyLM(0), TinyLM(1)
    trajs, rows, owner = _episodes(TinyLM(2) if stored else model)
    ref = [_logprobs(reference, r.input_ids) for r in rows]
    mine = [_logprobs(model, r.input_ids) for r in rows] if stored else None
    adv, metrics = dpo_advantages(trajs, rows, owner, ref, BETA, loss, eps, policy_logprobs=mine)
    pairs = [(0, 1), (0, 3), (2, 1), (2, 3)]
    assert metrics["dpo_pairs"] == 4.0 and adv[4] == 0.0

    model.zero_grad(set_to_none=True)
    direct = _direct_loss(model, reference, rows, owner, pairs, loss, eps)
    direct.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    cfg = UpdateConfig(surrogate="pg", reduction="seq_mean_token_sum_norm", norm_const=1.0, micro_batch_size=2)
    got, m = grads_of(model, rows, [adv[i] for i in owner], cfg)

    # float32 log-probs summed over ≤ 29 targets per episode: each side's rounding is a few float32
    # ulps of the largest term; 64 ulps of the gradient's scale bounds both summation orders.
    for n in want:
        tol = 64 * torch.finfo(torch.float32).eps * float(want[n].abs().max())
        assert (got[n] - want[n]).abs().max() <= tol, n
    assert metrics["dpo_loss"] == pytest.approx(float(direct.detach()), rel=1e-5)
    assert m["n_rows_trained"] == 5.0 and m["rows_skipped_zero_advantage"] == 1.0


def test_dpo_metrics_are_the_implicit_rewards():
    model = TinyLM(0)
    trajs, rows, owner = _episodes(model)
    ref = [[0.0] * len(r.input_ids) for r in rows]  # log π_ref = 0: the implicit reward is β log π_θ
    _, m = dpo_advantages(trajs, rows, owner, ref, BETA)
    logp = [0.0] * 5
    for r, i in zip(rows, owner):
        logp[i] += math.fsum(x for x, k in zip(r.old_logprobs, r.loss_mask) if k)
    assert m["dpo_chosen_logp"] == pytest.approx((2 * logp[0] + 2 * logp[2]) / 4)
    assert m["dpo_rejected_reward"] == pytest.approx(BETA * (2 * logp[1] + 2 * logp[3]) / 4)
    margins = [logp[w] - logp[r] for w, r in [(0, 1), (0, 3), (2, 1), (2, 3)]]
    assert m["dpo_reward_margin"] == pytest.approx(BETA * sum(margins) / 4)
    assert m["dpo_reward_accuracy"] == sum(h > 0 for h in margins) / 4
