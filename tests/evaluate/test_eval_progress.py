"""Long evaluation phases report progress: a Rich bar on a terminal, start/end lines elsewhere."""

import io
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from consequence.evaluate.progress import Phases


def test_lines_per_phase_when_not_a_terminal():
    buf = io.StringIO()
    with Phases(Console(file=buf, force_terminal=False, width=200)) as phases, phases.phase("episodes", 4) as tick:
        tick(1)
        tick(3)
        tick(2)  # an older count never moves it back
    lines = buf.getvalue().splitlines()
    assert lines[0] == "episodes: start, 4 episodes"
    assert re.fullmatch(r"episodes: done, 3/4 episodes in \d+\.\d s \(\d+\.\d\d episodes/s\)", lines[1])


def test_a_phase_cut_short_is_not_reported_done():
    """Break-test: Ctrl-C during the final evaluation printed "episodes: done, 0/4"."""
    buf = io.StringIO()
    with Phases(Console(file=buf, force_terminal=False, width=200)) as phases:
        with pytest.raises(KeyboardInterrupt), phases.phase("episodes", 4) as tick:
            tick(1)
            raise KeyboardInterrupt
        with pytest.raises(RuntimeError), phases.phase("recovery", 2):
            raise RuntimeError("sandbox broke")
    lines = buf.getvalue().splitlines()
    assert re.fullmatch(r"episodes: interrupted, 1/4 episodes in [0-9.]+ s \([0-9.]+ episodes/s\)", lines[1])
    assert lines[3].startswith("recovery: stopped, 0/2 episodes in ")


def test_a_bar_with_counts_and_rate_on_a_terminal():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    with Phases(console) as phases, phases.phase("episodes", 10) as tick:
        add = phases.counter(tick)
        for _ in range(10):
            add(1)
    text = buf.getvalue()
    assert "episodes" in text and "10/10" in text and "episodes/s" in text and "start," not in text


def test_silent_without_a_console():
    with Phases(None) as phases, phases.phase("x", 2) as tick:
        tick(2)  # nothing to print to, nothing raised


def test_sample_episodes_reports_episodes_finished(renderer):
    from consequence.distill.warmstart import BUNDLED
    from consequence.envs.registry import load_environment
    from consequence.evaluate.rollouts import sample_episodes
    from consequence.policy.tiny import load_policy
    from consequence.rollout.episodes import Budgets

    model, tok = load_policy(BUNDLED)
    from consequence.harness.renderer import Renderer

    env = load_environment("repair")
    tasks = env.sample("validation", 2, seed=0)
    seen: list[int] = []
    trajs = sample_episodes(
        model, Renderer(tok, env.tools), env, tasks, 2, Budgets(max_turns=2, max_new_tokens=16), 0, progress=seen.append
    )
    quiet = sample_episodes(model, Renderer(tok, env.tools), env, tasks, 2, Budgets(max_turns=2, max_new_tokens=16), 0)
    assert seen[-1] == 4 == len(trajs) and seen == sorted(seen) and len(seen) >= 2
    assert [t.calls[-1].output_ids for t in trajs] == [t.calls[-1].output_ids for t in quiet]  # same episodes


@pytest.mark.slow
def test_eval_prints_each_phase_with_counts(tmp_path):
    from consequence.cli import app

    res = CliRunner().invoke(app, ["eval", "--problems", "2", "-n", "1", "--max-turns", "2", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for name, total, unit in (("episodes", 2, "episodes"), ("recovery episodes", 2, "episodes")):
        assert f"{name}: start, {total} {unit}" in res.output
        assert re.search(
            rf"^{name}: done, {total}/{total} {unit} in \d+\.\d s \(\d+\.\d\d {unit}/s\)$", res.output, re.M
        ), res.output
    assert re.search(r"^visible tests \(selection\): done, (\d+)/\1 programs", res.output, re.M)
