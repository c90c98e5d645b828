"""Batched sampling with a KV cache: the rollout hot path.

For ``LlamaForCausalLM`` (and same-layout models: RMSNorm, RoPE, SwiGLU, optional GQA and
q/k/v/o biases) we run our own forward pass in plain torch over the model's own weights
with a preallocated static KV cache; this avoids HF ``generate``'s per-step overhead.
Other architectures fall back to HF ``model(...)`` with ``past_key_values``.

Log-probs are those of the distribution actually sampled from (``logprobs.process_logits``:
temperature, then top-k, then top-p, renormalised); ``temperature == 0`` is greedy and its
log-probs are under the unprocessed ``T = 1`` distribution. When top-k or top-p cuts the
support, each sampled token also comes with the ids of the support it was drawn from
(``Sample.keep_ids``, the keep-sampling mask), so that the trainer scores it under that
same support after the weights have moved (``logprobs`` module doc).

Constrained decoding (``constraints``, one :class:`Constraint` per prompt or ``None``; the
grammars of ``policy.constrained``): at each step a constrained row's logits are restricted
to the ids its grammar allows next, *before* the processing above (vLLM's order: the
guided-decoding mask, then temperature, top-k, top-p): the token is drawn from
``log_softmax(logits / T)`` over allowed ∩ top-k / top-p support, where top-k / top-p rank
the allowed ids only. That intersection is the row's recorded support (``keep_ids``), so
the trainer's log-prob of a constrained token is taken under the same masked distribution
(ratio 1 on fresh samples). Greedy (``temperature == 0``) takes the most probable allowed
id and keeps the greedy convention: its log-prob is under the unprocessed, unmasked
``T = 1`` distribution (what the trainer computes at ``T = 0``), and no support is stored.
A support is stored as its ids: a large allowed set (free text inside a JSON string) costs
up to a vocabulary of ids per token unless top-k / top-p cut it.

Speed notes (2-core CPU, tiny model; see benchmarks/bench_generation.py):
- identical prompts (a GRPO group) are prefilled once and their cache rows copied;
- prefill runs in chunks of ~2048 tokens, and the last layer only finishes the last
  position (every position's k/v is still cached);
- decode attention is two matmuls over the static cache (no per-step concatenation);
- finished rows are dropped from the batch and the cache once they are >= 1/8 of it
  (until then they ride along and their outputs are ignored).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from consequence.policy.device import precision
from consequence.policy.logprobs import keep_mask, kept_ids
from consequence.policy.lora import effective_weight, unwrap


@dataclass(frozen=True)
class SamplingParams:
    """Sampler settings. ``temperature == 0`` = greedy; ``top_k == 0`` / ``top_p == 1`` = off.
    ``dtype``: ``float32``, or ``bfloat16`` to run the forward passes under bfloat16 autocast
    (``policy.device.precision``; the sampling distribution is still taken in float32).
    ``top_logprobs``: how many of the most probable alternatives of each sampled token to
    return (``Sample.top_logprobs``; 0 = none); it changes nothing that is sampled."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    dtype: str = "float32"
    top_logprobs: int = 0


@dataclass
class Sample:
    """One completion.

    Attributes:
        output_ids: sampled ids; the stop id is included when one was sampled.
        logprobs: log μ(y_k | prefix) per sampled token; ``len == len(output_ids)``.
        stop_reason: ``"stop"`` (a stop id was sampled) or ``"length"`` (max_new_tokens hit).
        keep_ids: per sampled token, the ascending ids of the support it was sampled from
            (top-k / top-p on); ``None`` when the support was the whole vocabulary
            (neither filter on, or greedy).
        top_logprobs: per sampled token, the ``params.top_logprobs`` most probable
            ``(id, log-prob)`` under the same processed distribution as ``logprobs``, most
            probable first (ids outside the support, probability 0, are left out); ``None``
            when ``params.top_logprobs`` is 0.
        constrained: sampled under a grammar (``constraints`` of :func:`generate`); its
            ``keep_ids`` (when stored) are then the grammar's allowed ids ∩ top-k / top-p.
    """

    output_ids: list[int]
    logprobs: list[float]
    stop_reason: str
    keep_ids: list[list[int]] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    constrained: bool = False


