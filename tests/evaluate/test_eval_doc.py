"""docs/evaluation.md checks a real report by hand: rebuild its episodes, recompute, compare."""

import re
from pathlib import Path

import pytest

from consequence.evaluate.episode_eval import outcome_shares, per_task_counts, summarize_pass_at_k
from consequence.evaluate.selection import summarize_selection
from consequence.evaluate.stats import binomial_se
from consequence.records import Trajectory

DOC = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"


def _episodes():
    text = DOC.read_text()
    table = text.split("<!-- episodes -->")[1].split("<!-- /episodes -->")[0]
    trajs, visible = [], {}
    for line in table.strip().splitlines()[2:]:
        problem, sample, outcome, program, vis, hidden = [c.strip() for c in line.strip("|").split("|")]
        reason = re.match(r"truncated \((\w+)\)", outcome)
        t = Trajectory(
            task_id=f"{problem}#0",
            group_id=problem,
            sample_id=int(sample),
            seed=0,
            policy_version=0,
            outcome="truncated" if reason else outcome,
            truncation_reason=reason and reason.group(1),
            verifier_score={"pass": 1.0, "fail": 0.0}.get(hidden),
            final_code=program,
        )
        trajs.append(t)
        visible[(problem, program)] = int(vis.split("/")[0])
    return trajs, lambda t: visible[(t.group_id, t.final_code)], text


def test_the_documented_report_is_what_the_library_computes():
    trajs, visible, text = _episodes()
    assert len(trajs) == 24
    pak = summarize_pass_at_k(per_task_counts(trajs), [1, 2, 4])
    assert [round(pak[k]["pass_at_k"], 3) for k in "124"] == [0.125, 0.250, 0.500]
    assert round(binomial_se(0.125, 6), 3) == 0.135
    sel = summarize_selection(trajs, [1, 2, 4], visible_score=visible)
    got = {rule: [round(sel[rule][k]["success"], 3) for k in "124"] for rule in sel}
    assert got == {"first": [0.125, 0.0, 0.0], "majority": [0.125, 0.0, 0.0], "visible": [0.125, 0.25, 0.5]}
    shares = outcome_shares(trajs)["shares"]
    assert (
        round(shares["solved"], 3),
        round(shares["truncated_max_turns"], 3),
        round(shares["submitted_wrong"], 3),
    ) == (0.125, 0.083, 0.792)
    # every number the hand check prints in bold
    for number in ["0.125", "0.250", "0.500", "0.135", "0.000", "0.292"]:
        assert f"**{number}**" in text, number


def test_documented_recovery_rate():
    text = " ".join(DOC.read_text().split())
    listing = text.split("solved per sample 0–3:")[1].split("The report's")[0].strip().rstrip(".")
    solved = {}
    for item in listing.split(";"):
        name, *values = item.split()
        solved[name] = [int(v) for v in values]
    assert solved["find_min.s1"] == [1, 0, 1, 1] and len(solved) == 6
    trajs = [
        Trajectory(task_id=f"{p}#0", group_id=p, sample_id=j, seed=0, policy_version=0, verifier_score=float(v))
        for p, vs in solved.items()
        for j, v in enumerate(vs)
    ]
    rec = summarize_pass_at_k(per_task_counts(trajs), [1])["1"]["pass_at_k"]
    assert rec == pytest.approx(1.75 / 6) and round(rec, 3) == 0.292
