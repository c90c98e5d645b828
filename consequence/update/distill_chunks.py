"""The distillation loss's forward in chunks of target positions, for large vocabularies.

The direct computation (``update.step._distill_forward``) holds the micro-batch's full
``[n, S-1, V]`` float32 logits of student and teacher, and the divergence's softmaxes over
them: for SmolLM2's 49,152 ids at 16 rows × 260 tokens that is 0.8 GB per copy, several
copies at once. Here both trunks run once (a prefix shared by every row once, as in
``policy.logprobs.token_logprobs``), only the hidden states of the target positions are
kept, and per chunk of targets the two LM heads, the student's log-softmax, entropy and
the divergence (``update.divergence.token_divergence``) run under
``torch.utils.checkpoint``: a chunk's ``[c, V]`` logits are recomputed in the backward pass
instead of stored. Values and gradients equal the direct computation to float32 rounding
(``tests/distill/test_distill_loss.py``).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from consequence.policy.logprobs import DEFAULT_CHUNK_SIZE, lm_head_split, scatter_targets
from consequence.policy.shared_prefix import trunk_hidden
from consequence.update.divergence import Kind, token_divergence

__all__ = ["distill_chunked", "can_chunk"]


def can_chunk(model, teacher) -> bool:
    """Whether both models split into a trunk and a plain LM head (``policy.logprobs.lm_head_split``)."""
    return lm_head_split(model) is not None and lm_head_split(teacher) is not None


def distill_chunked(
    model,
    teacher,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    temperature: float,
    entropy_grad: bool,
    kind: Kind,
    beta: float,
    tau: float,
    top_k: int,
    shared: int = 0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student log-probs, entropy and divergence to the teacher at the target positions.

    Args:
        model: the student (a causal LM that :func:`can_chunk`), in training.
        teacher: the frozen teacher, same vocabulary (no gradient flows into it).
        input_ids: [n, S] long, right-padded; attention_mask: [n, S] (1 = real token).
        target_mask: [n, S-1] bool, the sampled tokens (the loss mask shifted by one).
        temperature: the sampling temperature of the student's log-probs and entropy.
        entropy_grad: whether the entropy carries a gradient (an entropy bonus is trained).
        kind, beta, tau, top_k: the divergence (:func:`token_divergence`).
        shared: tokens of a prefix shared by every row (``policy.shared_prefix.shared_prefix_len``),
            run through both trunks once; 0 = none.
        chunk_size: target positions per chunk (≥ 1).

    Returns:
        (log-probs [n, S-1], entropy [n, S-1], divergence [n, S-1]), float32, 0 away from the
        targets; the same values as the direct computation at the targets.

    Raises:
        ValueError: ``chunk_size`` < 1, or a model that cannot be split (check :func:`can_chunk`).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not can_chunk(model, teacher):
        raise ValueError("distill_chunked needs student and teacher with a plain LM head (llama, qwen2, ...)")
    n, S = input_ids.shape
    S1 = S - 1
    lin = (attention_mask[:, 1:].bool() & target_mask.bool()).reshape(-1).nonzero().squeeze(1)
    rows, pos = lin // max(S1, 1), lin % max(S1, 1)
    split, t_split = lm_head_split(model), lm_head_split(teacher)
    assert split is not None and t_split is not None  # can_chunk above
    trunk, head = split
    feats = trunk_hidden(trunk, input_ids, attention_mask, prefix_len=shared)[:, :-1][rows, pos]  # [P, H]
    t_trunk, t_head = t_split
    with torch.no_grad():  # on the teacher's own device (--teacher-device); each chunk's logits come back
        t_dev = next(teacher.parameters()).device
        t_hidden = trunk_hidden(t_trunk, input_ids.to(t_dev), attention_mask.to(t_dev), prefix_len=shared)
        t_feats = t_hidden[:, :-1][rows.to(t_dev), pos.to(t_dev)]
        del t_hidden
    targets = input_ids[:, 1:][rows, pos]
    fn = functools.partial(
        _chunk, head, t_head, temperature, entropy_grad and torch.is_grad_enabled(), kind, beta, tau, top_k
    )
    parts = []
    for a in range(0, lin.numel(), chunk_size):
        args = (feats[a : a + chunk_size], t_feats[a : a + chunk_size], targets[a : a + chunk_size])
        parts.append(
            checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
            if torch.is_grad_enabled()
            else fn(*args)
        )
    zero = feats.sum().float() * 0 if not lin.numel() else None  # no target: zeros still on the graph
    lp, ent, div = (scatter_targets([p[k] for p in parts], lin, n * S1, zero).view(n, S1) for k in range(3))
    return lp, ent, div


def _chunk(
    head,
    t_head,
    temperature: float,
    entropy_grad: bool,
    kind: Kind,
    beta: float,
    tau: float,
    top_k: int,
    feats_cH: torch.Tensor,
    t_feats_cH: torch.Tensor,
    targets_c: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob [c], entropy [c], divergence [c]) of ``c`` target positions."""
    z = head(feats_cH).float()
    logp = torch.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)
    lp = logp.gather(-1, targets_c.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        t_z = t_head(t_feats_cH).float().to(z.device)
    return lp, ent, token_divergence(z, t_z, kind, beta, tau, top_k)
