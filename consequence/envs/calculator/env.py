"""Arithmetic with a calculator tool: ``calculator``, a multi-turn environment that is not code.

A task is an arithmetic question too long to do reliably in one's head: an expression
("What is 4837 * 29 - 1204?", ``terms`` operands of ``digits`` digits joined by + - *,
sometimes with one pair of parentheses; an operand is at least 2) or, about a third of
the time, a small word problem (a stock that grows, shrinks and is multiplied step by step,
evaluated in the order told: ``terms`` numbers, the counts of ``digits`` digits, a
multiplier of ``max(1, digits - 1)`` digits and at least 2, a stock that never falls below
1). The reference answer is an integer.

The policy MAY call the tool ``calculator`` with one argument ``expression`` (a string)
before it answers. The expression is checked with :mod:`ast` first (numbers, ``+ - * / //
% **``, unary ``-`` / ``+``, parentheses; at most :data:`MAX_EXPRESSION_CHARS` characters;
an exponent must be a number literal of magnitude at most :data:`MAX_EXPONENT`; an integer
part whose magnitude could exceed ``10 ** MAX_DIGITS`` by an upper bound is refused), and only an accepted
expression is evaluated, in the existing sandbox (:func:`consequence.sandbox.sandbox.run_tests`:
a fresh isolated interpreter, :data:`CALC_LIMITS`: 2 s wall, 1 s CPU). The observation is
the value's ``repr`` (``"84"``, ``"3.5"``) or ``"error: ..."``; a refused expression runs
nothing and is an error observation, never an exception.

The episode ends when the policy replies without a tool call: that reply is the answer.
Answer rule (:func:`extract_answer`): the content of the last ``<answer>…</answer>`` in the
reply, which must be one number (``-12``, ``139069``, ``1,234``, ``84.0``); without that tag,
the last number in the reply. The answer is correct when its value equals the reference
exactly (``84``, ``84.0`` and ``84.00`` are 84; ``83.99`` is not).

Reward (rule: sum over steps and components), per step:

- ``accuracy`` (primary; success when 1): at the answer step, 1.0 if the answer is correct,
  else 0.0 (also 0.0 when the reply holds no number);
- ``tool_cost``: at each calculator call's step, ``-tool_cost`` (option, >= 0, default 0.0),
  for every call within the budget of ``max_calls`` (option, default 4), whether or not its
  expression was accepted. A call beyond the budget is refused with an error observation
  (``error: calculator limit reached ...``), evaluates nothing and costs 0.0; the episode
  goes on (the policy should answer).

So an episode's reward is ``accuracy - tool_cost * n_calls`` with ``n_calls <= max_calls``,
and ``reward_range = (-tool_cost * max_calls * (1 + 1e-9), 1.0)`` (the factor covers the
rounding of the per-step sum); an episode that never answers (a budget ended it) scores
``-tool_cost * n_calls``. A sandbox that cannot start is re-run up to
``sandbox.ENV_RETRIES`` times, then the episode is an ``env_error`` (excluded, never 0).

Tasks: ``n_problems`` problems generated deterministically from ``digits``, ``terms`` and
``shift`` (not from the split seed: problem ``i`` is the same for every seed and every
``n_problems``); the split seed splits them by problem id ≈ 80 / 10 / 10
(:func:`consequence.envs.repair.jsonl.split_by_problem`). One task per problem; the problem
id names the difficulty (``calc-d3t3-0042``).

No shortcut without the arithmetic (:func:`make_problems` redraws a problem until it
holds): question texts are distinct, so no question is in two splits; answers are
distinct, so a constant answer is right on at most one problem of the whole set (≤ 1 / 60
of a 60-problem split, the default's validation and test); an answer is never -1, 0 or 1,
and its magnitude is none of the numbers written in its question (copying one never
scores); the calculator accepts the task's ``expression`` whole. Options that cannot give
``n_problems`` such problems (e.g. ``digits=1 terms=2``) are refused, naming the fix.

The held-out shift (option ``shift=true``, for evaluation only): for the same ``digits``
and ``terms`` the problems a policy trained on the default ones never saw: operands of
``digits + 1`` digits and ``terms + 1`` operands (expressions and word problems alike; a
word problem's multiplier has ``digits`` digits), and word problems in a held-out wording
(other places, units, opening, step sentences and closing question; no sentence is shared
with the default wording). Its problems have their own random streams and ids
(``calc-d4t4s-0042`` is the shift of ``digits=3 terms=3``) and are split ≈ 0 / 50 / 50:
there is no train split, and a training run with ``shift=true`` is refused. Evaluate a run
trained with ``--env-option digits=D --env-option terms=T`` on its shift with
``consequence eval --model RUN --env calculator --env-option digits=D --env-option terms=T
--env-option shift=true`` (options given to eval replace the run's, so repeat them).
"""

