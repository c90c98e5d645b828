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

Memory (chunking). The trainer never holds the full ``[N, S-1, V]`` float32 logits (for
SmolLM2-135M at 32 rows × 200 tokens that is 1.26 GB per copy, and the unchunked path
makes several: logits, processed logits, log-softmax, the entropy's terms, and their
gradients). :func:`token_logprobs` runs the transformer trunk once to the final hidden
states, then, per chunk of ``chunk_size`` target positions (rows × positions flattened,
padded targets skipped), applies the LM head, the processing above, the log-softmax
gather of the target and the entropy. With autograd on, each chunk runs under
``torch.utils.checkpoint`` (non-reentrant): only its ``[chunk, H]`` hidden states are
kept, and its ``[chunk, V]`` logits are recomputed in the backward pass. Values and
gradients equal :func:`token_logprobs_unchunked` (the direct computation) to float32
rounding. A model whose logits are not ``lm_head(trunk(...).last_hidden_state)`` (not a
known Hugging Face causal LM) is run whole and only its processing is chunked.

Shared prefix. In the chunked path the trunk runs a prefix shared by every row once
(``policy/shared_prefix.py``): few-shot prompts share most of their tokens, so the update's
trunk work falls from rows × length to prefix + rows × suffix (values and gradients equal
to float32 rounding).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from consequence.policy.packing import packed_hidden, packing_refusal
from consequence.policy.shared_prefix import SHARED_PREFIX_MIN_TOKENS, shared_prefix_len, trunk_hidden

# Real target positions (rows × positions, flattened) per chunk of the LM head and processing.
# Measured at SmolLM2-135M's head (vocabulary 49,152, hidden 576), 32 rows × 200 tokens,
# forward + backward, 2 CPU cores: CPU time 1.24-1.29× the unchunked head at 512-4096
# (the head's matmul is recomputed in the backward pass), 1.38× at 256; the chunk's
# [1024, 49152] float32 temporaries are 0.2 GB each (the unchunked ones 1.26 GB).
DEFAULT_CHUNK_SIZE = 1024

# ``chunk_size=None`` chunks only when the real targets' float32 logits would exceed this:
# a small-vocabulary model (the tiny policy: 768 ids, ~30 MB per micro-batch) keeps the
# direct computation, so its runs stay bit-identical to before chunking existed (the two
# differ by float32 rounding only, ~1e-9 in the loss, which changes later samples).
AUTO_CHUNK_BYTES = 256 * 2**20

# Hugging Face causal LMs whose logits are exactly ``lm_head(model(...).last_hidden_state)``
# (no soft-capping or logit scaling), so the head can be applied per chunk.
_PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3"})


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
        out.append(flat[k : k + c])
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
        raise ValueError(
            f"keep_index names a position outside the [{N}, {S1 + 1}] batch, position 0, "
            f"or a token id >= the vocabulary size {V}"
        )
    lin = row * S1 + pos
    where, slot = torch.unique(lin, return_inverse=True)  # one slot per target position
    keep_PV = torch.zeros((where.numel(), V), dtype=torch.bool, device=proc_NSV.device)
    keep_PV[slot, tok] = True
    flat = proc_NSV.reshape(N * S1, V)
    masked = flat.index_select(0, where).masked_fill(~keep_PV, float("-inf"))
    return flat.index_copy(0, where, masked).view(N, S1, V)


def _processed(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    keep_index: torch.Tensor | None,
    keep_rows: torch.Tensor | None,
) -> torch.Tensor:
    """[N, S-1, V] logits whose log_softmax is the sampling distribution of each target."""
    if keep_index is None or temperature == 0:
        return process_logits(logits, temperature, top_k, top_p)  # supports from the current logits
    proc = logits / temperature if temperature != 1.0 else logits
    if keep_rows is not None and not bool(keep_rows.all()):
        # rows recorded without supports keep the old rule: top-k / top-p of these logits
        bare = (~keep_rows).nonzero().flatten()
        proc = proc.index_copy(0, bare, process_logits(proc.index_select(0, bare), 1.0, top_k, top_p))
    return mask_to_support(proc, keep_index)


