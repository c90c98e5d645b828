"""The task box: the environment API (``api``: ``Environment``, ``Episode``,
``SingleTurnEnvironment``), the registry of names (``registry``), and one subpackage per
environment (docs/environments.md)."""

from consequence.exports import lazy

__all__ = ["Environment", "Episode", "SingleTurnEnvironment", "env_of", "load_environment", "register_env"]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "Environment": "api",
        "Episode": "api",
        "SingleTurnEnvironment": "api",
        "register_env": "registry",
        "load_environment": "registry",
        "env_of": "registry",
    },
)
