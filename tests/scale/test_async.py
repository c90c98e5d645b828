"""Bounded staleness, the asynchronous queue and masked IS, without Ray (docs/async.md).

The scheduler runs against a scripted stand-in for Ray whose virtual clock decides which
batch finishes first, so lags, drops and re-runs are hand-computed values.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from consequence.config import TrainConfig
from consequence.records import TrainingRow
from consequence.scale.preflight import check_rollout_workers
from consequence.scale.scheduler import AsyncRollouts, RolloutError, batches_done, worker_threads
from consequence.scale.staleness import lag, lag_metrics, may_start, pipeline_warning
from consequence.update.sampler_gap import apply_is_mask, is_mask_keep, sampler_gap_metrics


# ---- staleness rules ------------------------------------------------------------------
def test_lag_is_trainer_version_minus_sampling_version():
    assert lag(5, 3) == 2 and lag(4, 4) == 0
    with pytest.raises(ValueError, match="sampled by version 6 reached the trainer at version 5"):
        lag(5, 6)


def test_admission_allows_k_batches_ahead():
    assert may_start(0, 0) and not may_start(1, 0)
    assert may_start(2, 2) and not may_start(3, 2)


def test_pipeline_warning_names_what_workers_and_k_leave_unused():
    assert pipeline_warning(2, 1) is None and pipeline_warning(2, 2) is None and pipeline_warning(1, 0) is None
    assert "1 of the 3 rollout workers will wait" in pipeline_warning(3, 1)
    assert "at most 2 version(s) old, not 4" in pipeline_warning(2, 4)  # bench_staleness: k = 4 ran as k = 2


def test_lag_metrics_count_consumed_and_dropped_groups():
    m = lag_metrics([1, 1, 1], [3, 3])
    assert m == {"lag_histogram": {"1": 3, "3": 2}, "lag_mean": 1.0, "lag_max": 1, "dropped_stale_groups": 2}
    assert lag_metrics([], [])["lag_mean"] == 0.0


def test_batches_done_reads_consumed_and_dropped_batches():
    history = [{"batch": 0, "dropped_batches": []}, {"batch": 3, "dropped_batches": [1]}]
    assert batches_done(history) == {0, 1, 3}


def test_worker_threads_share_the_cores_among_concurrent_batches():
    base = dict(rollout_workers=4)
    assert worker_threads(TrainConfig(**base), 8) == 8  # k = 0: one batch at a time, every core (as sync)
    assert worker_threads(TrainConfig(**base, max_staleness=1), 8) == 4  # 2 batches at once
    assert worker_threads(TrainConfig(**base, max_staleness=9), 8) == 2  # 4 batches at once
    assert worker_threads(TrainConfig(rollout_workers=1, max_staleness=1), 2) == 2
    assert worker_threads(TrainConfig(**base, ray_address="auto"), 8) == 1


# ---- a scripted Ray --------------------------------------------------------------------
class ActorDied(Exception):
    pass


class TaskFailed(Exception):
    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause

    def as_instanceof_cause(self):
        return self.cause


class Ref:
    def __init__(self, ray, value=None, error=None, duration=0.0):
        self.value, self.error, self.finish = value, error, ray.now + duration


class FakeRay:
    """Ray's calls the scheduler makes; a job of batch b takes ``durations.get(b, 1)`` ticks."""

    exceptions = SimpleNamespace(RayActorError=ActorDied, RayTaskError=TaskFailed, GetTimeoutError=TimeoutError)

    def __init__(self, durations=None, die=()):
        self.now, self.durations, self.die = 0.0, durations or {}, list(die)
        self.started, self.killed, self.max_in_flight, self.options = [], 0, 0, []

    def is_initialized(self):
        return True

    def remote(self, num_cpus):
        def actor_class(cls):
            def options(**kw):
                self.options.append(kw)
                return SimpleNamespace(remote=lambda *args: FakeActor(self, cls(*args)))

            return SimpleNamespace(options=options)

        return actor_class

    def put(self, obj):
        return obj

    def wait(self, refs, num_returns, timeout):
        refs = sorted(refs, key=lambda r: r.finish)
        ready = [r for r in refs if r.finish - self.now <= timeout][:num_returns]
        if ready:
            self.now = max(self.now, ready[-1].finish)
        return ready, [r for r in refs if r not in ready]

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, actor):
        self.killed += 1

    def cluster_resources(self):
        return {"CPU": 2.0}


