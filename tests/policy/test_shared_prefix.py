"""The trainer runs a prefix shared by every row once (policy/shared_prefix.py): the same
hidden states, log-probs and gradients as the plain forward (float32 rounding), with the
prefix's tokens through the trunk once instead of once per row.

A random small Llama (2 layers); five right-padded rows sharing 150 tokens; full
fine-tuning and a PEFT LoRA adapter; activation checkpointing falls back to the plain path.
"""

from __future__ import annotations

import pytest
import torch

from consequence.policy import logprobs as L
from consequence.policy.shared_prefix import SHARED_PREFIX_MIN_TOKENS, shared_prefix_len, trunk_hidden

V, P, S = 300, 150, 200
LENGTHS = (200, 180, 160, 190, 151)  # the shortest row keeps one token after the prefix


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).float()


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, V, (1, P), generator=g)
    ids = torch.cat([prefix.expand(len(LENGTHS), -1), torch.randint(1, V, (len(LENGTHS), S - P), generator=g)], 1)
    am = torch.ones_like(ids)
    for i, n in enumerate(LENGTHS):
        ids[i, n:], am[i, n:] = 0, 0
    ids[:, P] = torch.arange(1, len(LENGTHS) + 1)  # the rows differ right after the prefix
    return ids, am


def test_shared_prefix_len_by_hand():
    am = torch.ones(3, 6, dtype=torch.long)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 5, 6], [1, 2, 3, 4, 7, 7]])
    assert shared_prefix_len(ids, am) == 3
    same = torch.tensor([[1, 2, 3, 4, 5, 6]] * 2)
    assert shared_prefix_len(same, am[:2]) == 5  # stops one token short: every row keeps a suffix
    short = am[:2].clone()
    short[1, 4:] = 0  # second row has 4 real tokens
    assert shared_prefix_len(same, short) == 3
    assert shared_prefix_len(same[:1], am[:1]) == 0  # one row shares nothing with anyone
    left = am[:2].clone()
    left[1, :2] = 0  # left padding: not the trainer's layout, so no sharing
    assert shared_prefix_len(same, left) == 0
    ids, am = _rows()
    assert shared_prefix_len(ids, am) == P


def _grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)  # the trunk alone leaves the head unused


def _assert_grads_close(got, want):
    assert [g is None for g in got] == [w is None for w in want]
    for g, w in ((g, w) for g, w in zip(got, want) if w is not None):
        scale = float(w.abs().max()) or 1.0
        assert float((g - w).abs().max()) <= 1e-4 * scale


def test_trunk_hidden_equals_the_plain_forward_and_runs_the_prefix_once():
    model = _llama()
    ids, am = _rows()
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    plain = model.model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
    seen.clear()
    shared = trunk_hidden(model.model, ids, am)
    hook.remove()
    assert seen == [(1, P), (len(LENGTHS), S - P)]  # 150 + 5 × 50 tokens instead of 5 × 200
    real = am.bool()
    torch.testing.assert_close(shared[real], plain[real], atol=1e-5, rtol=0)
    w = torch.randn(plain.shape, generator=torch.Generator().manual_seed(1))
    _assert_grads_close(_grads(model, (shared * w)[real].sum()), _grads(model, (plain * w)[real].sum()))


def test_too_short_a_prefix_keeps_the_plain_forward():
    model = _llama()
    ids, am = _rows()
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    trunk_hidden(model.model, ids, am, min_shared=P + 1)
    hook.remove()
    assert seen == [tuple(ids.shape)]
    assert SHARED_PREFIX_MIN_TOKENS > 78  # the tiny model's repair prompts (78 shared) stay on the direct path


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_token_logprobs_with_a_shared_prefix_equal_the_direct_computation(lora):
    """The update's log-probs and entropy, and their gradients (full fine-tuning or the
    LoRA A, B matrices), equal token_logprobs_unchunked (no sharing, whole logits)."""
    model = _llama()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    ids, am = _rows()
    assert L.auto_chunk_size(model, ids, am) == L.DEFAULT_CHUNK_SIZE  # small logits, but a long shared prefix
    want_lp, want_ent = L.token_logprobs_unchunked(model, ids, am, 0.7, with_entropy=True, entropy_grad=True)
    got_lp, got_ent = L.token_logprobs(model, ids, am, 0.7, with_entropy=True, entropy_grad=True)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-5, rtol=0)
    w = torch.randn(want_lp.shape, generator=torch.Generator().manual_seed(3))
    _assert_grads_close(
        _grads(model, (got_lp * w).sum() + got_ent.sum()), _grads(model, (want_lp * w).sum() + want_ent.sum())
    )


def test_activation_checkpointing_falls_back_to_the_plain_forward():
    """Under HF activation checkpointing the trunk returns no cache; the plain forward runs."""
    model = _llama()
    L.enable_gradient_checkpointing(model)
    model.train()
    ids, am = _rows()
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    got = trunk_hidden(model.model, ids, am)
    hook.remove()
    assert seen == [tuple(ids.shape)]
    model.eval()
    want = model.model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
    torch.testing.assert_close(got[am.bool()], want[am.bool()], atol=1e-5, rtol=0)