class Constraint(Protocol):
    """One completion's grammar state (``policy.constrained.Constraint`` implements it)."""

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: the ids the grammar allows next (at least one)."""
        ...

    def advance(self, token: int) -> None:
        """Feed the sampled id to the grammar."""
        ...


# one grammar state per prompt (None: that row is not constrained), or None for none at all
Constraints = Sequence[Constraint | None] | None


PREFILL_CHUNK_TOKENS = 2048
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


class _FastLlama:
    """Plain-torch forward of a Llama-layout causal LM with a static KV cache.

    Built from the model's current weights each time (cheap: parameters are shared, only
    q|k|v and gate|up are concatenated into one matrix each). For a LoRA policy every
    adapted layer contributes its effective weight W0 + (alpha/r) B A (``policy.lora``), so
    rollouts come from the adapter the trainer just updated.
    """

    def __init__(self, model) -> None:
        model = unwrap(model)  # a LoRA policy: read each layer's W0 + (alpha/r) B A, never W0 alone
        W = effective_weight
        cfg = model.config
        inner = model.model
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device
        self.embed = inner.embed_tokens.weight
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            wqkv = torch.cat([W(a.q_proj), W(a.k_proj), W(a.v_proj)], 0)
            bqkv = None
            if a.q_proj.bias is not None:
                bqkv = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0)
            wgu = torch.cat([W(m.gate_proj), W(m.up_proj)], 0)
            bgu = None
            if m.gate_proj.bias is not None:
                bgu = torch.cat([m.gate_proj.bias, m.up_proj.bias], 0)
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    wqkv,
                    bqkv,
                    W(a.o_proj),
                    a.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    wgu,
                    bgu,
                    W(m.down_proj),
                    m.down_proj.bias,
                )
            )
        self.norm_w = inner.norm.weight
        self.lm_head = W(model.lm_head)
        rot = inner.rotary_emb
        self.inv_freq = rot.inv_freq.to(torch.float32)
        self.attn_scaling = float(getattr(rot, "attention_scaling", 1.0))
        self.scale = getattr(model.model.layers[0].self_attn, "scaling", self.head_dim**-0.5)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        # built inside the sampler's precision context (policy.device.precision): bfloat16 autocast or not
        self.autocast = torch.is_autocast_enabled(self.device.type)

    @staticmethod
    def supports(model) -> bool:
        model = unwrap(model)
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in ("llama", "qwen2", "mistral"):
            return False
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return False
        if getattr(cfg, "pretraining_tp", 1) != 1:
            return False
        if getattr(cfg, "use_sliding_window", False):
            return False
        if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
            return False
        inner = getattr(model, "model", None)
        rot = getattr(inner, "rotary_emb", None)
        return rot is not None and getattr(rot, "rope_type", "default") in _STATIC_ROPE

    # -- pieces ---------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, L] long -> cos, sin [B, 1, L, D]."""
        freqs = pos.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)
        cos = (emb.cos() * self.attn_scaling).to(self.dtype)[:, None]
        sin = (emb.sin() * self.attn_scaling).to(self.dtype)[:, None]
        return cos, sin

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        rot = torch.cat([-x[..., h:], x[..., :h]], -1)
        return x * cos + rot * sin

    def alloc(self, batch: int, length: int) -> None:
        # zeros, not empty: a masked slot still enters attention as weight 0 × value, and
        # 0 × (uninitialised NaN) = NaN; a caller that fills only some slots (prefix reuse)
        # would otherwise sample from NaN probabilities
        shape = (batch, self.n_kv, length, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.k_cache = [c.index_select(0, rows) for c in self.k_cache]
        self.v_cache = [c.index_select(0, rows) for c in self.v_cache]

    def forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        start: int,
        key_valid: torch.Tensor,
        all_logits: bool = False,
        rows: slice = slice(None),
    ) -> torch.Tensor:
        """Run ``ids`` [B, L] at cache slots ``start .. start+L-1``.

        Args:
            ids: [B, L] long token ids.
            pos: [B, L] long RoPE positions.
            start: first cache slot written.
            key_valid: [B, start+L] bool, which cache slots hold real tokens.
            all_logits: return [B, L, V] logits instead of the last position's [B, V].
            rows: the cache rows these B sequences occupy (chunked prefill).
        """
        B, L = ids.shape
        end = start + L
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(ids, self.embed)
        cos, sin = self._rope(pos)
        # Query i (slot start+i) sees valid slots <= start+i; each query also sees itself so
        # that padding queries never get an all-masked row (their outputs are unused).
        causal_only = False
        neg: torch.Tensor | None = None  # the padding mask inverted, for the one-query path
        if L == 1:
            mask = key_valid[:, None, None, :end]
            neg = ~mask
        elif start == 0 and bool(key_valid[:, :end].all()):
            mask, causal_only = None, True  # no padding: SDPA's causal kernel, no mask tensor
        else:
            slots = torch.arange(end, device=ids.device)
            qs = torch.arange(start, end, device=ids.device)
            causal = slots[None, :] <= qs[:, None]  # [L, end]
            mask = (causal[None] & key_valid[:, None, :end]) | (slots[None, None, :] == qs[None, :, None])
            mask = mask[:, None]
        gqa = nkv != nh
        rep = nh // nkv
        last = len(self.layers) - 1
        for li, (w1, wqkv, bqkv, wo, bo, w2, wgu, bgu, wd, bd) in enumerate(self.layers):
            h = self._rms(x, w1)
            qkv = F.linear(h, wqkv, bqkv)
            q, k, v = qkv.split([nh * D, nkv * D, nkv * D], -1)
            q = self._apply_rope(q.view(B, L, nh, D).transpose(1, 2), cos, sin)
            k = self._apply_rope(k.view(B, L, nkv, D).transpose(1, 2), cos, sin)
            kc, vc = self.k_cache[li][rows], self.v_cache[li][rows]
            kc[:, :, start:end] = k
            vc[:, :, start:end] = v.view(B, L, nkv, D).transpose(1, 2)
            if L == 1 and self.autocast:
                # Decode under bfloat16 autocast: the scores and their softmax in float32, as
                # SDPA's kernels (prefill, the trainer) keep them; bfloat16 scores would each
                # be rounded by up to 2^-8 of their size before the softmax.
                with torch.autocast(self.device.type, enabled=False):
                    sc = torch.matmul(q.reshape(B, nkv, rep, D).float(), kc[:, :, :end].float().transpose(-1, -2))
                    sc = (sc * self.scale).masked_fill_(neg, float("-inf"))
                    att = torch.matmul(torch.softmax(sc, -1), vc[:, :, :end].float()).reshape(B, 1, nh * D)
            elif L == 1:
                # Decode: plain matmuls over the cache view (faster than SDPA on strided
                # views on CPU); GQA by grouping query heads per kv head.
                sc = torch.matmul(q.reshape(B, nkv, rep, D), kc[:, :, :end].transpose(-1, -2))
                sc = (sc * self.scale).masked_fill_(neg, float("-inf"))
                att = torch.matmul(torch.softmax(sc, -1), vc[:, :, :end]).reshape(B, 1, nh * D)
            elif li == last and not all_logits:
                # Prefill, last layer: every position's k/v is cached above, but only the
                # last position's output is needed from here on.
                q = q[:, :, -1:]
                m = None if mask is None else mask[:, :, -1:]
                att = (
                    F.scaled_dot_product_attention(
                        q, kc[:, :, :end], vc[:, :, :end], attn_mask=m, scale=self.scale, enable_gqa=gqa
                    )
                    .transpose(1, 2)
                    .reshape(B, 1, nh * D)
                )
                x = x[:, -1:]
            else:
                att = (
                    F.scaled_dot_product_attention(
                        q,
                        kc[:, :, :end],
                        vc[:, :, :end],
                        attn_mask=mask,
                        is_causal=causal_only,
                        scale=self.scale,
                        enable_gqa=gqa,
                    )
                    .transpose(1, 2)
                    .reshape(B, L, nh * D)
                )
            x = x + F.linear(att, wo, bo)
            h = self._rms(x, w2)
            g, u = F.linear(h, wgu, bgu).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, wd, bd)
        if not all_logits:
            x = x[:, -1]
        return F.linear(self._rms(x, self.norm_w), self.lm_head)


