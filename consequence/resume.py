"""Moved: resume states are ``consequence.loop.resume`` (this name is kept while the layout changes)."""

from consequence.loop.resume import *  # noqa: F403
from consequence.loop.resume import resume_config

__all__ = ["resume_config"]
