"""A training run whose rollout worker samples with vLLM (docs/vllm.md, docs/async.md).

Runs only where vLLM and Ray import (`.venv-vllm`, built by `.ci/vllm_env.sh`; `.ci/run`
runs this file there); skipped in the main environment.
"""

import importlib.util
import json
import math

import pytest
import torch
from rich.console import Console

from consequence.config import TrainConfig
from consequence.distill.warmstart import BUNDLED
from consequence.loop.train import train
from consequence.policy.logprobs import token_logprobs_unchunked
from consequence.policy.tiny import load_policy
from consequence.records import read_trajectories, trajectory_to_rows

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("ray") is None,
    reason="needs vllm and ray: build .venv-vllm with `make vllm-env` (docs/vllm.md)",
)


def test_a_vllm_rollout_worker_trains_like_our_sampler(tmp_path):
    """k = 0, one worker: batch 1 is sampled after version 1 was loaded into the engine, so
    the trainer's recomputation checks both the engine's log-probs and its weight update."""
    run = tmp_path / "run"
    train(
        TrainConfig(
            model=str(BUNDLED),
            run_dir=str(run),
            iterations=2,
            tasks_per_iteration=2,
            group_size=2,
            eval_every=0,
            max_turns=2,
            max_new_tokens=16,
            final_eval_episodes=0,
            learning_rate=1e-2,
            entropy_coef=0.05,  # a gradient whatever the rewards: version 1 differs from version 0
            rollout_workers=1,
            rollout_engine="vllm",
        ),
        Console(quiet=True),
    )
    manifest = json.loads((run / "manifest.json").read_text())
    checks = {c["name"]: c for c in manifest["checks"]["results"]}
    assert checks["ratio"]["passed"] is True  # vLLM's log-probs, recomputed by the trainer, within 1e-3
    assert manifest["rollout_workers"][0]["where"][0]["engine"] == "vllm"
    ms = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for it, m in enumerate(ms):
        assert m["batch"] == m["sampled_version"] == it and m["lag_max"] == 0
        # the engine and the trainer agree to fp32 rounding (measured max |Δ log p| ≈ 3e-5)
        assert m["sampler_trainer_kl"] < 1e-7 and 0.999 < m["is_ratio_min"] <= m["is_ratio_max"] < 1.001
        trajs = read_trajectories(run / "trajectories" / f"iter_{it:04d}.parquet")
        assert {t.policy_version for t in trajs} == {it} and sum(t.n_generated_tokens for t in trajs) > 0
    assert ms[0]["optimizer_steps_taken"] == 1  # so version 1 differs from version 0
    # batch 1 was sampled by version 1, not by the engine's first weights: under version 0 its
    # tokens' log-probs are far from what the engine reported, under version 1 (the trainer's
    # recomputation, is_ratio above) within rounding
    model, _ = load_policy(BUNDLED)
    worst = 0.0
    for t in read_trajectories(run / "trajectories" / "iter_0001.parquet"):
        for r in trajectory_to_rows(t):
            ids = torch.tensor([r.input_ids])
            with torch.no_grad():
                lp, _ = token_logprobs_unchunked(model, ids, torch.ones_like(ids), 1.0)
            mask = torch.tensor(r.loss_mask[1:], dtype=torch.bool)
            worst = max(worst, float((lp[0][mask] - torch.tensor(r.old_logprobs[1:])[mask]).abs().max()))
    assert worst > 1e-2 > math.log(ms[1]["is_ratio_max"])
