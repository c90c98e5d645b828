"""The values of the harness options ``--context`` and ``--observation-format``, parsed in one
place for the settings (refused before any work) and the harness (``harness.context``)."""

from __future__ import annotations

CONTEXTS = ("full", "last:K", "summary:K")
OBSERVATION_FORMATS = ("raw", "json", "truncated:N")


def _count(option: str, value: str, kind: str, what: str) -> int:
    """The positive integer after ``kind:`` in ``value``; ValueError naming ``option`` otherwise."""
    text = value[len(kind) + 1 :]
    if not text.isdigit() or int(text) < 1:
        raise ValueError(
            f"{option} {value}: {kind}:{what[0]} needs a whole number >= 1 of {what} after the colon, e.g. {kind}:2"
        )
    return int(text)


def parse_context(value: str) -> tuple[str, int]:
    """``(kind, K)`` of a ``--context`` value: ``full`` → ``("full", 0)``, ``last:K`` / ``summary:K``.

    Raises:
        ValueError: another value, or K not a whole number >= 1 (the message names the option).
    """
    if value == "full":
        return "full", 0
    for kind in ("last", "summary"):
        if value.startswith(kind + ":"):
            return kind, _count("--context", value, kind, "K turns")
    raise ValueError(f"--context {value}: choose one of {', '.join(CONTEXTS)} (K a whole number >= 1)")


def parse_observation_format(value: str) -> tuple[str, int]:
    """``(kind, N)`` of an ``--observation-format`` value: ``raw`` / ``json`` → N = 0, ``truncated:N``.

    Raises:
        ValueError: another value, or N not a whole number >= 1 (the message names the option).
    """
    if value in ("raw", "json"):
        return value, 0
    if value.startswith("truncated:"):
        return "truncated", _count("--observation-format", value, "truncated", "N characters")
    raise ValueError(
        f"--observation-format {value}: choose one of {', '.join(OBSERVATION_FORMATS)} (N a whole number >= 1)"
    )