from __future__ import annotations

import ast
import math
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from consequence.envs.api import SPLITS, Environment
from consequence.envs.repair.problems import TestCase
from consequence.sandbox.sandbox import ENV_RETRIES, SandboxLimits, TestReport, run_tests, with_retries

__all__ = [
    "TOOLS",
    "CALC_LIMITS",
    "MAX_EXPRESSION_CHARS",
    "MAX_EXPONENT",
    "MAX_DIGITS",
    "ArithmeticTask",
    "check_expression",
    "calculate",
    "extract_answer",
    "is_correct",
    "make_problems",
    "CalculatorEpisode",
    "CalculatorEnvironment",
]

TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 4837 * 29 - 1204"}},
                "required": ["expression"],
            },
        },
    }
]

# wall_s: seconds for the whole sandbox run; cpu_s: CPU seconds; memory_mb: MiB of address space.
CALC_LIMITS = SandboxLimits(wall_s=2.0, cpu_s=1, memory_mb=256, max_output_bytes=4096)
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000  # |k| of a ** k, a number literal
MAX_DIGITS = 100  # an integer part whose magnitude could exceed 10 ** MAX_DIGITS is refused (an upper bound)
_CHUNK = 64  # characters of the value read back per sandbox test (the runner shows <= 80)
_CHUNKS = 3  # so values of up to 192 characters come back whole

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


# ---- the tool -----------------------------------------------------------------------
class _Refused(Exception):
    pass


def _literal(node: ast.AST) -> int | float | None:
    """The value of a number literal with optional unary signs, else None."""
    sign = 1
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign = -sign if isinstance(node.op, ast.USub) else sign
        node = node.operand
    # bool is the only subclass of int or float an ast.Constant holds, and is no number literal
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return sign * node.value
    return None


def _bound(node: ast.AST) -> tuple[str, float]:
    """(``"int"`` or ``"float"``, an upper bound on log10 of the magnitude of an int value).

    Float arithmetic is O(1) (it overflows instead of growing), so only int parts are bounded.

    Raises:
        _Refused: a node that is not arithmetic, an exponent that is not a small literal,
            or an int part that could exceed ``10 ** MAX_DIGITS``.
    """
    if isinstance(node, ast.Constant):
        if type(node.value) is int:
            return "int", math.log10(abs(node.value)) if node.value else 0.0
        if type(node.value) is float:
            return "float", 0.0
        raise _Refused(f"only numbers are allowed, not {node.value!r}")
    if isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd)):
            raise _Refused(f"operator {type(node.op).__name__} is not allowed (use + - * / // % **)")
        return _bound(node.operand)
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINOPS:
            raise _Refused(f"operator {type(node.op).__name__} is not allowed (use + - * / // % **)")
        ka, la = _bound(node.left)
        if isinstance(node.op, ast.Pow):
            k = _literal(node.right)
            if k is None:
                _bound(node.right)  # name the offending node when there is one
                raise _Refused("an exponent must be a number literal (e.g. 2 ** 10), not an expression")
            if abs(k) > MAX_EXPONENT:
                raise _Refused(f"exponent {k} is too large (at most {MAX_EXPONENT} in magnitude)")
            if ka == "int" and type(k) is int and k >= 0:
                kind, log = "int", la * k
            else:
                kind, log = "float", 0.0
        else:
            kb, lb = _bound(node.right)
            if isinstance(node.op, ast.Div) or "float" in (ka, kb):
                kind, log = "float", 0.0
            elif isinstance(node.op, (ast.Add, ast.Sub)):
                kind, log = "int", max(la, lb) + math.log10(2)
            elif isinstance(node.op, ast.Mult):
                kind, log = "int", la + lb
            elif isinstance(node.op, ast.FloorDiv):  # |a // b| <= |a| for an int b != 0
                kind, log = "int", la
            else:  # Mod: |a % b| < |b|
                kind, log = "int", lb
        if kind == "int" and log > MAX_DIGITS + 1e-9:
            raise _Refused(f"the result could exceed 10**{MAX_DIGITS}; split the computation")
        return kind, log
    what = {
        ast.Name: "names",
        ast.Call: "function calls",
        ast.Attribute: "attributes",
        ast.Subscript: "subscripts",
    }.get(type(node), type(node).__name__)
    raise _Refused(f"only arithmetic is allowed (numbers, + - * / // % **, parentheses), not {what}")


