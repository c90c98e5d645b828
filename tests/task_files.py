"""Repair tasks as JSONL for the tests that train on a task file (docs/tasks.md format)."""

import json


def repair_record(i: int, **extra) -> dict:
    return {
        "task_id": f"max-{i}",
        "problem_id": f"p{i}",
        "kind": "repair",
        "prompt": "Return the largest element.",
        "starting_code": "def f(xs):\n    return min(xs)",
        "entry_point": "f",
        "visible_tests": [{"call": "f([1, 2])", "expected": "2"}],
        "hidden_tests": [{"call": f"f([{i}, {i + 5}, 1])", "expected": str(i + 5)}],
        "patch": [2, "    return max(xs)"],
        **extra,
    }


def write_tasks(path, n: int = 12, bad_line: dict | None = None) -> None:
    """``n`` valid repair tasks as JSONL (distinct problems); ``bad_line`` replaces line 3."""
    records = [repair_record(i) for i in range(n)]
    if bad_line is not None:
        records[2] = bad_line
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
