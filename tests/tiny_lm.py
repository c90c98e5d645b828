"""A toy causal LM and training rows built from it, for the update box's tests (shared by the
tests of the update, the pre-step checks, the masked-position properties and the async loop)."""

from types import SimpleNamespace

import torch

from consequence.records import TrainingRow
from consequence.update.step import accumulate_gradients

V = 11
PAD = 0


class TinyLM(torch.nn.Module):
    """Embedding + causal running mean + linear head: a position-dependent toy LM."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(V, 8)
        self.head = torch.nn.Linear(8, V)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        pos = torch.arange(1, input_ids.shape[1] + 1, dtype=h.dtype).unsqueeze(-1)
        h = torch.tanh(h.cumsum(dim=1) / pos)
        return SimpleNamespace(logits=self.head(h))


def ref_logprobs(model, input_ids, attention_mask, temperature=1.0):
    """Local reference of policy.logprobs.token_logprobs: [N, S-1] log-probs and entropy."""
    logits = model(input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def make_rows(model, lengths, n_prompt=2, seed=0, perturb=0.0, temperature=1.0):
    """Rows with n_prompt context tokens then targets; old_logprobs from the model (+noise)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, L in enumerate(lengths):
        ids = torch.randint(1, V, (n_prompt + L,), generator=g)
        with torch.no_grad():
            lp, _ = ref_logprobs(model, ids[None], torch.ones(1, len(ids), dtype=torch.long), temperature)
        old = torch.cat([torch.zeros(1), lp[0]])
        old = old + perturb * torch.randn(len(ids), generator=g)
        mask = [0] * n_prompt + [1] * L
        old = [float(o) if m else 0.0 for o, m in zip(old, mask)]
        rows.append(TrainingRow(ids.tolist(), mask, old, traj_index=i))
    return rows


def grads_of(model, rows, adv, cfg):
    model.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(model, rows, adv, cfg, PAD, ref_logprobs)
    g = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return g, metrics
