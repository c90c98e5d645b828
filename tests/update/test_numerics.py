"""Numerics (issue 6): a NaN / ±inf log-prob, ratio, advantage, loss or gradient stops the
step with a message naming the tensor and the trajectories; the last resume state stays."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from rich.console import Console

import consequence.loop.learner as learner_module
from consequence.config import TrainConfig
from consequence.loop.learner import Batch, make_learner, update
from consequence.policy.logprobs import token_logprobs
from consequence.records import TrainingRow, Trajectory
from consequence.update.step import NonFiniteError
from reward_signal import ODD_SAMPLES_WIN

MARK = 7  # first token of the row that the injected faults hit


@pytest.fixture()
def setup(tiny_tokenizer):
    from consequence.policy.tiny import build_model

    model = build_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    cfg = TrainConfig(micro_batch_size=1)  # one row per micro-batch: a loss or gradient names one row
    learner = make_learner(cfg, model)
    trajs = [Trajectory(f"task{k}", f"3/task{k}", s, seed=0, policy_version=3) for k in range(2) for s in range(2)]
    rows = []
    for i in range(len(trajs)):
        ids = [MARK if i == 2 else 5, 40 + i, 41, 42, 43]
        with torch.no_grad():
            lp, _ = token_logprobs(model, torch.tensor([ids]), torch.ones(1, 5, dtype=torch.long))
        old = [0.0, 0.0, *lp[0, 1:].tolist()]
        rows.append(TrainingRow(ids, [0, 0, 1, 1, 1], old, traj_index=i))
    batch = Batch(rows, [1.0, -1.0, 1.0, -1.0], [list(r.old_logprobs) for r in rows], trajectories=trajs)
    return cfg, learner, batch


def _poisoned(kind: str):
    """A logprob_fn like the trainer's, with a fault in the rows that start with MARK."""

    def fn(model, input_ids, attention_mask, temperature=1.0):
        lp, ent = token_logprobs(model, input_ids, attention_mask, temperature, with_entropy=True)
        hit = (input_ids[:, 0] == MARK)[:, None]
        if kind == "logprobs":
            lp = torch.where(hit, torch.full_like(lp, math.nan), lp)
        elif kind == "gradient" and hit.any():  # finite forward, NaN backward: d sqrt(x)/dx at 0
            lp = lp + 0.0 * torch.sqrt(lp - lp)
        return lp, ent

    return fn


@pytest.mark.parametrize("kind", ["advantage", "ratio", "logprobs", "loss", "gradient"])
def test_nonfinite_tensor_names_itself_and_the_trajectory(setup, monkeypatch, kind):
    cfg, learner, batch = setup
    if kind == "advantage":
        batch.advantages[2] = math.nan
    elif kind == "ratio":
        batch.rows[2].old_logprobs[3] = -math.inf  # exp(logπ − logπ_old) = inf
    elif kind == "loss":
        batch.advantages[2] = 3e38  # finite, but the row's sum of ratio·A overflows float32
    else:
        monkeypatch.setattr(learner_module, "logprob_fn", lambda cfg: _poisoned(kind))
    before = [p.detach().clone() for p in learner.model.parameters()]
    with pytest.raises(NonFiniteError) as e:
        update(batch, cfg, learner, pad_id=0, seed=0)
    msg = str(e.value)
    assert msg.startswith(f"{kind} is not finite in row(s) [2]"), msg
    assert "task task1 group 3/task1 sample 0 (trajectory 2)" in msg and "task0" not in msg, msg
    assert "optimizer step 1 not taken" in msg
    assert isinstance(e.value, FloatingPointError) and e.value.rows == [2]
    assert all(torch.equal(a, p) for a, p in zip(before, learner.model.parameters()))
    assert all(p.grad is None for p in learner.model.parameters())


@pytest.mark.slow
def test_nan_in_a_run_stops_it_and_keeps_the_last_state(tmp_path, monkeypatch):
    from consequence.distill.warmstart import BUNDLED
    from consequence.loop.resume import latest_state
    from consequence.loop.sources import Rollouts
    from consequence.loop.train import RunStopped, train

    now, sha = {"it": 0}, {}
    real_next_batch = Rollouts.next_batch

    def tracking(self, it, *args, **kwargs):
        now["it"] = it
        if it == 1:  # the state of iteration 0 as it was written
            sha["state"] = hashlib.sha256(
                (run / "checkpoints/state-0001/policy/model.safetensors").read_bytes()
            ).hexdigest()
        return real_next_batch(self, it, *args, **kwargs)

    def fn(model, input_ids, attention_mask, temperature=1.0, **kw):
        lp, ent = token_logprobs(model, input_ids, attention_mask, temperature, **kw)
        if now["it"] == 1 and torch.is_grad_enabled():
            lp = torch.cat([torch.full_like(lp[:1], math.nan), lp[1:]])
        return lp, ent

    monkeypatch.setattr(Rollouts, "next_batch", tracking)
    monkeypatch.setattr(learner_module, "logprob_fn", lambda cfg: fn)
    run = tmp_path / "run"
    cfg = TrainConfig(
        run_dir=str(run),
        model=str(BUNDLED),
        env=ODD_SAMPLES_WIN,  # every group mixed, so no row is skipped for a zero advantage
        iterations=3,
        tasks_per_iteration=2,
        group_size=2,
        eval_every=0,
        final_eval_episodes=0,
        skip_checks=True,
        max_turns=3,
        max_new_tokens=24,
    )
    with pytest.raises(RunStopped) as e:
        train(cfg, Console(quiet=True))
    msg = str(e.value)
    assert (
        "stopped in iteration 1 (trajectory numbers index trajectories/iter_0001.parquet): logprobs is not finite in row(s)"
        in msg
        and "group 1/" in msg
        and "sample " in msg
    ), msg
    assert "state-0001 (after iteration 0) is intact" in msg and f"--resume {run}" in msg
    state = latest_state(run)
    assert state.iteration == 1 and not (run / "checkpoints" / "state-0002").exists()
    got = hashlib.sha256((state.path / "policy" / "model.safetensors").read_bytes()).hexdigest()
    assert got == sha["state"]
