"""Code-repair environment with four tools (gymnasium-style signatures, no dependency).

The policy sees the request, reads the code, runs the VISIBLE tests, replaces lines and
finishes. The reward (at ``finish`` only) is :func:`verify` on the HIDDEN tests: 1.0 if all
pass, else 0.0. Observations are kept short for a small model context.
"""

from __future__ import annotations

from typing import Any

from consequence.envs.humaneval.code_tasks import run_hidden
from consequence.envs.repair.problems import RepairTask
from consequence.sandbox.sandbox import ENV_RETRIES, SandboxLimits, TestReport, run_tests, with_retries

__all__ = ["TOOLS", "SYSTEM_PROMPT", "RepairEnv", "verify", "format_report"]


def _tool(name: str, description: str, props: dict | None = None) -> dict:
    props = props or {}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(props)},
        },
    }


TOOLS: list[dict] = [
    _tool("run_tests", "Run the tests on the current code."),
    _tool("read_code", "Show the current code with line numbers."),
    _tool(
        "replace_line",
        "Replace one line of the code.",
        {
            "line": {"type": "integer", "description": "1-based line number"},
            "code": {"type": "string", "description": "the new line, with indentation"},
        },
    ),
    _tool("finish", "End the episode when the tests pass."),
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)

SYSTEM_PROMPT = "You fix Python functions. Use the tools."

MAX_SHOWN_FAILURES = 2


def verify(task: RepairTask, code: str, limits: SandboxLimits | None = None) -> TestReport:
    """Score ``code`` on the task's HIDDEN tests (the one scoring function for training
    reward and evaluation): a test list or a ``check`` program (HumanEval), see
    :func:`consequence.envs.humaneval.code_tasks.run_hidden`; ``limits=None`` = that mode's default.
    Status ``'sandbox_error'`` means: exclude, do not score."""
    return run_hidden(code, task.hidden_tests, limits)


def format_report(report: TestReport, max_failures: int = MAX_SHOWN_FAILURES) -> str:
    """Short text: ``"2/5 passed"`` then at most ``max_failures`` failure lines."""
    head = f"{report.passed}/{report.total} passed"
    if report.status == "timeout":
        return f"{head}\ntimeout: the code ran too long"
    if report.status == "crash":
        return f"{head}\ncrash: {report.error}"
    if report.error is not None:
        return f"{head}\n{report.error}"
    return "\n".join([head] + report.messages[:max_failures])


class RepairEnv:
    """One repair episode over one :class:`RepairTask`.

    ``step`` takes ``{"name": str, "arguments": dict}`` already validated against TOOLS and
    returns ``(observation, reward, terminated, truncated, info)``. Reward is 0.0 except at
    ``finish``. A sandbox that cannot start is re-run up to ``env_retries`` more times (the
    same check on the same code); ``info["env_retries"]`` counts those re-runs for the step.
    ``info["env_error"]`` is set when the sandbox still failed after them; the episode then
    terminates with reward 0.0 and the caller must exclude it.
    """

    tools = TOOLS
    answer_ends_episode = False  # a reply without a tool call is an ordinary turn

    def __init__(self, task: RepairTask, limits: SandboxLimits | None = None, env_retries: int = ENV_RETRIES):
        self.task = task
        self.limits = limits  # None: each test mode's default limits
        self.env_retries = env_retries
        self._lines: list[str] = task.buggy_code.split("\n")
        self._done = False
        self._tested: tuple[str, float] | None = None  # (code, share of visible tests passed) at the last run_tests

    @property
    def code(self) -> str:
        """The current source of the function."""
        return "\n".join(self._lines)

    @property
    def tested_share(self) -> float | None:
        """Share of the VISIBLE tests (in [0, 1]) that passed at the last ``run_tests`` on the
        code as it is now; None when the current code was never tested (an edit since the
        last run, or no run yet). Kept from the policy's own runs: nothing is run to know it."""
        if self._tested is None or self._tested[0] != self.code:
            return None
        return self._tested[1]

    def _info(self, **kw: Any) -> dict:
        return {"task_id": self.task.task_id, "problem_id": self.task.problem_id, **kw}

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """Restore the buggy code; return the user request (the code itself is not shown)."""
        self._lines = self.task.buggy_code.split("\n")
        self._done, self._tested = False, None
        t = self.task
        obs = f"Fix {t.func_name} in solution.py so all tests pass.\n{t.func_name}: {t.docstring}"
        return obs, self._info()

    def step(self, action: dict) -> tuple[str, float, bool, bool, dict]:
        """Apply one tool call.

        Raises:
            ValueError: unknown tool name.
            RuntimeError: the episode already ended (call ``reset``).
        """
        name = action.get("name")
        args = action.get("arguments") or {}
        if name not in TOOL_NAMES:
            raise ValueError(f"unknown tool {name!r}; expected one of {TOOL_NAMES}")
        if self._done:
            raise RuntimeError("episode is over; call reset()")
        if name == "read_code":
            text = "\n".join(f"{k}| {ln}" for k, ln in enumerate(self._lines, 1))
            return text, 0.0, False, False, self._info()
        if name == "replace_line":
            return self._replace(args), 0.0, False, False, self._info()
        if name == "run_tests":
            code, lim = self.code, self.limits or SandboxLimits()
            rep = with_retries(lambda: run_tests(code, self.task.visible_tests, lim), self.env_retries)
            info = self._info(env_retries=rep.attempts - 1)
            if rep.status == "sandbox_error":
                self._done = True
                info["env_error"] = f"sandbox: {rep.error}"
                return "sandbox error", 0.0, True, False, info
            self._tested = (code, rep.passed / rep.total if rep.total else 0.0)
            return format_report(rep), 0.0, False, False, info
        # finish
        self._done = True
        code = self.code
        rep = with_retries(lambda: verify(self.task, code, self.limits), self.env_retries)
        info = self._info(verifier=rep, env_retries=rep.attempts - 1)
        if rep.status == "sandbox_error":
            info["env_error"] = f"sandbox: {rep.error}"
            return "done", 0.0, True, False, info
        reward = 1.0 if rep.all_passed else 0.0
        info["reward_components"] = {"hidden_tests": reward}
        return "done", reward, True, False, info

    def retry_feedback(self, info: dict) -> str | None:
        """After ``finish`` (``--attempts k``): None when every hidden test passed; else reopen
        the episode with the code as the model left it and say how many hidden tests passed
        (their text and failure messages stay hidden: they would give the tests away)."""
        rep = info.get("verifier")
        if rep is None or rep.all_passed:
            return None
        self._done = False
        return (
            f"finish: {rep.passed}/{rep.total} hidden tests passed; the code is as you left it: "
            "fix it and call finish again"
        )

    def _replace(self, args: dict) -> str:
        n = len(self._lines)
        try:
            line = int(args.get("line", ""))  # missing: int("") fails as a non-number does
        except (TypeError, ValueError):
            return f"error: line must be an integer 1..{n}"
        code = args.get("code")
        if not isinstance(code, str):
            return "error: code must be a string"
        if "\n" in code.rstrip("\n"):
            return "error: code must be one line"
        if not 1 <= line <= n:
            return f"error: line must be 1..{n}"
        self._lines[line - 1] = code.rstrip("\n")
        return "ok"
