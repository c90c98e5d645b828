"""Distillation as a loss (--distill-loss forward|reverse|jsd, GKD): the update subtracts the
per-token divergence to a frozen teacher; values and gradients against a direct computation."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from rich.console import Console

from consequence.config import TrainConfig
from consequence.policy.tiny import BUNDLED, load_policy, save_policy
from consequence.records import TrainingRow
from consequence.update.divergence import token_divergence
from consequence.update.step import UpdateConfig, accumulate_gradients


def _perturbed(model, scale=0.1, seed=0):
    t = copy.deepcopy(model).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        t.lm_head.weight.add_(scale * torch.randn(t.lm_head.weight.shape, generator=g))
    return t


def _rows():
    # two rows of different lengths; targets are the sampled tokens only (loss_mask 1)
    a = TrainingRow([5, 6, 7, 8, 9], [0, 0, 1, 1, 1], [0.0, 0.0, -1.0, -1.0, -1.0], 0)
    b = TrainingRow([5, 10, 11, 12], [0, 1, 1, 0], [0.0, -1.0, -1.0, 0.0], 1)
    return [a, b]


@pytest.fixture(scope="module")
def student():
    model, _tok = load_policy(BUNDLED)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("kind,beta", [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.5), ("jsd", 0.1)])
def test_loss_and_gradient_equal_the_direct_token_mean_of_the_divergence(student, kind, beta):
    model = copy.deepcopy(student)
    teacher = _perturbed(student)
    rows = _rows()
    cfg = UpdateConfig(
        distill_loss=kind, distill_beta=beta, distill_temperature=2.0, pg_coef=0.0, micro_batch_size=1
    )  # two micro-batches: the step's totals must still hold
    model.zero_grad()
    m = accumulate_gradients(model, rows, [0.0, 0.0], cfg, 0, None, teacher=teacher)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # direct: −Σ_t D_t / (number of targets), one row at a time, autograd
    model.zero_grad()
    total, n_targets = 0.0, sum(sum(r.loss_mask[1:]) for r in rows)
    for r in rows:
        ids = torch.tensor([r.input_ids])
        s_logits = model(input_ids=ids).logits[0, :-1]
        with torch.no_grad():
            t_logits = teacher(input_ids=ids).logits[0, :-1]
        d = token_divergence(s_logits, t_logits, kind, beta, 2.0)
        mask = torch.tensor(r.loss_mask[1:], dtype=torch.bool)
        loss = d[mask].sum() / n_targets
        loss.backward()
        total += float(loss.detach())
    assert m["loss"] == pytest.approx(total, rel=1e-5)
    assert m["distill_divergence"] == pytest.approx(total, rel=1e-5)  # token mean of D = the loss at pg_coef 0
    assert m["n_rows_trained"] == 2.0 and m["rows_skipped_zero_advantage"] == 0.0  # A = 0 rows still train
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(got[n], p.grad, atol=1e-6, rtol=1e-4), n


def test_teacher_equal_to_student_gives_zero_divergence_and_gradient(student):
    model = copy.deepcopy(student)
    cfg = UpdateConfig(distill_loss="jsd", pg_coef=0.0)
    model.zero_grad()
    m = accumulate_gradients(model, _rows(), [0.0, 0.0], cfg, 0, None, teacher=copy.deepcopy(student).eval())
    assert m["distill_divergence"] == pytest.approx(0.0, abs=1e-7)
    assert max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None) < 1e-6


def test_kd_plus_rl_adds_the_weighted_surrogate(student):
    """loss(pg_coef w) = w · loss(surrogate alone) + loss(divergence alone)."""
    teacher = _perturbed(student)
    rows, adv = _rows(), [1.0, -0.5]

    def loss(**kw):
        model = copy.deepcopy(student)
        return accumulate_gradients(
            model, rows, adv, UpdateConfig(**kw), 0, _lp_fn, teacher=teacher if kw.get("distill_loss") else None
        )["loss"]

    rl = loss()
    kd = loss(distill_loss="reverse", pg_coef=0.0)
    both = loss(distill_loss="reverse", pg_coef=0.3)
    assert both == pytest.approx(0.3 * rl + kd, rel=1e-5)


def _lp_fn(model, input_ids, attention_mask, temperature=1.0, **kw):
    from consequence.policy.logprobs import token_logprobs_unchunked

    return token_logprobs_unchunked(model, input_ids, attention_mask, temperature)


def test_a_loss_without_teacher_is_refused(student):
    with pytest.raises(ValueError, match="needs the frozen teacher"):
        accumulate_gradients(copy.deepcopy(student), _rows(), [0.0, 0.0], UpdateConfig(distill_loss="jsd"), 0, None)


@pytest.mark.slow
def test_cli_run_trains_on_the_divergence_and_counts_the_teacher(tmp_path, teacher_dir):
    from consequence.loop.train import train

    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"),
        iterations=2,
        tasks_per_iteration=2,
        group_size=2,
        eval_every=0,
        final_eval_episodes=0,
        max_turns=2,
        max_new_tokens=16,
        distill_loss="jsd",
        distill_beta=0.3,
        teacher=str(teacher_dir),
    )
    train(cfg, Console(quiet=True))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for m in lines:
        assert m["distill_divergence"] > 0
        assert m["teacher_forward_tokens"] > m["distill_targets"] == m["n_tokens"] > 0
        assert m["rows_skipped_zero_advantage"] == 0.0


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"distill_loss": "jsd"}, "needs --teacher"),
        ({"distill_loss": "jsd", "teacher": "T", "advantage": "reverse_kl"}, "give one"),
        ({"distill_beta": 0.2}, "read only by --distill-loss"),
        ({"distill_loss": "forward", "teacher": "T", "distill_beta": 0.2}, "read only by --distill-loss jsd"),
        ({"distill_loss": "jsd", "teacher": "T", "top_p": 0.9}, "--top-k / --top-p"),
    ],
)
def test_settings_that_would_be_dropped_are_refused(kw, match, tmp_path):
    if kw.get("teacher") == "T":
        kw = {**kw, "teacher": str(tmp_path)}
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


@pytest.mark.slow
def test_teacher_vocabulary_and_top_k_are_checked_before_any_work(tmp_path, student):
    from consequence.loop.train import train

    _, tok = load_policy(BUNDLED)
    wide = copy.deepcopy(student)
    wide.resize_token_embeddings(1024)  # the same tokenizer files, a wider output layer
    save_policy(wide, tok, tmp_path / "wide")
    base = dict(
        iterations=1,
        tasks_per_iteration=2,
        group_size=2,
        eval_every=0,
        final_eval_episodes=0,
        max_turns=2,
        max_new_tokens=16,
    )
    for kind in ({"distill_loss": "jsd"}, {"advantage": "reverse_kl"}):
        run = tmp_path / f"run-{len(kind)}-{list(kind.values())[0]}"
        with pytest.raises(ValueError, match="--teacher .* predicts over 1024 token ids, the student over 768"):
            train(TrainConfig(run_dir=str(run), teacher=str(tmp_path / "wide"), **kind, **base), Console(quiet=True))
        assert not run.exists()  # refused before the run folder was made
    run = tmp_path / "topk"
    with pytest.raises(ValueError, match="--distill-top-k 1000 is larger than the vocabulary"):
        train(
            TrainConfig(run_dir=str(run), teacher=str(BUNDLED), distill_loss="jsd", distill_top_k=1000, **base),
            Console(quiet=True),
        )
    assert not run.exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind,beta,top_k", [("jsd", 0.3, 0), ("forward", 0.5, 5), ("reverse", 0.5, 0)])
def test_chunked_forward_equals_the_direct_one_in_values_and_gradients(student, kind, beta, top_k):
    """update/distill_chunks.py against the full-logits path, chunks of 3 target positions."""
    from consequence.records import pad_rows
    from consequence.update.distill_chunks import distill_chunked
    from consequence.update.step import _distill_forward

    teacher = _perturbed(student)
    batch = {k: v for k, v in pad_rows(_rows(), 0).items() if isinstance(v, torch.Tensor)}
    cfg = UpdateConfig(
        distill_loss=kind,
        distill_beta=beta,
        distill_temperature=2.0,
        distill_top_k=top_k,
        temperature=0.7,
        entropy_coef=0.01,
    )
    tmask = batch["loss_mask"][:, 1:] > 0
    outs, grads = [], []
    for chunked in (False, True):
        model = copy.deepcopy(student)
        if chunked:
            lp, ent, div = distill_chunked(
                model,
                teacher,
                batch["input_ids"],
                batch["attention_mask"],
                tmask,
                0.7,
                True,
                kind,
                beta,
                2.0,
                top_k,
                chunk_size=3,
            )  # no shared prefix
        else:
            lp, ent, div = _distill_forward(model, teacher, batch, cfg)
        (lp[tmask].sum() + 0.3 * ent[tmask].sum() - div[tmask].sum()).backward()
        outs.append([x[tmask].detach() for x in (lp, ent, div)])
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-5)
    assert outs[0][2].min() > 0  # a real divergence, not zeros on both sides
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4), n


def test_a_large_vocabulary_takes_the_chunked_path_with_the_same_step(student, monkeypatch):
    """Above AUTO_CHUNK_BYTES the update step runs chunked; loss and gradient are unchanged."""
    import consequence.policy.logprobs as L
    import consequence.update.step as step_module

    teacher = _perturbed(student)
    cfg = UpdateConfig(distill_loss="jsd", pg_coef=0.0, micro_batch_size=2)
    seen, results = [], []
    real = step_module.distill_chunked
    monkeypatch.setattr(step_module, "distill_chunked", lambda *a, **k: seen.append(1) or real(*a, **k))
    for limit in (L.AUTO_CHUNK_BYTES, 0):  # the tiny model's logits are small: 0 forces chunking
        monkeypatch.setattr(L, "AUTO_CHUNK_BYTES", limit)
        model = copy.deepcopy(student)
        m = accumulate_gradients(model, _rows(), [0.0, 0.0], cfg, 0, None, teacher=teacher)
        results.append((m["loss"], torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    assert len(seen) == 1  # only the second run chunked
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6, rtol=1e-4)
