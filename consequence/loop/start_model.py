"""The model RL starts from with ``--cold-start-demos N``: the cold start of ``--model`` (or of
the bundled tiny warm start) on the environment demonstrator's verified episodes, from the
cache or built into it (``consequence.distill.coldstart.cached_cold_start``).

The run's config keeps what the user asked for (``model`` and the ``cold_start_*`` settings);
the manifest's ``model`` is the folder RL started from, ``cold_start`` (manifest and
``RUN_DIR/cold_start.json``) says which cold start that is, and it is the reference policy: the
warm-start side of the final comparison and the start a resumed run is checked against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape

from consequence.config import TrainConfig

__all__ = ["check_cold_start", "cold_start_config", "cold_start_extra", "cold_started"]


def check_cold_start(cfg: TrainConfig, env: Any) -> None:
    """Refuse, before any work, a cold start that cannot run: an environment without a
    demonstrator (``--cold-start-demos`` plays it).

    Args:
        cfg: the run's settings.
        env: the run's environment (``envs.registry.env_of``).

    Raises:
        ValueError: ``cold_start_demos`` > 0 and ``env`` has no demonstrator, or none with its
            options (``envs.api.cannot_demonstrate``); the message names the other routes
            (``consequence sft`` with a file or a served teacher).
    """
    from consequence.envs.api import cannot_demonstrate, has_demonstrator

    if not cfg.cold_start_demos:
        return
    instead = (
        f"cold-start the model from a file of demonstrations or a served teacher instead, `consequence sft "
        f"--model M --env {cfg.env} --demos-file FILE --out DIR` (or --teacher-url URL), then train with "
        "--model DIR; or drop --cold-start-demos"
    )
    if not has_demonstrator(env):
        raise ValueError(
            f"--cold-start-demos {cfg.cold_start_demos} plays the demonstrator of --env {env.label}, which has "
            "none (Environment.demonstration; `consequence envs` shows which environments have one): " + instead
        )
    why = cannot_demonstrate(env)
    if why is not None:  # its options leave it none
        raise ValueError(
            f"--cold-start-demos {cfg.cold_start_demos} plays the demonstrator of --env {env.label}, which cannot "
            f"demonstrate here ({why}): " + instead
        )


def cold_start_config(cfg: TrainConfig):
    """The :class:`~consequence.distill.coldstart.ColdStartConfig` of a run's ``cold_start_*``
    settings: the demonstrator's ``cold_start_demos`` train episodes drawn with
    ``cold_start_seed`` (also the LoRA initialisation's and SFT's seed) on the run's split
    (``split_seed``), the run's LoRA settings (rank 0: all weights), SFT with the
    ``cold_start_*`` optimiser settings."""
    from consequence.distill.coldstart import ColdStartConfig
    from consequence.distill.sft import SFTConfig
    from consequence.envs.registry import environment_options

    return ColdStartConfig(
        env=cfg.env,
        env_options=environment_options(cfg.env_options, cfg.tasks_file),
        demos=cfg.cold_start_demos,
        seed=cfg.cold_start_seed,
        split_seed=cfg.split_seed,
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_targets=tuple(cfg.lora_targets),
        tool_format=cfg.tool_format,
        sft=SFTConfig(
            learning_rate=cfg.cold_start_learning_rate,
            epochs=cfg.cold_start_epochs,
            rows_per_step=cfg.cold_start_rows_per_step,
            micro_batch_size=cfg.cold_start_micro_batch_size,
            seed=cfg.cold_start_seed,
        ),
    )


def cold_start_extra(cfg: TrainConfig) -> dict[str, Any]:
    """What else of the run shapes its cold start's demonstrations, for the cache key: the
    ``--train-problems`` cut of the train split and the task file's contents."""
    from consequence.report.manifest import sha256_of

    return {
        "train_problems": cfg.train_problems,
        "tasks_file_sha256": sha256_of(Path(cfg.tasks_file)) if cfg.tasks_file else None,
    }


def cold_started(
    cfg: TrainConfig, student: Path, env: Any, console, build: bool = True, before_build=None
) -> tuple[Path, dict[str, Any]]:
    """The cold start of ``student`` with the run's settings (``cold_start_demos`` > 0).

    Args:
        cfg: the run's settings.
        student: the resolved ``--model`` folder (or the tiny warm start's).
        env: the run's environment (its train split is the one played).
        console: where the log lines and the SFT progress bar go.
        build: False for a resumed run: it must start from the cold start it began with, so a
            missing one is refused instead of built again.
        before_build: called once before a build (the run's checks against the student).

    Returns:
        ``(the cold start's folder, the run's record of it)``: where it is, its cache key,
        whether it was reused, when it was built, the student (as given and as resolved), and
        its ``sft.json`` (settings, demonstrations' counts, rows, losses, seconds).

    Raises:
        ValueError: the environment has no demonstrator (:func:`check_cold_start`), a resumed
            run's cold start is gone from the cache (names it and the fix), or as
            ``consequence.distill.coldstart.cold_start``.
    """
    from consequence.distill.coldstart import built_on, cached_cold_start
    from consequence.evaluate.progress import Phases
    from consequence.policy.device import resolve_device
    from consequence.policy.named import is_named, source_record

    check_cold_start(cfg, env)
    ccfg, extra = cold_start_config(cfg), cold_start_extra(cfg)

    def log(line: str) -> None:
        console.print(escape(line))

    try:
        with Phases(console) as phases:
            folder, record, reused = cached_cold_start(
                student,
                ccfg,
                extra=extra,
                log=log,
                phases=phases,
                source=source_record(cfg.model) if is_named(cfg.model) else None,
                env=env,
                build=build,
                before_build=before_build,
                device=resolve_device(cfg.device),  # a build runs where the run computes
            )
    except ValueError as e:
        if build:
            raise
        raise ValueError(
            f"cannot resume: {e}; the run started RL from that cold start (the reference policy of its "
            "final comparison), and building it again need not give the same weights. Start the run again "
            "without --resume (it builds the cold start anew), or put the folder back"
        ) from None
    return folder, {
        "path": str(folder),
        "key": folder.name,
        "reused": reused,
        "built": built_on(folder),
        "model": cfg.model,  # as given (None: the bundled tiny warm start)
        "student": str(student),
        "extra": extra,
        "sft": record,
    }
