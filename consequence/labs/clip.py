"""Lab ``clip``: where the clipped surrogate stops giving a gradient.

Plots :func:`consequence.update.surrogates.clipped_surrogate` against ρ ∈ [0.5, 1.5] for
A = ±1 with ε = 0.2 and with clip-higher (0.2 / 0.28), and finds by autograd where the
gradient with respect to logπ is zero.

In probabilities: a token with A > 0 keeps a gradient only while π_θ ≤ (1 + ε)·π_old, so
its probability can rise by ε·π_old before its term flattens: 0.002 for a token at
π_old = 0.01 and 0.1 for one at 0.5 with ε = 0.2 (the tutorial's paragraph on the clip's
relative bound after its A = ±1, ε = 0.2 example; DAPO, Yu et al. 2025, §3.1, ties this
early saturation of rare tokens to the entropy collapse that clip-higher counters). The
lab finds that largest π_θ from ``clipped_surrogate``'s own gradient
(:func:`largest_prob_with_gradient`) and prints the rise.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from consequence.figures import pyplot, save_figure
from consequence.update.surrogates import clipped_surrogate

SETTINGS = {"eps 0.2": (0.2, 0.2), "clip-higher 0.2/0.28": (0.2, 0.28)}
N_GRID = 1000
PI_OLD = (0.01, 0.5)  # the tutorial's rare and even tokens


def rho_grid() -> torch.Tensor:
    """ρ at bin centres of [0.5, 1.5] (no point lands exactly on a clip edge): [N_GRID] float64."""
    return 0.5 + (torch.arange(N_GRID, dtype=torch.float64) + 0.5) / N_GRID


def surrogate_and_grad(rho: torch.Tensor, adv: float, eps_low: float, eps_high: float):
    """Objective and d objective / d logπ at each ρ (old logπ = 0): two [N] float64 tensors."""
    logp = rho.log().clone().requires_grad_(True)
    obj, _, _ = clipped_surrogate(
        logp[None], torch.zeros_like(logp)[None], torch.full((1,), adv, dtype=torch.float64), eps_low, eps_high
    )
    obj.sum().backward()
    return obj.detach()[0], logp.grad


def zero_grad_edge(rho: torch.Tensor, grad: torch.Tensor) -> float:
    """Midpoint between the zero-gradient region and the gradient region (one edge)."""
    zero = grad == 0
    edges = (zero[1:] != zero[:-1]).nonzero()
    if len(edges) != 1:
        raise ValueError(f"expected one edge, found {len(edges)}")
    i = int(edges[0])
    return round(float(rho[i] + rho[i + 1]) / 2, 6)


def _has_gradient(pi: float, pi_old: float, eps_low: float, eps_high: float) -> bool:
    """Whether one token with A = +1 at π_θ = ``pi`` gives ``clipped_surrogate`` a nonzero
    gradient with respect to logπ_θ (float64)."""
    logp = torch.tensor([[math.log(pi)]], dtype=torch.float64, requires_grad=True)
    obj, _, _ = clipped_surrogate(
        logp,
        torch.tensor([[math.log(pi_old)]], dtype=torch.float64),
        torch.ones(1, dtype=torch.float64),
        eps_low,
        eps_high,
    )
    obj.sum().backward()
    assert logp.grad is not None  # a leaf that requires grad, after backward
    return bool(logp.grad[0, 0] != 0)


def largest_prob_with_gradient(pi_old: float, eps_low: float = 0.2, eps_high: float = 0.2) -> float:
    """The largest π_θ(a|h) at which a token with A > 0 still gets a gradient from
    :func:`~consequence.update.surrogates.clipped_surrogate`, by bisection on π_θ.

    The clip binds at ρ = π_θ/π_old = 1 + eps_high, so the answer is (1 + ε)·π_old and the
    rise before the term flattens is ε·π_old (PPO, Schulman et al. 2017, eq. 7). A
    probability cannot pass 1: when (1 + ε)·π_old > 1 the term never flattens and 1.0 is
    returned. The bisection runs 60 halvings of [π_old, 1], so the answer is within
    2^-60 of the edge, plus the rounding of exp(logπ_θ − logπ_old) near 1 + ε (a few
    ulps relative, ~1e-16).

    Args:
        pi_old: π_old(a|h) of the token, in (0, 1].
        eps_low, eps_high: the clip range [1 − eps_low, 1 + eps_high] (only eps_high binds for A > 0).

    Returns:
        π_θ as a float.

    Raises:
        ValueError: ``pi_old`` outside (0, 1]; or no gradient even at π_θ = π_old (ρ = 1),
            i.e. a clip range that excludes ρ = 1.
    """
    if not 0.0 < pi_old <= 1.0:
        raise ValueError(f"pi_old = {pi_old}: a probability in (0, 1] is needed")
    if not _has_gradient(pi_old, pi_old, eps_low, eps_high):
        raise ValueError(f"no gradient at ρ = 1 with eps_low {eps_low}, eps_high {eps_high}: the clip range excludes 1")
    if _has_gradient(1.0, pi_old, eps_low, eps_high):
        return 1.0
    lo, hi = pi_old, 1.0  # gradient at lo, none at hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _has_gradient(mid, pi_old, eps_low, eps_high) else (lo, mid)
    return lo


def run(out_dir: Path, seed: int = 0) -> dict:
    rho = rho_grid()
    out: dict = {}
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, adv in zip(axes, (1.0, -1.0)):
        ax.plot(rho, rho * adv, color="grey", ls=":", label="unclipped ρA")
        for name, (lo, hi) in SETTINGS.items():
            obj, grad = surrogate_and_grad(rho, adv, lo, hi)
            edge = zero_grad_edge(rho, grad)
            out[f"A={adv:+g} {name}: zero gradient edge rho"] = edge
            zero = grad == 0
            out[f"A={adv:+g} {name}: zero gradient side"] = "above" if bool(zero[-1]) else "below"
            (line,) = ax.plot(rho, obj, label=f"{name} (zero gradient {'>' if bool(zero[-1]) else '<'} {edge:g})")
            ax.plot(rho[zero], obj[zero], ".", ms=2, color=line.get_color())
            ax.axvline(edge, color=line.get_color(), ls="--", lw=0.8)
        ax.set(title=f"clipped surrogate, A = {adv:+g} (dots: zero gradient)", xlabel="ρ = π/π_old", ylabel="objective")
        ax.legend(fontsize=8)
    ref = torch.tensor([[1.3, 1.3]], dtype=torch.float64)
    obj, _, _ = clipped_surrogate(
        ref.log(), torch.zeros_like(ref), torch.tensor([[1.732, -0.577]], dtype=torch.float64)
    )
    out["rho=1.3 eps=0.2 A=1.732"] = float(obj[0, 0])
    out["rho=1.3 eps=0.2 A=-0.577"] = float(obj[0, 1])
    for name, (lo, hi) in SETTINGS.items():
        for pi_old in PI_OLD:
            top = largest_prob_with_gradient(pi_old, lo, hi)
            out[f"A>0 {name}, pi_old={pi_old:g}: largest pi with gradient"] = top
            out[f"A>0 {name}, pi_old={pi_old:g}: rise eps*pi_old"] = top - pi_old
    out["png"] = str(save_figure(fig, out_dir, "clip"))
    return out
