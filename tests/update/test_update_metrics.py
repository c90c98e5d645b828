"""The update box over several optimizer steps: exactly N mini-batches, and metrics merged
over the steps that trained (never NaN, order-free extremes, batch-level explained variance)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import consequence.loop.learner as learner_module
from consequence.config import TrainConfig
from consequence.credit.value import ValueModel, explained_variance
from consequence.loop.learner import Batch, Learner, _chunks, merge_steps, update
from consequence.policy.logprobs import token_logprobs
from consequence.update.step import UpdateConfig
from tiny_lm import PAD, TinyLM, make_rows


def _learner(model, lr=0.0):
    return Learner(model, torch.optim.SGD(model.parameters(), lr=lr), UpdateConfig(micro_batch_size=4))


def _batch(rows, adv):
    return Batch(rows, adv, [list(r.old_logprobs) for r in rows])


def _record_parts(monkeypatch):
    sizes: list[list[int]] = []
    real = learner_module.ppo_step

    def spy(model, opt, rows, *a, **k):
        sizes[-1].append(len(rows))
        return real(model, opt, rows, *a, **k)

    monkeypatch.setattr(learner_module, "ppo_step", spy)
    return sizes


@pytest.mark.parametrize("n,want", [(5, [4, 3, 3, 3, 3]), (7, [3, 3, 2, 2, 2, 2, 2]), (16, [1] * 16), (1, [16])])
def test_mini_batches_give_exactly_n_steps_of_near_equal_size(monkeypatch, n, want):
    assert [len(p) for p in _chunks(list(range(16)), n)] == want
    sizes = _record_parts(monkeypatch)
    model = TinyLM()
    rows = make_rows(model, [2 + i % 3 for i in range(16)])
    sizes.append([])
    m = update(
        _batch(rows, [1.0 - 2 * (i % 2) for i in range(16)]),
        TrainConfig(mini_batches=n, epochs_per_batch=2),
        _learner(model),
        PAD,
        seed=0,
    )
    assert sizes[-1] == want * 2 and m["n_updates"] == 2 * n == m["optimizer_steps_taken"]


def test_every_row_is_in_exactly_one_part_per_epoch():
    parts = _chunks(list(range(16)), 7)
    assert sorted(i for p in parts for i in p) == list(range(16))
    with pytest.raises(ValueError, match="non-empty"):
        _chunks([0, 1, 2], 4)


def test_fewer_rows_than_mini_batches_is_refused_before_any_step():
    model = TinyLM()
    rows = make_rows(model, [3, 2, 4])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"--mini-batches 4 .* only 3 training row.*Lower --mini-batches to at most 3"):
        update(_batch(rows, [1.0, -1.0, 1.0]), TrainConfig(mini_batches=4), _learner(model, lr=0.1), PAD, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _step(n_tokens, **kw):
    trained = n_tokens > 0
    return {
        "loss": kw.pop("loss", 0.0),
        "n_tokens": float(n_tokens),
        "n_rows": 4.0,
        "n_rows_trained": 4.0 if trained else 0.0,
        "rows_skipped_zero_advantage": 0.0 if trained else 4.0,
        "offpolicy_masked_rows": 0.0,
        "optimizer_stepped": float(trained),
        **kw,
    }


def test_merge_steps_by_hand_skipped_steps_add_only_counts():
    a = _step(
        10, ratio_mean=1.0, ratio_min=0.9, ratio_max=1.1, entropy=2.0, clip_frac_high=0.1, loss=0.5, grad_norm=1.0
    )
    skipped = _step(0)
    b = _step(
        30, ratio_mean=1.2, ratio_min=0.8, ratio_max=1.05, entropy=1.0, clip_frac_high=0.5, loss=0.1, grad_norm=3.0
    )
    m = merge_steps([skipped, a, b])
    assert m["ratio_mean"] == pytest.approx((10 * 1.0 + 30 * 1.2) / 40)  # token-weighted: 1.15
    assert m["entropy"] == pytest.approx(1.25) and m["clip_frac_high"] == pytest.approx(0.4)
    assert (m["ratio_min"], m["ratio_max"]) == (0.8, 1.1)
    assert m["loss"] == pytest.approx(0.3) and m["grad_norm"] == pytest.approx(2.0)  # the skipped 0 left out
    assert (m["first_step_ratio_min"], m["first_step_ratio_max"]) == (0.9, 1.1)  # first step that trained
    assert (m["n_updates"], m["optimizer_steps_taken"], m["optimizer_steps_skipped"]) == (3.0, 2.0, 1.0)
    assert m["n_tokens"] == 40.0 and m["rows_skipped_zero_advantage"] == 4.0 and m["n_rows"] == 12.0
    # extremes do not depend on step order
    r = merge_steps([b, skipped, a])
    assert (r["ratio_min"], r["ratio_max"]) == (0.8, 1.1) and r["first_step_ratio_min"] == 0.8
    # nothing trained: no ratio, entropy or first-step keys at all, and strict JSON
    none = merge_steps([_step(0), _step(0)])
    assert not {"ratio_mean", "ratio_min", "entropy", "first_step_ratio_min", "grad_norm", "loss"} & none.keys()
    json.dumps(none, allow_nan=False)


def test_update_with_skipped_steps_reports_true_token_means_and_strict_json():
    model = TinyLM()
    rows = make_rows(model, [3, 2, 4, 5, 2, 3, 4, 2])
    adv = [1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.5, -0.5]  # four rows of all-equal groups
    m = update(_batch(rows, adv), TrainConfig(mini_batches=8), _learner(model), PAD, seed=0)
    json.dumps(m, allow_nan=False)
    assert (m["n_updates"], m["optimizer_steps_taken"], m["optimizer_steps_skipped"]) == (8.0, 4.0, 4.0)
    live = [rows[i] for i in (0, 1, 6, 7)]
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r.input_ids) for r in live], batch_first=True)
    am = torch.nn.utils.rnn.pad_sequence(
        [torch.ones(len(r.input_ids), dtype=torch.long) for r in live], batch_first=True
    )
    mask = torch.nn.utils.rnn.pad_sequence([torch.tensor(r.loss_mask[1:]) for r in live], batch_first=True) > 0
    with torch.no_grad():
        lp, ent = token_logprobs(model, ids, am, with_entropy=True)
    assert m["n_tokens"] == int(mask.sum()) == 3 + 2 + 4 + 2
    assert m["entropy"] == pytest.approx(float(ent[mask].mean()), abs=1e-5)  # mean over every trained token
    assert 1 - 1e-5 < m["ratio_min"] <= m["ratio_max"] < 1 + 1e-5  # lr 0: on-policy throughout
    assert m["first_step_ratio_min"] == pytest.approx(1.0, abs=1e-5)


def test_value_explained_variance_is_over_the_whole_batch(tiny_tokenizer):
    from consequence.policy.tiny import build_model

    model = build_model(tiny_tokenizer, seed=0)
    rows = make_rows(TinyLM(), [3, 2])  # ids < 11, inside the tiny vocabulary
    # each mini-batch holds one row whose returns are constant (Var 0 within the step)
    returns = [[0.0] * 2 + [1.0] * 3, [0.0] * 2 + [0.0] * 2]
    values = [[0.0] * 2 + [0.75] * 3, [0.0] * 2 + [0.25] * 2]
    # R over the 5 targets (1,1,1,0,0): Var 0.24; R − V (.25,.25,.25,−.25,−.25): Var 0.06 → 1 − 0.06/0.24
    assert explained_variance(rows, returns, values) == pytest.approx(0.75)
    assert explained_variance(rows[:1], returns[:1], values[:1]) is None  # Var(R) = 0: undefined
    critic = ValueModel(model)
    learner = Learner(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        UpdateConfig(),
        critic=critic,
        critic_optimizer=torch.optim.SGD(critic.parameters(), lr=0.0),
    )
    batch = Batch(rows, [1.0, -1.0], [list(r.old_logprobs) for r in rows], returns=returns, old_values=values)
    m = update(batch, TrainConfig(mini_batches=2), learner, PAD, seed=0)
    assert m["value_explained_var"] == pytest.approx(0.75) and m["value_n_tokens"] == 5.0
    assert math.isfinite(m["value_loss"]) and m["value_loss"] > 0
    json.dumps(m, allow_nan=False)