# A generator for a batch: one torch.Generator shared by every row (its draws depend on the
# batch's composition), a sequence of one generator per row (row i's draws depend only on row
# i: one random stream per episode; a None entry marks a finished row that rides along and
# must not advance any stream), or None (torch's global RNG).
Generators = torch.Generator | Sequence[torch.Generator | None] | None
# on_token(prompt index, token id, log-prob): a token kept for that prompt, as it is sampled.
OnToken = Callable[[int, int, float], None]


def draw(probs_BV: torch.Tensor, generator: Generators) -> torch.Tensor:
    """One token per row from the categorical distributions ``probs_BV``.

    With one generator per row, row b's token is the inverse CDF of a uniform drawn from its
    own generator: u_b ~ U[0, 1), token = min{j : Σ_{k≤j} p_bk > u_b · Σ_k p_bk} (the CDF in
    float64). Its value depends only on row b's probabilities and stream, never on which
    other rows share the batch, so a different token in one episode cannot shift the draws
    of any other. A token of probability 0 is never drawn (its CDF step is empty). A row
    whose generator is ``None`` (finished, its output ignored) draws nothing: u_b = 0, so
    no stream advances for a token nobody keeps.

    Args:
        probs_BV: [B, V] float, non-negative, each row with a positive sum.
        generator: see ``Generators``; a sequence must hold exactly B entries.

    Returns:
        [B] long token ids.

    Raises:
        ValueError: a generator sequence whose length is not B.

    >>> g = [torch.Generator().manual_seed(s) for s in (1, 2)]
    >>> p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    >>> draw(p, g).tolist()
    [1, 2]
    """
    if isinstance(generator, torch.Generator) and generator.device.type != probs_BV.device.type:
        # a CPU generator for probabilities on an accelerator (multinomial needs both on one
        # device): B uniforms come over instead of the [B, V] probabilities going back
        u_B = torch.rand(probs_BV.shape[0], generator=generator, dtype=torch.float64).to(probs_BV.device)
        return _inverse_cdf(probs_BV, u_B)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    if len(generator) != probs_BV.shape[0]:
        raise ValueError(f"draw: {len(generator)} generators for {probs_BV.shape[0]} rows (one per row)")
    zero = torch.zeros(1, dtype=torch.float64)
    u_B = torch.cat([zero if g is None else torch.rand(1, generator=g, dtype=torch.float64) for g in generator]).to(
        probs_BV.device
    )
    return _inverse_cdf(probs_BV, u_B)


