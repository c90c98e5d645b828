"""Arithmetic with a calculator tool (``--env calculator``; docs/environments.md)."""

from consequence.exports import lazy

__all__ = ["CalculatorEnvironment"]
__getattr__, __dir__ = lazy(__name__, {"CalculatorEnvironment": "env"})
