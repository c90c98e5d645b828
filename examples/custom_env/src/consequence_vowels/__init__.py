"""vowel-count, a plug-in environment for consequence (docs/environments.md)."""

from consequence_vowels.env import VowelCountEnvironment

__all__ = ["VowelCountEnvironment"]
