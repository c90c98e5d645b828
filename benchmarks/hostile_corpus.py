"""The hostile-program corpus through the default task's sandbox: the README table.

Runs every case of :mod:`consequence.envs.repair.hostile` (and the two controls) through the
visible-test runner (``sandbox.run_tests``) and the reward path (``RepairEnv`` ``finish``
-> the two-process judge) with the training defaults, one case at a time, and prints a
Markdown table: case, what it tries, visible-test feedback, reward, processes left
alive, files outside the work directory changed, wall seconds (both runs), and the judge's
reason for the 0 (paths cut). Writes
``benchmarks/results/hostile_corpus.json`` with the host's isolation layers.
Run: ``.venv/bin/python benchmarks/hostile_corpus.py`` (about 20 s; Linux only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

from consequence.envs.repair.hostile import CASES, CONTROLS, host_guards, run_case
from consequence.sandbox.sandbox import isolation_report


def _why(text: str) -> str:
    """The judge's reason without paths or the test call, e.g. ``PermissionError [Errno 13]``."""
    text = re.sub(r"^add\([^)]*\) ", "", text)
    text = re.sub(r": '[^']*'$", "", text).replace("Permission denied", "").rstrip(": ")
    return text.replace("|", "/")


def _row(r) -> str:
    if r.skipped:
        return f"| `{r.name}` | {r.tries} | skipped: {r.skipped} | | | | | |"
    fb = r.feedback + (" (forged)" if r.feedback_passed and not r.name.startswith("control") else "")
    reward = f"{r.reward:g}" + (f" ({r.reward_status})" if r.reward_status != "ok" else "")
    if r.env_error:
        reward = f"env_error: {r.env_error}"
    outside = ", ".join(r.outside_changed) if r.outside_changed else "none"
    if r.connections:
        outside += f"; {r.connections} connection(s) reached the host"
    return (
        f"| `{r.name}` | {r.tries} | {fb} | {reward} | {_why(r.why)} | {len(r.survivors)} "
        f"| {outside} | {r.wall_s:.2f} |"
    )


def main() -> None:
    guards = host_guards()
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="hostile-") as d:
        for case in CASES + CONTROLS:
            results.append(run_case(case, Path(d) / case.name, guards=guards))
    total_s = time.perf_counter() - t0
    print(
        "| case | what it tries | visible tests (run_tests) | reward (judge) | judge's reason "
        "| processes left | changed outside the work dir | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(_row(r))
    hostile = [r for r in results if not r.name.startswith("control") and not r.skipped]
    contained = [
        r
        for r in hostile
        if r.reward == 0.0 and not r.env_error and not r.survivors and not r.outside_changed and not r.connections
    ]
    print(
        f"\n{len(CASES)} hostile programs ({len(hostile)} run, {len(CASES) - len(hostile)} "
        f"skipped), {len(contained)} contained (reward 0, nothing outside changed, no "
        f"process left); visible-test feedback forged by "
        f"{sum(r.feedback_passed for r in hostile)}; {total_s:.1f} s in all"
    )
    print("isolation:", json.dumps(isolation_report()))
    out = Path(__file__).parent / "results" / "hostile_corpus.json"
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "cases": len(CASES),
                "run": len(hostile),
                "contained": len(contained),
                "total_s": total_s,
                "host": {
                    "uid": os.geteuid(),
                    "kernel": platform.release(),
                    "python": sys.version.split()[0],
                    "guards": guards,
                    "isolation": isolation_report(),
                },
                "results": [dataclasses.asdict(r) for r in results],
            },
            indent=2,
        )
    )
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
