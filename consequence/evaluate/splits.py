"""Split discipline: which splits a run touched, and a warning when test may have chosen settings.

Validation picks settings and checkpoints; the test split is touched once, after the
choice (docs/design.md §7). Every evaluation on a split appends one line to a ledger,
``$CONSEQUENCE_CACHE/split-ledger.jsonl`` (or ``$CONSEQUENCE_LEDGER``), keyed by task source and split seed (the
same problems). Results and run manifests carry the list of splits they touched.

The rule of the warning (:func:`reuse_warning`). A test evaluation of the policies M (the
policy evaluated, plus the other arm of a comparison or the warm start of a training run)
warns when, for some evaluated policy P in M, the ledger holds an earlier test evaluation
E on the same problems (task source and split seed) of a policy Q such that all of

1. Q is not in M: not the same weights (sha256 of the weight files; so a copy, a bitwise
   reproduction or the same folder under another name is the same policy) — re-evaluating a
   policy, or comparing two arms, never warns about itself;
2. E was recorded before P's weights were written (their modification time): a result
   that came after P existed cannot have chosen P's settings or P itself;
3. P does not merely repeat Q's settings: when P and Q are the same checkpoint (e.g.
   ``checkpoints/final``) of two training runs whose ``config.yaml`` are equal apart from
   the run folder, the seed and keys that do not change the weights (``REPEAT_IGNORES``),
   P's settings were fixed before E (as in ``consequence reproduce``).

Then Q's test result existed when P was made and could have been used to make it, so P's
test number may be optimistic. The ledger cannot know what a person looked at; it states
what happened and leaves the judgement to the reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from consequence.config import flat_settings
from consequence.fileio import append_line, cache_root

SPLITS: tuple[str, ...] = ("train", "validation", "test")
# Config keys that do not change a run's weights (or replicate them: the seed).
REPEAT_IGNORES: frozenset[str] = frozenset(
    {
        "run_dir",
        "seed",
        "checkpoint_every",
        "final_eval_episodes",
        "final_eval_decoding",
        "final_eval_splits",
        "skip_checks",
    }
)
_HASHES: dict[tuple, str] = {}


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


def _weight_files(p: Path) -> list[Path]:
    return sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")) if p.is_dir() else []


def fingerprint(policy: str | os.PathLike) -> str:
    """Identity of a checkpoint folder by place: absolute path plus size and modification
    time of its weight files (kept in the ledger for older readers; see :func:`weights_sha256`)."""
    p = Path(policy).resolve()
    stamp = ";".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in _weight_files(p))
    return f"{p}|{stamp}"


def weights_sha256(policy: str | os.PathLike) -> str | None:
    """sha256 over the names and bytes of a checkpoint's weight files (``*.safetensors``,
    ``*.bin``); None when the folder has none. Memoised per (path, size, mtime): a file
    rewritten in place is hashed again."""
    files = _weight_files(Path(policy).resolve())
    if not files:
        return None
    key = tuple((str(w), w.stat().st_size, w.stat().st_mtime_ns) for w in files)
    if key not in _HASHES:
        h = hashlib.sha256()
        for w in files:
            h.update(w.name.encode() + b"\0")
            with open(w, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def weights_written(policy: str | os.PathLike) -> float | None:
    """When the weights were last written (latest mtime of the weight files, Unix seconds)."""
    files = _weight_files(Path(policy).resolve())
    return max(w.stat().st_mtime for w in files) if files else None


def _identity(path: str, sha: str | None) -> str:
    return f"sha256:{sha}" if sha else f"path:{Path(path).resolve()}"


def _entry_time(e: dict[str, Any]) -> float:
    """Unix time of a ledger entry; older entries only have a local time to the second,
    read as the end of that second."""
    if isinstance(e.get("unix_time"), (int, float)):
        return float(e["unix_time"])
    try:
        return time.mktime(time.strptime(e["time"], "%Y-%m-%dT%H:%M:%S")) + 1.0
    except (KeyError, TypeError, ValueError):
        return float("inf")  # unknown time: never counts as before a policy was written


def _run_settings(policy: Path) -> dict[str, Any] | None:
    """The training config of ``RUN/checkpoints/NAME`` minus :data:`REPEAT_IGNORES` (None if not a run)."""
    cfg = policy.parent.parent / "config.yaml"
    if policy.parent.name != "checkpoints" or not cfg.is_file():
        return None
    try:
        data = flat_settings(yaml.safe_load(cfg.read_text()))
    except (yaml.YAMLError, OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    out = {}
    for k, v in data.items():
        if k in REPEAT_IGNORES:
            continue
        out[k] = str(Path(v).resolve()) if isinstance(v, str) and k in ("model", "tasks") and Path(v).exists() else v
    return out


def repeats_settings(p: str | os.PathLike, q: str | os.PathLike) -> bool:
    """P and Q are the same checkpoint name of two runs with equal settings (rule 3)."""
    p, q = Path(p).resolve(), Path(q).resolve()
    if p.name != q.name:
        return False
    sp = _run_settings(p)
    return sp is not None and sp == _run_settings(q)


def earlier_choosers(tasks: str, split_seed: int, policies: list[str], path: Path | None = None) -> list[str]:
    """Paths of the policies Q whose earlier test evaluations count under the rule of the
    module docstring against this evaluation of ``policies`` (sorted, unique)."""
    mine = {_identity(p, weights_sha256(p)) for p in policies}
    written = {p: weights_written(p) for p in policies}
    found: set[str] = set()
    for e in read_ledger(path):
        if e.get("split") != "test" or e.get("tasks") != tasks or e.get("split_seed") != split_seed:
            continue
        shas = e.get("weights_sha256") or [None] * len(e.get("policies", []))
        for q, sha in zip(e.get("policies", []), shas):
            if _identity(q, sha) in mine:
                continue
            when = _entry_time(e)
            for p in policies:
                made = written[p]
                if (made is None or when < made) and not repeats_settings(p, q):
                    found.add(str(q))
    return sorted(found)


def reuse_warning(tasks: str, split_seed: int, policies: list[str], path: Path | None = None) -> str | None:
    """The warning for a new test evaluation of ``policies`` (every policy of this run,
    e.g. both arms of a comparison), or None when no earlier test evaluation of another
    policy could have chosen them (the rule of the module docstring)."""
    others = earlier_choosers(tasks, split_seed, policies, path)
    if not others:
        return None
    shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return (
        f"the test split of {tasks} (split seed {split_seed}) was evaluated for {len(others)} other "
        f"polic{'y' if len(others) == 1 else 'ies'} ({shown}; ledger {path or ledger_path()}) before the "
        "weights evaluated now were written. If those results were seen when this policy's settings or "
        "checkpoint were chosen, the test split took part in the choice and this test number is "
        "optimistic: choose on validation, then run test once."
    )


def record_touch(
    tasks: str, split_seed: int, split: str, purpose: str, policies: list[str], path: Path | None = None
) -> dict[str, Any]:
    """Append one touch to the ledger and return it (also for the result's own record).

    Args:
        tasks: task source name; split_seed: the split's seed (together: the problems).
        split: ``train``, ``validation``, ``test`` (or ``all`` for HumanEval).
        purpose: e.g. ``"consequence eval"``, ``"final evaluation of a training run"``.
        policies: the evaluated checkpoints (stored as absolute paths, fingerprints and
            the sha256 of their weights).

    A ledger that cannot be written (read-only cache) does not stop the evaluation; the
    returned record says ``"ledger": null``.
    """
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "unix_time": time.time(),
        "tasks": tasks,
        "split_seed": split_seed,
        "split": split,
        "purpose": purpose,
        "policies": [str(Path(p).resolve()) for p in policies],
        "fingerprints": [fingerprint(p) for p in policies],
        "weights_sha256": [weights_sha256(p) for p in policies],
        "pid": os.getpid(),
    }
    path = path or ledger_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        append_line(path, json.dumps(entry))
        entry["ledger"] = str(path)
    except OSError:
        entry["ledger"] = None
    return entry
