"""What a run shows: the manifest, plots and report.md, ``consequence explain``, and the
trajectory viewer (docs/viewer.md)."""

from consequence.exports import lazy

__all__ = [
    "build_manifest",
    "find_run_files",
    "plot_metrics",
    "read_manifest",
    "render_difference",
    "render_recipe",
    "write_manifest",
    "write_markdown_report",
]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "build_manifest": "manifest",
        "read_manifest": "manifest",
        "write_manifest": "manifest",
        "plot_metrics": "plots",
        "write_markdown_report": "plots",
        "render_recipe": "explain",
        "render_difference": "explain",
        "find_run_files": "viewer",
    },
)
