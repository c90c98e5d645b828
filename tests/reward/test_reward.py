import math

import pytest

from consequence.reward.scoring import RewardResult, checked_reward


def test_scalar_ok():
    r = checked_reward(lambda: 0.75)
    assert r == RewardResult(0.75, {}, None)


def test_components_summed():
    r = checked_reward(lambda: {"correct": 0.5, "format": 0.25}, low=0.0, high=1.0)
    assert r.value == 0.75 and r.error is None
    assert r.components == {"correct": 0.5, "format": 0.25}


def test_case11_nan():
    r = checked_reward(lambda: float("nan"))
    assert r.value is None and "nan" in r.error


def test_case11_exception():
    def boom():
        raise RuntimeError("verifier crashed")

    r = checked_reward(boom)
    assert r.value is None
    assert "RuntimeError" in r.error and "verifier crashed" in r.error


def test_case11_out_of_range():
    r = checked_reward(lambda: 1.5, low=0.0, high=1.0)
    assert r.value is None and "1.5" in r.error
    # negative control: the same value inside a wider declared range is accepted
    assert checked_reward(lambda: 1.5, low=0.0, high=2.0).value == 1.5


def test_inf_and_bad_components_and_types():
    assert checked_reward(lambda: math.inf).value is None
    r = checked_reward(lambda: {"a": 0.5, "b": float("nan")})
    assert r.value is None and "'b'" in r.error
    r = checked_reward(lambda: {"a": 0.7, "b": 0.7})
    assert r.value is None and "1.4" in r.error
    r = checked_reward(lambda: "1.0")
    assert r.value is None and "str" in r.error
    assert checked_reward(lambda: None).value is None
    assert checked_reward(lambda: {}).value is None


def test_boundaries_inclusive():
    assert checked_reward(lambda: 0.0).value == 0.0
    assert checked_reward(lambda: 1).value == 1.0
    assert checked_reward(lambda: -1.0, low=-1.0, high=1.0).value == -1.0


def test_bad_range():
    with pytest.raises(ValueError):
        checked_reward(lambda: 0.0, low=1.0, high=0.0)
