"""The training run (docs/design.md §1): ``train`` holds the loop on one screen (``run_loop``:
batch source → credit → update → validate → record) and the run around it; ``sources`` the
batch sources; ``learner`` the credit and update steps of any recipe; ``recorder`` everything
the run writes; ``checks`` the pre-step checks (§6); ``diagnostics``; ``resume``.

The entry point is ``consequence.loop.train.train`` (``cq.train`` in the Python API)."""

from consequence.exports import lazy

__all__ = [
    "BatchSource",
    "Collected",
    "FixedDataMix",
    "Learner",
    "PreStepCheckError",
    "Rollouts",
    "RunInterrupted",
    "RunRecorder",
    "RunStopped",
    "WorkerRollouts",
    "credit",
    "latest_state",
    "make_learner",
    "resume_config",
    "run_ending",
    "run_loop",
    "run_pre_step_checks",
    "update",
]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "run_loop": "train",
        "RunStopped": "train",
        "RunInterrupted": "train",
        "BatchSource": "sources",
        "Collected": "sources",
        "Rollouts": "sources",
        "WorkerRollouts": "sources",
        "FixedDataMix": "sources",
        "Learner": "learner",
        "make_learner": "learner",
        "credit": "learner",
        "update": "learner",
        "RunRecorder": "recorder",
        "run_ending": "recorder",
        "PreStepCheckError": "checks",
        "run_pre_step_checks": "checks",
        "latest_state": "resume",
        "resume_config": "resume",
    },
)
