"""A run's report.md says how many training seeds stand behind its numbers (issue 32)."""

from consequence.report.plots import write_markdown_report

REPORT = {
    "episodes_per_split": 4,
    "budgets": {"max_turns": 2},
    "results": [
        {
            "split": "test",
            "decoding": "sampled",
            "comparison": {
                "a_mean": 0.25,
                "b_mean": 0.5,
                "diff": 0.25,
                "low": 0.0,
                "high": 0.5,
                "n_groups": 4,
                "env_errors_excluded": 0,
            },
        }
    ],  # fmt: skip
}


def test_the_report_names_its_single_training_seed(tmp_path):
    write_markdown_report({**REPORT, "training_seeds": [3], "eval_seed": 0}, tmp_path / "r.md")
    text = (tmp_path / "r.md").read_text()
    assert "One training seed (3; evaluation seed 0)" in text and "not training seeds" in text
    assert "| test | sampled | 25.0 % | 50.0 % | +25.0 pts | [+0.0, +50.0] | 4 | 0 |" in text
    write_markdown_report(REPORT, tmp_path / "old.md")  # a report written before the field existed
    assert "training seed" not in (tmp_path / "old.md").read_text()
