"""Padding-free packing of a right-padded batch through a decoder trunk (``--packing``).

A micro-batch of N rows padded to S tokens costs the trunk N·S positions in every linear
layer; packed, the N rows' real tokens run as ONE sequence of T = Σ L_i positions. Each row
keeps its own positions (``position_ids`` restart at 0 at each row, so rotary embeddings
see the row as if alone) and attends only to its own earlier tokens: Hugging Face's mask
builder turns position ids that restart into a block-diagonal causal mask when no
attention mask is given (``transformers.masking_utils.find_packed_sequence_indices``,
the eager and SDPA attention paths). The hidden states are scattered back into the padded
``[N, S, H]`` layout, so everything after the trunk (the LM head on the targets, the
processed distribution, the loss and its reductions) is the padded computation, position
for position.

Cost: the linear layers run T instead of N·S positions, but on a CPU SDPA runs the packed
block-diagonal mask densely, T² instead of N·S² attention scores, so packing pays when rows
differ much in length and the micro-batch is small (benchmarks/bench_packing.py measures it;
the update already sorts rows by length, docs/design.md §5).
"""

from __future__ import annotations

import torch

# Attention paths that build their mask from restarting position ids when no mask is given
# (transformers.masking_utils: sdpa_mask / eager_mask / flex with packed_sequence_mask).
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention")


def packing_refusal(model, split: tuple[torch.nn.Module, torch.nn.Module] | None) -> str | None:
    """Why ``model`` cannot be packed (a sentence), or None when it can: it must split into a
    Hugging Face trunk and a plain LM head (``split``, what ``policy.logprobs.lm_head_split``
    returned for it) and use an attention path of :data:`PACKING_ATTENTION`."""
    if split is None:
        return f"{type(model).__name__} is not a plain-head Hugging Face causal LM (its trunk cannot run alone)"
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in PACKING_ATTENTION:
        return (
            f"its attention implementation {impl!r} does not mask packed rows (one of {', '.join(PACKING_ATTENTION)})"
        )
    return None


def packed_positions(lengths: torch.Tensor) -> torch.Tensor:
    """``[T]`` long: 0..L_i−1 for each row i in order (T = Σ L_i).

    Args:
        lengths: [N] long, each row's real tokens (≥ 1).
    """
    starts = torch.cumsum(lengths, 0) - lengths  # [N] offset of each row in the packed sequence
    return torch.arange(int(lengths.sum()), device=lengths.device) - torch.repeat_interleave(starts, lengths)


def packed_hidden(trunk: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Final hidden states of ``trunk`` for every row, computed on the rows packed into one sequence.

    Args:
        trunk: the model without its LM head (e.g. ``LlamaForCausalLM.model``), called as
            ``trunk(input_ids=[1, T], position_ids=[1, T], attention_mask=None, use_cache=False)``.
        input_ids: [N, S] long, right-padded.
        attention_mask: [N, S] (1 = real token, 0 = padding), each row's ones first.

    Returns:
        hidden [N, S, H] (the trunk's dtype): at every real position the row's own hidden
        state, equal to the padded forward's to float rounding (the sums run in another
        order); 0 at padded positions; differentiable.

    Raises:
        ValueError: a row that is not right-padded, or without any real token.
    """
    real = attention_mask.bool()
    lengths = real.sum(1)
    if bool((lengths == 0).any()):
        raise ValueError("packing: a row has no real token; drop empty rows before the forward pass")
    if not bool((real == (torch.arange(real.shape[1], device=real.device) < lengths[:, None])).all()):
        raise ValueError("packing: the batch is not right-padded (a row's real tokens must come first)")
    ids_T = input_ids[real]  # row-major: row 0's tokens, then row 1's, ...
    pos_T = packed_positions(lengths)
    hidden_TH = trunk(
        input_ids=ids_T[None], position_ids=pos_T[None], attention_mask=None, use_cache=False
    ).last_hidden_state[0]
    out = hidden_TH.new_zeros(*input_ids.shape, hidden_TH.shape[-1])
    return out.index_put((real.nonzero(as_tuple=True)), hidden_TH)
