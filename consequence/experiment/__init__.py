"""Experiments: what a run will spend before it starts, and what it spent (``budget``); what
the arms of an experiment did over their training seeds (``aggregate``).

``aggregate.aggregate`` is not exported here: its name is its module's, which an export must
not shadow (tests/project/test_package_exports.py); import it from ``consequence.experiment.aggregate``."""

from consequence.exports import lazy

_BUDGET = ["BudgetLine", "attempts_for", "plan_lines", "spent_lines", "trajectories_of"]
_AGGREGATE = ["per_problem_success", "write_report"]
__all__ = _BUDGET + _AGGREGATE
__getattr__, __dir__ = lazy(
    __name__,
    {**{name: "budget" for name in _BUDGET}, **{name: "aggregate" for name in _AGGREGATE}},
)
