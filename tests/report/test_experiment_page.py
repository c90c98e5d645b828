"""`consequence view OUT` on an experiment folder (consequence.report.experiment_page): the report's
tables rendered, its figures inlined byte for byte, its runs linked relative to the page."""

from __future__ import annotations

import base64

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.report.experiment_page import build_experiment_page

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))  # any bytes: the page must carry them unchanged

MD = """# Experiment: success over training seeds

| arm | mean success % |
|---|---|
| grpo | 31.2 (3 seeds) |

![experiment.png](experiment.png)
![gone.png](gone.png)
"""


@pytest.fixture
def folder(tmp_path):
    out = tmp_path / "exp"
    (out / "runs" / "grpo-seed0").mkdir(parents=True)
    (out / "runs" / "grpo-seed0" / "report.md").write_text("# run\n")
    (out / "runs" / "grpo-seed0" / "report.json").write_text("{}")
    (out / "runs" / "grpo-seed1").mkdir()  # still training: no report yet
    (out / "experiment.md").write_text(MD)
    (out / "experiment.png").write_bytes(PNG)
    return out


def test_the_page_renders_tables_inlines_figures_and_links_runs(folder):
    page = build_experiment_page(folder)
    assert "<td>grpo</td>" in page and "<td>31.2 (3 seeds)</td>" in page  # a real table, not raw markdown
    assert f"data:image/png;base64,{base64.b64encode(PNG).decode()}" in page
    assert 'src="gone.png"' in page  # a figure that is not there keeps its link
    assert '<a href="runs/grpo-seed0/report.md">report.md</a>' in page
    assert "<td>grpo-seed0</td><td>finished</td>" in page and "<td>grpo-seed1</td><td>not finished</td>" in page
    elsewhere = build_experiment_page(folder, folder.parent)  # links follow where the page is written
    assert '<a href="exp/runs/grpo-seed0/report.md">' in elsewhere


def test_the_cli_writes_the_page_and_refuses_a_run_s_options(folder, tmp_path):
    r = CliRunner().invoke(app, ["view", str(folder)])
    assert r.exit_code == 0, r.output
    assert (folder / "viewer.html").read_text() == build_experiment_page(folder)
    r = CliRunner().invoke(app, ["view", str(folder), "--iteration", "0"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--iteration" in r.output and "is an experiment folder" in r.output
    assert "Traceback" not in r.output
    with pytest.raises(FileNotFoundError, match="no experiment.md"):
        build_experiment_page(tmp_path)
