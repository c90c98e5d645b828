"""Single-line bug injection on function templates (8 bug kinds).

Every mutant replaces exactly ONE line of a correct template, so the reference line is
always a one-line fix. Whether a mutant is really a bug (some test fails) is decided by
execution in :mod:`consequence.envs.repair.problems`.
"""

from __future__ import annotations

import re

BUG_KINDS: tuple[str, ...] = (
    "init",
    "off_by_one",
    "comparison",
    "operator",
    "return_var",
    "index",
    "bool",
    "early_return",
)

_INIT = {
    "{xs}[0]": ("0", "1"),
    "0": ("1", "-1"),
    "1": ("0", "2"),
    "[]": ("[0]",),
    "max({xs}[0], {xs}[1])": ("{xs}[0]", "0"),
    "min({xs}[0], {xs}[1])": ("0", "{xs}[1]"),
}
_RANGES = {
    "range(len({xs}))": ("range(len({xs}) - 1)", "range(1, len({xs}))"),
    "range(1, len({xs}))": ("range(2, len({xs}))", "range(1, len({xs}) - 1)"),
    "range(len({xs}) - 1)": ("range(len({xs}) - 2)", "range(1, len({xs}) - 1)"),
    "range(len({xs}) - 1, -1, -1)": ("range(len({xs}) - 1, 0, -1)", "range(len({xs}) - 2, -1, -1)"),
    "{xs}[1:]": ("{xs}[2:]", "{xs}[1:-1]"),
    "{xs}[2:]": ("{xs}[3:]", "{xs}[1:]"),
}
_CMP = {">": ("<", ">="), ">=": ("<", ">"), "<": (">", "<="), "<=": (">", "<"), "==": ("!=",), "!=": ("==",)}
_OPS = {
    "+=": ("-=",),
    "-=": ("+=",),
    "*=": ("+=",),
    "+": ("-",),
    "-": ("+",),
    "*": ("+",),
    "/": ("//",),
    "//": ("/",),
    "%": ("//",),
}
_INDEX = {
    "0": ("1",),
    "1": ("0",),
    "-1": ("0",),
    "{i}": ("{i} - 1", "{i} + 1"),
    "{i} + 1": ("{i}", "{i} - 1"),
    "{i} - 1": ("{i}", "{i} + 1"),
    "{a}": ("0", "{i}"),
}
_BOOL = {
    "True": ("False",),
    "False": ("True",),
    " and ": (" or ",),
    " or ": (" and ",),
    " not in ": (" in ",),
    "if not ": ("if ",),
}
_RET_VARS = ("{a}", "{b}", "{s}", "{x}", "{i}", "{xs}", "{xs}[0]", "{t}", "{lo}", "{hi}")


def _at(line: str, start: int, end: int, alts) -> list[str]:
    return [line[:start] + r + line[end:] for r in alts]


def _each(line: str, pattern: str, table) -> list[str]:
    out = []
    for m in re.finditer(pattern, line):
        out += _at(line, m.start(1), m.end(1), table.get(m.group(1), ()))
    return out


def _literal(line: str, table) -> list[str]:
    out = []
    for key, alts in table.items():
        start = line.find(key)
        while start >= 0:
            out += _at(line, start, start + len(key), alts)
            start = line.find(key, start + 1)
    return out


def line_mutants(line: str, present: str) -> list[tuple[str, str]]:
    """All (bug_kind, new_line) single-line mutations of one template line.

    ``present`` is the full template text, used to pick variables that exist.
    """
    out: list[tuple[str, str]] = []
    m = re.match(r"^    \{\w+\} = (.+)$", line)
    if m and m.group(1) in _INIT:
        out += [("init", r) for r in _at(line, m.start(1), m.end(1), _INIT[m.group(1)])]
    out += [("off_by_one", r) for r in _literal(line, _RANGES)]
    out += [("comparison", r) for r in _each(line, r" (>=|<=|==|!=|>|<) ", _CMP)]
    out += [("operator", r) for r in _each(line, r" (\+=|-=|\*=|\+|-|\*|//|/|%) ", _OPS)]
    for m in re.finditer(r"\b(max|min)\(", line):
        alt = "min" if m.group(1) == "max" else "max"
        out.append(("operator", line[: m.start(1)] + alt + line[m.end(1) :]))
    out += [("index", r) for r in _each(line, r"(?<=[\w}\)])\[([^\[\]:]+)\]", _INDEX)]
    out += [("bool", r) for r in _literal(line, _BOOL)]
    m = re.match(r"^(\s*)return (.+)$", line)
    if m:
        ind, expr = m.groups()
        alts = [v for v in _RET_VARS if v != expr and v.split("[")[0] in present]
        out += [("return_var", f"{ind}return {v}") for v in alts[:2]]
        if len(ind) >= 8:
            out.append(("early_return", f"{ind}pass"))
    return [(k, r) for k, r in out if r != line]


