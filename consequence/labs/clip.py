"""Lab ``clip``: where the clipped surrogate stops giving a gradient.

Plots :func:`consequence.update.surrogates.clipped_surrogate` against ρ ∈ [0.5, 1.5] for
A = ±1 with ε = 0.2 and with clip-higher (0.2 / 0.28), and finds by autograd where the
gradient with respect to logπ is zero.
"""

from __future__ import annotations

from pathlib import Path

import torch

from consequence.figures import pyplot, save_figure
from consequence.update.surrogates import clipped_surrogate

SETTINGS = {"eps 0.2": (0.2, 0.2), "clip-higher 0.2/0.28": (0.2, 0.28)}
N_GRID = 1000


def rho_grid() -> torch.Tensor:
    """ρ at bin centres of [0.5, 1.5] (no point lands exactly on a clip edge): [N_GRID] float64."""
    return 0.5 + (torch.arange(N_GRID, dtype=torch.float64) + 0.5) / N_GRID


def surrogate_and_grad(rho: torch.Tensor, adv: float, eps_low: float, eps_high: float):
    """Objective and d objective / d logπ at each ρ (old logπ = 0): two [N] float64 tensors."""
    logp = rho.log().clone().requires_grad_(True)
    obj, _, _ = clipped_surrogate(logp[None], torch.zeros_like(logp)[None],
                                  torch.full((1,), adv, dtype=torch.float64), eps_low, eps_high)
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
            line, = ax.plot(rho, obj, label=f"{name} (zero gradient {'>' if bool(zero[-1]) else '<'} {edge:g})")
            ax.plot(rho[zero], obj[zero], ".", ms=2, color=line.get_color())
            ax.axvline(edge, color=line.get_color(), ls="--", lw=0.8)
        ax.set(title=f"clipped surrogate, A = {adv:+g} (dots: zero gradient)", xlabel="ρ = π/π_old", ylabel="objective")
        ax.legend(fontsize=8)
    ref = torch.tensor([[1.3, 1.3]], dtype=torch.float64)
    obj, _, _ = clipped_surrogate(ref.log(), torch.zeros_like(ref), torch.tensor([[1.732, -0.577]], dtype=torch.float64))
    out["rho=1.3 eps=0.2 A=1.732"] = float(obj[0, 0])
    out["rho=1.3 eps=0.2 A=-0.577"] = float(obj[0, 1])
    out["png"] = str(save_figure(fig, out_dir, "clip"))
    return out
