"""The documentation holds together: links resolve, citations of the design document and
of the cases point at sections that exist, and nothing points outside the repository.

Each checker takes text and returns what is wrong with it, so that every check has a
negative control (a broken text it must report).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
CASES = ROOT / "docs" / "cases.md"
TEXT_SUFFIXES = {
    ".py",
    ".md",
    ".yaml",
    ".yml",
    ".toml",
    ".json",
    ".jsonl",
    ".txt",
    ".cfg",
    ".ini",
    ".jinja",
    ".html",
    ".sh",
    "",
}


_NOT_SOURCES = {"runs", "__pycache__", "node_modules"}  # run outputs and caches, not the project's docs


def _markdown_files() -> list[Path]:
    """Every markdown file of the repository (README.md, CONTRIBUTING.md, docs/, examples/, …),
    without hidden folders (.git, .venv, .venv-vllm), run outputs and build metadata."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(
            d for d in dirs if not d.startswith(".") and d not in _NOT_SOURCES and not d.endswith(".egg-info")
        )
        out += [Path(folder) / f for f in sorted(files) if f.endswith(".md")]
    return out


def _user_docs() -> list[Path]:
    """The pages a user reads for the commands: README.md, CONTRIBUTING.md and docs/*.md."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _text_files(*tops: str) -> list[Path]:
    """Text files under the given top-level files or folders (caches and binaries skipped)."""
    out = []
    for top in tops:
        p = ROOT / top
        paths = [p] if p.is_file() else sorted(p.rglob("*")) if p.is_dir() else []
        for f in paths:
            if (
                f.is_file()
                and f.suffix in TEXT_SUFFIXES
                and "__pycache__" not in f.parts
                and f.stat().st_size < 5_000_000
            ):
                out.append(f)
    return out


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# ---- markdown: headings, anchors, links --------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _strip_code(text: str) -> str:
    """Text without fenced code blocks and inline code spans (their brackets are not links)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def headings(text: str) -> list[str]:
    """The ATX headings of a markdown text, outside code blocks."""
    return _HEADING.findall(_FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lowercase, punctuation other
    than ``-`` and ``_`` removed, spaces to hyphens."""
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", s.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Anchors of every heading (repeated headings get -1, -2, … as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for h in headings(text):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(text: str, base: Path) -> list[str]:
    """Relative links in markdown ``text`` (a file in folder ``base``) that do not resolve.

    Web links (``scheme:``) are skipped. A pure anchor (``#…``) must name a heading of
    ``text`` itself; a link to a markdown file with an anchor, a heading of that file.
    """
    bad = []
    own = None
    for target in _LINK.findall(_strip_code(text)):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue
        if target.startswith("#"):
            own = anchors(text) if own is None else own
            if target[1:] not in own:
                bad.append(f"{target}: no heading with anchor {target} in this file")
            continue
        path, _, anchor = target.partition("#")
        dest = (base / path).resolve()
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(_read(dest)):
            bad.append(f"{target}: no heading with anchor #{anchor}")
    return bad


def test_every_relative_link_resolves():
    files = _markdown_files()
    names = {str(f.relative_to(ROOT)) for f in files}
    # the walk does find the pages, the examples' READMEs included
    assert {"README.md", "CONTRIBUTING.md", "docs/design.md", "examples/custom_env/README.md"} <= names
    assert not any(n.startswith((".", "runs/")) for n in names)
    bad = [f"{f.relative_to(ROOT)}: {b}" for f in files for b in broken_links(_read(f), f.parent)]
    assert not bad, "\n".join(bad)


def test_broken_links_are_reported(tmp_path):
    (tmp_path / "there.md").write_text("# Title\n\n## 2. A section\n")
    (tmp_path / "sub").mkdir()
    good = (
        "## Local\n[a](there.md) [b](there.md#2-a-section) ![img](sub) [c](https://example.org/x.md) "
        "[d](#local) `[e](missing.md)`\n```\n[f](missing.md)\n```\n"
    )
    assert broken_links(good, tmp_path) == []
    bad = "[a](missing.md) and [b](there.md#no-such-heading) and ![c](sub/none.png) and [d](#nowhere)"
    assert broken_links(bad, tmp_path) == [
        "missing.md: no such file",
        "there.md#no-such-heading: no heading with anchor #no-such-heading",
        "sub/none.png: no such file",
        "#nowhere: no heading with anchor #nowhere in this file",
    ]


def test_slug_matches_github():
    assert (
        slug("Case 14 — top-p after the weights moved: the support is the sampler's (update box)")
        == "case-14--top-p-after-the-weights-moved-the-support-is-the-samplers-update-box"
    )
    assert slug("2. The data that flows: token-in, token-out") == "2-the-data-that-flows-token-in-token-out"
    assert slug("`consequence train --resume RUN_DIR`") == "consequence-train---resume-run_dir"
    assert anchors("# A\n## A\n") == {"a", "a-1"}


# ---- citations of docs/design.md §N and docs/cases.md case NN ----------------------------

CITING = ("consequence", "tests", "docs", "benchmarks", "README.md", "CONTRIBUTING.md")

_DESIGN_CITE = re.compile(r"docs/design\.md\s*((?:§\s*\d+(?:\s*(?:,|and|–|-)\s*)?)+)")
_CASES_CITE = re.compile(r"docs/cases\.md(?:,\s*|\s*\(\s*)cases?\s+(\d{2}(?:\s*(?:,|and|/|–|-)\s*\d{2})*)")


def design_citations(text: str) -> list[int]:
    """Section numbers cited as "docs/design.md §N" (also "§3, §7")."""
    return [int(n) for m in _DESIGN_CITE.finditer(text) for n in re.findall(r"§\s*(\d+)", m.group(1))]


def case_citations(text: str) -> list[str]:
    """Case numbers cited as "docs/cases.md, case NN" or "docs/cases.md (case NN)"."""
    return [n for m in _CASES_CITE.finditer(text) for n in re.findall(r"\d{2}", m.group(1))]


def design_sections(text: str) -> set[int]:
    """Numbers of the headings "## N. Title" (or "## §N …") of the design document."""
    return {int(m.group(1)) for h in headings(text) if (m := re.match(r"§?\s*(\d+)[.\s]", h))}


def case_headings(text: str) -> set[str]:
    """Two-digit numbers of the headings that contain "Case NN"."""
    return {m.group(1) for h in headings(text) if (m := re.search(r"\bcase\s+(\d{2})\b", h, re.I))}


def missing_citations(files: dict[str, str], sections: set[int], cases: set[str]) -> list[str]:
    """``path:line: …`` for every citation of a design section or a case that has no heading."""
    bad = []
    for name, text in files.items():
        lines = text.split("\n")
        for i in range(len(lines)):
            # a citation may wrap onto the next line ("docs/design.md\n§6")
            window = lines[i] + " " + (lines[i + 1] if i + 1 < len(lines) else "")
            head = len(lines[i])
            for m in _DESIGN_CITE.finditer(window):
                if m.start() < head:
                    for n in re.findall(r"§\s*(\d+)", m.group(1)):
                        if int(n) not in sections:
                            bad.append(f"{name}:{i + 1}: docs/design.md §{n} has no section {n}")
            for m in _CASES_CITE.finditer(window):
                if m.start() < head:
                    for n in re.findall(r"\d{2}", m.group(1)):
                        if n not in cases:
                            bad.append(f"{name}:{i + 1}: docs/cases.md case {n} has no heading")
    return bad


def test_design_has_sections_1_to_9_and_cases_01_to_14():
    assert design_sections(_read(DESIGN)) >= set(range(1, 10))
    assert case_headings(_read(CASES)) >= {f"{n:02d}" for n in range(1, 15)}


def test_every_citation_has_its_section():
    me = Path(__file__).resolve()  # its negative controls cite sections that do not exist
    files = {str(f.relative_to(ROOT)): _read(f) for f in _text_files(*CITING) if f.resolve() != me}
    assert sum(len(design_citations(t)) for t in files.values()) > 10  # the pattern does find them
    assert sum(len(case_citations(t)) for t in files.values()) > 5
    bad = missing_citations(files, design_sections(_read(DESIGN)), case_headings(_read(CASES)))
    assert not bad, "\n".join(bad)


def test_citation_checker_reports_missing_sections():
    text = (
        "see docs/design.md §6 and docs/design.md §3, §12\n"
        "(docs/cases.md, case 02) docs/cases.md (case 99) docs/cases.md, case 11, docs/cases.md,\n"
        "case 03; docs/design.md\n§10 wrapped\n"
    )
    assert design_citations(text) == [6, 3, 12, 10]
    assert case_citations(text) == ["02", "99", "11", "03"]
    bad = missing_citations({"x.py": text}, sections={1, 3, 6}, cases={"02", "03", "11"})
    assert bad == [
        "x.py:1: docs/design.md §12 has no section 12",
        "x.py:2: docs/cases.md case 99 has no heading",
        "x.py:3: docs/design.md §10 has no section 10",
    ]
    assert design_sections("# design\n## 1. Loop\n## §2 Data\n```\n## 3. in code\n```\n") == {1, 2}
    assert case_headings("## Case 01 — a\n## case 2 — b\n### Case 13: c\n") == {"01", "13"}


# ---- nothing points outside the repository ------------------------------------------------

SCANNED = ("consequence", "tests", "docs", "benchmarks", "README.md", "CONTRIBUTING.md", "Makefile", "pyproject.toml")
_OUTSIDE = re.compile(r"(?<![\w.-])shared/|DESIGN\.md")


def outside_references(text: str) -> list[str]:
    """Mentions of the project's private folders: a ``shared/`` path or ``DESIGN.md``."""
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in _OUTSIDE.finditer(text)]


def test_nothing_points_outside_the_repository():
    me = Path(__file__).resolve()
    bad = [
        f"{f.relative_to(ROOT)} {hit}"
        for f in _text_files(*SCANNED)
        if f.resolve() != me
        for hit in outside_references(_read(f))
    ]
    assert not bad, "\n".join(bad)


def test_outside_reference_checker_reports_them():
    assert outside_references("see docs/design.md §2; a shared lock; pre-shared/key") == []
    text = "as in /work/shared/cases/01.md\nand DESIGN.md §4\n`shared/`"
    assert outside_references(text) == ["line 1: shared/", "line 2: DESIGN.md", "line 3: shared/"]


@pytest.mark.parametrize("name", ["design.md", "cases.md"])
def test_the_two_documents_exist_and_are_linked_from_contributing(name):
    assert (ROOT / "docs" / name).is_file()
    assert f"docs/{name}" in _read(ROOT / "CONTRIBUTING.md")


# ---- every command-line option is documented -----------------------------------------------


def cli_options() -> dict[str, list[tuple[str, list[str]]]]:
    """``{command: [(parameter name, its option strings), …]}`` of every visible option of the
    Typer app (the top-level ``consequence`` options under ``""``), read from the click
    command objects, not from help text. A flag pair ``--x/--no-x`` is one option."""
    import typer.main

    from consequence.cli import app

    group = typer.main.get_command(app)
    commands = {"": group, **group.commands}
    return {
        name: [
            (p.name, [*p.opts, *p.secondary_opts]) for p in cmd.params if p.param_type_name == "option" and not p.hidden
        ]
        for name, cmd in commands.items()
    }


def undocumented_options(
    options: dict[str, list[tuple[str, list[str]]]], text: str, yaml_commands: tuple[str, ...] = ("train",)
) -> list[str]:
    """``command: --option`` for every option that ``text`` never mentions.

    An option counts as documented when one of its option strings appears whole (``--seed``
    is not found inside ``--seed-x`` or ``--split-seed``; ``-k`` not inside ``top-k``), or, for
    a command in ``yaml_commands`` (train's options are its config keys), when its key is
    written as YAML, ``key:`` at the start of a line or of a code span.
    """
    bad = []
    for command, params in options.items():
        for name, opts in params:
            if any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text) for o in opts):
                continue
            if command in yaml_commands and re.search(rf"(?m)(?:^\s*|`){re.escape(name)}:", text):
                continue
            bad.append(f"{command or 'consequence'}: {opts[0]}")
    return bad