def token_logprobs_unchunked(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    keep_index: torch.Tensor | None = None,
    keep_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log π(next token | prefix) for every position, differentiable (HF forward), with the
    whole ``[N, S-1, V]`` logits in memory: the direct computation that
    :func:`token_logprobs` (``chunk_size=0``) falls back to and is tested against.

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
    return logprobs_from_logits(
        out.logits[:, :-1],
        input_ids,
        attention_mask,
        temperature,
        top_k,
        top_p,
        with_entropy,
        entropy_grad,
        keep_index,
        keep_rows,
    )


def logprobs_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    keep_index: torch.Tensor | None = None,
    keep_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs_unchunked` after the forward pass, for a caller that needs the
    logits too (the distillation loss compares them with the teacher's).

    Args:
        logits: [N, S-1, V] float, ``logits[:, j]`` predicting ``input_ids[:, j+1]``.
        Other arguments and the returns: as :func:`token_logprobs_unchunked`.
    """
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


def accepts_target_mask(fn: Callable[..., Any]) -> bool:
    """Whether a ``logprob_fn`` takes ``target_mask`` (as :func:`token_logprobs` does): callers pass
    the loss mask then, so the LM head runs on the targets only, never on prompt positions."""
    try:
        return "target_mask" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: pass nothing extra
        return False


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    keep_index: torch.Tensor | None = None,
    keep_rows: torch.Tensor | None = None,
    chunk_size: int | None = None,
    target_mask: torch.Tensor | None = None,
    share_prefix: bool = True,
    packing: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log π(next token | prefix) for every position, differentiable, computed in chunks.

    Same arguments, values and gradients as :func:`token_logprobs_unchunked` (see there
    and the module doc for the processed distribution and ``keep_index`` / ``keep_rows``),
    without ever holding the ``[N, S-1, V]`` logits: the trunk runs once, then the LM head,
    processing, log-softmax gather and entropy run per chunk of target positions, each
    chunk recomputed in the backward pass (``torch.utils.checkpoint``) instead of stored.

    Args:
        model: a causal LM. A Hugging Face ``*ForCausalLM`` of a type in
            ``_PLAIN_HEAD_TYPES`` (also wrapped by PEFT LoRA; tied or untied head) gets
            the trunk / head split; any other model (``model(input_ids,
            attention_mask).logits``) runs whole and only its processing is chunked.
        input_ids: [N, S] long, right-padded.
        attention_mask: [N, S] (1 = real token, 0 = padding).
        chunk_size: target positions per chunk (real targets only; padded ones are
            skipped). ``None``: ``DEFAULT_CHUNK_SIZE`` when the real targets' float32
            logits would exceed ``AUTO_CHUNK_BYTES``, else unchunked; ``0``: unchunked.
        target_mask: [N, S-1] bool, the targets the caller uses (the loss mask: sampled
            tokens); the chunked path runs the LM head only there (a prompt's positions
            cost trunk work only) and holds 0 log-prob and entropy elsewhere. The
            unchunked path computes every target (same values where the mask is true).
            ``None``: every real target.
        share_prefix: run a prefix shared by every row (at least ``SHARED_PREFIX_MIN_TOKENS``
            tokens: few-shot prompts, a group's prompt) through the trunk once
            (:func:`consequence.policy.shared_prefix.trunk_hidden`); with ``chunk_size=None``
            such a batch is chunked even when its logits are small. ``False``: one full
            forward per row (benchmarks compare the two).
        packing: run the rows' real tokens through the trunk as one packed sequence
            (:func:`consequence.policy.packing.packed_hidden`: per-row position ids, a
            block-diagonal causal mask) instead of the padded batch; the same values to float
            rounding and the same gradients. Only for a model with a trunk / head split
            (``packing.packing_refusal`` says why not); a shared prefix is then not run once.

    Returns:
        logprobs [N, S-1] float32 (0 at padded targets, -inf outside a target's support),
        entropy [N, S-1] float32 in nats (0 at padded targets) or ``None``; as
        :func:`token_logprobs_unchunked`.

    Raises:
        ValueError: a negative temperature or chunk size, ``keep_index`` naming a position or
            id outside the batch, or ``packing`` on a model that cannot be packed.
    """
    shared = shared_prefix_len(input_ids, attention_mask) if share_prefix and not packing else 0  # once per call
    chunk = auto_chunk_size(model, input_ids, attention_mask, shared) if chunk_size is None else int(chunk_size)
    if chunk < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 = unchunked), got {chunk_size}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if packing:
        if (why := packing_refusal(model, lm_head_split(model))) is not None:
            raise ValueError(f"--packing: {why}; train without --packing")
        chunk = chunk or input_ids.numel()  # packed hidden states need the split path: one chunk = unchunked
    if chunk == 0:
        return token_logprobs_unchunked(
            model,
            input_ids,
            attention_mask,
            temperature,
            top_k,
            top_p,
            with_entropy,
            entropy_grad,
            keep_index,
            keep_rows,
        )
    N, S = input_ids.shape
    S1 = S - 1
    valid = attention_mask[:, 1:].bool()
    if target_mask is not None:
        valid = valid & target_mask.bool()
    lin = valid.reshape(-1).nonzero().squeeze(1)  # [P] flat index row * S1 + j of each computed target
    rows_P, pos_P = lin // max(S1, 1), lin % max(S1, 1)
    split = lm_head_split(model)
    if split is not None:
        trunk, head = split
        if packing:
            hidden = packed_hidden(trunk, input_ids, attention_mask)
        else:
            hidden = trunk_hidden(trunk, input_ids, attention_mask, prefix_len=shared)  # a shared prefix runs once
        feats_PX = hidden[:, :-1][rows_P, pos_P]  # [P, H]: hidden states that predict a real target
        vocab = _out_features(head)
        del hidden
        if torch.is_grad_enabled() and feats_PX.device.type == "cpu":
            _trim_host_heap()
    else:  # logits from the whole model; only the processing is chunked
        head = None
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        feats_PX = logits[:, :-1][rows_P, pos_P]  # [P, V] (the full logits are freed here)
        vocab = logits.shape[-1]
        del logits
    terms = _ChunkSpec(temperature, top_k, top_p, with_entropy, entropy_grad and torch.is_grad_enabled())
    support = None
    if keep_index is not None and temperature != 0:
        support = _support_slots(keep_index, keep_rows, lin, rows_P, N, S1, vocab)
    targets_P = input_ids[:, 1:][rows_P, pos_P]
    lps, ents = [], []
    P = lin.numel()
    for a in range(0, P, chunk):
        b = min(a + chunk, P)
        args = (feats_PX[a:b], targets_P[a:b]) + (
            _chunk_support(support, a, b) if support is not None else (None, None, None)
        )
        fn = functools.partial(_chunk_terms, head, terms)
        if torch.is_grad_enabled():
            lp_c, ent_c = checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            lp_c, ent_c = fn(*args)
        lps.append(lp_c)
        ents.append(ent_c)
    # no real target: 0 everywhere, still on the graph (as the unchunked outputs are)
    zero = None if P else feats_PX.sum().float()  # feats_PX is [0, X]
    lp = scatter_targets(lps, lin, N * S1, zero).view(N, S1)
    ent = None
    if with_entropy:
        ent = scatter_targets(ents, lin, N * S1, zero if terms.entropy_grad else None).view(N, S1)
    return lp, ent


def scatter_targets(parts: list[torch.Tensor], lin: torch.Tensor, n: int, zero: torch.Tensor | None) -> torch.Tensor:
    """[n] float32: zeros with the concatenated ``parts`` at flat indices ``lin`` [P] long."""
    out = torch.zeros(n, dtype=torch.float32, device=lin.device)
    if parts:
        out = out.index_copy(0, lin, torch.cat(parts))
    return out if zero is None else out + zero


class _ChunkSpec:
    """Settings shared by every chunk of one :func:`token_logprobs` call."""

    __slots__ = ("temperature", "top_k", "top_p", "with_entropy", "entropy_grad")

    def __init__(self, temperature: float, top_k: int, top_p: float, with_entropy: bool, entropy_grad: bool):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.with_entropy, self.entropy_grad = with_entropy, entropy_grad


def _chunk_terms(
    head,
    spec: _ChunkSpec,
    feats_cX: torch.Tensor,
    targets_c: torch.Tensor,
    bare_b: torch.Tensor | None,
    where_m: torch.Tensor | None,
    keep_2: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-prob and entropy of ``c`` positions under the processed distribution.

    Args:
        head: the LM head (``[c, H] -> [c, V]``), or ``None`` when ``feats_cX`` are logits.
        feats_cX: [c, H] hidden states (or [c, V] logits), any float dtype.
        targets_c: [c] long target ids.
        bare_b: [b] long chunk positions whose row has no stored supports (top-k / top-p
            of these logits), or ``None``. Only when stored supports are used.
        where_m: [m] long chunk positions with a stored support (ascending, unique).
        keep_2: [k, 2] long ``(slot in where_m, kept id)`` pairs of those supports.

    Returns:
        (log-probs [c] float32, entropy [c] float32; empty when not asked for).
    """
    z = head(feats_cX) if head is not None else feats_cX
    if z.dtype != torch.float32:
        z = z.float()
    T = spec.temperature
    if where_m is None:  # no stored supports: the current logits' top-k / top-p (greedy: raw)
        proc = process_logits(z, T, spec.top_k, spec.top_p)
    else:
        proc = z / T if T != 1.0 else z
        if bare_b is not None and bare_b.numel():
            proc = proc.index_copy(0, bare_b, process_logits(proc.index_select(0, bare_b), 1.0, spec.top_k, spec.top_p))
        if where_m.numel():
            assert keep_2 is not None  # _chunk_support gives where_m and keep_2 together
            keep_mV = torch.zeros((where_m.numel(), proc.shape[-1]), dtype=torch.bool, device=proc.device)
            keep_mV[keep_2[:, 0], keep_2[:, 1]] = True
            masked = proc.index_select(0, where_m).masked_fill(~keep_mV, float("-inf"))
            proc = proc.index_copy(0, where_m, masked)
    logp_cV = torch.log_softmax(proc, dim=-1)
    del proc, z
    lp = logp_cV.gather(-1, targets_c.unsqueeze(-1)).squeeze(-1)
    ent = lp.new_zeros(0)
    if spec.with_entropy:
        with torch.set_grad_enabled(spec.entropy_grad):
            safe = torch.where(torch.isfinite(logp_cV), logp_cV, torch.zeros_like(logp_cV))
            ent = -(safe.exp() * safe).sum(-1)
    return lp, ent


def _support_slots(
    keep_index: torch.Tensor,
    keep_rows: torch.Tensor | None,
    lin: torch.Tensor,
    rows_P: torch.Tensor,
    N: int,
    S1: int,
    V: int,
) -> dict[str, torch.Tensor]:
    """The stored supports of :func:`token_logprobs_unchunked` re-indexed by computed position.

    Args:
        keep_index: [K, 3] long ``(row, target position in input_ids, kept id)``.
        keep_rows: [N] bool rows with stored supports, or ``None`` (all).
        lin: [P] long flat index ``row * (S-1) + j`` of each computed (real) target.
        rows_P: [P] long row of each computed target.

    Returns:
        ``slot`` [K'] long computed position of each entry on a real target (ascending),
        ``tok`` [K'] long its kept id, ``bare`` [B] long computed positions of rows
        without stored supports (ascending; empty when every row has them).

    Raises:
        ValueError: as :func:`mask_to_support`.
    """
    dev = lin.device
    if keep_index.numel():
        row, pos, tok = keep_index[:, 0], keep_index[:, 1] - 1, keep_index[:, 2]
        if bool((pos < 0).any() | (pos >= S1).any() | (row >= N).any() | (tok >= V).any()):
            raise ValueError(
                f"keep_index names a position outside the [{N}, {S1 + 1}] batch, position 0, "
                f"or a token id >= the vocabulary size {V}"
            )
        slot_of = torch.full((N * S1,), -1, dtype=torch.long, device=dev)
        slot_of[lin] = torch.arange(lin.numel(), device=dev)
        slot = slot_of[row * S1 + pos]
        on = slot >= 0  # entries on padded targets change nothing (their log-prob is 0)
        slot, tok = slot[on], tok[on]
        order = torch.argsort(slot, stable=True)
        slot, tok = slot[order], tok[order]
    else:
        slot = tok = torch.zeros(0, dtype=torch.long, device=dev)
    if keep_rows is not None and not bool(keep_rows.all()):
        bare = (~keep_rows.bool())[rows_P].nonzero().flatten()
    else:
        bare = torch.zeros(0, dtype=torch.long, device=dev)
    return {"slot": slot, "tok": tok, "bare": bare}


def _chunk_support(support: dict[str, torch.Tensor], a: int, b: int):
    """(bare [b'], where [m], keep [k, 2]) of computed positions ``a:b``, chunk-local."""
    slot, tok, bare = support["slot"], support["tok"], support["bare"]
    lo, hi = torch.searchsorted(slot, torch.tensor([a, b], device=slot.device)).tolist()
    where, inv = torch.unique(slot[lo:hi] - a, return_inverse=True)
    blo, bhi = torch.searchsorted(bare, torch.tensor([a, b], device=bare.device)).tolist()
    return bare[blo:bhi] - a, where, torch.stack([inv, tok[lo:hi]], dim=1)


_LIBC: list = []  # [glibc handle or None], looked up once


def _trim_host_heap() -> None:
    """Return the free pages of glibc's heap to the OS (``malloc_trim(0)``); no-op elsewhere.

    The trunk's forward frees many [N·S, H]-sized temporaries (below glibc's dynamic mmap
    threshold, so on the heap) between tensors that stay alive for the backward pass
    (checkpointed layer inputs, saved activations); glibc keeps those holes resident. At
    SmolLM2-135M's shapes, micro-batch 32, with gradient checkpointing, the step's peak
    resident memory was 3.9-5.0 GB without this call and 3.3 GB with it (live tensors:
    2.8 GB), at no measurable time cost (benchmarks/bench_logprob_memory.py).
    """
    if not _LIBC:
        try:
            import ctypes

            lib = ctypes.CDLL("libc.so.6")
            _LIBC.append(lib if hasattr(lib, "malloc_trim") else None)
        except OSError:  # not glibc (macOS, musl): nothing to do
            _LIBC.append(None)
    if _LIBC[0] is not None:
        _LIBC[0].malloc_trim(0)


def auto_chunk_size(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, shared: int | None = None) -> int:
    """``DEFAULT_CHUNK_SIZE``, or 0 when the full logits of the real targets are small and no
    long prefix is shared by every row (the chunked path runs a shared prefix once)."""
    shared = shared_prefix_len(input_ids, attention_mask) if shared is None else shared
    if shared >= SHARED_PREFIX_MIN_TOKENS and lm_head_split(model) is not None:
        return DEFAULT_CHUNK_SIZE
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(head, torch.nn.Module):
        vocab = _out_features(head)
    if not vocab:
        return DEFAULT_CHUNK_SIZE
    targets = int(attention_mask[:, 1:].sum())
    return DEFAULT_CHUNK_SIZE if targets * vocab * 4 > AUTO_CHUNK_BYTES else 0


def _out_features(head) -> int:
    w = getattr(head, "weight", None)
    return int(w.shape[0]) if w is not None else int(head.out_features)


def lm_head_split(model) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(trunk, LM head) of a model whose logits are ``head(trunk(...).last_hidden_state)``.

    Args:
        model: a Hugging Face ``*ForCausalLM`` (or a PEFT model wrapping one).

    Returns:
        the trunk (called with ``input_ids``, ``attention_mask``, ``use_cache=False``;
        ``.last_hidden_state`` [N, S, H]) and the head (``[.., H] -> [.., V]``; the
        embedding matrix itself when tied), or ``None`` when ``model`` is not a known
        plain-head causal LM (its logits may be soft-capped, scaled or computed otherwise)
        or is a PEFT prompt-learning model (virtual tokens), or is an FSDP2 ``fully_shard``
        root (only its own forward gathers the shards it holds, e.g. the embeddings and a
        tied head: the trunk or head alone would see shards).
    """
    if any(c.__name__ == "FSDPModule" for c in type(model).__mro__):  # torch.distributed.fsdp.FSDPModule
        return None
    base = model
    if callable(getattr(model, "get_base_model", None)):  # PEFT
        peft_cfg = getattr(model, "active_peft_config", None)
        if peft_cfg is None or getattr(peft_cfg, "is_prompt_learning", False):
            return None
        base = model.get_base_model()
    cls = type(base)
    cfg = getattr(base, "config", None)
    if (
        not cls.__module__.startswith("transformers.models.")
        or not cls.__name__.endswith("ForCausalLM")
        or getattr(cfg, "model_type", None) not in _PLAIN_HEAD_TYPES
    ):
        return None
    if any(
        getattr(cfg, k, None) not in (None, 1, 1.0)
        for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")
    ):
        return None
    trunk, head = getattr(base, "model", None), base.get_output_embeddings()
    if not isinstance(trunk, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        return None
    return trunk, head


def enable_gradient_checkpointing(model) -> None:
    """Recompute each transformer layer's activations in the backward pass instead of storing them.

    Calls the Hugging Face ``activation_checkpointing_enable`` (non-reentrant
    ``torch.utils.checkpoint``, so frozen inputs such as a LoRA base still get layer
    gradients) and puts ``model`` in training mode, because Hugging Face checkpoints a
    layer only in training mode (the sampler switches to eval mode and back by itself).
    Values and gradients are unchanged for models without dropout (Llama, Qwen, SmolLM2);
    a model with dropout > 0 would now train with it on.

    Args:
        model: a Hugging Face ``PreTrainedModel`` (or a PEFT model wrapping one).

    Raises:
        ValueError: the model does not support gradient checkpointing.
    """
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"gradient_checkpointing: {type(base).__name__} does not support it "
            "(needs a Hugging Face model with supports_gradient_checkpointing)"
        )
    kwargs = {"use_reentrant": False}
    if callable(getattr(base, "activation_checkpointing_enable", None)):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
