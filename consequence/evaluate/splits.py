"""Split discipline: which splits a run touched, and a warning when test chose settings.

Validation picks settings and checkpoints; the test split is touched once, after the
choice (docs/design.md §7). Every evaluation on a split appends one line to a ledger,
``$CONSEQUENCE_CACHE/split-ledger.jsonl`` (or ``$CONSEQUENCE_LEDGER``), keyed by task source and split seed (the
same problems). Results and run manifests carry the list of splits they touched.

A test evaluation of a policy when the ledger already holds test evaluations of OTHER
policies on the same problems gets a warning in its report: if those results were looked
at before this policy's settings were chosen, the choice used the test split and this
test number is optimistic. The ledger cannot know what a person looked at; it states
what happened and leaves the judgement to the reader.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from consequence.fileio import append_line, cache_root

SPLITS: tuple[str, ...] = ("train", "validation", "test")


def ledger_path() -> Path:
    """``$CONSEQUENCE_LEDGER`` if set, else ``$CONSEQUENCE_CACHE/split-ledger.jsonl``."""
    override = os.environ.get("CONSEQUENCE_LEDGER")
    return Path(override) if override else cache_root() / "split-ledger.jsonl"


def read_ledger(path: Path | None = None) -> list[dict[str, Any]]:
    """Every recorded touch, oldest first; an unreadable line is skipped (a crash mid-append
    is cut back by :func:`append_line`, so only hand edits produce one)."""
    path = path or ledger_path()
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def fingerprint(policy: str | os.PathLike) -> str:
    """Identity of a checkpoint: its absolute path plus the size and modification time of
    its weight files (cheap for any model size), so retraining into the same folder is a
    new policy and the same folder named another way is the same one."""
    p = Path(policy).resolve()
    weights = sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")) if p.is_dir() else []
    stamp = ";".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    return f"{p}|{stamp}"


def reuse_warning(tasks: str, split_seed: int, policies: list[str], path: Path | None = None) -> str | None:
    """The warning for a new test evaluation of ``policies`` (every policy of this run,
    e.g. both arms of a comparison), or None when no OTHER policy was evaluated on the
    test split of these problems before (policies are told apart by :func:`fingerprint`)."""
    earlier = [e for e in read_ledger(path) if e.get("split") == "test" and e.get("tasks") == tasks
               and e.get("split_seed") == split_seed]
    mine = {fingerprint(p) for p in policies}
    others = sorted({f.split("|")[0] for e in earlier for f in e.get("fingerprints", []) if f not in mine})
    if not others:
        return None
    shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return (f"the test split of {tasks} (split seed {split_seed}) was evaluated before for {len(others)} other "
            f"polic{'y' if len(others) == 1 else 'ies'} ({shown}; ledger {path or ledger_path()}). If those "
            "results were seen before this policy's settings or checkpoint were chosen, the test split took "
            "part in the choice and this test number is optimistic: choose on validation, then run test once.")


def record_touch(tasks: str, split_seed: int, split: str, purpose: str, policies: list[str],
                 path: Path | None = None) -> dict[str, Any]:
    """Append one touch to the ledger and return it (also for the result's own record).

    Args:
        tasks: task source name; split_seed: the split's seed (together: the problems).
        split: ``train``, ``validation``, ``test`` (or ``all`` for HumanEval).
        purpose: e.g. ``"consequence eval"``, ``"final evaluation of a training run"``.
        policies: the evaluated checkpoints (stored as absolute paths and fingerprints).

    A ledger that cannot be written (read-only cache) does not stop the evaluation; the
    returned record says ``"ledger": null``.
    """
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "tasks": tasks, "split_seed": split_seed,
             "split": split, "purpose": purpose, "policies": [str(Path(p).resolve()) for p in policies],
             "fingerprints": [fingerprint(p) for p in policies], "pid": os.getpid()}
    path = path or ledger_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        append_line(path, json.dumps(entry))
        entry["ledger"] = str(path)
    except OSError:
        entry["ledger"] = None
    return entry
