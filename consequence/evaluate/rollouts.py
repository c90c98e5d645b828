"""Evaluation episodes: the policy on fixed tasks, scored like the training reward.

The episodes go through the same harness, environment, budgets and verifier as training
(rollout and reward boxes); only the sampling settings and the seeds are the
evaluation's own, so two policies run on identical instances and seeds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from consequence.policy.sampler import SamplingParams
from consequence.records import Trajectory
from consequence.reward.scoring import rescore_group, score_trajectories
from consequence.rollout.attempts import Attempts
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.rollout.groups import group_of
from consequence.rollout.sampling import episodes_in_flight, policy_generate_fn
from consequence.seeding import seed_of


def run_eval(
    model,
    renderer,
    env,
    tasks: Sequence,
    budgets: Budgets,
    seed: int,
    greedy: bool = True,
    policy_version: int = 0,
    temperature: float = 1.0,
    progress: Callable[[int], None] | None = None,
) -> list[Trajectory]:
    """One episode of ``model`` per task: greedy, or sampled at ``temperature``.

    ``progress(n_done)``: see :func:`sample_episodes`.

    Returns:
        scored trajectories, in task order (``sample_id`` 0).
    """
    return sample_episodes(
        model, renderer, env, tasks, 1, budgets, seed, 0.0 if greedy else temperature, policy_version, progress=progress
    )


def sample_episodes(
    model,
    renderer,
    env,
    tasks: Sequence,
    n: int,
    budgets: Budgets,
    seed: int,
    temperature: float = 1.0,
    policy_version: int = 0,
    openings: Sequence[tuple] | None = None,
    progress: Callable[[int], None] | None = None,
    attempts: Attempts | None = None,
) -> list[Trajectory]:
    """``n`` episodes per task of environment ``env`` (``sample_id`` 0 … n−1, each with its
    own seed), scored with the environment's reward components (``score_group`` per task).

    One random stream per episode: episode j of a task samples from its own generator,
    seeded ``seed_of(seed, task_id, j)`` (also its ``reset`` seed and the trajectory's
    ``seed``), so an episode depends on the seed, its task and j only — not on the other
    tasks of the list, their order or the batch it ran in, and a single token that lands
    otherwise in one episode cannot shift the draws of any other. The same (seed, task)
    gives the same streams for every policy (paired comparisons: common random numbers).
    ``group_id`` is the task id. ``openings[i]`` is the
    scripted start of task i's episodes (see ``EpisodeSpec.opening``), default none.
    ``progress(n_done)``, when given, is called with the number of episodes finished so
    far after each batched model call and once at the end (``run_episodes``); it does not
    change the episodes. ``attempts`` (``rollout.attempts.check_attempts``): each episode
    may answer again after a wrong answer, with the environment's feedback; None: one answer
    (``episode_eval.attempts_vs_samples`` compares such episodes with independent samples).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n (samples per task) must be >= 1, got {n}")
    params = SamplingParams(temperature=temperature, max_new_tokens=budgets.max_new_tokens)
    openings = openings or [()] * len(tasks)
    specs = [
        EpisodeSpec(
            episode,
            t.task_id,
            t.task_id,
            j,
            seed_of(seed, t.task_id, j),
            tuple(openings[i]),
            env.answer_ends_episode,
            attempts=attempts,
        )
        for i, t in enumerate(tasks)
        for j, episode in enumerate(group_of(env, t, n))
    ]
    gen = policy_generate_fn(model, params, renderer.stop_ids, seed, episode_seeds=[s.seed for s in specs])
    trajs = run_episodes(
        gen,
        renderer,
        specs,
        budgets,
        env.system_prompt,
        policy_version,
        progress=progress,
        examples=env.examples,
        max_live=episodes_in_flight(model, budgets.max_total_tokens),
    )
    score_trajectories(trajs, components=env.reward_components, reward_range=env.reward_range)
    for i, t in enumerate(tasks):
        rescore_group(env, t, trajs[i * n : (i + 1) * n])
    return trajs
