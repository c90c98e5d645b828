"""Lab ``reduction``: how each token reduction weights the tokens of a group.

GRPO rewards (1,0,0,0) → advantages (√3, −1/√3, −1/√3, −1/√3); lengths (2,4,4,6); ρ = 1.
The per-token objective comes from :func:`clipped_surrogate`, the scalar from
:func:`reduce_tokens` (Dr.GRPO constant 6); the per-token weight is the gradient of the
reduced value with respect to each token's term. Minimised losses: 0 / 0.2887 / 0.1925.
"""

from __future__ import annotations

from pathlib import Path

import torch

from consequence.credit.advantages import group_advantages
from consequence.figures import pyplot, save_figure
from consequence.update.losses import REDUCTIONS, reduce_tokens
from consequence.update.surrogates import clipped_surrogate

REWARDS, LENGTHS, NORM_CONST = (1.0, 0.0, 0.0, 0.0), (2, 4, 4, 6), 6.0


def setup() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advantages [4], per-token objective [4, 6] and mask [4, 6] (float64), ρ = 1."""
    adv = torch.tensor(group_advantages(list(REWARDS), ["g"] * len(REWARDS), "grpo"), dtype=torch.float64)
    T = max(LENGTHS)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    logp = torch.full((len(LENGTHS), T), -1.0, dtype=torch.float64)
    obj, _, _ = clipped_surrogate(logp, logp.clone(), adv)
    return adv, obj, mask


def run(out_dir: Path, seed: int = 0) -> dict:
    adv, obj, mask = setup()
    out: dict = {f"advantage seq {i + 1} (len {L})": float(a) for i, (a, L) in enumerate(zip(adv, LENGTHS))}
    weights = {}
    for red in REDUCTIONS:
        u = obj.clone().requires_grad_(True)
        loss = -reduce_tokens(u, mask, red, norm_const=NORM_CONST)
        (grad,) = torch.autograd.grad(-loss, u)
        weights[red] = grad * mask
        out[f"loss {red}"] = float(loss.detach())
        for i in range(len(LENGTHS)):
            out[f"token weight {red} seq {i + 1}"] = float(weights[red][i, 0])
        out[f"sum of weights {red}"] = float(weights[red].sum())

    plt = pyplot()
    fig, axes = plt.subplots(1, len(REDUCTIONS), figsize=(14, 4.2), sharey=True)
    for ax, red in zip(axes, REDUCTIONS):
        w = weights[red]
        for i, L in enumerate(LENGTHS):
            xs = [i + (k - (L - 1) / 2) * 0.12 for k in range(L)]
            ax.bar(xs, w[i, :L].tolist(), width=0.1, color="C2" if adv[i] > 0 else "C3")
        ax.set_xticks(
            range(len(LENGTHS)),
            [f"seq {i + 1}\nL={L}, A={float(a):+.2f}" for i, (L, a) in enumerate(zip(LENGTHS, adv))],
            fontsize=8,
        )
        ax.set_title(f"{red}\nloss {out[f'loss {red}']:.4f}", fontsize=10)
    axes[0].set_ylabel("weight of each token")
    out["png"] = str(save_figure(fig, out_dir, "reduction"))
    return out
