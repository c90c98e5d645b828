"""Training improves something: a small seeded run on the bundled model, through the public
API, raises success on held-out problems with a 95 % CI that excludes 0.

The task is a single-turn dataset with a Python reward function (docs/api.md §1): "the
function F is broken", and the reward is 1 when the reply's first action reads the code
(``read_code``) rather than running the tests or editing at once, the habit of diagnosing
first. The bundled warm start does so in about a third of its samples; the reward alone must
move it. Held-out problems are the test split (other function names, never trained on),
evaluated with sampled decoding against the warm start, paired by problem.

Chosen so that training seeds 0–2 all learn (measured with these settings, 2 cores, beside
another training run): warm start → trained policy on the test split, sampled,
difference [95 % CI]; mean train reward, first → last iteration:

- seed 0: 0.326 → 1.000, +0.674 [+0.604, +0.743]; train reward 0.33 → 1.00
- seed 1: 0.412 → 1.000, +0.588 [+0.496, +0.676]; train reward 0.30 → 0.98
- seed 2: 0.321 → 1.000, +0.679 [+0.630, +0.726]; train reward 0.36 → 1.00

The same numbers with 1 or 2 torch threads. The test alone (``pytest tests/loop/test_learning.py``,
1 torch thread as tests/conftest.py sets): 20 s wall, 16.6 s user+sys CPU beside other work, so
about 17 s on 2 idle cores; the run itself is about 10 s of CPU (6 iterations × 8 problems × 8
samples, then 2 × 128 evaluation episodes). Training is deterministic for a seed on a machine,
so the test runs seed 0 once.

Why not the repair environment (the default): one iteration of the default size takes about
96 s on 2 cores, and the default run needs 18 of them and 400 episodes per split to show
+9 points [+4.9, +13.3] on the test split (README), far over the 2 minutes a test may take.
"""

from __future__ import annotations

import json

import pytest

import consequence as cq

FUNCTIONS = ["add", "merge", "count", "split", "clamp", "rotate", "flatten", "dedupe", "pad", "scale"]


def _read_code_first(prompt, completion, **info):
    return 1.0 if '"name": "read_code"' in completion else 0.0


@pytest.mark.slow
def test_a_short_run_raises_held_out_success_with_a_ci_above_zero(tmp_path):
    data = [{"prompt": f"The function {f}_{i} is broken. Fix it."} for i in range(20) for f in FUNCTIONS]
    config = cq.TrainConfig(
        run_dir=str(tmp_path / "run"),
        seed=0,
        iterations=6,
        tasks_per_iteration=8,
        group_size=8,
        max_turns=1,
        max_new_tokens=32,
        learning_rate=1e-3,
        eval_every=0,
        final_eval_episodes=128,
        final_eval_splits=["test"],
        final_eval_decoding=["sampled"],
    )
    run = cq.train(config, env=data, reward_fn=_read_code_first)
    assert run.status == "finished"
    rewards = [m["reward_mean"] for m in run.metrics]
    assert rewards[-1] > rewards[0] + 0.3  # the training signal itself rose (0.33 → 1.0 for seed 0)
    [result] = json.loads((tmp_path / "run" / "report.json").read_text())["results"]
    assert result["split"].startswith("test") and result["decoding"] == "sampled"
    c = result["comparison"]
    assert 0.2 < c["a_mean"] < 0.5  # the warm start does it sometimes: there was something to learn
    assert c["low"] > 0 and c["b_mean"] > c["a_mean"]  # held-out success rose, CI excludes 0
