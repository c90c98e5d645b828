"""Data-parallel updates (issue 18): 2 gloo ranks on loopback give the single-process step.

One 2-rank job (two spawned processes, a TCP store on a port the OS picks) runs every
case and writes what it saw; the tests compare it with the same step in this process:
for each reduction the DP = 2 gradient, the step's metrics and the weights after one
AdamW step equal the single-process ones (7 rows of uneven lengths, so the shards
differ in rows and tokens). One rank's NaN advantage stops both ranks with the same
NonFiniteError, and a collective a rank never enters ends in a named timeout error.
Then the trainer's side: ``--update-ranks 2`` against 1 on a tiny training run, and a
dead rank process.
"""

from __future__ import annotations

import datetime
import functools
import gc
import json
import math
import multiprocessing as mp
import os

import pytest
import torch

from consequence.policy.logprobs import token_logprobs
from consequence.records import TrainingRow
from consequence.update.data_parallel import (
    DataParallelError,
    DataParallelUpdate,
    data_parallel_gradients,
    data_parallel_step,
    merge_rank_metrics,
    shard_rows,
)
from consequence.update.step import NonFiniteError, UpdateConfig, accumulate_gradients, ppo_step

V, PAD = 64, 0
TARGETS = [3, 9, 2, 6, 2, 5, 4]  # 7 rows, 31 targets (both odd): the shards differ in rows and in target tokens
ADV = [1.0, -0.5, 0.3, -1.2, 0.0, 0.8, -0.4]  # row 4's advantage is 0: skipped unless KL / entropy run
LP = functools.partial(token_logprobs, with_entropy=True, entropy_grad=True)
CASES = {
    "token_mean": dict(reduction="token_mean"),
    "seq_mean_token_mean": dict(reduction="seq_mean_token_mean"),
    "seq_mean_token_sum": dict(reduction="seq_mean_token_sum_norm"),  # L_const = the step's longest row (global max)
    "constant_norm": dict(reduction="seq_mean_token_sum_norm", norm_const=12.0),
    "token_mean_kl_entropy": dict(reduction="token_mean", kl_coef=0.1, entropy_coef=0.01),
}
LR = 0.5
IDLE_ADV = [0.0, 0.7, 0.0, 0.0, 0.0, 0.0, 0.0]  # one row to train: every other row is skipped
IDLE = {"idle_rank_skipped_rows": list(range(7)), "idle_rank_empty_shard": [1]}  # name: the step's rows


def _optimizer(model):
    """SGD for comparing weights with one process: AdamW's first step is lr·g/(|g| + ε), which turns a
    1e-12 difference of a ~1e-9 gradient entry into a visible one; SGD moves each weight by lr·g. (The
    trainer's AdamW replicas are compared with each other, bit for bit, by the training-run test.)"""
    return torch.optim.SGD(model.parameters(), lr=LR)


def _model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).float()


def _rows(model, n_prompt: int = 2, seed: int = 1):
    """Rows with 2 context tokens then targets; old log-probs are the model's + noise (ratios ≠ 1, some clipped);
    reference log-probs are the model's + other noise."""
    g = torch.Generator().manual_seed(seed)
    rows, ref = [], []
    for i, L in enumerate(TARGETS):
        ids = torch.randint(1, V, (n_prompt + L,), generator=g)
        with torch.no_grad():
            lp, _ = LP(model, ids[None], torch.ones(1, len(ids), dtype=torch.long))
        lp = torch.cat([torch.zeros(1), lp[0]])
        mask = [0] * n_prompt + [1] * L
        old = [float(o) if m else 0.0 for o, m in zip(lp + 0.3 * torch.randn(len(ids), generator=g), mask)]
        ref.append([float(o) if m else 0.0 for o, m in zip(lp + 0.2 * torch.randn(len(ids), generator=g), mask)])
        rows.append(TrainingRow(ids.tolist(), mask, old, traj_index=i))
    return rows, ref


def _cfg(name: str, micro: int) -> UpdateConfig:
    return UpdateConfig(micro_batch_size=micro, **CASES[name])


def _kw(name: str, ref, idx):
    return {"ref_logprobs": [ref[i] for i in idx]} if CASES[name].get("kl_coef") else {}


