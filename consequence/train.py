"""Moved: the training loop is ``consequence.loop.train`` (this name is kept while the layout changes)."""

from consequence.loop.recorder import RunRecorder, Terminated, run_ending
from consequence.loop.train import RunInterrupted, RunStopped, policy_training, preflight, run_loop, train

__all__ = [
    "RunInterrupted",
    "RunRecorder",
    "RunStopped",
    "Terminated",
    "policy_training",
    "preflight",
    "run_ending",
    "run_loop",
    "train",
]
