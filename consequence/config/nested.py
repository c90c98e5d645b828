"""YAML nested by box: ``update: {learning_rate: 2e-4}`` as well as ``learning_rate: 2e-4``.

The boxes are those of the loop (``config.BOXES``) plus ``run``; every field belongs to one
(``config.box_of``). A run's ``config.yaml`` and ``consequence train --print-config`` are
nested; the command line stays flat (``--learning-rate``), and a flat file (every run's
``config.yaml`` before this) still reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The loop's order, with the run's own settings first.
ORDER: tuple[str, ...] = ("run", "policy", "tasks", "rollout", "reward", "credit", "update", "evaluate")


def nested(values: Mapping[str, Any], box_of) -> dict[str, dict[str, Any]]:
    """``values`` (flat, field → value, in field order) grouped by box, in :data:`ORDER`;
    boxes with no field left out. ``box_of(name)`` gives a field's box."""
    out: dict[str, dict[str, Any]] = {box: {} for box in ORDER}
    for name, value in values.items():
        out[box_of(name)][name] = value
    return {box: fields for box, fields in out.items() if fields}


def flat(data: Mapping[str, Any], fields: Mapping[str, Any], box_of) -> dict[str, Any]:
    """A settings mapping with its box sections (``update: {...}``) merged into one flat one.

    A key that is a box name and holds a mapping is a section (``tasks: humaneval``, a string,
    stays the older name of ``env``); every other key passes as it is, so an unknown one is
    refused by the model with its close matches.

    Raises:
        ValueError: a box section that is not a mapping, a field under a box it does not
            belong to (naming the right box), or a field given twice (flat and in its section).
    """
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in ORDER and key != "tasks" and not isinstance(value, Mapping):  # `tasks: NAME` is env's older name
            raise ValueError(
                f"{key}: a box section holds the box's settings as a mapping (e.g. update: "
                f"{{learning_rate: 2.0e-4}}), got {value!r}"
            )
        if key not in ORDER or not isinstance(value, Mapping):
            _put(out, key, value, "")
            continue
        for name, v in value.items():
            if name in fields and box_of(name) != key:
                raise ValueError(
                    f"{key}.{name}: {name} is a setting of the {box_of(name)} box, not of {key}; "
                    f"move it under {box_of(name)}:"
                )
            _put(out, name, v, f"{key}.")
    return out


def _put(out: dict[str, Any], name: str, value: Any, where: str) -> None:
    if name in out:
        raise ValueError(f"{where}{name}: given twice (flat and under its box); give it once")
    out[name] = value
