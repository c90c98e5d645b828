"""Update ranks launched by ``torchrun`` (update box, issue 34).

``--update-ranks N`` either spawns N − 1 rank processes on this machine (the default,
:class:`~consequence.update.data_parallel.DataParallelUpdate`), or joins ranks that
``torchrun`` started, on one node or several, with the same flags::

    torchrun --nproc-per-node 2 -m consequence train --update-ranks 2 ...
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m consequence train --update-ranks 2 ...        # the same command on each node

Rank 0 (``RANK=0``) is the trainer: it rolls out, assigns credit, writes the run. Every
other rank runs :func:`serve_update_rank` and nothing else (no run folder, no model
loading): it receives rank 0's policy and optimizer through the process group, wraps the
policy in DistributedDataParallel, and runs the steps rank 0 scatters to it until rank 0
sends stop. The process group is gloo (CPU tensors; NCCL is for the CUDA path, which has
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
import pickle
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


def _receive() -> Any:
    out: list[Any] = [None]
    dist.scatter_object_list(out, None, src=0)
    return out[0]


def serve_update_rank(timeout_s: float | None = None) -> None:
    """Rank k ≥ 1 of a torchrun launch: hold a replica and run rank 0's steps until stop.

    Raises:
        RuntimeError: this process was not launched as a rank k ≥ 1, or a collective failed
            (rank 0 died: torchrun then ends the job).
    """
    from consequence.update.data_parallel import DEFAULT_TIMEOUT_S, run_job, wrap_for_data_parallel

    launched = launched_by_torchrun()
    if launched is None or launched[0] == 0:
        raise RuntimeError("serve_update_rank runs on the ranks k >= 1 that torchrun started")
    join_launched_group(DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    try:
        got: list[Any] = [None]
        dist.broadcast_object_list(got, src=0)
        replica = pickle.loads(got[0])
        model, optimizer = replica["model"], replica["optimizer"]
        ddp = wrap_for_data_parallel(model)  # a collective: rank 0 wraps its model at the same point
        while (msg := _receive())[0] != "stop":
            run_job(model, optimizer, ddp, msg[1])
    finally:
        dist.destroy_process_group()
