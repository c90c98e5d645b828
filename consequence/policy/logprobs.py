"""Trainer-side token log-probs under the same processed distribution as the sampler.

``process_logits`` is the one definition of "the distribution actually sampled from",
shared by ``sampler.generate`` and ``token_logprobs`` so that ratio π/μ == 1 when the
weights have not changed:

1. temperature: ``logits / T`` (``T == 0`` means greedy; log-probs are then reported under
   the unprocessed ``T = 1`` distribution with no top-k / top-p, since the greedy
   "distribution" is a point mass whose log-prob is always 0);
2. top-k (``k > 0``): logits strictly below the k-th largest become ``-inf`` (ties kept);
3. top-p (``p < 1``): on the softmax of the result of 2, keep the smallest set of most
   probable tokens whose cumulative probability reaches ``p`` (a token is kept when the
   mass of the tokens strictly ahead of it in descending order is ``< p``; the top token
   is always kept); the others become ``-inf``.

``log_softmax`` of the processed logits renormalises over the kept support.

The keep-sampling mask. Steps 2 and 3 depend on the logits, so once the weights move a
support recomputed from the *current* logits is no longer the one the sampler drew from:
a sampled token can fall outside it (log-prob ``-inf``, ratio 0 or NaN) and the
normalisation changes for the others. The sampler therefore stores, per sampled token,
the ids of its support (:func:`kept_ids`); ``token_logprobs(..., keep_index=...)`` masks
the logits of those target positions to the stored support before ``log_softmax`` at the
sampling temperature, for π_θ, π_ref and every recomputation of π_old alike. Only rows
recorded without supports (files written before supports were stored) fall back to
recomputing top-k / top-p from the current logits, which is exact only on the behaviour
weights.
"""

from __future__ import annotations

import torch


def keep_mask(scaled_V: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor | None:
    """Boolean support of the processed distribution.

    Args:
        scaled_V: [..., V] float, logits already divided by the temperature.
        top_k: keep the k largest (0 = off).
        top_p: nucleus mass (1.0 = off).

    Returns:
        [..., V] bool (True = may be sampled), or ``None`` when neither filter is on.
    """
    V = scaled_V.shape[-1]
    use_k = 0 < top_k < V
    use_p = top_p < 1.0
    if not use_k and not use_p:
        return None
    with torch.no_grad():
        x = scaled_V.detach()
        keep = torch.ones_like(x, dtype=torch.bool)
        if use_k:
            kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
            keep = x >= kth
        if use_p:
            xk = x.masked_fill(~keep, float("-inf"))
            probs = torch.softmax(xk, dim=-1)
            sp, idx = torch.sort(probs, dim=-1, descending=True)
            ahead = torch.cumsum(sp, dim=-1) - sp  # mass strictly ahead in sorted order
            keep_sorted = ahead < top_p
            keep_sorted[..., 0] = True
            keep_p = torch.zeros_like(keep).scatter_(-1, idx, keep_sorted)
            keep = keep & keep_p
    return keep


def kept_ids(keep_BV: torch.Tensor) -> list[list[int]]:
    """The support of each row as a sorted list of token ids.

    Args:
        keep_BV: [B, V] bool keep mask (:func:`keep_mask`).

    Returns:
        B lists of ints (ascending), the ids where ``keep_BV`` is True.
    """
    rows, ids = keep_BV.nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=keep_BV.shape[0]).tolist()
    flat = ids.tolist()
    out, k = [], 0
    for c in counts:
        out.append(flat[k:k + c])
        k += c
    return out


