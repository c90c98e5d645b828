"""--train-problems N: nested subsets of the train split for scale sweeps (issue 32)."""

from __future__ import annotations

import pytest

from consequence.config import TrainConfig
from consequence.envs.registry import env_of, problem_key


def _ids(tasks) -> list[str]:
    return [problem_key(t) for t in tasks]


def test_subsets_are_nested_and_validation_and_test_stay_fixed():
    full = env_of(TrainConfig())
    sizes = (5, 50, 200, len(full.split["train"]))
    envs = {n: env_of(TrainConfig(train_problems=n)) for n in sizes}
    for small, big in zip(sizes, sizes[1:]):
        a, b = _ids(envs[small].split["train"]), _ids(envs[big].split["train"])
        assert len(a) == small and a == b[:small]  # the first `small` of the same order
    assert sorted(_ids(envs[sizes[-1]].split["train"])) == sorted(_ids(full.split["train"]))  # all of them
    for n in sizes:
        for split in ("validation", "test"):
            assert _ids(envs[n].split[split]) == _ids(full.split[split])
    # training draws only from the subset
    drawn = {t.problem_id for t in envs[5].sample("train", 40, seed=3)}  # instances of the 5 problems
    assert drawn == set(_ids(envs[5].split["train"]))
    # another split seed: another split and another order, still nested
    other = {n: _ids(env_of(TrainConfig(train_problems=n, split_seed=1)).split["train"]) for n in (5, 50)}
    assert other[5] == other[50][:5] and other[5] != _ids(envs[5].split["train"])


def test_more_problems_than_the_split_holds_is_refused():
    n = len(env_of(TrainConfig()).split["train"])
    with pytest.raises(ValueError, match=f"--train-problems {n + 1}: the train split has only {n} problems"):
        env_of(TrainConfig(train_problems=n + 1))
    with pytest.raises(ValueError, match="train_problems"):
        TrainConfig(train_problems=0)
