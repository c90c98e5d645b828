"""--env-option split_by=family: validation and test families are never seen in training (issue 32)."""

from __future__ import annotations

import pytest

from consequence.config import TrainConfig
from consequence.envs.registry import env_of, load_environment


def _families(env) -> dict[str, set[str]]:
    return {split: {p.family for p in env.split[split]} for split in ("train", "validation", "test")}


def test_families_are_disjoint_across_splits_and_every_problem_is_kept():
    by_problem = load_environment("repair", 0)
    by_family = env_of(TrainConfig(env_options={"split_by": "family"}))
    fam = _families(by_family)
    assert [len(fam[s]) for s in ("train", "validation", "test")] == [15, 3, 3]  # of 21 families
    assert not (fam["train"] & fam["validation"]) and not (fam["train"] & fam["test"])
    assert not (fam["validation"] & fam["test"])
    assert sorted(p.problem_id for s in by_family.split.values() for p in s) == sorted(
        p.problem_id for s in by_problem.split.values() for p in s
    )
    # the default split shares families: every test family also appears in training
    assert _families(by_problem)["test"] <= _families(by_problem)["train"]
    # seeded: another split seed draws other test families; the same seed the same ones
    assert _families(load_environment("repair", 1, {"split_by": "family"}))["test"] != fam["test"]
    assert _families(load_environment("repair", 0, {"split_by": "family"})) == fam


def test_other_values_and_environments_without_families_are_refused():
    with pytest.raises(ValueError, match="split_by=task: give problem or family"):
        load_environment("repair", 0, {"split_by": "task"})
    with pytest.raises(ValueError, match="split_by"):
        load_environment("humaneval-repair", 0, {"split_by": "family"})
