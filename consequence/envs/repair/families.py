"""Hand-written function families composed from parts (loop shape, condition, update).

Each :class:`Variant` is a correct reference function written as a template: ``{xs}``,
``{a}``, ``{x}``, ``{i}`` ... are role placeholders that an *instance* renames. Variants
are structure only; bugs are injected by :mod:`consequence.envs.repair.bugs`.
"""

from __future__ import annotations

from dataclasses import dataclass

# Role -> pool of short names (a renaming draws distinct names from these).
POOLS: dict[str, tuple[str, ...]] = {
    "xs": ("xs", "nums", "items", "vals", "arr", "seq"),
    "x": ("x", "v", "e", "y"),
    "i": ("i", "j", "p", "idx"),
    "t": ("t", "target", "val", "key"),
    "b": ("second", "sec", "s2", "b"),
    "s": ("s", "total", "run", "acc"),
    "lo": ("lo", "low", "a", "mn"),
    "hi": ("hi", "high", "b", "mx"),
}
ACC_POOLS: dict[str, tuple[str, ...]] = {
    "max": ("best", "m", "top", "big"),
    "min": ("best", "m", "low", "small"),
    "sum": ("total", "acc", "s", "res"),
    "count": ("count", "c", "cnt", "k"),
    "list": ("out", "res", "ys", "acc"),
    "idx": ("best", "bi", "pos", "m"),
}
ROLE_ORDER = ("xs", "x", "i", "t", "lo", "hi", "a", "b", "s")


@dataclass(frozen=True)
class Variant:
    """One correct function template.

    ``spec`` names the argument shape: ``"L"`` list of ints (may be empty), ``"N"``
    non-empty list, ``"N2"`` list of length >= 2, ``"LT"`` (list, int), ``"C"`` (x, lo, hi).
    """

    vid: str
    family: str
    func: str
    spec: str
    doc: str
    lines: tuple[str, ...]
    acc_pool: str = "sum"

    def roles(self) -> tuple[str, ...]:
        text = "\n".join(self.lines)
        return tuple(r for r in ROLE_ORDER if "{" + r + "}" in text)

    def pool(self, role: str) -> tuple[str, ...]:
        return ACC_POOLS[self.acc_pool] if role == "a" else POOLS[role]


def _v(vid, family, func, spec, doc, args, body, acc="sum") -> Variant:
    head = (f"def {func}({args}):", f'    """{doc}"""')
    rows = tuple("    " + ln for ln in body.strip("\n").split("\n"))
    return Variant(vid, family, func, spec, doc, head + rows, acc)


LOOPS = {  # name -> (loop header, element expression)
    "e": ("for {x} in {xs}:", "{x}"),
    "r": ("for {i} in range(len({xs})):", "{xs}[{i}]"),
    "s": ("for {x} in {xs}[1:]:", "{x}"),
    "r1": ("for {i} in range(1, len({xs})):", "{xs}[{i}]"),
}


def _extreme() -> list[Variant]:
    out = []
    for fam, ops, word in (("find_max", (">", ">="), "largest"), ("find_min", ("<", "<="), "smallest")):
        for ln, (hdr, el) in LOOPS.items():
            for k, op in enumerate(ops):
                body = f"{{a}} = {{xs}}[0]\n{hdr}\n    if {el} {op} {{a}}:\n        {{a}} = {el}\nreturn {{a}}"
                out.append(
                    _v(
                        f"{fam}.{ln}{k}",
                        fam,
                        fam,
                        "N",
                        f"Return the {word} element of a non-empty list.",
                        "{xs}",
                        body,
                        fam[5:],
                    )
                )
    return out


def _arg_extreme() -> list[Variant]:
    out = []
    for fam, op, word in (("argmax", ">", "largest"), ("argmin", "<", "smallest")):
        doc = f"Return the index of the first {word} element of a non-empty list."
        shapes = {
            "r1": ("for {i} in range(1, len({xs})):", "{xs}[{i}]"),
            "r": ("for {i} in range(len({xs})):", "{xs}[{i}]"),
            "en": ("for {i}, {x} in enumerate({xs}):", "{x}"),
        }
        for ln, (hdr, el) in shapes.items():
            body = f"{{a}} = 0\n{hdr}\n    if {el} {op} {{xs}}[{{a}}]:\n        {{a}} = {{i}}\nreturn {{a}}"
            out.append(_v(f"{fam}.{ln}", fam, fam, "N", doc, "{xs}", body, "idx"))
    return out


