"""Diagnostics: per-iteration extras and each warning, triggered and not."""

from consequence.loop.diagnostics import iteration_extras, warnings_for
from consequence.records import ModelCall, Trajectory


def _m(**kw):
    base = {
        "reward_mean": 0.3,
        "entropy": 0.1,
        "truncated_fraction": 0.1,
        "first_step_ratio_min": 1.0,
        "first_step_ratio_max": 1.0,
    }
    return {**base, **kw}


def test_no_warning_on_a_healthy_history():
    assert warnings_for([_m(), _m(reward_mean=0.35, val_success=0.3), _m(reward_mean=0.4)]) == []


def test_entropy_collapse():
    (w,) = warnings_for([_m(entropy=0.1), _m(entropy=0.01)])
    assert w.startswith("entropy collapse")


def test_ratio_far_from_one_on_first_step():
    (w,) = warnings_for([_m(first_step_ratio_min=0.97)])
    assert "ratio far from 1" in w


def test_rising_truncation():
    h = [_m(truncated_fraction=0.1), _m(truncated_fraction=0.15), _m(truncated_fraction=0.25)]
    (w,) = warnings_for(h)
    assert "0.10 → 0.25" in w
    assert warnings_for(h[:2]) == []


def test_reward_up_validation_flat_is_flagged():
    h = [
        _m(reward_mean=0.2, val_success=0.40),
        _m(reward_mean=0.3),
        _m(reward_mean=0.35, val_success=0.41),
        _m(reward_mean=0.45, val_success=0.38),
    ]
    (w,) = warnings_for(h)
    assert "possible reward hacking" in w and "0.20 → 0.45" in w


def test_iteration_extras_counts():
    call = ModelCall([1, 2], [3, 4, 9], [0.0] * 3, "stop")
    t1 = Trajectory(
        task_id="a",
        group_id="g",
        sample_id=0,
        seed=0,
        policy_version=0,
        calls=[call],
        reward=1.0,
        tool_histogram={"run_tests": 2},
    )
    t2 = Trajectory(
        task_id="a",
        group_id="g",
        sample_id=1,
        seed=1,
        policy_version=0,
        calls=[call],
        reward=1.0,
        tool_histogram={"run_tests": 1, "finish": 1},
    )
    t3 = Trajectory(task_id="b", group_id="h", sample_id=0, seed=0, policy_version=0, outcome="env_error")
    x = iteration_extras([t1, t2, t3])
    assert x["tool_histogram"] == {"finish": 1, "run_tests": 3}
    assert x["groups_all_equal"] == 1 and x["groups_no_valid"] == 1
    assert x["env_error_rate"] == 1 / 3 and x["gen_tokens_max"] == 3 and x["rows_per_trajectory"] == 1.0


def test_warnings_when_an_iteration_left_metrics_out():
    # iteration 0 trained no row (every group all-equal): no entropy, no first-step ratio
    skipped = {"reward_mean": 0.0, "truncated_fraction": 0.1}
    assert warnings_for([skipped]) == []
    # the entropy baseline is the first iteration that reports one (0.1), so 0.01 is a collapse
    (w,) = warnings_for([skipped, _m(entropy=0.1), _m(entropy=0.01)])
    assert w.startswith("entropy collapse") and "0.1000" in w
    # null / NaN values neither trigger nor crash; the first-step check still fires when present
    assert warnings_for([_m(entropy=None, first_step_ratio_min=None, first_step_ratio_max=None)]) == []
    assert warnings_for([_m(entropy=float("nan"))]) == []
    (w,) = warnings_for([skipped, _m(first_step_ratio_max=1.05)])
    assert "ratio far from 1" in w and "1.0500" in w


def test_rejection_sampling_that_accepts_nothing_is_flagged():
    w = warnings_for([{"rejection_attempts": 16.0, "rejection_accepted": 0.0}])
    assert len(w) == 1 and "accepted none of 16 episodes" in w[0]
    assert warnings_for([{"rejection_attempts": 16.0, "rejection_accepted": 3.0}]) == []


