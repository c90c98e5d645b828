"""Experiments: what a run will spend before it starts, and what it spent (``budget``)."""

from consequence.exports import lazy

__all__ = ["BudgetLine", "attempts_for", "plan_lines", "spent_lines", "trajectories_of"]
__getattr__, __dir__ = lazy(
    __name__,
    {name: "budget" for name in __all__},
)
