"""The trainer's forward with a prefix shared by every row run once (policy box).

Rows of one update micro-batch often start with the same tokens: the system prompt and the
worked examples of a few-shot prompt (SmolLM2 on reasoning-gym with two examples: 207 of
the 225 prompt tokens, the same in all 32 rows of an iteration), and the whole prompt
within a group. A plain forward runs that prefix once per row, in the forward and in the
backward pass. :func:`trunk_hidden` runs it once: the trunk on ``[1, L]`` with a K/V cache,
the cache repeated to the N rows (``Cache.batch_repeat_interleave``), then the trunk on
the ``[N, S-L]`` suffixes attending to it. Autograd flows through the cached keys and
values, so the gradient of every parameter is the sum over the rows, as in the plain
forward; the two agree to float32 rounding (~1e-6), not bit for bit (different kernels
and summation order).

Exactness conditions (checked, else the plain forward runs): a Hugging Face trunk that
returns ``past_key_values`` (not under activation checkpointing, which turns the cache
off), right-padded rows, and a shared prefix of at least ``SHARED_PREFIX_MIN_TOKENS``
tokens that stops one token short of the shortest row (every row keeps a suffix).
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["SHARED_PREFIX_MIN_TOKENS", "shared_prefix_len", "trunk_hidden"]

# A prefix shared by all rows is run once when it is at least this long (the sampler's prompt
# sharing uses the same bound). Shorter prefixes keep the direct path: the tiny model's repair
# prompts share 78 tokens, and its runs stay bit for bit as they were.
SHARED_PREFIX_MIN_TOKENS = 128


def shared_prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Length of the longest prefix shared by every row, at most the shortest row's length − 1.

    Args:
        input_ids: [N, S] long, right-padded.
        attention_mask: [N, S] (1 = real token, 0 = padding).

    Returns:
        L in tokens (0 for fewer than two rows, or rows that are not right-padded).
    """
    N = input_ids.shape[0]
    if N < 2:
        return 0
    lengths = attention_mask.sum(dim=1)
    m = int(lengths.min()) - 1
    if m <= 0 or not bool((attention_mask[:, : m + 1] != 0).all()):
        return 0  # not right-padded in the shared part
    same = (input_ids[:, :m] == input_ids[:1, :m]).all(dim=0)  # [m]
    differ = (~same).nonzero()
    return int(differ[0]) if differ.numel() else m


def trunk_hidden(
    trunk: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    min_shared: int = SHARED_PREFIX_MIN_TOKENS,
    prefix_len: int | None = None,
) -> torch.Tensor:
    """Final hidden states of a Hugging Face decoder trunk, a shared prefix run once.

    Args:
        trunk: the model without its LM head (e.g. ``LlamaForCausalLM.model``), called as
            ``trunk(input_ids=, attention_mask=, past_key_values=, use_cache=)``.
        input_ids: [N, S] long, right-padded.
        attention_mask: [N, S] (1 = real token, 0 = padding).
        min_shared: run the prefix once only when at least this many tokens are shared.
        prefix_len: :func:`shared_prefix_len` of the batch when the caller has it already.

    Returns:
        hidden [N, S, H] (the trunk's dtype), equal to
        ``trunk(input_ids, attention_mask, use_cache=False).last_hidden_state`` to float32
        rounding at every real position; differentiable.
    """
    L = shared_prefix_len(input_ids, attention_mask) if prefix_len is None else prefix_len
    if L < min_shared or getattr(trunk, "gradient_checkpointing", False):
        return trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    N = input_ids.shape[0]
    head = trunk(input_ids=input_ids[:1, :L], attention_mask=attention_mask[:1, :L], use_cache=True)
    cache = getattr(head, "cache", None) or getattr(head, "past_key_values", None)
    if cache is None or not callable(getattr(cache, "batch_repeat_interleave", None)):
        return trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    cache.batch_repeat_interleave(N)  # [1, heads, L, d] -> [N, heads, L, d]; its backward sums the rows
    tail = trunk(
        input_ids=input_ids[:, L:], attention_mask=attention_mask, use_cache=True, **{_cache_kwarg(trunk): cache}
    ).last_hidden_state
    return torch.cat([head.last_hidden_state.expand(N, -1, -1), tail], dim=1)


def _cache_kwarg(trunk: torch.nn.Module) -> str:
    """``cache`` (transformers >= 5.2x) or ``past_key_values`` (older; deprecated since)."""
    return "cache" if "cache" in inspect.signature(trunk.forward).parameters else "past_key_values"