def check_expression(expression: object) -> str | None:
    """Why ``expression`` is refused (the text after ``error: ``), or None when it may run.

    >>> check_expression("12*(3+4)") is None
    True
    >>> check_expression("9**9**9")
    'an exponent must be a number literal (e.g. 2 ** 10), not an expression'
    """
    if not isinstance(expression, str):
        return f"expression must be a string, got {type(expression).__name__}"
    if not expression.strip():
        return "empty expression"
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"expression too long ({len(expression)} characters; at most {MAX_EXPRESSION_CHARS})"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        return f"not an arithmetic expression ({getattr(e, 'msg', e)})"
    try:
        _bound(tree.body)
    except _Refused as e:
        return str(e)
    except RecursionError:
        return "expression nested too deeply"
    return None


def calculate(
    expression: object, limits: SandboxLimits = CALC_LIMITS, env_retries: int = ENV_RETRIES
) -> tuple[str, TestReport | None]:
    """Evaluate ``expression`` in the sandbox: (observation, the sandbox's report).

    The observation is the value's ``repr`` or ``"error: ..."``; the report is None when
    :func:`check_expression` refused the expression (then nothing ran), and has status
    ``'sandbox_error'`` when the sandbox failed ``1 + env_retries`` times (the caller makes
    that an env_error). Never raises for a bad expression: ``expression`` is whatever the
    tool call carried, and anything but a string is refused.

    The accepted expression is the body of a one-line program (``_r = repr(EXPR)``) whose
    value is read back through the sandbox's test messages, 64 characters per test.
    """
    refused = check_expression(expression)
    if refused is not None:
        return f"error: {refused}", None
    assert isinstance(expression, str)  # check_expression refuses anything else
    code = f"_r = repr({expression.strip()})\n"
    tests = [TestCase(f"_r[{i * _CHUNK}:{(i + 1) * _CHUNK}]", "<value>") for i in range(_CHUNKS)]
    tests.append(TestCase("len(_r)", "<value>"))
    rep = with_retries(lambda: run_tests(code, tests, limits), env_retries)
    if rep.status == "sandbox_error":
        return "error: the calculator is unavailable", rep
    if rep.status == "timeout":
        return f"error: the calculation took longer than {limits.wall_s:g} s", rep
    if rep.status == "crash":
        return f"error: the calculation failed ({rep.error})", rep
    if rep.error is not None:  # the expression raised (ZeroDivisionError, OverflowError, ...)
        return f"error: {rep.error}", rep
    parts = []
    for t, msg in zip(tests, rep.messages):
        head = f"{t.call} returned "
        tail = f", expected {t.expected}"
        if not (msg.startswith(head) and msg.endswith(tail)):
            return f"error: the calculation failed ({msg})", rep
        parts.append(ast.literal_eval(msg[len(head) : -len(tail)]))
    if len(parts) != len(tests):
        return "error: the calculation failed (no value came back)", rep
    value, length = "".join(parts[:-1]), parts[-1]
    if len(value) != length:
        return f"error: the value has {length} characters, too long to show", rep
    return value, rep


