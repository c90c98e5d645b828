import pytest

from consequence.evaluate.compare import ArmResult, paired_comparison, summarize
from consequence.records import Trajectory
from consequence.reward.scoring import score_trajectories


def _t(task, sample, outcome="finished", score=1.0):
    return Trajectory(task, task, sample, 0, 0, outcome=outcome, verifier_score=score)


def test_env_error_pairs_are_dropped_from_both_arms_and_counted():
    a = ArmResult("a", [_t("p1#0", 0, score=0.0), _t("p2#0", 0, "env_error", None), _t("p3#0", 0, score=0.0)])
    b = ArmResult("b", [_t("p1#0", 0), _t("p2#0", 0), _t("p3#0", 0, score=0.0)])
    c = paired_comparison(a, b)
    assert c["env_errors_excluded"] == 1 and c["episodes"] == 3
    assert c["a_mean"] == 0.0 and c["b_mean"] == 0.5 and c["diff"] == 0.5


def test_unpaired_arms_are_refused():
    with pytest.raises(ValueError, match="same episodes"):
        paired_comparison(ArmResult("a", [_t("p1#0", 0)]), ArmResult("b", [_t("p2#0", 0)]))


def test_truncated_episode_is_not_a_success_and_summary_counts_outcomes():
    s = summarize([_t("p#0", 0), _t("p#0", 1, "truncated", None), _t("p#0", 2, score=0.0), _t("p#0", 3, "env_error", None)])
    # success over the 3 episodes whose environment did not fail; outcome shares over all 4
    assert s["success"] == pytest.approx(1 / 3) and s["truncated"] == 0.25 and s["env_error"] == 0.25


def test_reward_box_scores_verifier_and_keeps_env_errors_out():
    ts = [_t("p#0", 0), _t("p#0", 1, "truncated", None), _t("p#0", 2, "env_error", None),
          _t("p#0", 3, score=float("nan"))]
    score_trajectories(ts)
    assert [t.reward for t in ts] == [1.0, 0.0, None, None]
    assert ts[3].outcome == "env_error" and "nan" in ts[3].error.lower()
    assert ts[0].reward_components == {"hidden_tests": 1.0}


def test_parse_error_fraction_counts_model_calls_not_episodes():
    from consequence.records import ModelCall

    def call(err=None):
        return ModelCall([1], [2], [0.0], "stop", parse_error=err)

    a = Trajectory("p#0", "p#0", 0, 0, 0, calls=[call(), call("no tool call"), call()])
    b = Trajectory("p#0", "p#0", 1, 0, 0, calls=[call("bad JSON")])
    s = summarize([a, b, Trajectory("p#0", "p#0", 2, 0, 0)])
    assert s["parse_error_fraction"] == pytest.approx(2 / 4)  # 2 of the 4 model calls did not parse
    assert summarize([])["parse_error_fraction"] == 0.0