def _inverse_cdf(probs_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """[B] long: min{j : Σ_{k≤j} p_bk > u_b · Σ_k p_bk}, the CDF in float64 (u_B [B] float64)."""
    cdf_BV = probs_BV.double().cumsum(-1)
    tok = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True).squeeze(-1)
    return tok.clamp_max(probs_BV.shape[-1] - 1)  # u · total < total, so only a guard


def _rows(generator: Generators, active: list[int], done: list[bool]) -> Generators:
    """The generators of the batch rows ``active`` (original indices) when there is one per row.

    A finished row (``done``) gets ``None``: it still rides in the batch, but its stream must
    not advance, or the row's next call (the episode's next turn) would start at an offset
    that depends on how long the other rows of this batch kept it waiting.
    """
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    return [None if d else generator[i] for i, d in zip(active, done)]


def _pick(
    logits_BV: torch.Tensor,
    params: SamplingParams,
    generator: Generators,
    allowed: tuple[torch.Tensor, list[bool]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[list[int] | None] | None, list[list[tuple[int, float]]] | None]:
    """Sample one token per row under ``logprobs.process_logits``'s distribution, restricted
    to the grammar's allowed ids on constrained rows (module doc).

    Args:
        allowed: ``(allowed_BV [B, V] bool, constrained [B])`` from :func:`_allowed`, or
            ``None`` when no row is constrained.

    Returns:
        ids [B] long, logprobs [B] float32, the kept ids of each row's support (``None``
        when no row's support is cut; a ``None`` entry for a row whose support is the whole
        vocabulary), and each row's ``params.top_logprobs`` most probable ``(id, log-prob)``
        under that same distribution (``None`` when 0).
    """
    logits_BV = logits_BV.float()
    keep = None
    if params.temperature == 0:
        pick_from = logits_BV if allowed is None else logits_BV.masked_fill(~allowed[0], float("-inf"))
        tok = pick_from.argmax(-1)
        logp = torch.log_softmax(logits_BV, -1)
    else:
        scaled = logits_BV / params.temperature if params.temperature != 1.0 else logits_BV
        if allowed is None:
            keep = keep_mask(scaled, params.top_k, params.top_p)
        else:  # top-k / top-p rank the allowed ids only
            cut = keep_mask(scaled.masked_fill(~allowed[0], float("-inf")), params.top_k, params.top_p)
            keep = allowed[0] if cut is None else cut & allowed[0]
        proc = scaled if keep is None else scaled.masked_fill(~keep, float("-inf"))
        logp = torch.log_softmax(proc, -1)
        tok = draw(logp.exp(), generator)
    top = _top(logp, params.top_logprobs) if params.top_logprobs > 0 else None
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1), _supports(keep, allowed, params), top


