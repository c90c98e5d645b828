"""The isolation of untrusted code, used by environments and rewards alike (docs/design.md §7).

- :mod:`~consequence.sandbox.sandbox`: run a candidate against test cases in a hardened,
  time- and memory-limited child (``run_tests``, ``SandboxLimits``, ``isolation_report``);
- :mod:`~consequence.sandbox.judge`: HumanEval-style test programs, the judge in one process
  and the candidate in another (``run_cases``, ``run_program``);
- :mod:`~consequence.sandbox.hardening` (the layers), :mod:`~consequence.sandbox.zygote`
  (the fork server), :mod:`~consequence.sandbox.cases` (what is run).
"""

from consequence.exports import lazy

__all__ = [
    "SandboxLimits",
    "TestCase",
    "TestProgram",
    "TestReport",
    "isolation_report",
    "run_cases",
    "run_program",
    "run_tests",
    "with_retries",
]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "SandboxLimits": "sandbox",
        "TestReport": "sandbox",
        "isolation_report": "sandbox",
        "run_tests": "sandbox",
        "with_retries": "sandbox",
        "TestCase": "cases",
        "TestProgram": "cases",
        "run_cases": "judge",
        "run_program": "judge",
    },
)
