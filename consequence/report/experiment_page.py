"""One static HTML page of an experiment folder (``consequence view OUT``): its report
(``experiment.md``, tables rendered, figures inlined) and the table of its runs, each linked
to its own report and, where ``consequence view`` wrote one, its trajectory viewer.

The page is self-contained (figures as data URIs), so it can be mailed or attached as it is.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")


def is_experiment_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds an experiment's report (``experiment.md``)."""
    return (Path(folder) / "experiment.md").is_file()


def _inline_images(markdown: str, folder: Path) -> str:
    """Each ``![alt](name.png)`` of a file in ``folder`` as a data URI (a missing file keeps its link)."""

    def sub(m: re.Match[str]) -> str:
        path = folder / m.group(2)
        if not path.is_file() or path.resolve().parent != folder.resolve():
            return m.group(0)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f"![{m.group(1)}](data:image/png;base64,{data})"

    return _IMAGE.sub(sub, markdown)


def _runs_table(folder: Path, page_dir: Path) -> str:
    """An HTML table: one row per ``runs/<arm>-seed<k>``, with links to its files (relative to the page)."""
    runs = sorted(p for p in (folder / "runs").glob("*") if p.is_dir()) if (folder / "runs").is_dir() else []
    if not runs:
        return ""
    rows = []
    for run in runs:
        links = [
            f'<a href="{html.escape(_relative(run / name, page_dir))}">{name}</a>'
            for name in ("report.md", "curves.png", "viewer.html", "metrics.jsonl")
            if (run / name).is_file()
        ]
        finished = "finished" if (run / "report.json").is_file() else "not finished"
        rows.append(f"<tr><td>{html.escape(run.name)}</td><td>{finished}</td><td>{' · '.join(links)}</td></tr>")
    return (
        "<h2>Runs</h2>\n<p>Each run is an ordinary run folder; <code>consequence view RUN</code> writes its "
        "trajectory viewer.</p>\n<table><tr><th>run</th><th>status</th><th>files</th></tr>\n"
        + "\n".join(rows)
        + "\n</table>"
    )


def _relative(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path.resolve(), start.resolve()).replace(os.sep, "/")


def build_experiment_page(folder: str | Path, page_dir: str | Path | None = None) -> str:
    """The HTML of an experiment folder's page: ``experiment.md`` rendered (CommonMark with
    tables, via markdown-it-py), its figures inlined, then the runs with links relative to
    ``page_dir`` (the folder the page is written to; default ``folder``).

    Raises:
        FileNotFoundError: ``folder`` holds no ``experiment.md`` (the experiment has not
            reported yet: run ``consequence experiment PLAN.yaml`` or ``--report-finished``).
    """
    from markdown_it import MarkdownIt

    folder = Path(folder)
    if not is_experiment_folder(folder):
        raise FileNotFoundError(
            f"{folder} has no experiment.md: run `consequence experiment PLAN.yaml` until it reports "
            "(or with --report-finished for the arms done so far)"
        )
    text = _inline_images((folder / "experiment.md").read_text(encoding="utf-8"), folder)
    body = MarkdownIt("commonmark").enable("table").render(text)
    runs = _runs_table(folder, Path(page_dir) if page_dir is not None else folder)
    title = html.escape(f"experiment {folder.resolve().name}")
    return (
        f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{title}</title>\n<style>"
        "body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td:first-child,th:first-child{text-align:left}img{max-width:100%}"
        f"</style></head><body>\n{body}\n{runs}\n</body></html>\n"
    )