def _supports(
    keep_BV: torch.Tensor | None, allowed: tuple[torch.Tensor, list[bool]] | None, params: SamplingParams
) -> list[list[int] | None] | None:
    """The kept ids of each row (:func:`_pick`); an unconstrained row without a top-k / top-p
    cut gets ``None`` (the whole vocabulary), as it would in a batch without constraints."""
    if keep_BV is None:
        return None
    cut = 0 < params.top_k < keep_BV.shape[-1] or params.top_p < 1.0  # keep_mask's own test
    if allowed is None or cut:
        return list(kept_ids(keep_BV))  # a top-k / top-p cut applies to every row
    rows = [b for b, c in enumerate(allowed[1]) if c]
    ids = kept_ids(keep_BV[rows])
    out: list[list[int] | None] = [None] * keep_BV.shape[0]
    for b, row_ids in zip(rows, ids):
        out[b] = row_ids
    return out


def _allowed(
    constraints: Constraints, active: list[int], done: list[bool], vocab_size: int, device
) -> tuple[torch.Tensor, list[bool]] | None:
    """``([B, V] bool, constrained [B])``: the ids each batch row's grammar allows next (all
    ids for a row without a grammar or a finished one), or ``None`` when no row has a grammar.

    Raises:
        RuntimeError: a grammar that allows no id (it would leave nothing to sample).
    """
    if constraints is None or all(constraints[i] is None for i in active):
        return None
    mask = torch.ones(len(active), vocab_size, dtype=torch.bool)
    flags = [False] * len(active)
    for b, i in enumerate(active):
        c = constraints[i]
        if c is None or done[b]:
            continue
        mask[b] = c.allowed(vocab_size)
        flags[b] = True
        if not bool(mask[b].any()):
            raise RuntimeError(f"constrained decoding: the grammar of prompt {i} allows no token")
    return mask.to(device), flags


