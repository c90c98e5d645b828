"""Masked positions never poison a value or a gradient (issue 30, item 6; update box).

A position outside the loss mask may hold anything: an endpoint or an asynchronous record
can carry an old log-prob of −1e4 or ±inf there, a prompt token has no sampler log-prob, a
reference outside its top-p support gives −inf. Multiplying by the mask after an exp is
not enough (exp(1e4) = inf, and inf · 0 is NaN in the backward pass even though the
forward value is finite), so every loss term selects the inputs first. The property tests
draw random small batches with extremes (±1e4, ±1e30, ±inf, NaN, 3e38) on every masked
position of every input, and check (a) a finite loss, (b) finite gradients, 0 exactly on
masked positions, (c) loss and gradients equal to those of the same batch with the masked
positions REMOVED (rows compacted to their targets; rows without a target dropped).

Why (c) holds only to float32 rounding, not bitwise: the compacted batch has another
layout, so (1) a sum runs over the same non-zero terms in another association (vectorised
lanes, pairwise blocks); recursive or blocked summation of n terms errs by at most
(n − 1)·u·Σ|x| (Higham 2002, "Accuracy and Stability of Numerical Algorithms", §4.2), with
u = 2⁻²⁴ the float32 unit roundoff; (2) an element may fall in a kernel's vector body on one
side and its scalar tail on the other, and the two exp implementations each are within
1 ulp (≤ 2u relative) of the exact value, not equal to each other. A per-token value or
gradient passes through at most 4 elementwise kernels (subtract, exp, multiply, divide),
so the two sides differ by ≤ 2 · 4 · 2u = 16u relative (``ELEMENTWISE``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consequence.credit.kl import KL_ESTIMATORS, kl_estimate, reverse_kl_advantages
from consequence.records import TrainingRow
from consequence.update.divergence import token_divergence
from consequence.update.losses import REDUCTIONS, reduce_tokens
from consequence.update.regularizers import tis_weights
from consequence.update.sampler_gap import is_mask_keep, sampler_gap_metrics
from consequence.update.step import UpdateConfig, accumulate_gradients
from consequence.update.surrogates import (
    SURROGATES,
    cispo_surrogate,
    clipped_surrogate,
    dual_clip_surrogate,
    gspo_surrogate,
    gspo_token_surrogate,
    policy_gradient_objective,
    surrogate_objective,
)
from consequence.update.value_step import value_step
from tiny_lm import PAD, TinyLM, make_rows, ref_logprobs

INF, NAN = float("inf"), float("nan")
EXTREMES = (1e4, -1e4, 1e30, -1e30, INF, -INF, NAN, 3e38)
U = 2.0**-24  # float32 unit roundoff
ELEMENTWISE = 16 * U  # module doc: ≤ 4 kernels per element, each ≤ 2u, on two sides
PROPERTY = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- random batches with extremes on masked positions ----------------------------------------
@dataclass
class Batch:
    """[N, T] float32 tensors; ``mask`` float32 (1 = target); ``adv_seq`` [N] (one per row)."""

    mask: torch.Tensor
    lp: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    sampler: torch.Tensor
    adv: torch.Tensor
    adv_seq: torch.Tensor
    ent: torch.Tensor

    def compact(self, keep: torch.Tensor | None = None) -> Batch:
        """The same targets with every other position removed: each row's targets moved to
        the front (order kept), rows without a target dropped, padded with 0 and mask 0."""
        keep = self.mask > 0 if keep is None else keep
        rows = [i for i in range(keep.shape[0]) if keep[i].any()]
        width = max(int(keep[i].sum()) for i in rows)
        out = {}
        for name in ("lp", "old", "ref", "sampler", "adv", "ent"):
            full = getattr(self, name)
            t = torch.zeros(len(rows), width)
            for j, i in enumerate(rows):
                v = full[i][keep[i]]
                t[j, : v.numel()] = v
            out[name] = t
        mask = torch.zeros(len(rows), width)
        for j, i in enumerate(rows):
            mask[j, : int(keep[i].sum())] = 1.0
        return Batch(mask=mask, adv_seq=self.adv_seq[rows], **out)


def _grid(lo: int, hi: int, step: float):
    # Dyadic values: sums of a few of them are exact in float32, so a GSPO sequence mean is
    # the same number whatever the layout, and no ratio lands within rounding of a clip edge.
    return st.integers(lo, hi).map(lambda k: k * step)


@st.composite
def batches(draw, extreme_targets_in_sampler: bool = False) -> Batch:
    n, t = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    on = draw(st.lists(st.booleans(), min_size=n * t, max_size=n * t))
    if not any(on):
        on[draw(st.integers(0, n * t - 1))] = True
    extreme = st.sampled_from(EXTREMES)

    def field(benign):
        """[N, T]: a draw of ``benign`` on each target, an extreme on every other position."""
        return torch.tensor([draw(benign) if m else draw(extreme) for m in on], dtype=torch.float32).view(n, t)

    mask = torch.tensor(on, dtype=torch.float32).view(n, t)
    m = mask > 0
    lp = field(_grid(-32, 0, 1 / 8))  # logπ_θ in [−4, 0]
    # ratios from e^−1.5 to e^1.5: both clip edges and the dual-clip c = 3 are crossed
    old = torch.where(m, lp - field(_grid(-12, 12, 1 / 8)), field(_grid(0, 0, 1)))
    ref = torch.where(m, lp - field(_grid(-8, 8, 1 / 8)), field(_grid(0, 0, 1)))
    # masked IS must also turn extreme sampler log-probs ON targets into masked positions
    sampler_delta = _grid(-4, 4, 1 / 8) | (extreme if extreme_targets_in_sampler else _grid(0, 0, 1))
    sampler = torch.where(m, old - field(sampler_delta), field(_grid(0, 0, 1)))
    adv = field(_grid(-8, 8, 1 / 4))
    adv_seq = torch.tensor(
        [draw(_grid(-8, 8, 1 / 4)) if m[i].any() else draw(extreme) for i in range(n)], dtype=torch.float32
    )
    ent = field(_grid(0, 24, 1 / 8))
    return Batch(mask, lp, old, ref, sampler, adv, adv_seq, ent)


def _run(b: Batch, objective, reduction: str, mask: torch.Tensor | None = None):
    """(loss, grad of logπ_θ, grad of the entropy, reduction of |objective|) for −reduce(objective)."""
    mask = b.mask if mask is None else mask
    lp = b.lp.clone().requires_grad_(True)
    ent = b.ent.clone().requires_grad_(True)
    obj = objective(b, lp, ent, mask)
    loss = -reduce_tokens(obj, mask, reduction)
    loss.backward()
    g_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    g_lp = lp.grad if lp.grad is not None else torch.zeros_like(lp)
    scale = reduce_tokens(torch.where(mask > 0, obj.detach(), 0.0).abs(), mask, reduction)
    return loss.detach(), g_lp, g_ent, float(scale)


def assert_inert(b: Batch, objective, reduction: str, keep: torch.Tensor | None = None) -> None:
    """Properties (a)–(c) of the module doc for ``objective`` under ``reduction``."""
    keep = b.mask > 0 if keep is None else keep
    loss, g_lp, g_ent, _ = _run(b, objective, reduction, keep.float())
    c = b.compact(keep)
    c_loss, c_lp, c_ent, scale = _run(c, objective, reduction)
    assert torch.isfinite(loss), f"loss {loss}"
    assert torch.isfinite(g_lp).all() and torch.isfinite(g_ent).all(), (g_lp, g_ent)
    assert (g_lp[~keep] == 0).all() and (g_ent[~keep] == 0).all()
    # two sums of ≤ N·T + N terms (nested for seq-mean) and a division on each side, plus the
    # elementwise difference of the terms themselves (module doc)
    n, t = b.mask.shape
    tol = (2 * (n * t + n + 2) * U + ELEMENTWISE) * scale
    assert abs(float(loss) - float(c_loss)) <= tol, (float(loss), float(c_loss), tol)
    cm = c.mask > 0
    torch.testing.assert_close(g_lp[keep], c_lp[cm], rtol=ELEMENTWISE, atol=0.0)
    torch.testing.assert_close(g_ent[keep], c_ent[cm], rtol=ELEMENTWISE, atol=0.0)


# ---- every surrogate (called directly with mask=, and through the dispatcher) -----------------
DIRECT = {
    "pg": lambda b, lp, ent, m: policy_gradient_objective(lp, b.adv, mask=m),
    "ppo_clip": lambda b, lp, ent, m: clipped_surrogate(lp, b.old, b.adv, mask=m)[0],
    "dapo_clip_higher": lambda b, lp, ent, m: clipped_surrogate(lp, b.old, b.adv, 0.2, 0.28, mask=m)[0],
    "dual_clip": lambda b, lp, ent, m: dual_clip_surrogate(lp, b.old, b.adv, 0.2, 0.2, 3.0, mask=m)[0],
    "gspo": lambda b, lp, ent, m: gspo_surrogate(lp, b.old, b.adv_seq, m, 0.2, 0.2)[0],
    "gspo_token": lambda b, lp, ent, m: gspo_token_surrogate(lp, b.old, b.adv, m, 0.2, 0.2)[0],
    "cispo": lambda b, lp, ent, m: cispo_surrogate(lp, b.old, b.adv, 1.0, 0.28, mask=m)[0],
}


def _dispatched(name: str):
    def objective(b, lp, ent, m):
        adv = b.adv_seq if name == "gspo" else b.adv
        return surrogate_objective(name, lp, b.old, adv, m, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)[0]

    return objective


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DIRECT))
@PROPERTY
@given(b=batches())
def test_surrogate_ignores_extremes_on_masked_positions(name, b):
    for reduction in REDUCTIONS:
        assert_inert(b, DIRECT[name], reduction)
        if name in SURROGATES:
            assert_inert(b, _dispatched(name), reduction)


# ---- TIS, KL k1/k2/k3, the entropy bonus, masked IS ------------------------------------------
def _tis(cap):
    def objective(b, lp, ent, m):
        obj, _, _ = clipped_surrogate(lp, b.old, b.adv, 0.2, 0.28, mask=m)
        return obj * tis_weights(b.old, b.sampler, cap, mask=m)

    return objective


def _kl(estimator):
    return lambda b, lp, ent, m: -0.1 * kl_estimate(lp, b.ref, estimator, mask=m)


def _entropy_bonus(b, lp, ent, m):
    return policy_gradient_objective(lp, b.adv, mask=m) + 0.01 * ent


@pytest.mark.slow
@PROPERTY
@given(b=batches(), cap=st.sampled_from([0.5, 1.5, 2.0]), reduction=st.sampled_from(REDUCTIONS))
def test_regularizers_ignore_extremes_on_masked_positions(b, cap, reduction):
    assert_inert(b, _tis(cap), reduction)
    for estimator in KL_ESTIMATORS:
        assert_inert(b, _kl(estimator), reduction)
    assert_inert(b, _entropy_bonus, reduction)
    # the weights themselves: in (0, C] everywhere, min(1, C) off the mask
    w = tis_weights(b.old, b.sampler, cap, mask=b.mask)
    assert torch.isfinite(w).all() and (w[b.mask == 0] == min(1.0, cap)).all()
    for estimator in KL_ESTIMATORS:
        assert (kl_estimate(b.lp, b.ref, estimator, mask=b.mask)[b.mask == 0] == 0).all()


@PROPERTY
@given(
    b=batches(extreme_targets_in_sampler=True),
    level=st.sampled_from(["token", "sequence"]),
    reduction=st.sampled_from(REDUCTIONS),
)
def test_masked_is_turns_rejected_tokens_into_inert_positions(b, level, reduction):
    """Masked IS (Liu et al. 2025, §4): the tokens it rejects (r = π_old/μ outside [0.8, 1.25],
    here also r = inf or NaN from an extreme sampler log-prob ON a target) leave the loss;
    with TIS on the kept ones the result equals the batch with the rejected tokens removed."""
    m = b.mask > 0
    keep = torch.stack([is_mask_keep(b.old[i], b.sampler[i], b.mask[i], 0.8, 1.25, level) for i in range(m.shape[0])])
    assert not (keep & ~m).any()  # never a masked position
    c = b.compact()
    c_keep = torch.stack(
        [is_mask_keep(c.old[i], c.sampler[i], c.mask[i], 0.8, 1.25, level) for i in range(c.mask.shape[0])]
    )
    assert torch.equal(keep[m], c_keep[c.mask > 0])  # extremes off target change no decision
    got = sampler_gap_metrics(b.old.tolist(), b.sampler.tolist(), b.mask.tolist(), 0.8, 1.25)
    want = sampler_gap_metrics(c.old.tolist(), c.sampler.tolist(), c.mask.tolist(), 0.8, 1.25)
    assert got.keys() == want.keys()
    for k in got:  # float64 means over the same values in the same order
        assert got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])), k
    if keep.any():
        assert_inert(b, _tis(2.0), reduction, keep=keep)


# ---- the credit box's reverse-KL advantages ---------------------------------------------------
@PROPERTY
@given(b=batches())
def test_reverse_kl_advantages_ignore_extremes_on_masked_positions(b):
    adv, met = reverse_kl_advantages(b.lp, b.ref, b.mask)
    m = b.mask > 0
    assert torch.isfinite(adv).all() and (adv[~m] == 0).all()
    assert torch.equal(adv[m], b.ref[m] - b.lp[m])  # one float32 subtraction each, no layout effect
    k1 = (b.lp - b.ref)[m]  # exact: grid values
    # the metric is a float32 sum of k non-zero terms (k − 1 roundings, each ≤ u·Σ|k1|) over
    # k plus one rounding of the division: within u·Σ|k1| of the exact (float64) mean
    assert abs(met["reverse_kl"] - float(k1.double().mean())) <= k1.numel() * U * float(k1.abs().double().mean())
    assert met["n_tokens"] == float(m.sum())


# ---- distillation divergences to a teacher ----------------------------------------------------
@pytest.mark.slow
@PROPERTY
@given(b=batches(), data=st.data())
def test_token_divergence_ignores_extremes_on_masked_positions(b, data):
    """Logits [N, T, V = 4] in [−2, 2] on targets, a whole vector of one extreme elsewhere."""
    n, t, v = *b.mask.shape, 4
    m = b.mask > 0
    logit = _grid(-16, 16, 1 / 8)
    student = torch.tensor(data.draw(st.lists(logit, min_size=n * t * v, max_size=n * t * v))).view(n, t, v)
    teacher = torch.tensor(data.draw(st.lists(logit, min_size=n * t * v, max_size=n * t * v))).view(n, t, v)
    student = torch.where(m.unsqueeze(-1), student, data.draw(st.sampled_from(EXTREMES)))
    teacher = torch.where(m.unsqueeze(-1), teacher, data.draw(st.sampled_from(EXTREMES)))
    kind = data.draw(st.sampled_from(["forward", "reverse", "jsd"]))
    top_k = data.draw(st.sampled_from([0, 2]))
    reduction = data.draw(st.sampled_from(REDUCTIONS))

    def run(s_logits, t_logits, mask):
        s = s_logits.clone().requires_grad_(True)
        div = token_divergence(s, t_logits, kind, 0.5, 1.0, top_k, mask=mask)
        loss = reduce_tokens(div, mask, reduction)
        loss.backward()
        return loss.detach(), s.grad, div.detach()

    loss, grad, div = run(student, teacher, b.mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.isfinite(div).all()
    assert (grad[~m] == 0).all() and (div[~m] == 0).all()
    rows = [i for i in range(n) if m[i].any()]
    width = max(int(m[i].sum()) for i in rows)
    cs, ct, cm = torch.zeros(len(rows), width, v), torch.zeros(len(rows), width, v), torch.zeros(len(rows), width)
    for j, i in enumerate(rows):
        k = int(m[i].sum())
        cs[j, :k], ct[j, :k], cm[j, :k] = student[i][m[i]], teacher[i][m[i]], 1.0
    c_loss, c_grad, c_div = run(cs, ct, cm)
    # Per position: ≤ V-term sums (log-sum-exp, Σ_v) and ≤ 4 elementwise kernels on each side,
    # all terms bounded by C = 2·(max logit gap 4 + log V) + 2 ≈ 13 nats: ≤ 2·(V + 4)·2u·C apart.
    tol = 2 * (v + 4) * 2 * U * 13.0
    torch.testing.assert_close(div[m], c_div[cm > 0], rtol=0.0, atol=tol)
    torch.testing.assert_close(grad[m], c_grad[cm > 0], rtol=0.0, atol=tol)
    assert abs(float(loss) - float(c_loss)) <= tol * (n * t + n + 2)


# ---- the scenario, by hand -------------------------------------------------------------
@pytest.mark.parametrize("extreme", [-1e4, INF, -INF, NAN, 1e30])
def test_clipped_surrogate_with_one_extreme_masked_old_logprob_hand_computed(extreme):
    """ε = 0.2, A = 1, token mean over 2 targets. Token 1: ρ = e^{0.125} < 1.2, gradient
    −ρ/2. Token 2: ρ = e^{0.25} > 1.2 with A > 0, clipped: objective 1.2, gradient 0. Token
    3 is masked and holds the extreme old log-prob. Dyadic inputs make logπ − logπ_old exact,
    so the only roundings are exp (≤ 1 ulp), the sum and one halving: rel 4u."""
    lp = torch.tensor([[-1.0, 0.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.125, -0.25, extreme]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    obj, ratio, clipped = clipped_surrogate(lp, old, torch.tensor([1.0]), mask=mask)
    loss = -reduce_tokens(obj, mask, "token_mean")
    loss.backward()
    rho = math.exp(0.125)
    assert loss.item() == pytest.approx(-(rho + 1.2) / 2, rel=4 * U)
    assert lp.grad[0, 0].item() == pytest.approx(-rho / 2, rel=4 * U)
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 2].item() == 0.0
    assert clipped.tolist() == [[False, True, False]] and ratio[0, 2].item() == 1.0
    # the same batch with the masked position removed: the same gradient on the targets
    lp2 = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    obj2, _, _ = clipped_surrogate(lp2, torch.tensor([[-1.125, -0.25]]), torch.tensor([1.0]))
    (-reduce_tokens(obj2, torch.ones(1, 2), "token_mean")).backward()
    assert torch.equal(lp.grad[0, :2], lp2.grad[0])  # same elementwise kernels, same slots
    # negative control: with the mask applied only in the reduction (the fault), the
    # forward loss is finite but the gradient is NaN: the input above is extreme enough
    if math.isfinite(extreme) and extreme < 0:
        lp3 = torch.tensor([[-1.0, 0.0, -0.5]], requires_grad=True)
        naive, _, _ = clipped_surrogate(lp3, old, torch.tensor([1.0]))
        naive_loss = -reduce_tokens(naive, mask, "token_mean")
        naive_loss.backward()
        assert torch.isfinite(naive_loss) and torch.isnan(lp3.grad[0, 2])


# ---- the optimizer step and the critic step, end to end -----------------------------------------
def _with_extremes(rows, values, x):
    """Copies with ``x`` on position 1 (a prompt token: not a target, but inside logits[:, :-1])."""
    out = [list(v) for v in values]
    for v, r in zip(out, rows):
        assert not r.loss_mask[1]
        v[1] = x
    return out


@pytest.mark.parametrize(
    "surrogate,estimator,reduction", [(s, KL_ESTIMATORS[i % 3], REDUCTIONS[i % 3]) for i, s in enumerate(SURROGATES)]
)
@pytest.mark.parametrize("x", [-1e4, INF, NAN])
def test_step_gradient_ignores_extremes_on_non_target_positions(surrogate, estimator, reduction, x):
    """accumulate_gradients with TIS, KL, entropy bonus and off-policy masking on: extremes
    in old / sampler / reference log-probs (and per-token advantages) on a non-target position
    give the gradient of the same rows with 0 there, bit for bit (same layout, same kernels)."""
    model = TinyLM(0)
    rows = make_rows(model, [3, 4, 2], perturb=0.1)
    sampler = [[o + 0.05 * (k % 3) for k, o in enumerate(r.old_logprobs)] for r in rows]
    ref = [[o - 0.03 * (k % 2) for k, o in enumerate(r.old_logprobs)] for r in rows]
    per_token = surrogate != "gspo"  # GSPO takes one advantage per sequence
    adv = (
        [[0.7, 0.0] + [0.7 - 0.4 * i] * (len(r.input_ids) - 2) for i, r in enumerate(rows)]
        if per_token
        else [0.7 - 0.4 * i for i in range(len(rows))]
    )
    cfg = UpdateConfig(
        surrogate=surrogate,
        reduction=reduction,
        tis_cap=2.0,
        kl_coef=0.1,
        kl_estimator=estimator,
        entropy_coef=0.01,
        offpolicy_delta=0.05,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
    )

    def grads(rows, adv, sampler, ref):
        model.zero_grad(set_to_none=True)
        met = accumulate_gradients(model, rows, adv, cfg, PAD, ref_logprobs, ref_logprobs=ref, sampler_logprobs=sampler)
        return {n: p.grad.clone() for n, p in model.named_parameters()}, met

    clean, met = grads(rows, adv, sampler, ref)
    bad_old = _with_extremes(rows, [r.old_logprobs for r in rows], x)
    bad_rows = [replace(r, old_logprobs=v) for r, v in zip(rows, bad_old)]
    bad_adv = _with_extremes(rows, adv, x) if per_token else adv
    dirty, bad_met = grads(bad_rows, bad_adv, _with_extremes(rows, sampler, x), _with_extremes(rows, ref, x))
    for name in clean:
        assert torch.isfinite(dirty[name]).all(), name
        assert torch.equal(clean[name], dirty[name]), name
    assert met == bad_met


class _TinyCritic(torch.nn.Module):
    """V for every position: embedding + linear, enough to carry a gradient."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.emb = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.emb(input_ids)).squeeze(-1)


