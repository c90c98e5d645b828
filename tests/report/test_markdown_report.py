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


def test_the_report_shows_the_shortcut_diagnostics_per_split_and_decoding(tmp_path):
    """Warm start → RL for each diagnostic (evaluate/shortcuts.py); — where undefined."""
    from consequence.evaluate.shortcuts import SHORTCUT_METRICS

    warm = {k: 0.5 for k, _ in SHORTCUT_METRICS} | {"answer_entropy": 2.0}
    rl = {k: 0.25 for k, _ in SHORTCUT_METRICS} | {"answer_entropy": 0.8113, "answer_equals_tool_value": None}
    results = [
        {**REPORT["results"][0], "split": "test (unseen problems)", "decoding": d, "warm_start": warm, "rl": rl}
        for d in ("greedy", "sampled")
    ]
    write_markdown_report({**REPORT, "results": results}, tmp_path / "r.md")
    text = (tmp_path / "r.md").read_text()
    assert "| measure | test, greedy | test, sampled |" in text
    assert "| episodes with a tool call | 50.0 % → 25.0 % | 50.0 % → 25.0 % |" in text
    assert "| answer entropy (bits) | 2.00 bits → 0.81 bits | 2.00 bits → 0.81 bits |" in text
    assert "| answers equal to the last tool value | 50.0 % → — | 50.0 % → — |" in text
    write_markdown_report(REPORT, tmp_path / "old.md")  # results written before the diagnostics existed
    assert "Shortcut diagnostics" not in (tmp_path / "old.md").read_text()


def test_the_eval_report_has_a_shortcut_section():
    from consequence.evaluate.report import shortcut_lines

    lines = shortcut_lines({"tool_call_rate": 0.75, "invalid_call_unparsable": 0.0, "answer_entropy": None})
    assert "## Shortcut diagnostics" in lines and "| episodes with a tool call | 75.0 % |" in lines
    stopped = "| model calls that stopped on their own and did not parse (cut ones excluded) | 0.0 % |"
    assert stopped in lines and "| answer entropy (bits) | — |" in lines
    assert shortcut_lines(None) == []  # an eval.json written before they existed
