"""An OpenEnv server's environment over HTTP (``--env openenv``; docs/environments.md)."""

from consequence.exports import lazy

__all__ = ["OpenEnvEnvironment"]
__getattr__, __dir__ = lazy(__name__, {"OpenEnvEnvironment": "env"})
