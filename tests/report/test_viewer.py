"""`consequence view`: the HTML page colours exactly the tokens the loss sees.

A real one-iteration run of the bundled model is viewed; the page is loaded in headless
Chromium (Debian's `chromium`, installed by .ci/run) and the coloured tokens of every
trajectory are counted against the trainer's own loss mask (trajectory_to_rows + pad_rows).
"""

import dataclasses
import doctest
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from typer.testing import CliRunner

import consequence.report.viewer as viewer
from consequence.cli import app
from consequence.distill.warmstart import BUNDLED
from consequence.records import pad_rows, read_trajectories, trajectory_to_rows, write_trajectories

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)",
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One iteration × 2 tasks × 2 rollouts, plus one hand-made two-row trajectory.

    The extra file ``iter_0001.parquet`` holds a copy of a real trajectory whose second call's
    context no longer extends the first (as if the context builder had rewritten history),
    so ``trajectory_to_rows`` splits it into two rows of different lengths and the viewer
    must show padding.
    """
    from rich.console import Console

    from consequence.config import TrainConfig
    from consequence.loop.train import train

    run = tmp_path_factory.mktemp("viewrun")
    train(
        TrainConfig(
            run_dir=str(run),
            model=str(BUNDLED),
            iterations=1,
            tasks_per_iteration=2,
            group_size=2,
            eval_every=0,
            final_eval_episodes=0,
        ),
        Console(quiet=True),
    )
    real = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    base = next(t for t in real if len(t.calls) >= 2)
    calls = list(base.calls)
    calls[1] = dataclasses.replace(calls[1], context_ids=calls[1].context_ids[1:])  # prefix broken: new row
    split = dataclasses.replace(base, calls=calls, group_id="split-row-example", task_id="split-row-example")
    write_trajectories(run / "trajectories" / "iter_0001.parquet", [split])
    return run


@pytest.fixture(scope="module")
def page(run_dir, tmp_path_factory):
    """The page with current log-probs, and the trajectories in page order."""
    html, summary = viewer.build_page(run_dir, with_current_logprobs=True, log=lambda *_: None)
    out = viewer.write_page(html, tmp_path_factory.mktemp("page") / "view.html")
    trajs = [t for p in sorted((run_dir / "trajectories").glob("iter_*.parquet")) for t in read_trajectories(p)]
    assert summary["n_shown"] == len(trajs) and summary["n_left_out"] == 0
    return out, trajs


class _Tokens(HTMLParser):
    """Collects (role, text) of every token element and the text of #pinned."""

    def __init__(self):
        super().__init__()
        self.tokens, self.pinned, self._in = [], "", None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if tag == "span" and "tok" in cls and "data-j" in a:
            roles = [c[4:] for c in cls if c.startswith("tok-")]
            assert len(roles) == 1, cls
            self.tokens.append([roles[0], ""])
            self._in = "tok"
        elif a.get("id") == "pinned":
            self._in = "pinned"

    def handle_endtag(self, tag):
        if tag in ("span", "div") and self._in:
            self._in = None if self._in == "pinned" or tag == "span" else self._in

    def handle_data(self, data):
        if self._in == "tok":
            self.tokens[-1][1] += data
        elif self._in == "pinned":
            self.pinned += data


def _chromium(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )


def _dom(tmp_path, url) -> _Tokens:
    p = _Tokens()
    p.feed(_chromium(tmp_path, "--dump-dom", url).stdout)
    return p


def test_doctests():
    assert doctest.testmod(viewer).failed == 0


