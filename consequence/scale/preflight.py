"""What rollout workers need, checked before a run writes anything (``train.preflight``)."""

from __future__ import annotations

import importlib.util
import socket

from consequence.config import TrainConfig, ray_host_port

__all__ = ["check_ray_address", "check_rollout_workers"]

PROBE_S = 10.0  # the longest a reachability check of --ray-address may take


def check_rollout_workers(cfg: TrainConfig) -> None:
    """Ray installed; vLLM importable for ``--rollout-engine vllm``; a HOST:PORT ``--ray-address``
    accepts connections.

    Raises:
        ValueError: what is missing or unreachable, and how to fix it.
    """
    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            "--rollout-workers needs Ray, which is not installed here: pip install 'consequence[ray]' "
            "(make install includes it)"
        )
    if cfg.rollout_engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "--rollout-engine vllm needs vLLM, which is not installed in this environment: build its own "
            "with `make vllm-env`, then run .venv-vllm/bin/consequence train ... (docs/vllm.md)"
        )
    if cfg.ray_address:
        check_ray_address(cfg.ray_address, min(PROBE_S, cfg.rollout_timeout))


def check_ray_address(address: str, timeout: float = PROBE_S) -> None:
    """A HOST:PORT Ray address accepts connections within ``timeout`` seconds (``auto`` and
    ``ray://`` addresses are left to Ray). Without this, ``ray.init`` retries an address nobody
    listens at for minutes.

    Raises:
        ValueError: not an address, or nothing accepts connections there; names the fix.
    """
    where = ray_host_port(address)
    if where is None and address != "auto" and not address.startswith("ray://"):
        raise ValueError(f"--ray-address {address}: give HOST:PORT of a Ray head, ray://HOST:PORT or auto")
    if where:
        try:
            socket.create_connection(where, timeout=timeout).close()
        except OSError as e:
            raise ValueError(
                f"--ray-address {address}: nothing accepts connections there ({e}); start the "
                "cluster's head with `ray start --head --port PORT` and pass HOST:PORT, or drop "
                "--ray-address for a local instance"
            ) from None