# ---- the answer ---------------------------------------------------------------------
_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?(?!\d|,\d)"
_LAST_NUMBER = re.compile(r"(?:(?<![\w).\]])-)?" + _NUMBER)
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.S)
_WHOLE = re.compile(r"[+-]?\d+(?:,\d{3})*(?:\.\d*)?")
_PLAIN = re.compile(r"-?\d+(?:\.\d*)?")


def extract_answer(reply: str) -> str | None:
    """The answer in ``reply``: the content of the last ``<answer>…</answer>`` (it must be
    one number, thousands commas allowed), else the last number in the reply (a ``-``
    right after a letter, digit or closing bracket is a minus sign, not a sign of the
    number). Commas and a leading ``+`` are dropped; None when there is no answer.

    >>> extract_answer("4837 * 29 = 140273, minus 1204 is 139069.")
    '139069'
    >>> extract_answer("I think <answer> -1,204 </answer>")
    '-1204'
    >>> extract_answer("<answer>about 5</answer> 7") is None
    True
    """
    tagged = _TAGGED.findall(reply)
    if tagged:
        text = tagged[-1].strip()
        return text.replace(",", "").lstrip("+") if _WHOLE.fullmatch(text) else None
    found = _LAST_NUMBER.findall(reply)
    return found[-1].replace(",", "") if found else None


def is_correct(answer: str | None, reference: int) -> bool:
    """Whether ``answer`` (from :func:`extract_answer`) has exactly the value ``reference``."""
    if answer is None or not _PLAIN.fullmatch(answer):  # "1e3", "NaN": not what the answer rule yields
        return False
    try:
        return Decimal(answer) == Decimal(reference)
    except InvalidOperation:
        return False


# ---- the tasks ----------------------------------------------------------------------
@dataclass(frozen=True)
class ArithmeticTask:
    """One question: ``answer`` is the exact integer result of ``expression`` (the
    computation the question stands for; a word problem's in the order told); ``kind`` is
    ``"expression"`` or ``"word"``."""

    task_id: str
    problem_id: str
    question: str
    answer: int
    kind: str
    expression: str


@dataclass(frozen=True)
class _Wording:
    """The sentences of a word problem (``{place}``, ``{n}``, ``{u}`` filled in): ``themes``
    (place, unit), the opening, the sentences of each step (``"+"``, ``"-"``, ``"*"``) and
    the closing question."""

    themes: tuple[tuple[str, str], ...]
    start: str
    steps: dict[str, tuple[str, ...]]
    end: str


# The default problems' wording (all that training sees) ...
_WORDING = _Wording(
    themes=(
        ("warehouse", "boxes"),
        ("library", "books"),
        ("farm", "eggs"),
        ("factory", "bolts"),
        ("bakery", "rolls"),
        ("school", "pencils"),
        ("harbour", "crates"),
        ("garden centre", "seeds"),
    ),
    start="A {place} starts the week with {n} {u}.",
    steps={
        "+": ("A delivery brings {n} more {u}.", "It receives {n} {u}.", "{n} {u} are returned to it."),
        "-": ("It sends away {n} {u}.", "{n} {u} are sold.", "{n} {u} are given away."),
        "*": ("Then the number of {u} is multiplied by {n}.", "Then it ends up with {n} times as many {u}."),
    },
    end="How many {u} does it have now?",
)
# ... and the held-out shift's: no sentence, place or unit in common with _WORDING.
_SHIFT_WORDING = _Wording(
    themes=(("museum shop", "postcards"), ("dairy", "bottles"), ("print shop", "posters"), ("toy store", "marbles")),
    start="On Monday, the {place} holds {n} {u}.",
    steps={
        "+": ("A truck drops off {n} {u}.", "Another {n} {u} arrive."),
        "-": ("It loses {n} {u}.", "Customers take {n} {u}."),
        "*": ("Next, its stock of {u} grows {n}-fold.", "Its stock of {u} is then scaled by a factor of {n}."),
    },
    end="How many {u} are there at the end?",
)
_TRIES = 200  # draws per problem before make_problems gives up