def test_every_cli_option_is_documented():
    options = cli_options()
    # the commands the docs describe are all there, and the walk finds their options
    assert {
        "train",
        "eval",
        "compare",
        "serve",
        "sft",
        "shrink",
        "merge",
        "view",
        "reproduce",
        "lab",
        "warmstart",
        "explain",
        "envs",
    } <= set(options)
    from consequence.config import TrainConfig  # train: one option per config field, plus 3 of its own

    assert len(options["train"]) == len(TrainConfig.model_fields) + 3
    for own in (("config", ["--config"]), ("resume", ["--resume"]), ("print_config", ["--print-config"])):
        assert own in options["train"]
    assert ("seed", ["--seed"]) in options["lab"] and ("show_version", ["--version"]) in options[""]
    text = "\n".join(_read(f) for f in _user_docs())
    bad = undocumented_options(options, text)
    assert not bad, (
        "options no page of README.md, CONTRIBUTING.md or docs/ mentions; document each where "
        "its feature is described:\n" + "\n".join(bad)
    )


def test_undocumented_option_checker_reports_them():
    options = {
        "": [("show_version", ["--version"])],
        "train": [
            ("split_seed", ["--split-seed"]),
            ("gae_lambda", ["--gae-lambda"]),
            ("skip_checks", ["--skip-checks", "--no-skip-checks"]),
            ("seed", ["--seed"]),
        ],
        "eval": [("k", ["-k"]), ("out", ["--out"])],
    }
    text = (
        "Use `--split-seed 3` and --no-skip-checks.\n```yaml\ngae_lambda: 0.9\n```\nconsequence eval -k 1,4 --version\n"
    )
    # --seed occurs only inside --split-seed; --out not at all
    assert undocumented_options(options, text) == ["train: --seed", "eval: --out"]
    # the YAML form counts only for train's config keys, and only as a key
    assert undocumented_options({"eval": [("gae_lambda", ["--gae-lambda"])]}, text) == ["eval: --gae-lambda"]
    assert undocumented_options({"train": [("seed", ["--seed"])]}, "the seed: 3") == ["train: --seed"]
    assert undocumented_options({"train": [("top_k", ["--top-k"]), ("k", ["-k"])]}, "--top-k 5") == ["train: -k"]
    assert undocumented_options(options, "") == [
        "consequence: --version",
        "train: --split-seed",
        "train: --gae-lambda",
        "train: --skip-checks",
        "train: --seed",
        "eval: -k",
        "eval: --out",
    ]


