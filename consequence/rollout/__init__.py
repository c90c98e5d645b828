"""The rollout box: what the model did when sampled. Episodes within budgets (``episodes``), groups
of G episodes per task (``groups``), and one iteration's batch of B tasks × G episodes, scored
(``collect``, played by an ``EpisodeRunner``)."""

from consequence.exports import lazy

__all__ = [
    "Budgets",
    "EpisodeRunner",
    "EpisodeSpec",
    "group_of",
    "harness_runner",
    "is_mixed",
    "policy_generate_fn",
    "roll_out_round",
    "run_episodes",
]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "Budgets": "episodes",
        "EpisodeSpec": "episodes",
        "run_episodes": "episodes",
        "group_of": "groups",
        "policy_generate_fn": "sampling",
        "EpisodeRunner": "collect",
        "harness_runner": "collect",
        "roll_out_round": "collect",
        "is_mixed": "collect",
    },
)
