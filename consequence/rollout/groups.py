"""The group builder's output, checked: G isolated episodes of one task (rollout box)."""

from __future__ import annotations

from typing import Any

__all__ = ["group_of"]


def group_of(env, task: Any, size: int) -> list:
    """``env.make_group(task, size)``, checked before any episode runs.

    Raises:
        ValueError: the builder returned another number of episodes than ``size``, or the
            same episode object twice (copies of a group must not share state).
    """
    episodes = list(env.make_group(task, size))
    if len(episodes) != size:
        raise ValueError(
            f"environment {env.name!r}: make_group({task.task_id!r}, {size}) returned "
            f"{len(episodes)} episodes; a group needs exactly {size} (one per rollout)"
        )
    if len({id(e) for e in episodes}) != size:
        raise ValueError(
            f"environment {env.name!r}: make_group({task.task_id!r}, {size}) returned the same "
            "episode object more than once; each rollout needs its own isolated episode"
        )
    return episodes
