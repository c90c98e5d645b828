import collections
import random

import torch

from consequence.distill.sft import bucketed_batches as _bucketed_batches
from consequence.distill.teacher import TeacherHabits, plan_episode
from consequence.envs.repair.problems import load_split, make_tasks


def _tasks(n=400):
    return make_tasks(load_split(0)["train"], n, seed=7)


def test_every_plan_ends_with_the_fix_then_finish():
    rng = random.Random(0)
    for t in _tasks(200):
        plan = plan_episode(t, rng)
        assert plan[-1] == ("finish", {})
        last_patch = [a for n, a in plan if n == "replace_line"][-1]
        assert (last_patch["line"], last_patch["code"]) == t.patch
        # a wrong first patch is on the fixed line, so the fix overwrites it
        assert all(a["line"] == t.patch[0] for n, a in plan if n == "replace_line")


def test_habit_mix_matches_the_configured_probabilities():
    rng = random.Random(1)
    habits = TeacherHabits(p_diagnose_first=0.5, p_read_only=0.3, p_wrong_patch_first=0.25, p_verify_before_finish=0.5)
    first = collections.Counter(plan_episode(t, rng, habits)[0][0] for t in _tasks(400))
    # 400 draws: expected 200 / 120 / 80, binomial sd ≤ 10
    assert abs(first["run_tests"] - 200) < 40
    assert abs(first["read_code"] - 120) < 35
    assert abs(first["replace_line"] - 80) < 30


def test_bucketed_batches_cover_each_row_once_per_epoch_with_similar_lengths():
    lengths = [random.Random(i).randint(50, 500) for i in range(1000)]
    batches = _bucketed_batches(lengths, 32, torch.Generator().manual_seed(0))
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(1000))
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 100  # random batches would spread ~420 tokens


def test_bundled_checkpoint_is_the_default_warm_start():
    # `consequence train` with defaults must use the shipped checkpoint, never rebuild it.
    from consequence.config import TrainConfig
    from consequence.distill.warmstart import BUNDLED, WarmstartConfig, _built_with

    d = TrainConfig()
    cfg = WarmstartConfig(seed=d.split_seed, n_demos=d.warmstart_demos, sft_epochs=d.warmstart_epochs)
    assert cfg == WarmstartConfig()
    assert _built_with(BUNDLED, cfg), "rebuild the bundle: consequence warmstart --bundle"
