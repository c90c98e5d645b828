"""`consequence train --cold-start-demos N`: the cold start (SFT on the environment
demonstrator's verified episodes) runs before RL, once per settings (cached, reused by later
runs: the training seeds of an experiment), RL and the final comparison's warm-start side
start from it, the run records which one it was, a resumed run reuses it (and refuses to
rebuild it), and an environment without a demonstrator is refused before any work."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from typer.testing import CliRunner

from consequence.cli import app
from consequence.config import TrainConfig
from consequence.policy.tiny import BUNDLED, load_policy


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CONSEQUENCE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "cold-starts"


def _cfg(run: Path, **kw) -> TrainConfig:
    """The bundled tiny model, a cold start on 4 calculator demonstrations (one SFT step), one
    iteration of 2 tasks × 2 rollouts, no evaluation."""
    settings = dict(
        run_dir=str(run),
        model=str(BUNDLED),
        env="calculator",
        cold_start_demos=4,
        cold_start_rows_per_step=4,
        cold_start_micro_batch_size=4,
        iterations=1,
        tasks_per_iteration=2,
        group_size=2,
        eval_every=0,
        final_eval_episodes=0,
        skip_checks=True,
        max_turns=2,
        max_new_tokens=24,
    )
    return TrainConfig(**{**settings, **kw})


def _train(cfg: TrainConfig, **kw) -> str:
    from consequence.loop.train import train

    out = io.StringIO()
    train(cfg, Console(file=out, width=300), **kw)
    return " ".join(out.getvalue().split())


def _weight(model) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach().clone()


@pytest.mark.slow
def test_the_cold_start_runs_once_then_is_reused_and_rl_starts_from_it(tmp_path, cache, monkeypatch):
    import consequence.loop.train as train_module

    references = []
    real = train_module.final_report

    def spy(cfg, reference, *args, **kwargs):  # the warm-start side of the final comparison
        references.append(_weight(reference))
        return real(cfg, reference, *args, **kwargs)

    monkeypatch.setattr(train_module, "final_report", spy)
    said = _train(_cfg(tmp_path / "a"))
    [folder] = [p for p in cache.iterdir() if p.is_dir()]
    assert f"cold start: building {folder}" in said and "cold start saved to" in said
    assert f"model {folder} (cold start of {BUNDLED})" in said
    built = (folder / "sft.json").stat().st_mtime_ns

    run = tmp_path / "a"
    config = yaml.safe_load((run / "config.yaml").read_text())  # the user's settings, as asked
    assert config["policy"]["model"] == str(BUNDLED) and config["policy"]["cold_start_demos"] == 4
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["model"]["path"] == str(folder)  # RL started from the cold start
    assert manifest["cold_start"]["path"] == str(folder) and manifest["cold_start"]["reused"] is False
    record = json.loads((run / "cold_start.json").read_text())
    assert record["key"] == folder.name and record["student"] == str(BUNDLED)
    assert record["sft"]["environment"] == "calculator" and record["sft"]["teacher"]["verified"] >= 1
    report = json.loads((run / "report.json").read_text())
    assert report["start_model"]["path"] == str(folder)
    assert report["start_model"]["cold_start"]["model"] == str(BUNDLED)
    assert "Warm start (the policy RL started from): `" + str(folder) + "`" in (run / "report.md").read_text()
    cold = _weight(load_policy(folder)[0])
    assert torch.equal(references[0], cold) and not torch.equal(cold, _weight(load_policy(BUNDLED)[0]))

    said = _train(_cfg(tmp_path / "b", seed=1))  # another training seed: the same cold start
    assert f"cold start: reusing {folder} (built " in said and "cold start: building" not in said
    assert (folder / "sft.json").stat().st_mtime_ns == built
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [folder.name]
    assert json.loads((tmp_path / "b" / "cold_start.json").read_text())["reused"] is True
    assert torch.equal(references[1], cold)

    said = _train(_cfg(tmp_path / "c", cold_start_seed=1))  # another cold start
    assert "cold start: building" in said and len([p for p in cache.iterdir() if p.is_dir()]) == 2


@pytest.mark.slow
def test_a_resumed_run_reuses_its_cold_start_and_never_builds_another(tmp_path, cache, monkeypatch):
    from consequence.loop.sources import Rollouts

    real = Rollouts.next_batch

    def crash_in_second(self, it, *args, **kwargs):
        if it == 1:
            raise KeyboardInterrupt  # stands in for a kill
        return real(self, it, *args, **kwargs)

    run = tmp_path / "run"
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(Rollouts, "next_batch", crash_in_second)
        _train(_cfg(run, iterations=2))
    [folder] = [p for p in cache.iterdir() if p.is_dir()]
    moved = tmp_path / "moved"
    shutil.move(folder, moved)
    with pytest.raises(ValueError, match=f"cannot resume: the cold start {folder} is not in the cache"):
        _train(_cfg(run, iterations=2), resume=True)
    assert not folder.exists()  # not built again: its weights are the run's reference
    shutil.move(moved, folder)
    said = _train(_cfg(run, iterations=2), resume=True)
    assert f"cold start: reusing {folder}" in said and "resuming at iteration 1" in said
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["model"]["path"] == str(folder)


def test_an_environment_without_a_demonstrator_is_refused_before_any_work(tmp_path, cache):
    run = tmp_path / "r"
    res = CliRunner().invoke(
        app, ["train", "--env", "humaneval", "--cold-start-demos", "4", "--run-dir", str(run)], env={"COLUMNS": "300"}
    )
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in said, said
    assert "--cold-start-demos 4 plays the demonstrator of --env humaneval, which has none" in said
    assert "consequence sft --model M --env humaneval --demos-file FILE --out DIR" in said
    assert not run.exists() and not cache.exists()


def test_no_demonstration_and_a_bad_lora_target_are_refused_before_the_cold_start(tmp_path, cache, monkeypatch):
    """The calculator with max_calls=0 cannot demonstrate (its demonstrator calls the tool); a
    --lora-targets the student lacks is refused before the demonstrations are collected."""
    run = tmp_path / "r"
    args = ["train", "--env", "calculator", "--cold-start-demos", "4", "--run-dir", str(run)]
    res = CliRunner().invoke(app, [*args, "--env-option", "max_calls=0"], env={"COLUMNS": "300"})
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in said, said
    assert "which cannot demonstrate here (option max_calls=0 allows no calculator call" in said
    assert not run.exists() and not cache.exists()

    def collected(*a, **kw):
        raise AssertionError("demonstrations collected before --lora-targets was checked")

    monkeypatch.setattr("consequence.distill.coldstart.collect_demonstrations", collected)
    res = CliRunner().invoke(app, [*args, "--lora-rank", "4", "--lora-targets", "q_proj,qproj"], env={"COLUMNS": "300"})
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "--lora-targets qproj: no linear layer of that name" in said, said
    assert not run.exists() and not list(cache.glob("*/sft.json"))  # (only the build's lock file)


def test_cold_start_settings_without_a_cold_start_are_refused():
    with pytest.raises(ValueError, match="--cold-start-epochs has no effect with --cold-start-demos 0"):
        TrainConfig(cold_start_epochs=2.0)
    assert TrainConfig(cold_start_demos=8, cold_start_seed=3).cold_start_seed == 3