def mutants(lines: tuple[str, ...]) -> list[tuple[str, int, str]]:
    """All (bug_kind, 0-based line index, new_line) of a template, body lines only.

    Duplicates (same line index and text) are dropped, first kind wins.
    """
    present = "\n".join(lines)
    seen: set[tuple[int, str]] = set()
    out = []
    for idx in range(2, len(lines)):
        for kind, new in line_mutants(lines[idx], present):
            if (idx, new) not in seen:
                seen.add((idx, new))
                out.append((kind, idx, new))
    return out


# ---- real code (e.g. HumanEval canonical solutions) ------------------------------------
# The template tables above key on placeholders such as ``{xs}``; these patterns are the
# same bug kinds written for concrete names.
_REAL_INIT = {
    "0": ("1", "-1"),
    "1": ("0", "2"),
    "[]": ("[0]",),
    "''": ("' '",),
    '""': ('" "',),
    "True": ("False",),
    "False": ("True",),
}
_REAL_RANGE = re.compile(r"range\((?:(\w+), )?(len\([\w.]+\)|\w+)\)")


def _real_line_mutants(line: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    m = re.match(r"^(\s+[A-Za-z_]\w* = )(.+)$", line)
    if m and m.group(2) in _REAL_INIT:
        out += [("init", m.group(1) + alt) for alt in _REAL_INIT[m.group(2)]]
    for m in _REAL_RANGE.finditer(line):
        start, stop = m.group(1), m.group(2)
        alts = [f"range({start + ', ' if start else ''}{stop} - 1)"]
        alts.append(
            f"range({int(start) + 1}, {stop})"
            if start and start.isdigit()
            else f"range(1, {stop})"
            if not start
            else ""
        )
        out += [("off_by_one", line[: m.start()] + a + line[m.end() :]) for a in alts if a]
    for m in re.finditer(r"\[(\d+):\]", line):
        k = int(m.group(1))
        out.append(("off_by_one", line[: m.start(1)] + str(k + 1) + line[m.end(1) :]))
    return out


def _return_var(line: str, names: list[str]) -> list[tuple[str, str]]:
    """``return a`` -> ``return b`` for up to two other local names ``b`` (sorted)."""
    m = re.match(r"^(\s*)return ([A-Za-z_]\w*)$", line)
    if not m:
        return []
    alts = [n for n in names if n != m.group(2)][:2]
    return [("return_var", f"{m.group(1)}return {n}") for n in alts]


def code_mutants(lines: list[str], first: int) -> list[tuple[str, int, str]]:
    """(bug_kind, 0-based line index, new_line) for real source lines ``lines[first:]``.

    Uses :func:`line_mutants` (comparison, operator, index, bool, early_return apply to
    concrete code as they are) plus concrete-name versions of init, off_by_one and
    return_var. Blank and comment lines are skipped; duplicates dropped (first kind wins).
    Whether a mutant is a bug is decided by running the tests, not here.
    """
    present = "\n".join(lines)
    body = "\n".join(lines[first:])
    names = sorted(
        set(re.findall(r"^\s*([A-Za-z_]\w*) = ", body, re.M)) | set(re.findall(r"\bfor ([A-Za-z_]\w*) in\b", body))
    )
    seen: set[tuple[int, str]] = set()
    out = []
    for idx in range(first, len(lines)):
        line = lines[idx]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        for kind, new in line_mutants(line, present) + _real_line_mutants(line) + _return_var(line, names):
            if new != line and (idx, new) not in seen:
                seen.add((idx, new))
                out.append((kind, idx, new))
    return out