def _advance(constraints: Constraints, active: list[int], done: list[bool], tokens: list[int]) -> None:
    """Feed each unfinished constrained row's sampled id to its grammar."""
    if constraints is None:
        return
    for b, i in enumerate(active):
        c = constraints[i]
        if c is not None and not done[b]:
            c.advance(tokens[b])


def _top(logp_BV: torch.Tensor, n: int) -> list[list[tuple[int, float]]]:
    """Each row's ``n`` most probable ``(id, log-prob)`` of ``logp_BV`` [B, V], most probable
    first; ids of log-prob ``-inf`` (outside a top-k / top-p support) are left out."""
    values, ids = logp_BV.topk(min(n, logp_BV.shape[-1]), -1)
    return [
        [(int(i), float(v)) for i, v in zip(row_i, row_v) if v != float("-inf")]
        for row_i, row_v in zip(ids.tolist(), values.double().tolist())
    ]


def _left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    valid = torch.zeros(len(prompts), L, dtype=torch.bool)
    for i, p in enumerate(prompts):
        if p:
            ids[i, L - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[i, L - len(p) :] = True
    return ids.to(device), valid.to(device)


def generate(
    model,
    prompts: list[list[int]],
    params: SamplingParams,
    stop_ids: Collection[int],
    generator: Generators = None,
    on_token: OnToken | None = None,
    constraints: Constraints = None,
) -> list[Sample]:
    """Sample one completion per prompt.

    Args:
        model: a causal LM (fast path for Llama-layout HF models, HF fallback otherwise).
        prompts: token id lists, any lengths (each non-empty).
        params: sampling settings.
        stop_ids: ids that end a completion (included in ``output_ids`` when sampled).
        generator: torch RNG for sampling: one generator for the batch, or one per prompt
            (one random stream per episode: a row's tokens then depend only on its own
            prompt and stream, ``draw``); ``None`` = global RNG. A CPU generator also drives
            a model on an accelerator (``draw``).
        on_token: ``on_token(i, token_id, logprob)`` for each token kept for prompt ``i``,
            as it is sampled (token-by-token streaming; called in the sampling thread).
        constraints: one grammar state per prompt (``None`` entries: unconstrained rows), or
            ``None``: each constrained token is drawn among its grammar's allowed ids and
            the grammar advanced (module doc); the states are consumed.

    The forward passes run on the model's device, in ``params.dtype`` (``policy.device.precision``).

    Returns:
        one ``Sample`` per prompt, in order.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    check_constraints(constraints, len(prompts))
    if params.max_new_tokens <= 0:
        return [Sample([], [], "length") for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), precision(params.dtype, next(model.parameters()).device):
            if _FastLlama.supports(model):
                return _generate_fast(model, prompts, params, set(stop_ids), generator, on_token, constraints)
            return _generate_hf(model, prompts, params, set(stop_ids), generator, on_token, constraints)
    finally:
        if was_training:
            model.train()


def check_constraints(constraints: Constraints, n: int) -> None:
    """Raise ValueError unless ``constraints`` is ``None`` or one entry per prompt (``n``)."""
    if constraints is not None and len(constraints) != n:
        raise ValueError(f"generate: {len(constraints)} constraints for {n} prompts (one per prompt, or None)")


def _generate_fast(model, prompts, params, stop_ids, generator, on_token=None, constraints=None) -> list[Sample]:
    fast = _FastLlama(model)
    dev = fast.device
    n = len(prompts)
    # Prefill each distinct prompt once, then copy its cache row to its duplicates.
    uniq: dict[tuple[int, ...], int] = {}
    src = [uniq.setdefault(tuple(p), len(uniq)) for p in prompts]
    uprompts = [list(k) for k in uniq]
    ids_u, valid_u = _left_pad(uprompts, dev)
    U, L = ids_u.shape
    total = L + params.max_new_tokens
    fast.alloc(U, total)
    pos_u = (valid_u.long().cumsum(-1) - 1).clamp_min(0)
    key_valid_u = torch.zeros(U, total, dtype=torch.bool, device=dev)
    key_valid_u[:, :L] = valid_u
    # Prefill in chunks of ~PREFILL_CHUNK_TOKENS tokens: same math, but the activations
    # stay in cache (measured 1.5x faster than one [U, L] pass on a 2-core CPU).
    step_rows = max(1, PREFILL_CHUNK_TOKENS // L)
    chunks = []
    for r0 in range(0, U, step_rows):
        r = slice(r0, min(U, r0 + step_rows))
        chunks.append(fast.forward(ids_u[r], pos_u[r], 0, key_valid_u[r], rows=r))
    logits = torch.cat(chunks, 0)
    rows = torch.tensor(src, dtype=torch.long, device=dev)
    if U != n or src != list(range(n)):
        fast.select_rows(rows)
        logits = logits.index_select(0, rows)
    key_valid = key_valid_u.index_select(0, rows)
    next_pos = pos_u[:, -1].index_select(0, rows) + 1  # [B]

    return decode(
        fast, logits, key_valid, next_pos, L, n, params, stop_ids, generator, on_token=on_token, constraints=constraints
    )


def decode(
    fast: _FastLlama,
    logits: torch.Tensor,
    key_valid: torch.Tensor,
    next_pos: torch.Tensor,
    L: int,
    n: int,
    params: SamplingParams,
    stop_ids,
    generator,
    on_leave=None,
    on_token: OnToken | None = None,
    constraints: Constraints = None,
) -> list[Sample]:
    """The decode loop after a prefill: sample, append, drop finished rows, feed the tokens back.

    Args:
        fast: the forward pass whose cache holds the n prefilled rows (prompt ends at slot L).
        logits: [n, V] next-token logits of the prefill; key_valid: [n, L + max_new] bool;
            next_pos: [n] long RoPE position of the first sampled token.
        generator: one for the batch or one per original row (``Generators``); a row keeps
            its own stream when finished rows leave the batch.
        on_leave: ``on_leave(b, i, output_ids)`` is called for every row just before it
            leaves the batch (batch row b of the cache, original index i), e.g. to keep its
            K/V (``prefix_cache``).
        on_token: ``on_token(i, token_id, logprob)`` for each token kept for original row
            ``i``, as it is sampled (``generate``).
        constraints: one grammar state per original row, or ``None`` (``generate``).

    Returns:
        one ``Sample`` per row, in the original order.
    """
    dev = fast.device
    out_ids: list[list[int]] = [[] for _ in range(n)]
    out_lp: list[list[float]] = [[] for _ in range(n)]
    out_keep: list[list[list[int]] | None] = [None] * n
    out_top: list[list[list[tuple[int, float]]]] | None = [[] for _ in range(n)] if params.top_logprobs > 0 else None
    reason = ["length"] * n
    active = list(range(n))  # batch row -> original index
    done_in_batch = [False] * n
    for step in range(params.max_new_tokens):
        allowed = _allowed(constraints, active, done_in_batch, logits.shape[-1], dev)
        tok, lp, keep, top = _pick(logits, params, _rows(generator, active, done_in_batch), allowed)
        # one device-to-host copy per step for ids and log-probs (float64 holds both exactly)
        tok_lp = torch.stack((tok.to(torch.float64), lp.to(torch.float64))).tolist()
        tok_l, lp_l = [int(t) for t in tok_lp[0]], tok_lp[1]
        _advance(constraints, active, done_in_batch, tok_l)
        hit = [t in stop_ids for t in tok_l]
        for b, i in enumerate(active):
            if done_in_batch[b]:
                continue
            out_ids[i].append(tok_l[b])
            out_lp[i].append(lp_l[b])
            _keep_support(out_keep, i, keep, b)
            if top is not None and out_top is not None:
                out_top[i].append(top[b])
            if on_token is not None:
                on_token(i, tok_l[b], lp_l[b])
            if hit[b]:
                reason[i] = "stop"
                done_in_batch[b] = True
        if step == params.max_new_tokens - 1:
            break
        n_done = sum(done_in_batch)
        if n_done == len(active):
            break
        if n_done and n_done * 8 >= len(active):  # drop finished rows from batch + cache
            if on_leave is not None:
                for b, i in enumerate(active):
                    if done_in_batch[b]:
                        on_leave(b, i, out_ids[i])
            alive = [b for b, d in enumerate(done_in_batch) if not d]
            keep_d = torch.tensor(alive, dtype=torch.long, device=dev)
            fast.select_rows(keep_d)
            key_valid = key_valid.index_select(0, keep_d)
            next_pos = next_pos.index_select(0, keep_d)
            tok = tok.index_select(0, keep_d)
            active = [active[b] for b in alive]
            done_in_batch = [False] * len(active)
        slot = L + step
        key_valid[:, slot] = True
        logits = fast.forward(tok[:, None], next_pos[:, None], slot, key_valid)
        next_pos = next_pos + 1
    if on_leave is not None:
        for b, i in enumerate(active):
            on_leave(b, i, out_ids[i])
    return _samples(out_ids, out_lp, reason, out_keep, out_top, constraints)


def _keep_support(out_keep: list[list[list[int]] | None], i: int, keep: list[list[int] | None] | None, b: int) -> None:
    """Append batch row ``b``'s support (if it has one) to original row ``i``'s supports."""
    if keep is not None and keep[b] is not None:
        row = out_keep[i]
        if row is None:
            row = out_keep[i] = []
        row.append(keep[b])  # type: ignore[arg-type]  # checked just above


def _samples(out_ids, out_lp, reason, out_keep, out_top=None, constraints: Constraints = None) -> list[Sample]:
    return [
        Sample(
            out_ids[i],
            out_lp[i],
            reason[i],
            out_keep[i],
            None if out_top is None else out_top[i],
            constraints is not None and constraints[i] is not None,
        )
        for i in range(len(out_ids))
    ]


def _generate_hf(model, prompts, params, stop_ids, generator, on_token=None, constraints=None) -> list[Sample]:
    """Reference path: HF forward with ``past_key_values`` (left-padded, no row dropping)."""
    dev = next(model.parameters()).device
    n = len(prompts)
    ids, valid = _left_pad(prompts, dev)
    mask = valid.long()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    # transformers >= 5.2x names the KV cache ``cache``; older versions ``past_key_values``.
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    past = getattr(out, key)
    logits = out.logits[:, -1]
    next_pos = pos[:, -1] + 1
    out_ids: list[list[int]] = [[] for _ in range(n)]
    out_lp: list[list[float]] = [[] for _ in range(n)]
    out_keep: list[list[list[int]] | None] = [None] * n
    out_top: list[list[list[tuple[int, float]]]] | None = [[] for _ in range(n)] if params.top_logprobs > 0 else None
    reason = ["length"] * n
    done = [False] * n
    rows = list(range(n))
    for step in range(params.max_new_tokens):
        allowed = _allowed(constraints, rows, done, logits.shape[-1], dev)
        tok, lp, keep, top = _pick(logits, params, _rows(generator, rows, done), allowed)
        _advance(constraints, rows, done, tok.tolist())
        for i, (t, t_lp) in enumerate(zip(tok.tolist(), lp.tolist())):
            if done[i]:
                continue
            out_ids[i].append(t)
            out_lp[i].append(t_lp)
            _keep_support(out_keep, i, keep, i)
            if top is not None and out_top is not None:
                out_top[i].append(top[i])
            if on_token is not None:
                on_token(i, t, t_lp)
            if t in stop_ids:
                reason[i], done[i] = "stop", True
        if all(done) or step == params.max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(n, 1, dtype=mask.dtype, device=dev)], 1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            use_cache=True,
            **{key: past},
        )
        past = getattr(out, key)
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    return _samples(out_ids, out_lp, reason, out_keep, out_top, constraints)