@pytest.mark.slow
@needs_chromium
def test_coloured_tokens_match_the_loss_mask(page, tmp_path):
    """Per trajectory: targets = mask ones, padding = attention zeros, every sampled token
    shown once, and every <|im_start|> / <|im_end|> the template added is a boundary."""
    out, trajs = page
    saw_padding = False
    for i, t in enumerate(trajs):
        rows = trajectory_to_rows(t)
        batch = pad_rows(rows, 0)
        dom = _dom(tmp_path, f"{out.as_uri()}#t={i}")
        roles = [r for r, _ in dom.tokens]
        assert len(roles) == batch["input_ids"].numel()
        assert roles.count("target") == int(batch["loss_mask"].sum()) == t.n_generated_tokens
        assert roles.count("pad") == int((batch["attention_mask"] == 0).sum())
        assert roles.count("prompt") > 0 and roles.count("boundary") > 0
        if len(rows) == 1:  # observations sit between calls; the last one is not in a row
            assert (roles.count("obs") > 0) == (len(t.calls) > 1)
        for role, text in dom.tokens:
            if text in ("<|im_start|>", "<|im_end|>"):
                assert role in ("boundary", "target"), (role, text)
        mask = [int(m) for row in batch["loss_mask"].tolist() for m in row]
        assert [r == "target" for r in roles] == [m == 1 for m in mask]
        saw_padding |= roles.count("pad") > 0
        # the end-of-turn token that closed each call is a target
        assert sum(1 for r, x in dom.tokens if r == "target" and x == "<|im_end|>") == sum(
            1 for c in t.calls if c.output_ids and c.stop_reason == "stop"
        )
    assert saw_padding, "the two-row trajectory should show padding"


@pytest.mark.slow
@needs_chromium
def test_pinned_token_shows_sampling_and_current_logprob_and_ratio(page, run_dir, tmp_path):
    from consequence.policy.tiny import load_policy

    out, trajs = page
    t = trajs[0]
    row = trajectory_to_rows(t)[0]
    j = max(k for k, m in enumerate(row.loss_mask) if m)  # the last sampled token (end of turn)
    dom = _dom(tmp_path, f"{out.as_uri()}#t=0&tok=0:{j}")
    fields = dict(f.split(": ", 1) for f in dom.pinned.split(" · "))
    model, tokenizer = load_policy(run_dir / "checkpoints" / "final")  # no iter_0001 checkpoint: final
    current = viewer.current_logprobs(model, tokenizer, t, 1.0, 0, 1.0)[0][j]
    sampling = row.old_logprobs[j]
    assert fields["role"] == "sampled target (loss mask 1)" and fields["loss mask"] == "1"
    assert fields["token id"] == str(row.input_ids[j])
    assert float(fields["sampling"]) == pytest.approx(sampling, abs=1e-4)
    assert float(fields["current"]) == pytest.approx(current, abs=1e-4)
    assert float(fields["ratio"]) == pytest.approx(math.exp(round(current, 4) - round(sampling, 4)), abs=1e-4)
    assert float(fields["advantage"]) == pytest.approx(t.advantage, abs=1e-4)


@pytest.mark.slow
@needs_chromium
def test_screenshot(page, tmp_path):
    out, _ = page
    png = tmp_path / "viewer.png"
    _chromium(tmp_path, f"--screenshot={png}", "--window-size=1400,1000", f"{out.as_uri()}#t=0&tok=0:40")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.slow  # shares run_dir's training run
def test_page_is_self_contained_and_small(page):
    html = page[0].read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "<link" not in html and "<script src" not in html
    assert len(html.encode()) < 200 * 1024 * 6  # about 20 bytes per token, 6 trajectories


@pytest.mark.slow  # shares run_dir's training run
def test_limit_keeps_whole_groups_spread_over_iterations(run_dir):
    # iteration 0: two groups of 2; iteration 1: one group of 1. A limit of 4 cannot take all 5.
    html, summary = viewer.build_page(run_dir, limit=4, log=lambda *_: None)
    assert summary["n_shown"] == 3 and summary["n_left_out"] == 2
    assert "split-row-example" in html


@pytest.mark.slow
def test_cli_writes_the_page_and_rejects_bad_input(run_dir, tmp_path):
    runner = CliRunner()
    out = tmp_path / "v.html"
    r = runner.invoke(app, ["view", str(run_dir), "--out", str(out), "--iteration", "0"])
    assert r.exit_code == 0, r.output
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir()] == ["v.html"]  # atomic: no temporary file left
    for args, message in [
        ([str(tmp_path / "missing")], "no such directory"),
        ([str(tmp_path)], "no trajectories"),
        ([str(run_dir), "--iteration", "7"], "iterations present: 0, 1"),
    ]:
        r = runner.invoke(app, ["view", *args])
        assert r.exit_code == 2 and message in r.output, r.output
    empty = tmp_path / "empty-run"
    write_trajectories(empty / "trajectories" / "iter_0000.parquet", [])
    r = runner.invoke(app, ["view", str(empty)])
    assert r.exit_code == 2 and "hold no trajectories" in r.output, r.output