def _folds() -> list[Variant]:
    out = []
    specs = (
        ("sum_list", "0", "+", "Return the sum of a list of ints (0 if empty)."),
        ("product", "1", "*", "Return the product of a list of ints (1 if empty)."),
    )
    for fam, init, op, doc in specs:
        for ln in ("e", "r"):
            hdr, el = LOOPS[ln]
            for k, upd in enumerate((f"{{a}} {op}= {el}", f"{{a}} = {{a}} {op} {el}")):
                body = f"{{a}} = {init}\n{hdr}\n    {upd}\nreturn {{a}}"
                out.append(_v(f"{fam}.{ln}{k}", fam, fam, "L", doc, "{xs}", body))
    for ln in ("e", "r"):
        hdr, el = LOOPS[ln]
        out.append(
            _v(
                f"sum_squares.{ln}",
                "sum_squares",
                "sum_squares",
                "L",
                "Return the sum of the squares of a list of ints.",
                "{xs}",
                f"{{a}} = 0\n{hdr}\n    {{a}} += {el} * {el}\nreturn {{a}}",
            )
        )
        out.append(
            _v(
                f"mean.{ln}",
                "mean",
                "mean",
                "N",
                "Return the average of a non-empty list as a float.",
                "{xs}",
                f"{{a}} = 0\n{hdr}\n    {{a}} += {el}\nreturn {{a}} / len({{xs}})",
            )
        )
    return out


CONDS = {  # func -> (condition on EL, docstring words, needs t)
    "count_pos": ("EL > 0", "are positive", False),
    "count_neg": ("EL < 0", "are negative", False),
    "count_even": ("EL % 2 == 0", "are even", False),
    "count_zero": ("EL == 0", "are zero", False),
    "count_big": ("EL > 3", "are greater than 3", False),
    "count_small": ("EL < -2", "are less than -2", False),
    "count_above": ("EL > {t}", "are greater than {t}", True),
}


def _counts() -> list[Variant]:
    out = []
    for func, (cond, words, has_t) in CONDS.items():
        args, spec = ("{xs}, {t}", "LT") if has_t else ("{xs}", "L")
        for ln in ("e", "r"):
            hdr, el = LOOPS[ln]
            c = cond.replace("EL", el)
            for k, upd in enumerate(("{a} += 1", "{a} = {a} + 1")):
                body = f"{{a}} = 0\n{hdr}\n    if {c}:\n        {upd}\nreturn {{a}}"
                out.append(
                    _v(
                        f"{func}.{ln}{k}",
                        "count_if",
                        func,
                        spec,
                        f"Return how many elements of {{xs}} {words}.",
                        args,
                        body,
                        "count",
                    )
                )
    for func, cond, words in (
        ("sum_pos", "EL > 0", "positive"),
        ("sum_even", "EL % 2 == 0", "even"),
        ("sum_neg", "EL < 0", "negative"),
    ):
        for ln in ("e", "r"):
            hdr, el = LOOPS[ln]
            c = cond.replace("EL", el)
            body = f"{{a}} = 0\n{hdr}\n    if {c}:\n        {{a}} += {el}\nreturn {{a}}"
            out.append(
                _v(
                    f"{func}.{ln}",
                    "sum_if",
                    func,
                    "L",
                    f"Return the sum of the {words} elements of a list.",
                    "{xs}",
                    body,
                )
            )
    return out


def _searches() -> list[Variant]:
    out = []
    doc = "Return the index of the first {t} in {xs}, or -1 if absent."
    for ln, hdr, el in (
        ("r", "for {i} in range(len({xs})):", "{xs}[{i}]"),
        ("en", "for {i}, {x} in enumerate({xs}):", "{x}"),
    ):
        body = f"{hdr}\n    if {el} == {{t}}:\n        return {{i}}\nreturn -1"
        out.append(_v(f"index_of.{ln}", "index_of", "index_of", "LT", doc, "{xs}, {t}", body))
    out.append(
        _v(
            "last_index_of.r",
            "index_of",
            "last_index_of",
            "LT",
            "Return the index of the last {t} in {xs}, or -1 if absent.",
            "{xs}, {t}",
            "for {i} in range(len({xs}) - 1, -1, -1):\n    if {xs}[{i}] == {t}:\n        return {i}\nreturn -1",
        )
    )
    for ln in ("e", "r"):
        hdr, el = LOOPS[ln]
        out.append(
            _v(
                f"contains.{ln}",
                "contains",
                "contains",
                "LT",
                "Return True if {t} occurs in {xs}, else False.",
                "{xs}, {t}",
                f"{hdr}\n    if {el} == {{t}}:\n        return True\nreturn False",
            )
        )
        out.append(
            _v(
                f"all_pos.{ln}",
                "all_pos",
                "all_pos",
                "L",
                "Return True if every element is positive (True if empty).",
                "{xs}",
                f"{hdr}\n    if {el} <= 0:\n        return False\nreturn True",
            )
        )
        out.append(
            _v(
                f"any_neg.{ln}",
                "any_neg",
                "any_neg",
                "L",
                "Return True if some element of the list is negative.",
                "{xs}",
                f"{hdr}\n    if {el} < 0:\n        return True\nreturn False",
            )
        )
    doc = "Return True if the list is in non-decreasing order."
    out.append(
        _v(
            "is_sorted.a",
            "is_sorted",
            "is_sorted",
            "L",
            doc,
            "{xs}",
            "for {i} in range(len({xs}) - 1):\n    if {xs}[{i}] > {xs}[{i} + 1]:\n        return False\nreturn True",
        )
    )
    out.append(
        _v(
            "is_sorted.b",
            "is_sorted",
            "is_sorted",
            "L",
            doc,
            "{xs}",
            "for {i} in range(1, len({xs})):\n    if {xs}[{i} - 1] > {xs}[{i}]:\n        return False\nreturn True",
        )
    )
    return out


