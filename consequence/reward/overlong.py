"""DAPO's overlong reward shaping (reward box; Yu et al. 2025, §3.4, eq. 13)."""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """Soft length penalty added to the task reward.

        0                                 if length ≤ max_length − buffer
        (max_length − buffer − length) / buffer   if max_length − buffer < length ≤ max_length
        −1                                if length > max_length

    Here ``length`` is an episode's token count (context + generated, the quantity the
    ``max_total_tokens`` budget limits), so the penalty warns the policy before the
    budget cuts the episode off.

    Args:
        length: tokens used, ≥ 0. max_length: the budget L_max. buffer: L_cache, in (0, L_max].

    Returns:
        float in [−1, 0].

    Raises:
        ValueError: buffer not in (0, max_length] or a negative length.

    >>> overlong_penalty(640, 768, 128), overlong_penalty(704, 768, 128), overlong_penalty(800, 768, 128)
    (0.0, -0.5, -1.0)
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer must be in (0, {max_length}], got {buffer}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length > max_length:
        return -1.0
    return (start - length) / buffer
