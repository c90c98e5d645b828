"""Labs: small experiments that plot one idea each, computed with the project's own boxes.

``LABS`` maps a lab name to ``run(out_dir: Path, seed: int = 0) -> dict``, which writes
``out_dir/<name>.png`` and returns the printed numbers (and ``"png"``, the image path).
Run one with ``consequence lab NAME``; ``consequence lab`` lists them with
:func:`describe`; see docs/labs.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from consequence.labs import baseline, clip, importance, lag, mixed_groups, passk, reduction, shaping

LABS: dict[str, Callable[..., dict]] = {
    "baseline": baseline.run,
    "importance": importance.run,
    "clip": clip.run,
    "reduction": reduction.run,
    "mixed-groups": mixed_groups.run,
    "passk": passk.run,
    "shaping": shaping.run,
    "lag": lag.run,
}


def describe(name: str) -> str:
    """One line on what lab ``name`` shows: the first line of its module's docstring,
    without the ``Lab ``name``:`` prefix."""
    doc = (sys.modules[LABS[name].__module__].__doc__ or "").strip().split("\n")[0]
    return doc.split(":", 1)[1].strip() if doc.startswith("Lab ") and ":" in doc else doc