def _operand(rng: random.Random, digits: int) -> int:
    """A number of ``digits`` digits, at least 2 (so ``x * 1`` never occurs)."""
    return rng.randint(max(2, 10 ** (digits - 1)), 10**digits - 1)


def _expression_problem(rng: random.Random, digits: int, terms: int) -> tuple[str, str, int]:
    nums = [str(_operand(rng, digits)) for _ in range(terms)]
    ops = [rng.choice("+-*") for _ in range(terms - 1)]
    toks = [nums[0]]
    for op, n in zip(ops, nums[1:]):
        toks += [op, n]
    if terms > 2 and rng.random() < 0.5:  # one pair of parentheses around 2 .. terms-1 operands
        width = rng.randint(2, terms - 1)
        start = rng.randint(0, terms - width)
        toks[2 * start] = "(" + toks[2 * start]
        toks[2 * (start + width - 1)] += ")"
    expr = " ".join(toks)
    return f"What is {expr}?", expr, eval(expr)  # trusted: generated digits and operators only


def _word_problem(rng: random.Random, digits: int, terms: int, wording: _Wording = _WORDING) -> tuple[str, str, int]:
    place, unit = rng.choice(wording.themes)
    value = _operand(rng, digits)
    lines, expr = [wording.start.format(place=place, n=value, u=unit)], str(value)
    for _ in range(terms - 1):
        n = _operand(rng, digits)
        op = rng.choice("+-*")
        if op == "-" and n >= value:
            op = "+"  # a stock never falls below 1
        if op == "*":
            n = _operand(rng, max(1, digits - 1))  # a multiplier (>= 2), kept shorter than the counts
        text = rng.choice(wording.steps[op]).format(n=n, u=unit)
        lines.append(text[0].upper() + text[1:])
        expr = f"({expr} {op} {n})"
        value = value + n if op == "+" else value - n if op == "-" else value * n
    lines.append(wording.end.format(u=unit))
    return " ".join(lines), expr[1:-1] if expr.startswith("(") else expr, value


def _fair(question: str, expr: str, answer: int) -> bool:
    """No shortcut in the problem itself: ``|answer| >= 2``, ``|answer|`` is none of the
    numbers written in the question, and the calculator accepts ``expr`` whole."""
    written = {int(x) for x in re.findall(r"\d+", question)}
    return abs(answer) >= 2 and abs(answer) not in written and check_expression(expr) is None


