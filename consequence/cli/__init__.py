"""Command-line interface: ``consequence train | plan | env-check | experiment | eval | compare | explain | view | lab | reproduce | warmstart | serve | reward-model | judge-check``.

One module per group of commands; importing them registers each on ``app``.
"""

from consequence.cli import env_check, evaluate, experiment, judge, plan, reward, serve, tools, train  # noqa: F401  (registers the commands)
from consequence.cli.app import app
from consequence.cli.common import check_model_dir as _check_model_dir  # noqa: F401  (tests)

__all__ = ["app"]

if __name__ == "__main__":
    app()
