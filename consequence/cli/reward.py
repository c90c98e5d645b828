"""``consequence reward-model train``: a Bradley-Terry reward model from a run's episodes."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from consequence.cli.app import app
from consequence.cli.common import console, quiet_libraries

reward_app = typer.Typer(no_args_is_help=True, help="Learned rewards: train a reward model from the verifier's pairs.")
app.add_typer(reward_app, name="reward-model")


def _episodes(paths: list[Path]) -> list:
    """The trajectories of every Parquet file given, a folder standing for its ``*.parquet``.

    Raises:
        ValueError: a path that does not exist, or a folder without Parquet files.
    """
    from consequence.records import read_trajectories

    out = []
    for p in paths:
        if not p.exists():
            raise ValueError(f"--data {p}: no such file or folder (give RUN/trajectories or one of its files)")
        files = sorted(p.glob("*.parquet")) if p.is_dir() else [p]
        if not files:
            raise ValueError(f"--data {p}: a folder without .parquet files (give RUN/trajectories)")
        for f in files:
            out += read_trajectories(f)
    return out


@reward_app.command("train")
def train_cmd(
    data: list[Path] = typer.Option(
        ..., "--data", help="Episodes to learn from: a run's trajectories/ folder or Parquet files (repeatable)."
    ),
    model: str = typer.Option(
        ...,
        "--model",
        help="The backbone: a causal LM folder or a registered name, sharing the policy's tokenizer "
        "(the reward model scores the policy's token ids).",
    ),
    out: Path = typer.Option(..., "--out", help="New folder for the reward model (never overwritten)."),
    epochs: int = typer.Option(2, "--epochs", min=1, help="Passes over the training pairs."),
    lr: float = typer.Option(1e-4, "--lr", min=0.0, help="AdamW learning rate (backbone and head)."),
    pairs_per_step: int = typer.Option(8, "--pairs-per-step", min=1, help="Pairs per optimizer step."),
    heldout: float = typer.Option(
        0.2, "--heldout", min=0.0, max=0.9, help="Share of the tasks held out, whole, for the pairwise accuracy."
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds the held-out split, the pair order and the new head."),
) -> None:
    """Train a Bradley-Terry reward model (Ouyang et al. 2022 §3.5) on the verifier's pairs of the
    episodes given: in each group, every verified episode over every failed one. Reports the
    held-out pairwise accuracy before and after; use it with `train --reward-model OUT`."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from consequence.policy.named import model_folder
    from consequence.reward.reward_model import RewardModel, split_pairs, train_reward_model

    quiet_libraries()
    try:
        if out.exists():
            raise ValueError(f"--out {out} exists; give a new folder (a reward model is never overwritten)")
        train_pairs, held = split_pairs(_episodes(data), heldout, seed)
        folder = model_folder(model, log=lambda s: console.print(escape(s)))
        torch.manual_seed(seed)
        rm = RewardModel.from_causal_lm(folder)
        cols = (TextColumn("reward model"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, console=console, transient=True) as bar:
            task = bar.add_task("steps", total=None)
            report = train_reward_model(
                rm,
                train_pairs,
                held,
                epochs,
                lr,
                pairs_per_step,
                seed,
                lambda s, n: bar.update(task, completed=s, total=n),
            )
        from transformers import AutoTokenizer

        meta = {
            "base": str(folder),
            "data": [str(p) for p in data],
            "pairs_train": len(train_pairs.chosen),
            "tasks_train": len(set(train_pairs.tasks)),
            "tasks_heldout": len(set(held.tasks)),
            "settings": {
                "epochs": epochs,
                "lr": lr,
                "pairs_per_step": pairs_per_step,
                "heldout": heldout,
                "seed": seed,
            },
            **report,
        }
        rm.save(out, AutoTokenizer.from_pretrained(str(folder)), meta)
    except (ValueError, FileExistsError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    except OSError as e:
        console.print(f"[red]error:[/] cannot write --out {escape(str(out))}: {escape(e.strerror or str(e))}")
        raise typer.Exit(2) from None
    console.print(_table(meta))
    console.print(f"reward model written to {escape(str(out))} (use: train --reward-model {escape(str(out))})")


def _table(meta: dict) -> Table:
    def pct(x) -> str:
        return "—" if x is None else f"{100 * x:.1f} %"

    t = Table(title="Bradley-Terry reward model (held-out tasks never trained on)")
    for c in ("", "pairs", "tasks", "held-out accuracy", "held-out BT loss"):
        t.add_column(c)
    b, a = meta["before"], meta["after"]
    t.add_row("train", str(meta["pairs_train"]), str(meta["tasks_train"]), "", "")
    loss = lambda x: "—" if x is None else f"{x:.4f}"  # noqa: E731
    t.add_row("held out, before", str(int(b["pairs"])), str(meta["tasks_heldout"]), pct(b["accuracy"]), loss(b["loss"]))
    t.add_row("held out, after", str(int(a["pairs"])), str(meta["tasks_heldout"]), pct(a["accuracy"]), loss(a["loss"]))
    return t
