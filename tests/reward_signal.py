"""A reward signal for tiny smoke runs: odd sample ids win.

The warm start rarely succeeds in a handful of rollouts, and groups whose rewards are all
equal carry no gradient (and are not even run by the update). Tests that need the
weights to move train on :class:`OddSamplesWin`, the repair environment whose finished
groups are rescored (``Environment.score_group``), given as a user would give their own
environment: ``TrainConfig(env=ODD_SAMPLES_WIN)`` or ``--env reward_signal:OddSamplesWin``.
tests/ is on ``sys.path`` under pytest and is ``sys.path[0]`` of tests/resume_child.py, so
a resume or a reproduction re-creates the environment from the run's config.yaml.

``score_group`` runs wherever a group is scored: training rollouts, and validation and
the final evaluation too. Evaluation's success reads ``verifier_score`` (the verifier's
own, left as it was), so its success rates stay the verifier's; only its reward totals
follow the signal.
"""

from __future__ import annotations

from consequence.envs.repair.tasks import RepairEnvironment

__all__ = ["ODD_SAMPLES_WIN", "ODD_SAMPLES_VERIFIED", "OddSamplesWin", "OddSamplesVerified"]

ODD_SAMPLES_WIN = "reward_signal:OddSamplesWin"
ODD_SAMPLES_VERIFIED = "reward_signal:OddSamplesVerified"


class OddSamplesWin(RepairEnvironment):
    """The ``repair`` environment (same problems, splits, episodes and verifier) whose reward
    is ``sample_id % 2``: every group of two or more rollouts is mixed, so every step trains.
    An env_error episode keeps reward None."""

    name = "odd-samples-win"

    @property
    def label(self) -> str:
        """The repair problems' label (the split ledger's task source): a rescored
        environment keeps its problems' name, as ``SingleTurnEnvironment.scoring`` does."""
        return RepairEnvironment.name

    def score_group(self, task, trajectories: list) -> None:
        """reward = primary (first) component = ``sample_id % 2``; the primary component is
        what the credit box's accuracy (dynamic sampling) reads."""
        for t in trajectories:
            if t.reward is not None:
                t.reward = float(t.sample_id % 2)
                t.reward_components = {**t.reward_components, self.reward_components[0]: t.reward}


class OddSamplesVerified(OddSamplesWin):
    """:class:`OddSamplesWin` whose signal also decides verification (``outcome`` finished,
    ``verifier_score`` = reward): rejection sampling keeps the verified episodes, the odd ones.
    Evaluation's success follows the signal too (it reads ``verifier_score``)."""

    name = "odd-samples-verified"

    def score_group(self, task, trajectories: list) -> None:
        """As :meth:`OddSamplesWin.score_group`, then every scored episode is verified with its reward."""
        super().score_group(task, trajectories)
        for t in trajectories:
            if t.reward is not None:
                t.outcome, t.verifier_score = "finished", t.reward
