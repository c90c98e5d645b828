"""The cold-start cache of `consequence train --cold-start-demos` (distill.coldstart.cached_cold_start):
built once and reused, one build when several processes want it at once (the seeds of an
experiment), a key that follows the student's files and every setting, and no rebuild where
only reuse is allowed (a resumed run). The SFT itself is stubbed: these test the cache."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

import consequence.distill.coldstart as coldstart
from consequence.distill.coldstart import ColdStartConfig, cached_cold_start, cold_start_key
from consequence.distill.sft import SFTConfig
from consequence.policy.tiny import BUNDLED

CFG = ColdStartConfig(env="calculator", demos=4, seed=0, split_seed=0, lora_rank=0, sft=SFTConfig(epochs=1.0))


@pytest.fixture
def builds(tmp_path, monkeypatch):
    """The cache in tmp_path; cold_start replaced by a stub that writes a folder with sft.json
    (after ``delay`` seconds, as a real build takes a while) and counts its calls."""
    monkeypatch.setenv("CONSEQUENCE_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    delay = {"s": 0.0}

    def fake(model_path, out, cfg, log, phases, source, env=None, device=None):
        calls.append(out)
        time.sleep(delay["s"])
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.mkdir()
        (tmp / "sft.json").write_text(json.dumps({"student": str(model_path), "settings": {"demos": cfg.demos}}))
        tmp.rename(out)  # the real one writes atomically too (save_policy)
        return json.loads((out / "sft.json").read_text())

    monkeypatch.setattr(coldstart, "cold_start", fake)
    return calls, delay


def test_a_cold_start_is_built_once_then_reused(builds):
    calls, _ = builds
    lines: list[str] = []
    checked: list[int] = []
    folder, record, reused = cached_cold_start(BUNDLED, CFG, log=lines.append, before_build=lambda: checked.append(1))
    assert not reused and len(calls) == 1 and checked == [1]
    assert folder.parent.name == "cold-starts" and folder.name == cold_start_key(BUNDLED, CFG)
    assert record["settings"]["demos"] == 4 and any(line.startswith("cold start: building") for line in lines)
    mtime = (folder / "sft.json").stat().st_mtime_ns
    lines.clear()
    again, record2, reused2 = cached_cold_start(BUNDLED, CFG, log=lines.append, before_build=lambda: checked.append(1))
    assert (again, record2, reused2) == (folder, record, True)
    assert len(calls) == 1 and checked == [1]  # neither built nor checked again
    assert (folder / "sft.json").stat().st_mtime_ns == mtime
    assert lines[0].startswith(f"cold start: reusing {folder} (built ")


def test_processes_that_want_the_same_cold_start_at_once_build_it_once(builds):
    """The loser of the lock waits for the builder, then reuses its folder (never a second
    build into the same folder, which would delete it under the first one's feet)."""
    calls, delay = builds
    delay["s"] = 0.5
    results, lines = [], []

    def run():
        results.append(cached_cold_start(BUNDLED, CFG, log=lines.append))

    threads = [threading.Thread(target=run) for _ in range(2)]  # flock: separate opens exclude each other
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and len(results) == 2
    assert results[0][0] == results[1][0] and sorted(r[2] for r in results) == [False, True]
    assert any("another process is building it" in line and "waiting" in line for line in lines)
    folder = results[0][0]
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name, f"{folder.name}.lock"]


def test_the_key_follows_the_students_files_and_every_setting(tmp_path):
    key = cold_start_key(BUNDLED, CFG)
    copy = shutil.copytree(BUNDLED, tmp_path / "copy")
    assert cold_start_key(copy, CFG) == key  # the same files elsewhere: the same student
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("{", '{"x": 1, ', 1))
    assert cold_start_key(copy, CFG) != key  # trained or edited in place: another student
    others = [
        ColdStartConfig(**{**CFG.__dict__, "demos": 5}),
        ColdStartConfig(**{**CFG.__dict__, "seed": 1}),
        ColdStartConfig(**{**CFG.__dict__, "split_seed": 1}),
        ColdStartConfig(**{**CFG.__dict__, "lora_rank": 16}),
        ColdStartConfig(**{**CFG.__dict__, "env_options": {"digits": 2}}),
        ColdStartConfig(**{**CFG.__dict__, "sft": SFTConfig(epochs=2.0)}),
    ]
    assert len({key, *(cold_start_key(BUNDLED, c) for c in others)}) == 1 + len(others)
    assert cold_start_key(BUNDLED, CFG, {"train_problems": 10}) != key


def test_reuse_only_refuses_a_missing_cold_start(builds):
    calls, _ = builds
    with pytest.raises(ValueError, match="is not in the cache"):
        cached_cold_start(BUNDLED, CFG, log=lambda _: None, build=False)
    assert calls == []
