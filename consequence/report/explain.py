"""``consequence explain``: a recipe as the seven boxes of the loop, or two recipes' difference."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from consequence.config import BOXES, TrainConfig
from consequence.recipes import BASELINE, Recipe, box_settings, differences, load_recipe

ROLE = {
    "tasks": "which problems, how many per iteration",
    "policy": "the model and how it samples",
    "rollout": "episodes per task, budgets, which groups are kept",
    "reward": "verifier score and shaping terms",
    "credit": "advantage of each trajectory or token",
    "update": "surrogate, clipping, reduction, regularisers, steps per batch",
    "evaluate": "validation and final comparison",
}


def _fmt(v) -> str:
    return escape(f"{v:g}" if isinstance(v, float) else str(v))


def render_recipe(recipe: Recipe, console: Console) -> None:
    """Print the recipe box by box: the settings it chooses, beside REINFORCE's; ● marks a
    box that differs from REINFORCE, and the paper section that motivates it follows."""
    base = load_recipe(BASELINE)
    mine, ref = box_settings(recipe), box_settings(base)
    base_cfg = base.train_config().model_dump()
    for box in BOXES:  # a setting REINFORCE does not choose: its default value
        ref[box] = {k: ref[box].get(k, base_cfg.get(k)) for k in set(ref[box]) | set(mine[box])}
    console.print(f"[bold]{escape(recipe.title)}[/] ({escape(recipe.name)}): {escape(recipe.summary)}")
    console.print(f"paper: {escape(recipe.paper)}")
    table = Table(show_lines=True)
    for col in ("box", "setting", "this recipe", base.title):
        table.add_column(col, overflow="fold")
    changed_boxes = []
    for box in BOXES:
        keys = [k for k, v in mine[box].items() if k in recipe.config or v != ref[box].get(k)]
        changed = any(mine[box][k] != ref[box].get(k) for k in keys)
        changed_boxes += [box] if changed else []
        label = f"{'● ' if changed else ''}{box}\n[dim]{ROLE[box]}[/]"
        if not keys:
            table.add_row(label, "[dim]defaults, as in every recipe[/]", "", "")
            continue
        table.add_row(
            label,
            "\n".join(escape(k) for k in keys),
            "\n".join(
                f"[bold]{_fmt(mine[box][k])}[/]" if mine[box][k] != ref[box].get(k) else _fmt(mine[box][k])
                for k in keys
            ),
            "\n".join(_fmt(ref[box].get(k)) for k in keys),
        )
    console.print(table)
    console.print(f"● = differs from {base.title}: {len(changed_boxes)} of {len(BOXES)} boxes.")
    for box in BOXES:
        if box in recipe.cite:
            console.print(f"  {'● ' if box in changed_boxes else ''}{box}: {escape(recipe.cite[box])}")
    console.print(
        f"Run it: {escape(recipe.run_command or 'consequence train --recipe ' + (recipe.ref or recipe.name))}"
    )


def render_difference(a: Recipe, b: Recipe, console: Console) -> None:
    """Print the settings, box by box, in which recipes ``a`` and ``b`` differ."""
    diff = differences(a, b)
    console.print(f"[bold]{escape(a.title)}[/] vs [bold]{escape(b.title)}[/]")
    if not diff:
        console.print("the two recipes have the same settings in every box")
        return
    table = Table(show_lines=True)
    for col in ("box", "setting", a.title, b.title, "what it does"):
        table.add_column(col, overflow="fold")
    for box in BOXES:
        for k, (va, vb) in diff.get(box, {}).items():
            table.add_row(box, escape(k), _fmt(va), _fmt(vb), escape(TrainConfig.model_fields[k].description or ""))
    console.print(table)
    same = [box for box in BOXES if box not in diff]
    console.print(f"same in: {', '.join(same) if same else 'no box'}")
