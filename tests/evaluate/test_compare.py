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
    s = summarize(
        [_t("p#0", 0), _t("p#0", 1, "truncated", None), _t("p#0", 2, score=0.0), _t("p#0", 3, "env_error", None)]
    )
    # success over the 3 episodes whose environment did not fail; outcome shares over all 4
    assert s["success"] == pytest.approx(1 / 3) and s["truncated"] == 0.25 and s["env_error"] == 0.25


def test_success_is_none_not_zero_when_every_environment_failed():
    """Two env errors measured nothing: success is undefined (None), not 0.0; the shares still count them."""
    s = summarize([_t("p#0", 0, "env_error", None), _t("p#0", 1, "env_error", None)])
    assert s["success"] is None and s["env_error"] == 1.0 and s["episodes"] == 2
    assert summarize([])["success"] is None


def test_reward_box_scores_verifier_and_keeps_env_errors_out():
    ts = [
        _t("p#0", 0),
        _t("p#0", 1, "truncated", None),
        _t("p#0", 2, "env_error", None),
        _t("p#0", 3, score=float("nan")),
    ]
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


def test_a_constant_answer_policy_is_flagged_in_the_final_report():
    """The SmolLM2 letter-counting run: the RL arm answered '1' to all 300 test problems (57 %
    of their answers are 1), the warm start to 91 %: the gain is a base rate, and the
    report must say so. Repair programs (all different) never trigger it."""
    from consequence.evaluate.compare import constant_answer_warning

    def arm(answers, solved):
        return [
            Trajectory(f"p{i}#0", f"p{i}#0", 0, 0, 0, outcome="finished", verifier_score=float(s), final_code=a)
            for i, (a, s) in enumerate(zip(answers, solved))
        ]

    warm = summarize(arm(["1"] * 18 + ["2", "3"], [1] * 10 + [0] * 10))
    rl = summarize(arm(["1"] * 20, [1] * 12 + [0] * 8))
    assert rl["top_answer"] == "1" and rl["top_answer_share"] == 1.0 and warm["top_answer_share"] == 0.9
    w = constant_answer_warning("test", "greedy", warm, rl)
    assert w.startswith(
        "test, greedy: the RL policy gave the same final answer '1' in 100% of its answered episodes "
        "(warm start: 90%; 20 of 20 episodes answered)"
    )
    assert constant_answer_warning("test", "greedy", rl, rl) is None  # no more concentrated than before
    programs = summarize(arm([f"def f(): return {i}" for i in range(20)], [1] * 20))
    assert programs["top_answer_share"] == 0.05 and constant_answer_warning("test", "greedy", warm, programs) is None
    few = summarize(arm(["1"] * 5, [1] * 5))
    assert constant_answer_warning("test", "greedy", warm, few) is None  # under 20 episodes: no claim


def test_answers_copied_from_the_question_are_flagged():
    """The SmolLM2 word-sorting run: RL learned to repeat the words in the order given (70 % of
    its greedy test answers), which wins on the inputs that are already sorted; the success
    of the answers that are not copies stayed at 2.0 %. Built here by hand: 20 questions, 5 of
    them already sorted."""
    from consequence.envs.api import answer_in_text
    from consequence.evaluate.compare import copied_answer_warning, request_text
    from consequence.records import ModelCall

    def ep(i, words, answer, ok):
        msgs = [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "Sort: b, a"},
            {"role": "assistant", "content": "<answer>a, b</answer>"},  # a worked example
            {"role": "user", "content": f"Sort these words: {words}\n"},
            {"role": "assistant", "content": f"<answer>{answer}</answer>"},
            {"role": "user", "content": "accuracy"},
        ]
        return Trajectory(
            f"p{i}#0",
            f"p{i}#0",
            0,
            0,
            0,
            calls=[ModelCall([1], [2], [0.0], "stop")],
            outcome="finished",
            verifier_score=float(ok),
            final_code=answer,
            messages=msgs,
        )

    given = [("a, b, c" if i < 5 else "c, a, b") for i in range(20)]
    rl = summarize([ep(i, w, w, i < 5) for i, w in enumerate(given)])  # copies: right on the 5 sorted ones
    warm = summarize([ep(i, w, "b, c, a", i == 7) for i, w in enumerate(given)])  # one real win
    assert request_text(ep(0, "x, y, z", "x", 0)) == "Sort these words: x, y, z\n"  # not the worked example
    assert (rl["success"], rl["copied_answer_share"], rl["success_not_copied"]) == (0.25, 1.0, 0.0)
    assert (warm["copied_answer_share"], warm["success_not_copied"]) == (0.0, 0.05)
    w = copied_answer_warning("test", "greedy", warm, rl)
    assert (
        w.startswith(
            "test, greedy: the RL policy's final answer is text copied from the question in 100% of "
            "its episodes (warm start: 0%)"
        )
        and "5.0 % → 0.0 %" in w
    )
    assert copied_answer_warning("test", "greedy", rl, rl) is None  # not more than before
    assert not answer_in_text("1", "count the letters of word_1 in 1 second")  # short answers: not counted
    assert not answer_in_text("cat", "concatenate") and answer_in_text("cat", "the cat sat")  # whole words only


def test_distinct_correct_answers_per_solved_task_by_hand():
    """Task a: 3 solved with 2 distinct answers (trailing spaces ignored), 1 failed; task b: 1
    solved; task c: none solved (not counted); an env_error never counts."""
    from consequence.evaluate.episode_eval import distinct_correct

    def t(task, sample, score, code, outcome="finished"):
        return Trajectory(task, task, sample, 0, 0, outcome=outcome, verifier_score=score, final_code=code)

    trajs = [
        t("a#0", 0, 1.0, "x = 1\n"),
        t("a#0", 1, 1.0, "x = 1   \n"),
        t("a#0", 2, 1.0, "x = 2"),
        t("a#0", 3, 0.0, "x = 3"),
        t("b#0", 0, 1.0, "y"),
        t("c#0", 0, 0.0, "z"),
        t("b#0", 1, None, "w", outcome="env_error"),
    ]
    got = distinct_correct(trajs)
    assert got == {"tasks_solved": 2.0, "distinct_correct_mean": (2 + 1) / 2, "distinct_per_solved": 3 / 4}
    assert distinct_correct([t("c#0", 0, 0.0, "z")]) == {
        "tasks_solved": 0.0,
        "distinct_correct_mean": 0.0,
        "distinct_per_solved": 0.0,
    }
