"""Code-repair problems: correct templates + one injected single-line bug.

A *problem* is structure: family variant (composed parts) + bug kind + bug line + bug text.
An *instance* renames the variables and draws its own test inputs from a seeded RNG.
Splits are made by problem id, so no validation/test problem is a renamed train problem.
Generation is trusted code: references and mutants are executed in-process with ``exec``.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
from dataclasses import dataclass

from consequence.envs.repair.bugs import BUG_KINDS, mutants
from consequence.envs.repair.families import Variant, all_variants
from consequence.sandbox.cases import TestCase, TestProgram

__all__ = [
    "TestCase",
    "TestProgram",
    "RepairTask",
    "Problem",
    "BUG_KINDS",
    "build_problems",
    "split_families",
    "split_problems",
    "make_tasks",
    "make_instance",
    "load_split",
]


@dataclass(frozen=True)
class RepairTask:
    """One instance of a problem (see module docstring); line numbers are 1-based."""

    task_id: str
    problem_id: str
    family: str
    bug_kind: str
    func_name: str
    docstring: str
    buggy_code: str
    reference_code: str
    patch: tuple[int, str]
    decoy_patches: tuple[tuple[int, str], ...]
    visible_tests: tuple[TestCase, ...]
    hidden_tests: tuple[TestCase, ...] | TestProgram


@dataclass(frozen=True)
class Problem:
    """A structural problem. ``inputs`` are ``repr`` of argument tuples (the killer pool),
    ``outputs`` the reference ``repr`` results; ``bug_killers`` / ``decoy_killers`` index
    inputs on which the buggy code / each decoy differs from the reference."""

    problem_id: str
    family: str
    bug_kind: str
    variant: Variant
    bug_line: int  # 0-based index into variant.lines
    bug_text: str
    decoys: tuple[tuple[int, str], ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    bug_killers: tuple[int, ...]
    decoy_killers: tuple[tuple[int, ...], ...]


_EDGES: dict[str, list] = {  # per spec: edge-case lists, or (list, target) pairs for "LT"
    "L": [[], [5], [-3], [0], [2, 2, 2], [-2, -5, -8], [1, 2, 3, 4], [4, 3, 2, 1], [3, -1, 3, 0], [-4, 6, -4, 1]],
    "N": [[5], [-3], [0], [2, 2, 2], [-2, -5, -8], [1, 2, 3, 4], [4, 3, 2, 1], [3, -1, 3, 0], [-4, 6, -4, 1], [7, 1]],
    "N2": [[1, 2], [2, 1], [5, 5], [-2, -5, -8], [3, 3, 1], [1, 2, 3, 4], [4, 3, 2, 1], [-1, -7, -3, -7], [0, 9, 9]],
    "LT": [
        ([], 3),
        ([3], 3),
        ([1, 2, 3], 3),
        ([3, 1, 3], 3),
        ([-1, -2], -2),
        ([1, 2], 5),
        ([2, 2], 2),
        ([-5, 4, 0], 0),
        ([4, 5, 6, 7], 4),
    ],
    "C": [
        (5, 0, 10),
        (-3, 0, 10),
        (15, 0, 10),
        (0, 0, 10),
        (10, 0, 10),
        (-5, -8, -2),
        (3, 3, 3),
        (-9, -8, -2),
        (1, 4, 6),
    ],
}


def _random_args(spec: str, rng: random.Random) -> tuple:
    if spec == "C":
        lo = rng.randint(-6, 4)
        return (rng.randint(-9, 9), lo, lo + rng.randint(0, 6))
    low = {"L": 0, "LT": 0, "N": 1, "N2": 2}[spec]
    xs = [rng.randint(-9, 9) for _ in range(rng.randint(low, 6))]
    if spec == "LT":
        t = rng.choice(xs) if xs and rng.random() < 0.6 else rng.randint(-9, 9)
        return (xs, t)
    return (xs,)


def _edge_args(spec: str) -> list[tuple]:
    return [e if isinstance(e, tuple) else (e,) for e in _EDGES[spec]]


def _canon(variant: Variant) -> dict[str, str]:
    return {r: variant.pool(r)[0] for r in variant.roles()}


@functools.lru_cache(maxsize=4096)
def _compile(source: str, func: str):
    ns: dict = {}
    try:
        exec(compile(source, "<gen>", "exec"), ns)  # trusted generation-time code
    except SyntaxError:
        return None
    return ns[func]


def _outcome(fn, args_repr: str) -> str:
    if fn is None:
        return "!SyntaxError"
    try:
        return repr(fn(*ast.literal_eval(args_repr)))
    except Exception as e:  # noqa: BLE001 - a buggy mutant may raise anything
        return "!" + type(e).__name__


def _outputs(lines, variant: Variant, inputs) -> tuple[str, ...]:
    src = "\n".join(lines).format(**_canon(variant))
    fn = _compile(src, variant.func)
    return tuple(_outcome(fn, a) for a in inputs)


def _killers(outs, ref) -> tuple[int, ...]:
    return tuple(k for k, (o, r) in enumerate(zip(outs, ref)) if o != r)


def _problems_of(variant: Variant, seed: int) -> list[Problem]:
    rng = random.Random(f"{seed}|{variant.vid}")
    args = _edge_args(variant.spec) + [_random_args(variant.spec, rng) for _ in range(40)]
    inputs = tuple(dict.fromkeys(repr(a) for a in args))
    ref = _outputs(variant.lines, variant, inputs)
    assert not any(o.startswith("!") for o in ref), variant.vid
    live = []  # (kind, idx, text, killers)
    for kind, idx, text in mutants(variant.lines):
        lines = variant.lines[:idx] + (text,) + variant.lines[idx + 1 :]
        kill = _killers(_outputs(lines, variant, inputs), ref)
        if kill:
            live.append((kind, idx, text, kill))
    out: list[Problem] = []
    for kind, idx, text, kill in live:
        same = [(i, t, k) for (_, i, t, k) in live if i == idx and t != text][:3]
        if not same:  # fall back to mutating another line of the buggy code
            buggy = variant.lines[:idx] + (text,) + variant.lines[idx + 1 :]
            for _, i, t in mutants(buggy):
                if i != idx and len(same) < 2:
                    lines = buggy[:i] + (t,) + buggy[i + 1 :]
                    k = _killers(_outputs(lines, variant, inputs), ref)
                    if k:
                        same.append((i, t, k))
        if not same:
            continue
        pid = f"{variant.vid}/{kind}/L{idx + 1}/{len([p for p in out if p.bug_line == idx])}"
        out.append(
            Problem(
                pid,
                variant.family,
                kind,
                variant,
                idx,
                text,
                tuple((i, t) for i, t, _ in same),
                inputs,
                ref,
                kill,
                tuple(k for _, _, k in same),
            )
        )
    return out


@functools.lru_cache(maxsize=8)
def _build(seed: int) -> tuple[Problem, ...]:
    return tuple(p for v in all_variants() for p in _problems_of(v, seed))


def build_problems(seed: int = 0) -> list[Problem]:
    """All problems (about 500), deterministic in ``seed`` (which draws the killer pool).

    Every kept bug fails >= 1 pool input and has 1-3 decoy patches that also fail.
    Cached: the first call takes about a second, later calls are free.
    """
    return list(_build(seed))


def split_problems(problems, seed: int = 0, fractions=(0.8, 0.1, 0.1)) -> dict[str, list]:
    """Split by problem id into ``train`` / ``validation`` / ``test`` (order by seeded hash).

    Raises:
        ValueError: if ``fractions`` do not have 3 entries summing to 1.
    """
    if len(fractions) != 3 or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions must be 3 numbers summing to 1, got {fractions}")
    key = lambda p: hashlib.sha256(f"{seed}|{p.problem_id}".encode()).hexdigest()  # noqa
    ordered = sorted(problems, key=key)
    n_tr = round(fractions[0] * len(ordered))
    n_va = round(fractions[1] * len(ordered))
    return {"train": ordered[:n_tr], "validation": ordered[n_tr : n_tr + n_va], "test": ordered[n_tr + n_va :]}


def split_families(problems, seed: int = 0, fractions=(0.7, 0.15, 0.15)) -> dict[str, list]:
    """Split by family: every problem of a family lands in the same split, so validation and
    test hold families never seen in training (generalisation to new kinds of program, not
    only new problems of known kinds). Families are ordered by a seeded hash and cut by
    ``fractions`` of the family count (21 families: 15 / 3 / 3).

    Raises:
        ValueError: ``fractions`` do not have 3 entries summing to 1, or a split gets no family.
    """
    if len(fractions) != 3 or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions must be 3 numbers summing to 1, got {fractions}")
    families = sorted({p.family for p in problems}, key=lambda f: hashlib.sha256(f"{seed}|{f}".encode()).hexdigest())
    n_tr, n_va = round(fractions[0] * len(families)), round(fractions[1] * len(families))
    cut = {"train": families[:n_tr], "validation": families[n_tr : n_tr + n_va], "test": families[n_tr + n_va :]}
    if not all(cut.values()):
        raise ValueError(f"{len(families)} families cannot fill three splits by {fractions}")
    where = {f: split for split, fs in cut.items() for f in fs}
    out: dict[str, list] = {"train": [], "validation": [], "test": []}
    for p in problems:
        out[where[p.family]].append(p)
    return out


def load_split(seed: int = 0, by: str = "problem") -> dict[str, list[Problem]]:
    """The generated problems split by problem id (``split_problems``) or by family
    (``split_families``), both seeded by ``seed``.

    Raises:
        ValueError: ``by`` is neither.
    """
    if by not in ("problem", "family"):
        raise ValueError(f"split_by must be problem or family, got {by!r}")
    problems = build_problems(seed)
    return split_problems(problems, seed) if by == "problem" else split_families(problems, seed)


def _names(variant: Variant, rng: random.Random) -> dict[str, str]:
    used: set[str] = set()
    names = {}
    for role in variant.roles():
        name = rng.choice([n for n in variant.pool(role) if n not in used])
        used.add(name)
        names[role] = name
    return names


def _test(func: str, args_repr: str, expected: str) -> TestCase:
    return TestCase(f"{func}({args_repr[1:-1].rstrip(',')})", expected)


def make_instance(problem: Problem, instance: str) -> RepairTask:
    """Instance ``instance`` of ``problem``: renamed variables, own test inputs.

    Deterministic in (problem_id, instance). The buggy code fails >= 1 visible test;
    hidden tests contain every visible test plus edge cases and a failing input per decoy.
    """
    v = problem.variant
    rng = random.Random(f"{problem.problem_id}#{instance}")
    names = _names(v, rng)
    fmt = lambda s: s.format(**names)  # noqa: E731
    ref_lines = [fmt(ln) for ln in v.lines]
    bug_lines = list(ref_lines)
    bug_lines[problem.bug_line] = fmt(problem.bug_text)
    fn = _compile("\n".join(v.lines).format(**_canon(v)), v.func)
    fresh = []
    for _ in range(3):
        a = repr(_random_args(v.spec, rng))
        fresh.append((a, _outcome(fn, a)))
    pool = list(zip(problem.inputs, problem.outputs))
    n_edge = len(_EDGES[v.spec])
    chosen = {pool[rng.choice(problem.bug_killers)]: 0, fresh[0]: 0}  # a dict: insertion order, no repeats
    for k in rng.sample(range(len(pool)), len(pool)):
        if len(chosen) >= 3:
            break
        chosen[pool[k]] = 0
    visible = list(chosen)
    rng.shuffle(visible)
    hidden = list(visible)
    hidden += [pool[rng.choice(k)] for k in problem.decoy_killers]
    hidden += [pool[i] for i in rng.sample(range(n_edge), 3)] + fresh[1:]
    dedup = lambda ts: tuple(dict.fromkeys(_test(v.func, a, e) for a, e in ts))  # noqa
    vis, hid = dedup(visible), dedup(hidden)
    return RepairTask(
        task_id=f"{problem.problem_id}#{instance}",
        problem_id=problem.problem_id,
        family=problem.family,
        bug_kind=problem.bug_kind,
        func_name=v.func,
        docstring=fmt(v.doc),
        buggy_code="\n".join(bug_lines),
        reference_code="\n".join(ref_lines),
        patch=(problem.bug_line + 1, ref_lines[problem.bug_line]),
        decoy_patches=tuple((i + 1, fmt(t)) for i, t in problem.decoys),
        visible_tests=vis,
        hidden_tests=hid,
    )


def make_tasks(problems, n: int, seed: int) -> list[RepairTask]:
    """``n`` instances cycling through a seeded permutation of ``problems``.

    Task ids are ``f"{problem_id}#{seed}-{k}"`` (k = position), so ids are unique across
    seeds. Raises ValueError if ``problems`` is empty and ``n > 0``.
    """
    problems = list(problems)
    if n > 0 and not problems:
        raise ValueError("make_tasks: no problems to draw from")
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    return [make_instance(problems[order[k % len(order)]], f"{seed}-{k}") for k in range(n)]
