"""What the sandbox runs: a test case (a call and its expected ``repr``) or a test program
(HumanEval's ``check(candidate)``); environments build them, ``sandbox.run_tests`` and
``judge.run_cases`` run them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TestCase", "TestProgram"]


@dataclass(frozen=True)
class TestCase:
    """One test: ``call`` is evaluated, ``repr`` of its result must equal ``expected``."""

    __test__ = False  # not a pytest class
    call: str
    expected: str


@dataclass(frozen=True)
class TestProgram:
    """Tests as a program (HumanEval style), run by ``consequence.sandbox.judge``.

    ``check`` is Python source defining ``check(candidate)``, which raises (e.g. a failed
    ``assert``) iff the candidate is wrong; ``entry_point`` names the candidate function;
    ``setup`` is trusted source executed before ``check`` in the judge (helpers the test
    uses, e.g. HumanEval's prompt with ``poly`` or ``encode_cyclic``). The judge never
    executes candidate code: ``candidate`` is a proxy to another process.
    """

    __test__ = False  # not a pytest class
    check: str
    entry_point: str
    setup: str = ""