# ---- no page calls a built feature planned ---------------------------------------------------

# features that are built (README "What works"), each with the words a page names it by
BUILT_FEATURES = {
    "distillation": r"distil",
    "data-parallel updates": r"data[- ]parallel|--update-ranks",
    "Ray rollout workers": r"\bRay\b|--rollout-workers",
    "vLLM rollout engine": r"\bvLLM\b",
}
_NOT_BUILT = re.compile(
    r"\bplanned\b|\bnot\s+(?:yet\s+)?built\b|\bnot\s+built\s+yet\b|\bnot\s+yet\s+"
    r"(?:implemented|supported|available)\b|\bfuture\s+work\b|\bwill\s+be\s+(?:added|built|"
    r"implemented|supported)\b|\bcoming\s+soon\b|\bTODO\b",
    re.I,
)
# a sentence ends at . ! ? ; or a blank line; a list item, table row or heading starts a new one
_SENTENCE_BREAK = re.compile(r"(?<=[.!?;])\s+|\n\s*\n|\n(?=\s*(?:[-*|#>]|\d+\.)\s)")


def called_not_built(text: str, features: dict[str, str] = BUILT_FEATURES) -> list[str]:
    """``feature: sentence`` for every sentence of ``text`` that names a built feature and calls
    something planned or not built.

    A sentence that says "refused" is about a combination the code refuses with a message (a
    built check, e.g. "rollout workers with --agent are refused with a message, not built"),
    not about the feature, and is skipped.
    """
    bad = []
    for sentence in _SENTENCE_BREAK.split(text):
        if not _NOT_BUILT.search(sentence) or re.search(r"\brefused\b", sentence, re.I):
            continue
        flat = " ".join(sentence.split())
        bad += [f"{name}: {flat[:160]}" for name, pattern in features.items() if re.search(pattern, sentence)]
    return bad


def test_no_page_calls_a_built_feature_planned():
    bad = [f"{f.relative_to(ROOT)}: {b}" for f in _markdown_files() for b in called_not_built(_read(f))]
    assert not bad, "\n".join(bad)


def test_planned_checker_reports_built_features_called_planned():
    text = (
        "Training runs in one process; splitting over data-parallel ranks is **planned**.\n\n"
        "- **Planned**, not dependencies today: Ray (rollout workers), vLLM (inference engine).\n"
        "- Also planned: on-policy distillation from a teacher.\n"
        "The same holds across data-parallel ranks (not\n  built: training runs in one process).\n"
    )
    assert [b.split(":")[0] for b in called_not_built(text)] == [
        "data-parallel updates",
        "Ray rollout workers",
        "vLLM rollout engine",
        "distillation",
        "data-parallel updates",
    ]
    fine = (
        "`--update-ranks N` splits each step over data-parallel ranks. Ray actors run the rollouts.\n"
        "Rollout workers with `--agent` or `--distill-lambda` < 1 are refused with a message, not built.\n"
        "## Not built yet\n\n- More seeds per method.\n"
        "A planned call of the scripted teacher is rendered as text.\n"
    )
    assert called_not_built(fine) == []