def test_iteration_metrics_carry_the_shortcut_diagnostics():
    """metrics.jsonl's line holds the shortcut diagnostics (evaluate/shortcuts.py), strict JSON
    with null where undefined; their values are those of the batch's trajectories."""
    import json
    from types import SimpleNamespace

    from consequence.evaluate.shortcuts import SHORTCUT_METRICS, shortcut_metrics
    from consequence.loop.train import iteration_metrics

    def ep(answer, tool, sample, invalid=()):
        call = ModelCall([1, 2], [3, 4], [-0.1, -0.2], "stop", invalid_calls=list(invalid))
        msgs = [{"role": "tool", "name": "calculator", "content": tool}] if tool else []
        return Trajectory(
            "p#0", "p#0", sample, 0, 0, calls=[call], reward=1.0 if answer == "7" else 0.0,
            final_code=answer, messages=msgs, n_tool_calls=int(bool(tool)) + len(invalid),
        )  # fmt: skip

    def line(trajs):
        r = SimpleNamespace(
            cfg=SimpleNamespace(
                dynamic_sampling=False, distill_lambda=1.0, reward_model=None, judge_url=None, shaping="none"
            ),
            env=SimpleNamespace(iteration_metrics=lambda ts: {}),
        )
        r.cfg.attempts, r.cfg.context = 1, "full"  # one answer per episode, the full history
        got = SimpleNamespace(trajectories=trajs, stats={"gen_tokens_total": 8}, queue=None, from_data=False)
        m = iteration_metrics(0, r, got, SimpleNamespace(metrics={}), {}, 1.0, 1.0, None)
        return json.loads(json.dumps(m, allow_nan=False))  # as the recorder writes it

    trajs = [ep("7", "7", 0), ep("7", None, 1), ep("12", "7", 2, ["unknown_tool"]), ep(None, None, 3)]
    m = line(trajs)
    assert {k: m[k] for k, _ in SHORTCUT_METRICS} == shortcut_metrics(trajs)
    assert (m["tool_call_rate"], m["invalid_call_unknown_tool"], m["answer_equals_tool_value"]) == (0.5, 0.25, 1 / 3)
    assert (m["top_answer_share"], m["answered_fraction"]) == (2 / 3, 0.75)
    assert line([ep(None, None, 0)])["answer_entropy"] is None  # nothing answered: null, not NaN


def test_rollout_speed_counts_the_dropped_groups_and_success_is_null_without_a_valid_episode():
    """Dynamic sampling generated 30 tokens in 2 s, of which the kept episodes hold 4: the
    sampler ran at 30 / 2 = 15 tokens/s, not 4 / 2. A batch of env errors has success null."""
    from types import SimpleNamespace

    from consequence.loop.train import iteration_metrics

    def ep(sample, outcome="finished"):
        call = ModelCall([1, 2], [3, 4], [-0.1, -0.2], "stop")
        return Trajectory("p#0", "p#0", sample, 0, 0, calls=[call], reward=None, outcome=outcome)

    r = SimpleNamespace(
        cfg=SimpleNamespace(
            dynamic_sampling=True, distill_lambda=1.0, reward_model=None, judge_url=None, shaping="none"
        ),
        env=SimpleNamespace(iteration_metrics=lambda ts: {}),
    )
    r.cfg.attempts, r.cfg.context = 1, "full"  # one answer per episode, the full history
    stats = {"gen_tokens_total": 30, "groups_generated": 5, "groups_kept": 1, "groups_dropped": 4}
    got = SimpleNamespace(trajectories=[ep(0), ep(1)], stats=stats, queue=None, from_data=False)
    m = iteration_metrics(0, r, got, SimpleNamespace(metrics={}), {}, 2.0, 1.0, None)
    assert m["rollout_tokens_per_s"] == 15.0 and m["gen_tokens_mean"] == 2.0 and m["groups_dropped"] == 4
    got.trajectories = [ep(0, "env_error"), ep(1, "env_error")]
    m = iteration_metrics(0, r, got, SimpleNamespace(metrics={}), {}, 2.0, 1.0, None)
    assert m["success"] is None and m["reward_mean"] is None and m["env_errors"] == 2
