"""Procedural tasks of the ``reasoning-gym`` package (``--env reasoning-gym``; docs/environments.md)."""

from consequence.exports import lazy

__all__ = ["ReasoningGymEnvironment"]
__getattr__, __dir__ = lazy(__name__, {"ReasoningGymEnvironment": "env"})
