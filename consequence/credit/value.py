"""A learned value head (critic) for PPO + GAE (credit box, docs/design.md §4).

The critic is a copy of the policy's transformer trunk (without its LM head) plus a
scalar head, initialised from the policy's weights as in RLHF-style PPO (Ouyang et al.
2022, §3.5, where the value function is initialised from a trained model); the head
starts at zero so the first advantages equal the returns.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from consequence.records import TrainingRow, pad_rows


class ValueModel(nn.Module):
    """V(h_j) for every prefix h_j = tokens[: j+1] of a batch of rows.

    Args:
        policy: a Hugging Face causal LM; its ``base_model`` (the trunk) is deep-copied.

    Raises:
        ValueError: the policy has no ``base_model`` / ``config.hidden_size``.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        trunk = getattr(policy, "base_model", None)
        hidden = getattr(getattr(policy, "config", None), "hidden_size", None) or getattr(
            getattr(policy, "config", None), "n_embd", None
        )
        if trunk is None or trunk is policy or hidden is None:
            raise ValueError("ValueModel needs a Hugging Face causal LM with a base_model trunk and config.hidden_size")
        self.trunk = copy.deepcopy(trunk)
        self.head = nn.Linear(int(hidden), 1, device=next(self.trunk.parameters()).device)  # beside the trunk
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Values [N, S] float32 for ``input_ids`` [N, S] long (right-padded); position j
        holds V of the state after token j."""
        h = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(h.float()).squeeze(-1)


@torch.no_grad()
def row_values(
    critic: ValueModel, rows: Sequence[TrainingRow], pad_id: int, micro_batch_size: int = 32
) -> tuple[list[list[float]], list[float]]:
    """Values of every row under ``critic``, aligned with the row's targets.

    Returns:
        (values: per row a list of len(input_ids) where position t holds V of the state
         in which token t was generated, i.e. the critic's output at t−1 (position 0: 0);
         final: per row, V of the state after its last token, the bootstrap of a
         truncated episode).
    """
    device = next(critic.parameters()).device
    values: list[list[float]] = [[] for _ in rows]
    final: list[float] = [0.0] * len(rows)
    for start in range(0, len(rows), micro_batch_size):
        idx = list(range(start, min(start + micro_batch_size, len(rows))))
        batch = pad_rows([rows[i] for i in idx], pad_id)
        v = critic(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float().cpu()
        for j, i in enumerate(idx):
            n = len(rows[i].input_ids)
            values[i] = [0.0] + v[j, : n - 1].tolist()
            final[i] = float(v[j, n - 1])
    return values, final


def explained_variance(
    rows: Sequence[TrainingRow], returns: Sequence[Sequence[float]], values: Sequence[Sequence[float]]
) -> float | None:
    """1 − Var(R − V) / Var(R) over every target token of ``rows`` (population variances).

    The standard diagnostic of a critic (e.g. OpenAI Baselines' ``explained_variance``):
    1 is a perfect fit, 0 no better than a constant, < 0 worse than one.

    Args:
        rows: training rows; their ``loss_mask`` picks the target tokens.
        returns: per row, value targets R aligned with ``input_ids``.
        values: per row, the critic's V aligned the same way (``row_values``).

    Returns:
        the explained variance, or ``None`` when it is undefined (no target token, or
        Var(R) = 0: every return equal).

    Raises:
        ValueError: the three sequences differ in length.
    """
    if not (len(rows) == len(returns) == len(values)):
        raise ValueError(f"{len(rows)} rows, {len(returns)} returns, {len(values)} values")
    r, v = [], []
    for row, ret, val in zip(rows, returns, values):
        for j, m in enumerate(row.loss_mask):
            if m and j > 0:  # position 0 is never a target (no logit predicts it)
                r.append(ret[j])
                v.append(val[j])
    if not r:
        return None
    r_t, v_t = torch.tensor(r, dtype=torch.float64), torch.tensor(v, dtype=torch.float64)
    var_r = float(r_t.var(unbiased=False))
    if var_r <= 0.0:
        return None
    return 1.0 - float((r_t - v_t).var(unbiased=False)) / var_r
