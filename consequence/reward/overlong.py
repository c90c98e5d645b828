"""DAPO's overlong reward shaping (reward box; Yu et al. 2025, §3.4, eq. 13)."""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """Soft length penalty added to the task reward.

        0                                 if length ≤ max_length − buffer
        (max_length − buffer − length) / buffer   if max_length − buffer < length ≤ max_length
        −1                                if length > max_length

    ``length`` is |y|, the length of what the policy generated: in an episode, its target
    tokens over all its calls (``Trajectory.n_generated_tokens``); the prompt and the
    observations the environment appended are not the policy's response and do not count.
    ``max_length`` is L_max, the most it can generate in the episode
    (``consequence.config.generation_budget``: min(max_turns × max_new_tokens,
    max_total_tokens)), and ``buffer`` is L_cache, so the penalty warns the policy before the
    generation budget is spent.

    Args:
        length: generated tokens, ≥ 0. max_length: L_max, in tokens. buffer: L_cache, in
            (0, L_max], in tokens.

    Returns:
        float in [−1, 0].

    Raises:
        ValueError: buffer not in (0, max_length] or a negative length.

    >>> overlong_penalty(256, 384, 128), overlong_penalty(320, 384, 128), overlong_penalty(400, 384, 128)
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