# ---- the 2-rank job (runs in each spawned process) ------------------------------------------
def _rank_job(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    seen: dict = {}
    for name in CASES:
        model = _model()
        rows, ref = _rows(model)
        cfg = _cfg(name, micro=2)  # another micro-batch split than the single process's
        mine = shard_rows(rows, 2, ADV, cfg)[rank]
        sub = lambda xs, mine=mine: [xs[i] for i in mine]  # noqa: E731
        model.zero_grad(set_to_none=True)
        m = data_parallel_gradients(model, sub(rows), sub(ADV), cfg, PAD, LP, row_ids=mine, **_kw(name, ref, mine))
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        opt = _optimizer(model)
        ms = data_parallel_step(model, opt, sub(rows), sub(ADV), cfg, PAD, LP, row_ids=mine, **_kw(name, ref, mine))
        seen[name] = {
            "grads": grads,
            "metrics": m,
            "step_metrics": ms,
            "shard": mine,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        }
    # a rank that runs no row (its shard all zero-advantage, or empty) still takes part in the sum
    for name, pick in IDLE.items():
        model = _model()
        rows, _ = _rows(model)
        rows, adv, cfg = [rows[i] for i in pick], [IDLE_ADV[i] for i in pick], _cfg("token_mean", micro=2)
        mine = shard_rows(rows, 2, adv, cfg)[rank]
        model.zero_grad(set_to_none=True)
        m = data_parallel_gradients(model, [rows[i] for i in mine], [adv[i] for i in mine], cfg, PAD, LP, row_ids=mine)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        seen[name] = {"grads": grads, "metrics": m, "shard": mine}
    # one rank's NaN advantage: both ranks raise the same NonFiniteError, then the group still works
    model = _model()
    rows, ref = _rows(model)
    cfg = _cfg("token_mean", micro=2)
    shards = shard_rows(rows, 2)
    bad = shards[1][0]
    adv = [math.nan if i == bad else a for i, a in enumerate(ADV)]
    mine = shards[rank]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    try:
        data_parallel_step(model, opt, [rows[i] for i in mine], [adv[i] for i in mine], cfg, PAD, LP, row_ids=mine)
        seen["nan"] = {"raised": None}
    except NonFiniteError as e:
        seen["nan"] = {"raised": str(e), "rows": e.rows, "bad": bad}
    after = data_parallel_step(model, opt, [rows[i] for i in mine], [ADV[i] for i in mine], cfg, PAD, LP, row_ids=mine)
    seen["nan"]["after_ok"] = after["optimizer_stepped"]
    # a collective rank 1 never enters: rank 0 ends with a named timeout after 2 s, no hang
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2), backend="gloo")
    if rank == 0:
        try:
            data_parallel_gradients(
                model, [rows[i] for i in mine], [ADV[i] for i in mine], cfg, PAD, LP, row_ids=mine, group=short
            )
            seen["timeout"] = None
        except DataParallelError as e:
            seen["timeout"] = str(e)
    torch.save(seen, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _run_two_ranks(out) -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_job, args=(r, store.port, str(out)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], f"rank processes exited with {codes}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank job's results, run once per session even under pytest-xdist (shared folder + file lock)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()  # under xdist one folder per worker, whose parent is the session's
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "data-parallel-job"
    root.mkdir(exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if not (root / "done").exists():
            _run_two_ranks(root)
            (root / "done").write_text("ok")
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _single(name: str):
    """The same step in one process: gradient, accumulate metrics, ppo_step metrics, weights after it."""
    model = _model()
    rows, ref = _rows(model)
    cfg = _cfg(name, micro=16)
    all_ = range(len(rows))
    model.zero_grad(set_to_none=True)
    m = accumulate_gradients(model, rows, ADV, cfg, PAD, LP, **_kw(name, ref, all_))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    opt = _optimizer(model)
    ms = ppo_step(model, opt, rows, ADV, cfg, PAD, LP, **_kw(name, ref, all_))
    return grads, m, ms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_metrics(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_give_the_single_process_gradient_metrics_and_weights(two_ranks, name):
    grads, m, ms, weights = _single(name)
    r0, r1 = two_ranks[0][name], two_ranks[1][name]
    assert sorted(r0["shard"] + r1["shard"]) == list(range(len(TARGETS)))
    assert len(r0["shard"]) != len(r1["shard"])  # uneven shards: local means would weight rows differently
    assert sum(TARGETS[i] for i in r0["shard"]) != sum(TARGETS[i] for i in r1["shard"])
    assert any(g.abs().sum() > 0 for g in grads.values())
    for r in (r0, r1):
        assert set(r["grads"]) == set(grads)
        for n in grads:
            torch.testing.assert_close(r["grads"][n], grads[n], atol=1e-6, rtol=1e-5, msg=n)
        _same_metrics(r["metrics"], m)
        _same_metrics(r["step_metrics"], ms)
    for n in weights:
        assert torch.equal(r0["weights"][n], r1["weights"][n]), n  # replicas identical, bit for bit
        torch.testing.assert_close(r0["weights"][n], weights[n], atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.slow  # shares the 2-rank job of two_ranks
@pytest.mark.parametrize("name", list(IDLE))
def test_a_rank_that_runs_no_row_still_gives_the_single_process_gradient(two_ranks, name):
    """DDP sums once per step through one backward every rank runs (``_synchronize``): a
    rank whose shard trains nothing (skipped rows, or no row at all) contributes zeros
    and the other rank's gradient is the step's, not half of it (DDP's default mean)."""
    model = _model()
    rows, _ = _rows(model)
    pick = IDLE[name]
    model.zero_grad(set_to_none=True)
    m = accumulate_gradients(
        model, [rows[i] for i in pick], [IDLE_ADV[i] for i in pick], _cfg("token_mean", 16), PAD, LP
    )
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    r0, r1 = two_ranks[0][name], two_ranks[1][name]
    assert [pick[i] for i in r0["shard"]] == [1]  # the one row that trains
    assert [pick[i] for i in r1["shard"]] == ([] if len(pick) == 1 else [0, 2, 3, 4, 5, 6])
    assert m["n_rows_trained"] == 1.0
    for r in (r0, r1):
        assert set(r["grads"]) == set(grads)
        for k in grads:
            torch.testing.assert_close(r["grads"][k], grads[k], atol=1e-6, rtol=1e-5, msg=k)
        _same_metrics(r["metrics"], m)


@pytest.mark.slow  # shares the 2-rank job of two_ranks
def test_one_ranks_nan_advantage_stops_both_ranks_with_the_same_error(two_ranks):
    a, b = two_ranks[0]["nan"], two_ranks[1]["nan"]
    assert a["raised"] is not None and a["raised"] == b["raised"]
    assert f"advantage is not finite in row(s) [{a['bad']}]" in a["raised"]
    assert "found by update rank 1 of 2" in a["raised"]
    assert a["rows"] == b["rows"] == [a["bad"]]  # named by its index in the whole step
    assert a["after_ok"] == b["after_ok"] == 1.0  # the group stays usable after an agreed error


@pytest.mark.slow  # shares the 2-rank job of two_ranks
def test_a_collective_one_rank_never_enters_ends_in_a_named_timeout(two_ranks):
    msg = two_ranks[0]["timeout"]
    assert msg is not None and "update rank 0 of 2" in msg and "all_gather_object of the shards' counts" in msg


def test_shards_are_a_deterministic_token_balanced_partition():
    rows = [TrainingRow([1] * n, [0] + [1] * (n - 1), [0.0] * n) for n in (9, 3, 8, 2, 7, 4, 5)]
    shards = shard_rows(rows, 2)
    assert shards == shard_rows(rows, 2) and sorted(sum(shards, [])) == list(range(7))
    load = [sum(len(rows[i].input_ids) for i in s) for s in shards]
    assert abs(load[0] - load[1]) <= 2
    assert shard_rows(rows[:1], 3) == [[0], [], []]
    with pytest.raises(ValueError):
        shard_rows(rows, 0)


def test_merge_rank_metrics_weights_token_means_by_tokens():
    got = merge_rank_metrics(
        [
            {"loss": 0.5, "ratio_mean": 1.0, "ratio_min": 0.9, "ratio_max": 1.1, "n_tokens": 3.0, "n_rows": 2.0},
            {"loss": 0.25, "ratio_mean": 2.0, "ratio_min": 0.8, "ratio_max": 1.0, "n_tokens": 1.0, "n_rows": 1.0},
            {"loss": 0.0, "n_tokens": 0.0, "n_rows": 0.0},
        ]
    )
    assert got == {"loss": 0.75, "ratio_mean": 1.25, "ratio_min": 0.8, "ratio_max": 1.1, "n_tokens": 4.0, "n_rows": 3.0}


# ---- the trainer's side --------------------------------------------------------------------
@pytest.mark.slow
def test_a_dead_rank_process_is_a_clear_error_not_a_hang():
    model = _model()
    rows, _ = _rows(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    dp = DataParallelUpdate(2, timeout_s=30, threads_per_rank=1)
    try:
        m = dp.ppo_step(model, opt, rows, ADV, _cfg("token_mean", 4), PAD, LP)
        assert m["optimizer_stepped"] == 1.0
        proc = dp._ranks.procs[0]
        proc.kill()
        proc.join(10)
        with pytest.raises(DataParallelError, match=r"update rank 1 \(pid \d+\) exited with code -9"):
            dp.ppo_step(model, opt, rows, ADV, _cfg("token_mean", 4), PAD, LP)
        with pytest.raises(DataParallelError, match="stopped earlier"):
            dp.ppo_step(model, opt, rows, ADV, _cfg("token_mean", 4), PAD, LP)
    finally:
        dp.close()
    assert not dp._ranks.procs


@pytest.mark.slow
@pytest.mark.parametrize("launcher,lora_rank", [("spawn", 0), ("spawn", 4), ("torchrun", 0)])
def test_update_ranks_2_trains_like_update_ranks_1(tmp_path, launcher, lora_rank):
    """Three iterations of two optimizer steps each, bit for bit equal with 1 and 2 ranks.

    Each step has 2 rows, so each rank's shard is one row, and the single process runs one
    row per micro-batch: every micro-batch is divided by the step's global totals
    (``accumulate_gradients(totals=...)``), so a rank's gradient is the single process's
    micro-batch gradient bit for bit, and the all-reduced sum of two is the single process's
    accumulation a + b (float addition commutes). No tolerance is needed, and none would do:
    AdamW moves a weight by lr·m̂/(√v̂ + ε), so a gradient entry that is rounding noise of
    order ε moves its weight by a good part of lr, and the next step's gradient differs by
    ~1e-4 relative (what the earlier version of this test, which divided each shard by its
    own totals and rescaled, saw on other machines). Metrics are float64 sums of a few
    numbers in another order: equal to 1e-12 relative (≥ 100× their rounding).

    ``spawn``: the trainer starts rank 1 itself; ``torchrun``: ``torchrun --nproc-per-node 2
    -m consequence train --update-ranks 2`` (rank 1 serves the update only)."""
    from consequence.config import TrainConfig
    from consequence.distill.warmstart import BUNDLED
    from consequence.loop.train import machine_dependent, train
    from consequence.policy.tiny import load_policy
    from consequence.records import read_trajectories

    # the parity environment: mixed groups from the warm start, so that steps train
    settings = dict(
        model=str(BUNDLED),
        env="env_fixtures:ParityEnvironment",
        iterations=3,
        tasks_per_iteration=1,
        group_size=4,
        final_eval_episodes=0,
        eval_every=0,
        max_turns=1,
        max_new_tokens=24,
        micro_batch_size=1,
        mini_batches=2,
        learning_rate=3e-3,
        skip_checks=True,
        lora_rank=lora_rank,  # with LoRA, DDP reduces the adapter's gradients only
    )

    def run(n: int):
        run_dir = tmp_path / f"r{n}"
        if n > 1 and launcher == "torchrun":
            _torchrun_train(n, {**settings, "run_dir": str(run_dir), "update_ranks": n})
        else:
            train(TrainConfig(**settings, run_dir=str(run_dir), update_ranks=n))
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        trajs = [read_trajectories(run_dir / "trajectories" / f"iter_{i:04d}.parquet") for i in range(3)]
        return lines, trajs, load_policy(run_dir / "checkpoints" / "final")[0]

    one, t1, m1 = run(1)
    two, t2, m2 = run(2)
    gc.collect()
    assert not mp.active_children()  # the rank processes are gone with the run
    assert sum(m["optimizer_steps_taken"] for m in one) >= 4  # the runs trained
    timing = {k for k in one[0] if machine_dependent(k)}
    for a, b in zip(one, two, strict=True):
        assert a.keys() - timing == b.keys() - timing
        for k in a.keys() - timing:
            if isinstance(a[k], float):
                assert b[k] == pytest.approx(a[k], rel=1e-12, abs=1e-15), k
            else:
                assert b[k] == a[k], k
    strip = lambda t: {k: v for k, v in t.to_dict().items() if k != "wall_time_s"}  # noqa: E731
    assert [[strip(t) for t in it] for it in t1] == [[strip(t) for t in it] for it in t2]
    moved = [not torch.equal(p, p0) for p, p0 in zip(m1.parameters(), load_policy(BUNDLED)[0].parameters())]
    assert any(moved)
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), name


def _torchrun_train(n: int, settings: dict) -> None:
    """``torchrun --standalone --nproc-per-node n -m consequence train`` with ``settings`` as flags."""
    import subprocess
    import sys
    from pathlib import Path

    flags = []
    for k, v in settings.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            flags.append(flag)
        elif v not in (False, 0) or k == "final_eval_episodes" or k == "eval_every":
            flags += [flag, str(v)]
    tests = str(Path(__file__).resolve().parents[1])  # env_fixtures
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    out = subprocess.run(  # a hang (a rank waiting for a group) ends in TimeoutExpired, a failure
        [*cmd, "-m", "consequence", "train", *flags], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.slow
def test_print_config_under_torchrun_ends_every_rank(tmp_path):
    """Break-test: rank 0 printed the settings and exited 0 while rank 1 waited for a process
    group rank 0 never joins, until the 600 s timeout. Ranks >= 1 now leave at once."""
    from consequence.distill.warmstart import BUNDLED

    _torchrun_train(2, {"model": str(BUNDLED), "run_dir": str(tmp_path / "r"), "update_ranks": 2, "print_config": True})
    assert not (tmp_path / "r").exists()  # nothing was trained or written


def test_torchrun_rank_count_must_match_update_ranks(monkeypatch):
    """Under torchrun the ranks are torchrun's: a different --update-ranks would leave ranks
    waiting for steps that never come (or a step waiting for ranks that do not exist)."""
    from consequence.update.data_parallel import check_rank_count
    from consequence.update.launch import launched_by_torchrun

    assert launched_by_torchrun() is None or os.environ.get("WORLD_SIZE") == "1"
    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert launched_by_torchrun() == (0, 3)
    check_rank_count(3)  # torchrun's processes may be on other nodes: no core limit
    with pytest.raises(ValueError, match=r"--update-ranks 2, but torchrun started 3 processes .*give --update-ranks 3"):
        check_rank_count(2)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match=r"RANK=3 is outside \[0, WORLD_SIZE=3\)"):
        launched_by_torchrun()


def test_unsupported_settings_are_refused_by_the_config():
    from consequence.config import TrainConfig

    with pytest.raises(ValueError, match="--update-ranks 2 with --advantage gae is not supported"):
        TrainConfig(update_ranks=2, advantage="gae")
    with pytest.raises(ValueError, match="--gradient-checkpointing is not supported"):
        TrainConfig(update_ranks=2, gradient_checkpointing=True)
    assert TrainConfig(update_ranks=1, advantage="gae").advantage == "gae"
    assert TrainConfig(update_ranks=2).update_ranks == 2


def test_more_ranks_than_cores_are_refused_before_an_earlier_run_is_touched(tmp_path):
    """Break-test: --update-ranks 1000 was accepted, deleted the earlier run's outputs and kept
    starting processes. It is refused in the checks, before anything in the run folder moves."""
    from typer.testing import CliRunner

    from consequence.cli import app
    from consequence.config import TrainConfig
    from consequence.update.data_parallel import check_rank_count, max_update_ranks

    cap = max_update_ranks()
    assert cap >= 2
    check_rank_count(TrainConfig(update_ranks=cap).update_ranks)
    with pytest.raises(
        ValueError, match=f"--update-ranks {cap + 1} would start {cap + 1} processes.*use at most {cap}"
    ):
        check_rank_count(cap + 1)
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (run / "trajectories" / "iter_0000.parquet").write_bytes(b"earlier")
    res = CliRunner().invoke(app, ["train", "--update-ranks", "1000", "--run-dir", str(run), "--iterations", "1"])
    assert res.exit_code == 2 and "use at most" in res.output, res.output
    assert (run / "metrics.jsonl").read_text() == '{"iteration": 0}\n'
    assert (run / "trajectories" / "iter_0000.parquet").read_bytes() == b"earlier"
