"""One iteration's batch: B train tasks × G episodes with π_old, scored and grouped.

How the episodes are played is an :class:`EpisodeRunner`: the in-process harness
(:func:`harness_runner`, the default), a user's agent through the loopback endpoint
(``consequence.serve.runner.agent_runner``), or an inference engine (vLLM) behind the
harness. The batch is the same whichever plays it: seeds, groups and scoring are decided here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from consequence.config import TrainConfig, generation_budget
from consequence.harness.context import ContextBuilder
from consequence.records import Trajectory, credited
from consequence.reward.scoring import rescore_group, score_trajectories
from consequence.reward.shaping import apply_potential_shaping
from consequence.rollout.attempts import check_attempts
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.rollout.groups import group_of
from consequence.rollout.sampling import episodes_in_flight, policy_generate_fn
from consequence.seeding import seed_of


class EpisodeRunner(Protocol):
    """Plays episodes: one trajectory per spec, in order, unscored, each with ``policy_version``.

    ``seed`` seeds the sampling of this round (``seed_of(run seed, iteration, ["round", r],
    "rollout")``); ``progress(k)`` is told the episodes done. Returns the trajectories and
    the runner's own counts (added up over rounds; e.g. the agent-runner's ``agent_calls``).
    """

    def __call__(
        self,
        specs: Sequence[EpisodeSpec],
        seed: int,
        policy_version: int,
        progress: Callable[[int], None] | None,
    ) -> tuple[list[Trajectory], dict[str, float]]: ...


def harness_runner(model, renderer, env, budgets: Budgets, sampling, engine=None) -> EpisodeRunner:
    """The in-process harness (``rollout.episodes.run_episodes``) sampling from ``model``, or
    from ``engine`` when given: an object whose ``generate_fn(sampling, stop_ids, seed)``
    returns a ``generate_fn`` of the contract of ``rollout.sampling.policy_generate_fn``
    (``policy.vllm_engine.VllmEngine``)."""

    def run(specs, seed, policy_version, progress):
        gen = (
            engine.generate_fn(sampling, renderer.stop_ids, seed)
            if engine is not None
            else policy_generate_fn(model, sampling, renderer.stop_ids, seed)
        )
        trajs = run_episodes(
            gen,
            renderer,
            specs,
            budgets,
            env.system_prompt,
            policy_version=policy_version,
            progress=progress,
            examples=env.examples,
            max_live=None if engine is not None else episodes_in_flight(model, budgets.max_total_tokens),
        )
        return trajs, {}

    return run


def collect(
    it: int,
    cfg: TrainConfig,
    runner: EpisodeRunner,
    env,
    budgets: Budgets,
    progress: Callable[[int], None] | None = None,
    policy_version: int | None = None,
    learned_reward: Callable[[list[Trajectory]], None] | None = None,
) -> tuple[list[Trajectory], dict[str, Any]]:
    """Roll out B tasks × G episodes, scored; with dynamic sampling keep only groups whose
    rewards differ, sampling new tasks for up to ``dynamic_sampling_max_rounds`` rounds
    (DAPO, Yu et al. 2025, §3.2).

    ``it`` picks the batch (its tasks and seeds); ``policy_version`` is the version of the
    weights that sample it, recorded on every trajectory (default ``it``: the synchronous
    loop; an asynchronous rollout worker may sample batch ``it`` with older weights).
    ``learned_reward(trajs)``: run on each round's scored episodes after the environment's
    reward (``--reward-model``: ``reward.reward_model.apply_reward_model``; ``--judge-url``:
    ``reward.judge.apply_judge``, which may make an episode an env_error).

    Returns:
        (trajectories of the kept groups, stats: groups generated / kept / dropped, the
        tokens generated in all rounds, and the runner's counts).
    """
    rounds = cfg.dynamic_sampling_max_rounds if cfg.dynamic_sampling else 1
    version = it if policy_version is None else policy_version
    kept: list[list[Trajectory]] = []
    generated = tokens = 0
    runner_stats: dict[str, float] = {}
    for r in range(rounds):
        groups, stats = roll_out_round(it, r, cfg, runner, env, budgets, progress, version, learned_reward)
        for k, v in stats.items():
            runner_stats[k] = runner_stats.get(k, 0.0) + v
        generated += len(groups)
        tokens += sum(t.n_generated_tokens for g in groups for t in g)
        kept += [g for g in groups if not cfg.dynamic_sampling or is_mixed(g, env.reward_components[0])]
        if len(kept) >= cfg.tasks_per_iteration:
            break
    kept = kept[: cfg.tasks_per_iteration]
    stats = {
        "groups_generated": generated,
        "groups_kept": len(kept),
        "groups_dropped": generated - len(kept),
        "gen_tokens_total": tokens,
        **runner_stats,
    }
    return [t for g in kept for t in g], stats


def roll_out_round(
    it: int,
    r: int,
    cfg: TrainConfig,
    runner: EpisodeRunner,
    env,
    budgets: Budgets,
    progress: Callable[[int], None] | None = None,
    version: int = 0,
    learned_reward: Callable[[list[Trajectory]], None] | None = None,
) -> tuple[list[list[Trajectory]], dict[str, float]]:
    """Round ``r`` of iteration ``it``: B tasks × G episodes played by ``runner``, scored
    (verifier + overlong shaping against the generation budget, DAPO §3.4; with ``--shaping
    potential`` the environment's potential-based shaping, ``reward.shaping``) and grouped.

    Returns:
        (the groups in task order, the runner's counts).
    """
    tag = (it,) if r == 0 else (it, "round", r)  # round 0 keeps the seeds of plain sampling
    tasks = env.sample("train", cfg.tasks_per_iteration, seed=seed_of(cfg.seed, *tag))
    prefix = f"{it}" if r == 0 else f"{it}.{r}"
    shown = (cfg.context, cfg.observation_format, cfg.show_budget)
    view = None if shown == ("full", "raw", False) else ContextBuilder(*shown)  # None: today's harness
    # None for --attempts 1: today's harness
    retries = check_attempts(env, cfg.attempts, cfg.attempt_discount, cfg.attempt_feedback)
    specs = [
        EpisodeSpec(
            episode,
            t.task_id,
            f"{prefix}/{t.task_id}",
            g,
            seed_of(cfg.seed, *tag, g),
            answer_ends_episode=env.answer_ends_episode,
            potential=env.potential if cfg.shaping == "potential" else None,
            builder=view,
            attempts=retries,
        )
        for t in tasks
        for g, episode in enumerate(group_of(env, t, cfg.group_size))
    ]
    trajs, stats = runner(specs, seed_of(cfg.seed, *tag, "rollout"), version, progress)
    score_trajectories(
        trajs,
        cfg.overlong_buffer,  # L_max of the overlong shaping: the generation budget
        generation_budget(budgets.max_turns, budgets.max_new_tokens, budgets.max_total_tokens),
        env.reward_components,
        env.reward_range,
    )
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    for task in tasks:
        rescore_group(env, task, groups[f"{prefix}/{task.task_id}"], overlong=bool(cfg.overlong_buffer))
    if learned_reward is not None:  # --reward-model: after the environment's reward, which it weighs
        learned_reward(trajs)
    if cfg.shaping == "potential":  # last: F = γΦ(s') − Φ(s) is added to whatever reward the turns carry
        apply_potential_shaping(trajs, cfg.gamma if cfg.shaping_gamma is None else cfg.shaping_gamma)
    return list(groups.values()), stats


def is_mixed(group: list[Trajectory], primary: str) -> bool:
    """Whether the group's accuracy differs among the members the credit box keeps (DAPO
    §3.2: keep a group when 0 < #correct < G): the ``primary`` reward component, the
    verifier's, not the shaped total, so an overlong penalty or another shaping term that
    differs among equally right (or equally wrong) answers does not keep the group. An
    env_error or an episode with no generated token leaves the group (docs/cases.md, case
    15), so a group mixed only through one of them carries no group-relative signal."""
    return len({t.reward_components.get(primary, 0.0) for t in group if credited(t)}) > 1
