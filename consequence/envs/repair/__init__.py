"""The code-repair environments (docs/environments.md): ``repair`` (our generated problems:
:mod:`~consequence.envs.repair.problems` over :mod:`~consequence.envs.repair.families` and
:mod:`~consequence.envs.repair.bugs`), ``humaneval-repair`` and ``jsonl`` (your tasks,
:mod:`~consequence.envs.repair.jsonl`); one episode is :class:`~consequence.envs.repair.env.RepairEnv`;
:mod:`~consequence.envs.repair.hostile` is the corpus of attacks on its sandbox."""

from consequence.exports import lazy

__all__ = ["HumanEvalRepairEnvironment", "JsonlRepairEnvironment", "RepairEnv", "RepairEnvironment"]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "RepairEnvironment": "tasks",
        "HumanEvalRepairEnvironment": "tasks",
        "JsonlRepairEnvironment": "tasks",
        "RepairEnv": "env",
    },
)
