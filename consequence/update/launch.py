"""Update ranks launched by ``torchrun`` (update box, issue 34).

``--update-ranks N`` either spawns N − 1 rank processes on this machine (the default,
:class:`~consequence.update.data_parallel.DataParallelUpdate`), or joins ranks that
``torchrun`` started, on one node or several, with the same flags::

    torchrun --nproc-per-node 2 -m consequence train --update-ranks 2 ...
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m consequence train --update-ranks 2 ...        # the same command on each node

Rank 0 (``RANK=0``) is the trainer: it rolls out, assigns credit, writes the run. Every
other rank serves the update and nothing else (no run folder, no model
loading; ``consequence.update.data_parallel.serve_update_rank``): it receives rank 0's
policy and optimizer through the process group, wraps the policy in
DistributedDataParallel, and runs the steps rank 0 scatters to it until rank 0 sends stop.
This module holds the launcher's side only: the environment, the group, the messages. The process group is gloo (CPU tensors; NCCL is for the CUDA path, which has
not run here).

Why torchrun and not Ray Train: the rollouts already run on Ray (``--rollout-workers``),
but the trainer is one process that owns the run; Ray Train's ``TorchTrainer`` would make
the trainer itself a Ray Train worker. torchrun is the launcher DDP users already run, it
sets the rendezvous environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``) on every node, and it tears the job down when any rank dies.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> tuple[int, int] | None:
    """``(rank, world_size)`` when a launcher (torchrun) started this process as one of
    several ranks (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set and
    ``WORLD_SIZE`` > 1); ``None`` otherwise.

    Raises:
        ValueError: ``RANK`` or ``WORLD_SIZE`` is not an integer, or ``RANK`` is outside
            ``[0, WORLD_SIZE)``.
    """
    if not all(k in os.environ for k in _ENV):
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError as e:
        raise ValueError(
            f"RANK={os.environ['RANK']!r} / WORLD_SIZE={os.environ['WORLD_SIZE']!r} are not integers; "
            "start the ranks with torchrun, which sets them"
        ) from e
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world}); start the ranks with torchrun")
    return (rank, world) if world > 1 else None


def join_launched_group(timeout_s: float) -> None:
    """Join the default gloo process group from torchrun's environment (``env://``).

    Raises:
        RuntimeError: the rendezvous did not complete within ``timeout_s``.
    """
    rank, world = launched_by_torchrun() or (0, 1)
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def scatter_messages(messages: list[Any]) -> None:
    """Rank 0: send ``messages[k - 1]`` to rank k ≥ 1 (one ``scatter_object_list``)."""
    dist.scatter_object_list([None], [None, *messages], src=0)


def receive_message() -> Any:
    """Rank k ≥ 1: the message rank 0 scattered to it (:func:`scatter_messages`)."""
    out: list[Any] = [None]
    dist.scatter_object_list(out, None, src=0)
    return out[0]