class FakeActor:
    def __init__(self, ray, worker):
        self.ray, self.worker = ray, worker
        self.ready = SimpleNamespace(remote=lambda: Ref(ray, worker.ready()))
        self.run = SimpleNamespace(remote=self._run)

    def _run(self, batch, version, state_ref):
        ray = self.ray
        ray.started.append((batch, version))
        if batch in ray.die:  # the worker process dies under this batch (once per listing)
            ray.die.remove(batch)
            return Ref(ray, error=ActorDied(f"worker died running batch {batch}"), duration=0.5)
        return Ref(ray, self.worker.run(batch, version, state_ref), duration=ray.durations.get(batch, 1.0))


class FakeWorker:
    def __init__(self, cfg, model_path, threads, slot, sys_path):
        self.slot = slot

    def ready(self):
        return {"pid": 100 + self.slot, "host": "here", "threads": 1}

    def run(self, batch, version, state_ref):
        trajs = [SimpleNamespace(group_id=f"{batch}/t{g}") for g in range(2) for _ in range(2)]  # 2 groups
        return {
            "batch": batch,
            "version": version,
            "trajectories": trajs,
            "stats": {"gen_tokens_total": 0},
            "worker": self.slot,
            "rollout_s": 1.0,
            "load_s": 0.0,
        }


def _scheduler(workers, k, ray, done=frozenset(), timeout=1800.0):
    cfg = TrainConfig(rollout_workers=workers, max_staleness=k, rollout_timeout=timeout)
    s = AsyncRollouts(cfg, "model", done=done, ray_module=ray, worker_cls=FakeWorker)
    s.version_model = torch.nn.Linear(1, 1)
    return s


def _run(s, ray, iterations):
    """The trainer's side: take a batch, 'update', publish the next version."""
    out = []
    s.publish(s.version_model, 0)
    for it in range(iterations):
        _, _, m = s.next_batch(it)
        ray.max_in_flight = max(ray.max_in_flight, len(s.jobs) + len(s.finished) + 1)
        out.append(m)
        s.publish(s.version_model, it + 1)
    return out


def test_k0_runs_one_batch_at_a_time_with_the_newest_weights():
    ray = FakeRay()
    s = _scheduler(2, 0, ray)
    ms = _run(s, ray, 4)
    assert [(m["batch"], m["sampled_version"]) for m in ms] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert ray.started == [(0, 0), (1, 1), (2, 2), (3, 3)] and ray.max_in_flight == 1
    assert all(m["lag_histogram"] == {"0": 2} and m["dropped_batches"] == [] for m in ms)