def process_logits(
    logits_V: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Processed logits whose ``log_softmax`` is the sampling distribution.

    Args:
        logits_V: [..., V] float raw logits.

    Returns:
        [..., V] float: ``logits / T`` with tokens outside the top-k / top-p support set
        to ``-inf``. ``temperature == 0`` returns the raw logits (greedy; see module doc).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits_V
    scaled = logits_V / temperature if temperature != 1.0 else logits_V
    keep = keep_mask(scaled, top_k, top_p)
    if keep is None:
        return scaled
    return scaled.masked_fill(~keep, float("-inf"))


def mask_to_support(proc_NSV: torch.Tensor, keep_index: torch.Tensor) -> torch.Tensor:
    """Set every logit outside the stored support of a target position to ``-inf``.

    Args:
        proc_NSV: [N, S-1, V] float logits (already divided by the temperature);
            position j predicts ``input_ids[:, j+1]``.
        keep_index: [K, 3] long rows ``(row, target position t in input_ids, kept token
            id)``: the support token t was sampled from (``records.pad_rows``). Target
            position t is logit position t − 1. Positions not named are left as they are.

    Returns:
        [N, S-1, V] float, differentiable w.r.t. ``proc_NSV`` (out-of-place).

    Raises:
        ValueError: a target position is 0 (no logit predicts it) or out of range.
    """
    if keep_index.numel() == 0:
        return proc_NSV
    N, S1, V = proc_NSV.shape
    row, pos, tok = keep_index[:, 0], keep_index[:, 1] - 1, keep_index[:, 2]
    if bool((pos < 0).any() | (pos >= S1).any() | (row >= N).any() | (tok >= V).any()):
        raise ValueError(f"keep_index names a position outside the [{N}, {S1 + 1}] batch, position 0, "
                         f"or a token id >= the vocabulary size {V}")
    lin = row * S1 + pos
    where, slot = torch.unique(lin, return_inverse=True)  # one slot per target position
    keep_PV = torch.zeros((where.numel(), V), dtype=torch.bool, device=proc_NSV.device)
    keep_PV[slot, tok] = True
    flat = proc_NSV.reshape(N * S1, V)
    masked = flat.index_select(0, where).masked_fill(~keep_PV, float("-inf"))
    return flat.index_copy(0, where, masked).view(N, S1, V)


def _processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               keep_index: torch.Tensor | None, keep_rows: torch.Tensor | None) -> torch.Tensor:
    """[N, S-1, V] logits whose log_softmax is the sampling distribution of each target."""
    if keep_index is None or temperature == 0:
        return process_logits(logits, temperature, top_k, top_p)  # supports from the current logits
    proc = logits / temperature if temperature != 1.0 else logits
    if keep_rows is not None and not bool(keep_rows.all()):
        # rows recorded without supports keep the old rule: top-k / top-p of these logits
        bare = (~keep_rows).nonzero().flatten()
        proc = proc.index_copy(0, bare, process_logits(proc.index_select(0, bare), 1.0, top_k, top_p))
    return mask_to_support(proc, keep_index)


def token_logprobs(
    model,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    keep_index: torch.Tensor | None = None,
    keep_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log π(next token | prefix) for every position, differentiable (HF forward).

    Args:
        model: a causal LM (HF ``model(input_ids, attention_mask).logits``).
        input_ids: [N, S] long, right-padded.
        attention_mask: [N, S] (1 = real token, 0 = padding).
        temperature, top_k, top_p: the sampler's settings (see module doc).
        with_entropy: also return the entropy of the processed distribution.
        entropy_grad: let the entropy carry a gradient (for an entropy bonus); otherwise
            it is computed without autograd, as a diagnostic that costs no backward.
        keep_index: [K, 3] long ``(row, target position in input_ids, kept id)``, the
            keep-sampling mask stored by the sampler (``records.pad_rows``). When given,
            a named target position uses exactly its stored support and top-k / top-p
            are not recomputed; other positions of those rows use the full vocabulary
            at ``temperature`` (non-targets, or calls sampled without truncation).
            ``None``: every position gets the top-k / top-p support of the current logits.
        keep_rows: [N] bool, the rows whose supports were stored (default: all rows when
            ``keep_index`` is given); the other rows fall back to top-k / top-p of the
            current logits.

    Returns:
        logprobs [N, S-1] float32: ``logprobs[:, j] = log π(input_ids[:, j+1] | ids[:, :j+1])``.
        A target outside its support gets ``-inf`` (it could not have been sampled);
        padded targets (``attention_mask[:, j+1] == 0``) get 0. Select loss positions
        with ``torch.where(mask, lp, 0)``, never ``lp * mask`` (-inf * 0 = nan).
        entropy [N, S-1] float32 in nats (0 at padded targets), or ``None``.

    Raises:
        ValueError: ``keep_index`` names a position or id outside the batch.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    logits = out.logits[:, :-1]
    if logits.dtype != torch.float32:
        logits = logits.float()
    proc = _processed(logits, temperature, top_k, top_p, keep_index, keep_rows)
    logp_V = torch.log_softmax(proc, dim=-1)
    del proc
    targets = input_ids[:, 1:]
    lp = logp_V.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    valid = attention_mask[:, 1:].bool()
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # tokens outside the support have p = 0 and contribute 0 (not 0 · -inf = nan)
            safe = torch.where(torch.isfinite(logp_V), logp_V, torch.zeros_like(logp_V))
            ent = -(safe.exp() * safe).sum(-1)
            ent = torch.where(valid, ent, torch.zeros_like(ent))
    return lp, ent