@pytest.mark.parametrize("x", [-1e4, INF, -INF, NAN, 3e38])
def test_value_step_ignores_extreme_returns_and_old_values_off_target(x):
    """A return or old value of ±inf on a non-target position made (V − inf)², selected away
    only afterwards, send 0 · 2(V − inf) = NaN into the critic: the step then refused to run.
    Now the critic steps to the same weights as with 0 there."""
    rows = [TrainingRow([3, 4, 5, 6], [0, 0, 1, 1], [0.0] * 4), TrainingRow([7, 8, 9], [0, 1, 1], [0.0] * 3)]
    returns = [[0.0, 0.0, 0.5, 1.0], [0.0, -0.5, 0.25]]
    old_values = [[0.0, 0.0, 0.25, 0.75], [0.0, -0.25, 0.5]]

    def stepped(returns, old_values):
        critic = _TinyCritic()
        opt = torch.optim.SGD(critic.parameters(), lr=0.5)
        met = value_step(critic, opt, rows, returns, old_values, pad_id=0, clip=0.2)
        return [p.detach().clone() for p in critic.parameters()], met

    clean, met = stepped(returns, old_values)
    bad_ret = [[x, x, 0.5, 1.0], [x, -0.5, 0.25]]  # position 1 of row 0: inside [:, 1:], not a target
    bad_old = [[x, x, 0.25, 0.75], [x, -0.25, 0.5]]
    dirty, bad_met = stepped(bad_ret, bad_old)
    assert met == bad_met
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