def test_the_trainer_keeps_its_threads_and_workers_start_with_theirs(monkeypatch):
    """torch.set_num_threads also turns MKL's dynamic threading off (ATen), which may change
    float results: the trainer must never call it, and a worker gets its threads from the
    environment it starts with, so that k = 0 computes as the synchronous loop."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    ray = FakeRay()
    s = _scheduler(1, 0, ray)
    _run(s, ray, 2)
    s.close()
    assert calls == []
    cores = torch.get_num_threads()
    assert ray.options == [
        {
            "scheduling_strategy": "SPREAD",
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(cores), "MKL_NUM_THREADS": str(cores)}},
        }
    ]


def test_k1_one_worker_samples_the_next_batch_during_the_update():
    ray = FakeRay()
    ms = _run(_scheduler(1, 1, ray), ray, 4)
    # batch 1 starts (version 0) as soon as batch 0 is taken, before iteration 0's update
    assert ray.started[:3] == [(0, 0), (1, 0), (2, 1)]
    assert [m["lag_max"] for m in ms] == [0, 1, 1, 1]


def test_a_batch_that_finishes_late_is_dropped_and_counted():
    # k = 1, 2 workers, batch 0 takes 2.5 ticks, the others 1: batches 1 and 2 are consumed
    # at iterations 0 and 1; batch 0 arrives during iteration 2 with lag 2 > 1: dropped.
    ray = FakeRay(durations={0: 2.5})
    s = _scheduler(2, 1, ray)
    ms = _run(s, ray, 3)
    assert [m["batch"] for m in ms] == [1, 2, 3]
    assert ms[2]["dropped_batches"] == [0]
    assert ms[2]["lag_histogram"] == {"0": 2, "2": 2} and ms[2]["dropped_stale_groups"] == 2
    assert all(m["lag_max"] <= 1 for m in ms)
    assert s.close() == {"unconsumed_batches": 1}  # batch 4, started during iteration 2


def test_a_dead_worker_is_replaced_and_its_batch_rerun():
    ray = FakeRay(die=[1])
    s = _scheduler(1, 0, ray)
    ms = _run(s, ray, 3)
    assert [m["batch"] for m in ms] == [0, 1, 2]
    assert [m["rerun_batches"] for m in ms] == [0, 1, 0]
    assert ray.started == [(0, 0), (1, 1), (1, 1), (2, 2)]


def test_a_batch_that_kills_every_worker_stops_the_run():
    ray = FakeRay(die=[0, 0, 0])
    s = _scheduler(1, 0, ray)
    with pytest.raises(RuntimeError, match="batch 0 was started 3 times and each time its rollout worker died"):
        _run(s, ray, 1)


def test_every_wait_is_bounded_and_names_the_batch():
    ray = FakeRay(durations={0: 100.0})
    s = _scheduler(1, 0, ray, timeout=5)
    with pytest.raises(RolloutError, match=r"waited 5 s \(--rollout-timeout\).*batch 0 on worker 0 \(version 0"):
        _run(s, ray, 1)


def test_a_resumed_run_rolls_out_the_missing_batches_first():
    ray = FakeRay()
    s = _scheduler(1, 0, ray, done={0, 1, 3})
    s.publish(torch.nn.Linear(1, 1), 3)
    assert s.next_batch(3)[2]["batch"] == 2
    s.publish(torch.nn.Linear(1, 1), 4)
    assert s.next_batch(4)[2]["batch"] == 4


def test_a_batch_error_inside_the_worker_is_raised_as_itself():
    ray = FakeRay()
    s = _scheduler(1, 0, ray)

    def broken(batch, version, state_ref):
        return Ref(ray, error=TaskFailed(ValueError("environment 'x': bad task")))

    s.workers[0].run = SimpleNamespace(remote=broken)
    s.publish(torch.nn.Linear(1, 1), 0)
    with pytest.raises(ValueError, match="bad task"):
        s.next_batch(0)


def test_settings_of_the_workers_are_refused_without_workers():
    for kw in ({"max_staleness": 2}, {"ray_address": "auto"}, {"rollout_timeout": 60}):
        with pytest.raises(ValueError, match="read only by the rollout workers"):
            TrainConfig(**kw)
    with pytest.raises(ValueError, match="read only by --is-mask"):
        TrainConfig(is_mask_high=3.0)


# ---- masked IS and the sampler–trainer gap ----------------------------------------------
def test_token_level_masked_is_keeps_the_band():
    old = torch.tensor([0.0, math.log(0.4), math.log(0.9), math.log(3.0), 0.0])
    mu = torch.zeros(5)
    mask = torch.tensor([0, 1, 1, 1, 1])
    keep = is_mask_keep(old, mu, mask, 0.5, 2.0, "token")
    assert keep.tolist() == [False, False, True, False, True]  # r = 0.4, 0.9, 3.0, 1.0 on targets


def test_sequence_level_masked_is_uses_the_geometric_mean():
    mask = torch.tensor([1, 1])
    mu = torch.zeros(2)
    # r = 0.4 and 3.0: geometric mean sqrt(1.2) = 1.095, inside [0.5, 2]: the row is kept whole
    assert is_mask_keep(torch.log(torch.tensor([0.4, 3.0])), mu, mask, 0.5, 2.0, "sequence").tolist() == [True, True]
    # r = 3.0 and 3.0: outside: dropped whole
    assert not is_mask_keep(torch.log(torch.tensor([3.0, 3.0])), mu, mask, 0.5, 2.0, "sequence").any()
    with pytest.raises(ValueError, match="0 < low < 1 < high"):
        is_mask_keep(mu, mu, mask, 1.5, 2.0, "token")


def test_masked_tokens_leave_the_loss_and_its_denominator():
    row = TrainingRow(
        input_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], old_logprobs=[0.0, math.log(3.0), 0.0, 0.0], traj_index=0
    )
    out, m = apply_is_mask([row], [[0.0, 0.0, 0.0, 0.0]], 0.5, 2.0, "token")
    assert out[0].loss_mask == [0, 0, 1, 1]
    assert m == {"is_masked_token_fraction": pytest.approx(1 / 3), "is_masked_rows": 0.0}


def test_masked_is_with_a_tis_cap_is_token_level_mis_by_hand():
    """--is-mask token alone rejects; with --tis-cap at the band's top the kept tokens are also
    weighted by r = π_old/μ: Liu et al. 2025's token-level MIS, r·1[r in band], checked against
    a direct autograd computation of −Σ_kept r_t (π_θ/π_old)_t A / n_kept."""
    from consequence.update.step import UpdateConfig, accumulate_gradients
    from tiny_lm import PAD, TinyLM, make_rows, ref_logprobs

    model = TinyLM()
    row = make_rows(model, [4], seed=2)[0]  # π_old = the current policy: every PPO ratio is 1
    r = [1.5, 3.0, 0.4, 0.8]  # the middle two lie outside [0.5, 2] and are rejected
    mu = row.old_logprobs[:2] + [o - math.log(x) for o, x in zip(row.old_logprobs[2:], r)]
    rows, m = apply_is_mask([row], [mu], 0.5, 2.0, "token")
    assert rows[0].loss_mask == [0, 0, 1, 0, 0, 1] and m["is_masked_token_fraction"] == pytest.approx(0.5)
    model.zero_grad(set_to_none=True)
    accumulate_gradients(
        model, rows, [0.7], UpdateConfig(tis_cap=2.0, reduction="token_mean"), PAD, ref_logprobs, sampler_logprobs=[mu]
    )
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ids = torch.tensor([row.input_ids])
    lp, _ = ref_logprobs(model, ids, torch.ones_like(ids))
    old = torch.tensor(row.old_logprobs[1:])
    ratio = (lp[0] - old).exp()  # targets at positions 2..5 of the row, 1..4 of the shifted log-probs
    (-(1.5 * ratio[1] + 0.8 * ratio[4]) * 0.7 / 2).backward()
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-6), n


def test_sampler_gap_metrics_by_hand():
    # targets: r = 2 and r = 0.5; k3 = r − 1 − log r = (1 − log 2 + (−0.5) + log 2) / 2 = 0.25
    m = sampler_gap_metrics([[0.0, math.log(2.0), math.log(0.5)]], [[0.0, 0.0, 0.0]], [[0, 1, 1]], 0.6, 1.5)
    assert m["is_ratio_mean"] == pytest.approx(1.25) and m["is_ratio_min"] == pytest.approx(0.5)
    assert m["is_ratio_max"] == pytest.approx(2.0) and m["sampler_trainer_kl"] == pytest.approx(0.25)
    assert m["is_ratio_outside_band"] == pytest.approx(1.0)
    assert sampler_gap_metrics([[0.0]], [[0.0]], [[0]]) == {}


def test_a_stale_uncorrected_gap_warns_once_instead_of_the_engine_mismatch_warning():
    from consequence.loop.diagnostics import warnings_for

    fresh = {"lag_max": 0, "first_step_ratio_min": 0.5, "first_step_ratio_max": 1.0}
    assert any("ratio far from 1" in w for w in warnings_for([fresh]))  # lag 0: the sampler should match
    stale = {
        "lag_max": 1,
        "first_step_ratio_min": 0.05,
        "first_step_ratio_max": 2.1,
        "is_ratio_outside_band": 0.02,
        "sampler_trainer_kl": 5.7e-4,
    }
    (w,) = warnings_for([fresh, stale])
    assert w.startswith("stale batches are far from the trainer: 2.0% of target tokens") and "--is-mask token" in w
    assert warnings_for([fresh, stale, dict(stale)]) == []  # once per run
    assert warnings_for([fresh, stale | {"is_masked_token_fraction": 0.02}]) == []  # corrected: no warning


def test_a_ray_address_is_checked_before_any_work():
    with pytest.raises(ValueError, match="'nowhere' is not a Ray address: give HOST:PORT"):
        TrainConfig(rollout_workers=1, ray_address="nowhere")
    for ok in ("127.0.0.1:6379", "auto", "ray://head:10001", "[::1]:6379"):
        TrainConfig(rollout_workers=1, ray_address=ok)
    with pytest.raises(ValueError, match="--ray-address 127.0.0.1:1: nothing accepts connections there"):
        check_rollout_workers(TrainConfig(rollout_workers=1, ray_address="127.0.0.1:1"))


def test_vllm_without_vllm_is_refused_before_any_work(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ValueError, match="--rollout-engine vllm needs vLLM.*make vllm-env"):
        check_rollout_workers(TrainConfig(rollout_workers=1, rollout_engine="vllm"))


def test_resume_may_move_the_rollouts_but_not_change_what_is_trained(tmp_path):
    import yaml

    from consequence.loop.resume import resume_config

    saved = TrainConfig(run_dir=str(tmp_path), rollout_workers=1, max_staleness=1, rollout_timeout=10)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved.model_dump()))
    (tmp_path / "manifest.json").write_text('{"status": "running"}')
    cfg = resume_config(tmp_path, {"rollout_timeout": 3600.0, "rollout_workers": 2, "ray_address": "auto"}, None)
    assert (cfg.rollout_timeout, cfg.rollout_workers, cfg.ray_address, cfg.max_staleness) == (3600.0, 2, "auto", 1)
    # a run its pre-step checks stopped is resumed with --skip-checks, as the checks' message says (break-test)
    assert resume_config(tmp_path, {"skip_checks": True}, None).skip_checks is True
    with pytest.raises(ValueError, match=r"--max-staleness 2 \(the run has 1\)"):
        resume_config(tmp_path, {"max_staleness": 2}, None)
    with pytest.raises(ValueError, match="--rollout-workers is 0 \\(the synchronous loop\\)"):
        resume_config(tmp_path, {"rollout_workers": 0}, None)
