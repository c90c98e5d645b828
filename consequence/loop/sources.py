"""Where an iteration's batch comes from: one interface, four implementations.

The loop asks a :class:`BatchSource` for the trajectories of iteration ``it`` and never
asks how they were made:

- :class:`Rollouts`: this process plays B tasks × G episodes with the current policy,
  through the in-process harness or a user's agent (``rollout.collect.EpisodeRunner``);
- :class:`WorkerRollouts`: rollout workers on Ray play them with weights at most
  ``max_staleness`` versions old (docs/async.md);
- :class:`FixedDataMix`: with ``--distill-lambda`` < 1, a seeded share of the iterations
  trains on ``--distill-data`` instead of the student's samples (GKD, Agarwal et al. 2024,
  Algorithm 1, line 3); the other iterations ask the source it wraps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from consequence.config import TrainConfig
from consequence.distill.fixed_data import draw_fixed_batch, draw_fixed_pairs, uses_fixed_data
from consequence.records import Trajectory
from consequence.rollout.collect import EpisodeRunner, collect


@dataclass
class Collected:
    """One iteration's batch as its source made it.

    Attributes:
        trajectories: scored trajectories, grouped (``group_id``), in group order.
        stats: the source's counts: ``gen_tokens_total`` always; ``groups_*`` (dynamic
            sampling) and ``agent_*`` (the agent-runner) where they apply.
        queue: the rollout workers' scheduler metrics (lag, waits, the worker's own time),
            empty for a batch made in this process.
        from_data: the batch is ``--distill-data``: the student sampled nothing.
    """

    trajectories: list[Trajectory]
    stats: dict[str, Any]
    queue: dict[str, Any] = field(default_factory=dict)
    from_data: bool = False


class BatchSource(Protocol):
    """What the loop needs of a batch source."""

    def next_batch(self, it: int, show: Callable[[str], None]) -> Collected:
        """The batch of iteration ``it``; ``show(text)`` displays what it waits for."""
        ...

    def publish(self, model, version: int) -> None:
        """Version ``version`` of the weights (after iteration ``version − 1``'s update) is out."""
        ...

    def close(self) -> dict[str, Any]:
        """Stop whatever the source started; returns counts for the manifest."""
        ...


class Rollouts:
    """This process rolls out every batch with the current policy (``rollout.collect.collect``)."""

    def __init__(self, cfg: TrainConfig, runner: EpisodeRunner, env, budgets, learned_reward=None):
        self.cfg, self.runner, self.env, self.budgets = cfg, runner, env, budgets
        self.learned_reward = learned_reward  # --reward-model (rollout.collect.collect)

    def next_batch(self, it: int, show: Callable[[str], None]) -> Collected:
        n = self.cfg.tasks_per_iteration * self.cfg.group_size
        progress = lambda d: show(f"iteration {it}: rollouts {d}/{n} episodes")  # noqa: E731
        trajs, stats = collect(
            it, self.cfg, self.runner, self.env, self.budgets, progress, learned_reward=self.learned_reward
        )
        return Collected(trajs, stats)

    def publish(self, model, version: int) -> None:
        pass  # the runner samples from the trainer's own model object

    def close(self) -> dict[str, Any]:
        return {}


class WorkerRollouts:
    """Batches from rollout workers on Ray (``scale.scheduler.AsyncRollouts``)."""

    def __init__(self, rollouts):
        self.rollouts = rollouts

    def next_batch(self, it: int, show: Callable[[str], None]) -> Collected:
        trajs, stats, queue = self.rollouts.next_batch(it, show)
        return Collected(trajs, stats, queue)

    def publish(self, model, version: int) -> None:
        self.rollouts.publish(model, version)

    def close(self) -> dict[str, Any]:
        return self.rollouts.close()


class FixedDataMix:
    """``--distill-data`` for the iterations a seeded draw gives it (u ≥ λ), else ``inner``.

    The draw depends on (seed, iteration) only, so a resumed or reproduced run trains on the
    same sources (``distill.fixed_data.uses_fixed_data``).
    """

    def __init__(self, cfg: TrainConfig, data: list[Trajectory], inner: BatchSource):
        self.cfg, self.data, self.inner = cfg, data, inner

    def next_batch(self, it: int, show: Callable[[str], None]) -> Collected:
        cfg = self.cfg
        if not uses_fixed_data(cfg.distill_lambda, cfg.seed, it):
            return self.inner.next_batch(it, show)
        if cfg.advantage == "dpo":  # pairs need a task's episodes together: whole tasks with a pair
            trajs = draw_fixed_pairs(self.data, cfg.tasks_per_iteration, cfg.seed, it)
        else:
            trajs = draw_fixed_batch(self.data, cfg.tasks_per_iteration * cfg.group_size, cfg.seed, it)
        return Collected(trajs, {"gen_tokens_total": 0}, from_data=True)  # the student generated nothing

    def publish(self, model, version: int) -> None:
        self.inner.publish(model, version)

    def close(self) -> dict[str, Any]:
        return self.inner.close()