def make_problems(n_problems: int, digits: int, terms: int, shift: bool = False) -> list[ArithmeticTask]:
    """``n_problems`` problems, deterministic in (``digits``, ``terms``, ``shift``): problem
    ``i`` is the same for every ``n_problems``; about a third are word problems.

    Problem ``i`` is drawn from its own random stream, redrawn (up to 200 times) until its
    question and its answer differ from those of every earlier problem (so a constant answer
    is right on at most one problem) and it is fair (:func:`_fair`: ``|answer| >= 2``, not a
    number written in the question, an expression the calculator accepts whole).

    Args:
        shift: make the held-out shift of (``digits``, ``terms``) instead: operands of
            ``digits + 1`` digits, ``terms + 1`` operands, word problems in the held-out
            wording (:data:`_SHIFT_WORDING`, which the default problems never use), ids
            ``calc-d{digits+1}t{terms+1}s-NNNN``, drawn from streams of their own.

    Raises:
        ValueError: that many such problems cannot be made with these ``digits`` and ``terms``.
    """
    d, t = (digits + 1, terms + 1) if shift else (digits, terms)
    wording, tag = (_SHIFT_WORDING, "s") if shift else (_WORDING, "")
    out: list[ArithmeticTask] = []
    questions: set[str] = set()
    answers: set[int] = set()
    for i in range(n_problems):
        rng = random.Random(f"calculator|d{d}|t{t}{'|shift' if shift else ''}|{i}")
        for _ in range(_TRIES):
            kind = "word" if rng.random() < 1 / 3 else "expression"
            if kind == "word":
                question, expr, answer = _word_problem(rng, d, t, wording)
            else:
                question, expr, answer = _expression_problem(rng, d, t)
            if question not in questions and answer not in answers and _fair(question, expr, answer):
                break
        else:
            raise ValueError(
                f"n_problems={n_problems}: only {len(out)} problems with distinct questions and distinct "
                f"answers could be made with digits={digits} and terms={terms}{' (shift)' if shift else ''}; "
                "lower n_problems or raise digits or terms"
            )
        questions.add(question)
        answers.add(answer)
        pid = f"calc-d{d}t{t}{tag}-{i:04d}"
        out.append(ArithmeticTask(pid, pid, question, int(answer), kind, expr))
    return out


# ---- the episode and the environment ------------------------------------------------
class CalculatorEpisode:
    """One question: calculator calls (``-tool_cost`` each, at most ``max_calls`` charged and
    evaluated), then the answer (``accuracy`` 1.0 / 0.0, ends the episode); see the module doc.

    ``code`` is None until the answer, then the extracted answer (``""`` when the reply held
    no number): what the runner stores as the trajectory's ``final_code``.
    """

    answer_ends_episode = True

    def __init__(
        self,
        task: ArithmeticTask,
        tool_cost: float = 0.0,
        max_calls: int = 4,
        limits: SandboxLimits = CALC_LIMITS,
        env_retries: int = ENV_RETRIES,
    ):
        self.task = task
        self.tool_cost = float(tool_cost)
        self.max_calls = max_calls
        self.limits = limits
        self.env_retries = env_retries
        self.calls = 0  # calculator calls charged so far
        self.code: str | None = None
        self._done = False
        self.computed = False  # a calculator call has returned the task's answer (the potential's state)

    def _info(self, **kw) -> dict:
        return {"task_id": self.task.task_id, "problem_id": self.task.problem_id, "calculator_calls": self.calls, **kw}

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """Start over; the observation is the question."""
        self.calls, self.code, self._done, self.computed = 0, None, False, False
        return self.task.question, self._info()

    def step(self, action: dict) -> tuple[str, float, bool, bool, dict]:
        """One calculator call or the answer (see the class doc).

        Raises:
            ValueError: a tool other than ``calculator``.
            RuntimeError: the episode already ended (call ``reset``).
        """
        if self._done:
            raise RuntimeError("episode is over; call reset()")
        if "answer" in action:
            self._done = True
            answer = extract_answer(str(action["answer"]))
            self.code = answer if answer is not None else ""
            reward = 1.0 if is_correct(answer, self.task.answer) else 0.0
            info = self._info(answer=answer, reference=self.task.answer, reward_components={"accuracy": reward})
            return ("correct" if reward else "incorrect"), reward, True, False, info
        if action.get("name") != "calculator":
            raise ValueError(f"{self.task.task_id}: unknown tool {action.get('name')!r}; the only tool is 'calculator'")
        if self.calls >= self.max_calls:
            return (
                f"error: calculator limit reached ({self.max_calls} calls); reply with your answer",
                0.0,
                False,
                False,
                self._info(reward_components={"tool_cost": 0.0}),
            )
        self.calls += 1
        cost = -self.tool_cost if self.tool_cost else 0.0
        obs, rep = calculate((action.get("arguments") or {}).get("expression"), self.limits, self.env_retries)
        info = self._info(reward_components={"tool_cost": cost}, env_retries=rep.attempts - 1 if rep is not None else 0)
        if rep is not None and rep.status == "sandbox_error":
            self._done = True
            info["env_error"] = f"sandbox: {rep.error}"
            return obs, cost, True, False, info
        self.computed |= rep is not None and is_correct(obs, self.task.answer)  # the value's repr, or "error: ..."
        return obs, cost, False, False, info

    def retry_feedback(self, info: dict) -> str | None:
        """After the answer (``--attempts k``): None when it was right; else reopen the episode
        (the calculator calls charged so far stay charged) and say the answer was wrong, naming
        the model's own value and never the reference."""
        if (info.get("reward_components") or {}).get("accuracy") == 1.0:
            return None
        self._done = False
        answer = info.get("answer")
        said = "your reply held no number" if answer is None else f"{answer} is not the exact value"
        return f"incorrect: {said}; try again and put the final number in <answer></answer>"


