"""``python -m consequence``: the CLI (also what ``torchrun -m consequence train ...`` runs)."""

from consequence.cli import app

if __name__ == "__main__":
    app()