def _lists() -> list[Variant]:
    out = [
        _v(
            "reverse_list.e",
            "reverse_list",
            "reverse_list",
            "L",
            "Return a new list with the elements in reverse order.",
            "{xs}",
            "{a} = []\nfor {x} in {xs}:\n    {a} = [{x}] + {a}\nreturn {a}",
            "list",
        ),
        _v(
            "reverse_list.r",
            "reverse_list",
            "reverse_list",
            "L",
            "Return a new list with the elements in reverse order.",
            "{xs}",
            "{a} = []\nfor {i} in range(len({xs}) - 1, -1, -1):\n    {a}.append({xs}[{i}])\nreturn {a}",
            "list",
        ),
        _v(
            "running_max.e",
            "running_max",
            "running_max",
            "L",
            "Return the list of maxima of each prefix of the list.",
            "{xs}",
            "{a} = []\nfor {x} in {xs}:\n    if not {a} or {x} > {a}[-1]:\n"
            "        {a}.append({x})\n    else:\n        {a}.append({a}[-1])\nreturn {a}",
            "list",
        ),
        _v(
            "running_sum.e",
            "running_sum",
            "running_sum",
            "L",
            "Return the list of sums of each prefix of the list.",
            "{xs}",
            "{a} = []\n{s} = 0\nfor {x} in {xs}:\n    {s} += {x}\n    {a}.append({s})\nreturn {a}",
            "list",
        ),
        _v(
            "second_largest.e",
            "second_largest",
            "second_largest",
            "N2",
            "Return the second largest value (counting repeats) of a list of length >= 2.",
            "{xs}",
            "{a} = max({xs}[0], {xs}[1])\n{b} = min({xs}[0], {xs}[1])\nfor {x} in {xs}[2:]:\n"
            "    if {x} > {a}:\n        {a}, {b} = {x}, {a}\n    elif {x} > {b}:\n"
            "        {b} = {x}\nreturn {b}",
            "max",
        ),
    ]
    for ln in ("e", "r"):
        hdr, el = LOOPS[ln]
        out.append(
            _v(
                f"dedupe.{ln}",
                "dedupe",
                "dedupe",
                "L",
                "Return the list without repeats, keeping first occurrences in order.",
                "{xs}",
                f"{{a}} = []\n{hdr}\n    if {el} not in {{a}}:\n        {{a}}.append({el})\nreturn {{a}}",
                "list",
            )
        )
    doc = "Return {x} limited to the range [{lo}, {hi}]; assumes {lo} <= {hi}."
    out.append(
        _v(
            "clamp.if",
            "clamp",
            "clamp",
            "C",
            doc,
            "{x}, {lo}, {hi}",
            "if {x} < {lo}:\n    return {lo}\nif {x} > {hi}:\n    return {hi}\nreturn {x}",
        )
    )
    out.append(
        _v(
            "clamp.elif",
            "clamp",
            "clamp",
            "C",
            doc,
            "{x}, {lo}, {hi}",
            "if {x} < {lo}:\n    return {lo}\nelif {x} > {hi}:\n    return {hi}\nelse:\n    return {x}",
        )
    )
    return out


def all_variants() -> list[Variant]:
    """Every correct template, in a fixed order (about 90 variants)."""
    return _extreme() + _arg_extreme() + _folds() + _counts() + _searches() + _lists()