_PROMPT = (
    "You solve arithmetic problems exactly. You may call the calculator tool with an arithmetic "
    "expression (numbers, + - * / // % **, parentheses); it returns the value. {budget}When you know "
    "the result, reply without a tool call and put the final number in <answer></answer>, e.g. "
    "<answer>42</answer>; without that tag the last number in your reply is your answer."
)


# What an LLM judge grades by (train --judge-url; docs/environments.md): the environment's own answer
# rule in words, so a judge and the verifier ask the same question.
_RUBRIC = (
    "The request is an arithmetic question or a small word problem with one exact integer answer. "
    "Work out that answer yourself. The response's final answer is the content of its last "
    "<answer></answer> tag, or without such a tag the last number in its last reply. Give 10 when the "
    "final answer equals the exact value, 0 otherwise. Calculator calls, their number, the length and "
    "the style of the response do not count."
)


class CalculatorEnvironment(Environment):
    """Arithmetic questions with a calculator tool (see the module doc for the answer rule and reward).

    Args:
        split_seed: seed of the problem-level split (≈ 80 / 10 / 10; with ``shift``
            0 / 50 / 50).
        n_problems: number of problems (10 .. 100000; default 600).
        digits: decimal digits of each operand (1 .. 12; default 3).
        terms: operands per question (2 .. 8; default 3).
        shift: the held-out shift of (``digits``, ``terms``) instead of its problems
            (default false): ``digits + 1`` digits, ``terms + 1`` operands, word problems in
            a wording the default problems never use; validation and test only (no train
            split: training on it is refused). See the module doc.
        tool_cost: reward per calculator call is ``-tool_cost`` (>= 0; default 0.0).
        max_calls: calculator calls charged and evaluated per episode (0 .. 64; default 4);
            a further call gets an error observation and costs nothing.

    Raises:
        ValueError: an option of the wrong type or out of range (names it and the range),
            before any problem is made; more problems than these ``digits`` and ``terms``
            allow with distinct answers (:func:`make_problems`).
    """

    name = "calculator"
    version = "2"
    system_prompt = _PROMPT.format(budget="")
    tools = TOOLS
    reward_components = ("accuracy", "tool_cost")
    rubric = _RUBRIC
    reward_range = (0.0, 1.0)  # per instance: (-tool_cost * max_calls * (1 + 1e-9), 1.0)
    answer_ends_episode = True

    def __init__(
        self,
        split_seed: int = 0,
        n_problems: int = 600,
        digits: int = 3,
        terms: int = 3,
        shift: bool = False,
        tool_cost: float = 0.0,
        max_calls: int = 4,
    ):
        for opt, value, low, high in (
            ("n_problems", n_problems, 10, 100000),
            ("digits", digits, 1, 12),
            ("terms", terms, 2, 8),
            ("max_calls", max_calls, 0, 64),
        ):
            if type(value) is not int or not low <= value <= high:
                raise ValueError(
                    f"--env calculator: option {opt}={value!r} must be an integer from {low} to "
                    f"{high} (--env-option {opt}=N)"
                )
        if type(tool_cost) not in (int, float) or not math.isfinite(tool_cost) or tool_cost < 0:
            raise ValueError(
                f"--env calculator: option tool_cost={tool_cost!r} must be a finite number >= 0 "
                "(the reward per calculator call is -tool_cost; --env-option tool_cost=0.05)"
            )
        if type(shift) is not bool:
            raise ValueError(
                f"--env calculator: option shift={shift!r} must be true or false (--env-option "
                "shift=true: the held-out shift, for evaluation only)"
            )
        self.n_problems, self.digits, self.terms, self.shift = n_problems, digits, terms, shift
        self.tool_cost, self.max_calls = float(tool_cost), max_calls
        lowest = -self.tool_cost * max_calls * (1 + 1e-9)
        self.reward_range = (lowest if lowest else 0.0, 1.0)
        budget = (
            f"You have at most {max_calls} calculator call{'s' if max_calls != 1 else ''}"
            + (f", each costing {self.tool_cost:g} reward" if self.tool_cost else "")
            + ". "
        )
        self.system_prompt = _PROMPT.format(budget=budget)
        super().__init__(split_seed)

    def load_splits(self, split_seed: int) -> dict[str, list]:
        from consequence.envs.repair.jsonl import split_by_problem

        tasks = make_problems(self.n_problems, self.digits, self.terms, self.shift)
        fractions = (0.0, 0.5, 0.5) if self.shift else (0.8, 0.1, 0.1)
        ids = split_by_problem([t.problem_id for t in tasks], seed=split_seed, fractions=fractions)
        return {s: [t for t in tasks if t.problem_id in ids[s]] for s in SPLITS}

    def check_splits(self, needed: dict[str, str | None]) -> None:
        """As :meth:`Environment.check_splits`, and the shift is never trained on.

        Raises:
            ValueError: ``shift`` is on and the train split is needed (names the fix).
        """
        if self.shift and needed.get("train"):
            raise ValueError(
                f"--env calculator: option shift=true is the held-out shift, for evaluation only: it has "
                f"no train split (its problems go 50 / 50 to validation and test), and {needed['train']} needs "
                "one; evaluate on --split validation or --split test, and train (or collect demonstrations) "
                "without shift, then evaluate the result with --env-option shift=true (and the run's digits "
                "and terms)"
            )
        super().check_splits(needed)

    def make_episode(self, task: ArithmeticTask) -> CalculatorEpisode:
        return CalculatorEpisode(task, self.tool_cost, self.max_calls)

    def potential(self, episode: CalculatorEpisode) -> float:
        """Φ(s) = 0.5 once a calculator call in the episode returned the task's answer
        (``CalculatorEpisode.computed``), else 0: the computation is done, the answer not yet
        given. Below the reward of a right answer (1); read from the episode, nothing is run."""
        return 0.5 if episode.computed else 0.0

    def retry_feedback(self, episode: CalculatorEpisode, info: dict) -> str | None:
        """A wrong answer reopens the episode: "incorrect: V is not the exact value; try again ..."
        (``CalculatorEpisode.retry_feedback``); None after a right one."""
        return episode.retry_feedback(info)

    def demonstration(self, task: ArithmeticTask, rng: random.Random) -> list[dict]:
        """One calculator call on the task's whole ``expression``, then the value as the answer
        (``<answer>VALUE</answer>``); ``rng`` is not used (one way to solve it). Verified by the
        episode's own reward before use (the ``Environment.demonstration`` hook).

        Raises:
            NotImplementedError: ``max_calls`` is 0: no calculator call is allowed, and this
                demonstrator solves a task only with one (none is produced).
        """
        if self.max_calls < 1:
            raise NotImplementedError(
                "option max_calls=0 allows no calculator call, and the calculator's demonstrator "
                "solves a task with one; give max_calls >= 1 to use it"
            )
        return [
            {"name": "calculator", "arguments": {"expression": task.expression}},
            {"answer": f"<answer>{task.answer}</answer>"},
        ]
