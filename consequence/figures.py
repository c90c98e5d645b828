"""Matplotlib figures saved atomically (shared by the evaluate, report and labs boxes)."""

from __future__ import annotations

import os
from pathlib import Path


def pyplot():
    """Matplotlib's pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out_dir: Path, name: str) -> Path:
    """Write ``fig`` to ``out_dir/<name>.png`` atomically (temp file, then os.replace)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{name}.png"
    tmp = out_dir / f".{name}.tmp.png"
    fig.tight_layout()
    fig.savefig(tmp, dpi=90)
    pyplot().close(fig)
    os.replace(tmp, png)
    return png
