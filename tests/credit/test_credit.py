import math
import warnings

import pytest

from consequence.credit.advantages import ESTIMATORS, group_advantages, mixed_group_fraction

S3 = math.sqrt(3)


def test_grpo_reference_1001():
    adv = group_advantages([1, 0, 0, 1], ["g"] * 4, "grpo")
    assert adv == pytest.approx([1, -1, -1, 1], abs=1e-5)


def test_grpo_reference_1000():
    adv = group_advantages([1, 0, 0, 0], ["g"] * 4, "grpo")
    assert adv == pytest.approx([S3, -1 / S3, -1 / S3, -1 / S3], abs=1e-5)


def test_grpo_sample_std_option():
    adv = group_advantages([1, 0, 0, 1], ["g"] * 4, "grpo", std_correction=1)
    s = math.sqrt(1 / 3)  # sample std of (1,0,0,1)
    assert adv == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], abs=1e-5)


def test_other_estimators_values():
    r, g = [1.0, 0.0, 0.0, 0.0], ["g"] * 4
    assert group_advantages(r, g, "reinforce") == [1.0, 0.0, 0.0, 0.0]
    assert group_advantages(r, g, "dr_grpo") == pytest.approx([0.75, -0.25, -0.25, -0.25])
    # RLOO: R_i - mean of the other three
    assert group_advantages(r, g, "rloo") == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # batch_mean ignores groups
    assert group_advantages([1, 0, 1, 1], ["a", "a", "b", "b"], "batch_mean") == pytest.approx(
        [0.25, -0.75, 0.25, 0.25]
    )


def test_case02_group_by_task_id_not_position():
    adv = group_advantages([1, 0, 1, 0], ["p1", "p2", "p1", "p2"], "grpo")
    assert adv == [0.0, 0.0, 0.0, 0.0]
    for est in ("rloo", "dr_grpo"):
        assert group_advantages([1, 0, 1, 0], ["p1", "p2", "p1", "p2"], est) == [0.0] * 4


def test_case03_env_error_excluded():
    adv = group_advantages([1, 0, 1, None], ["g"] * 4, "grpo")
    assert adv[3] is None
    m = 2 / 3
    s = math.sqrt(((1 - m) ** 2 * 2 + m**2) / 3)
    assert adv[:3] == pytest.approx([(1 - m) / (s + 1e-6), -m / (s + 1e-6), (1 - m) / (s + 1e-6)])
    # negative control: scoring the crash as 0 gives a different (wrong) baseline of 0.5
    wrong = group_advantages([1, 0, 1, 0], ["g"] * 4, "grpo")
    assert wrong[0] != pytest.approx(adv[0])
    for est in ESTIMATORS:
        assert group_advantages([1, 0, 1, None], ["g"] * 4, est)[3] is None
    assert group_advantages([1, 0, None, 1], ["g"] * 4, "batch_mean")[:2] == pytest.approx([1 / 3, -2 / 3])


def test_case12_single_rollout_group():
    with pytest.warns(UserWarning, match="no comparison"):
        assert group_advantages([1.0], ["g"], "grpo") == [0.0]
    with pytest.warns(UserWarning, match="no comparison"):
        assert group_advantages([1.0], ["g"], "dr_grpo") == [0.0]
    with pytest.raises(ValueError, match="RLOO needs at least 2"):
        group_advantages([1.0], ["g"], "rloo")
    # a group reduced to one valid member by env_errors is the same situation
    with pytest.warns(UserWarning):
        assert group_advantages([1.0, None], ["g", "g"], "grpo") == [0.0, None]


def test_no_warning_for_normal_groups():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group_advantages([1, 0], ["g", "g"], "grpo")


def test_errors():
    with pytest.raises(ValueError, match="reinforce"):
        group_advantages([1.0], ["g"], "ppo")
    with pytest.raises(ValueError, match="not finite"):
        group_advantages([1.0, float("nan")], ["g", "g"])
    with pytest.raises(ValueError, match="not finite"):
        group_advantages([1.0, float("inf")], ["g", "g"], "reinforce")
    with pytest.raises(ValueError):
        group_advantages([1.0, 0.0], ["g"])


def test_mixed_group_fraction():
    r = [1, 0, 1, 1, 0, 0, 1, None]
    g = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert mixed_group_fraction(r, g) == pytest.approx(1 / 4)
    assert mixed_group_fraction([None, None, 1, 0], ["a", "a", "b", "b"]) == 1.0
    assert mixed_group_fraction([], []) == 0.0
