"""The reward box: every score checked (finite, in range) and shaped (DAPO's overlong penalty)."""

from consequence.exports import lazy

__all__ = ["RewardResult", "checked_reward", "overlong_penalty", "rescore_group", "score_trajectories"]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "RewardResult": "scoring",
        "checked_reward": "scoring",
        "score_trajectories": "scoring",
        "rescore_group": "scoring",
        "overlong_penalty": "overlong",
    },
)
