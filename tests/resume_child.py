"""A real `consequence train` process for tests/loop/test_resume.py, run as a subprocess.

    python tests/resume_child.py [PAUSE] -- ARGS...   (ARGS go to `consequence train`)

The callers give a fixed reward signal as the environment (``--env
reward_signal:OddSamplesWin``: odd sample ids win, as in test_train_e2e.py) so that every
update moves the weights; tests/ is ``sys.path[0]`` for this script, so that environment
imports here, and again in a ``--resume`` from the run's config.yaml.

PAUSE, when given, is ``NAME:N:MARKER``: on the N-th call of NAME (``update`` = the
update box, ``state`` = writing a resume state, after the optimizer file and before the
rename) the process creates the file MARKER and sleeps, so that the test can SIGKILL it
at that exact point.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def _pause_at(name: str, n: int, marker: str) -> None:
    import consequence.loop.resume as resume_module
    import consequence.loop.train as train_module

    module, attr = (train_module, "update") if name == "update" else (resume_module, "_write_learner")
    real = getattr(module, attr)
    calls = [0]

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == n:
            Path(marker).write_text("paused")
            time.sleep(600)
        return out

    setattr(module, attr, wrapper)


def main(argv: list[str]) -> None:
    import signal

    import torch

    # A job started in the background by a non-interactive shell (as CI may start the test
    # suite) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler;
    # restore what a terminal's Ctrl-C meets so the SIGINT test means the same everywhere.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    torch.set_num_threads(1)  # same arithmetic in every child, light on a shared machine
    split = argv.index("--")
    if argv[:split]:
        name, n, marker = argv[0].split(":", 2)
        _pause_at(name, int(n), marker)
    from consequence.cli import app

    app(["train", *argv[split + 1 :]], standalone_mode=True)


if __name__ == "__main__":
    main(sys.argv[1:])
