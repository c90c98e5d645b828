"""A reward signal for tiny smoke runs: odd sample ids win.

The warm start rarely succeeds in a handful of rollouts, and groups whose rewards are all
equal carry no gradient (and are not even run by the update). Tests that need the
weights to move wrap the reward box with :func:`odd_samples_win`.
"""


def odd_samples_win(real_score):
    """``score_trajectories`` that scores as usual, then sets reward = sample_id % 2
    (env_error episodes keep reward None)."""

    def score(trajs, *args):
        real_score(trajs, *args)
        for t in trajs:
            if t.reward is not None:  # the verifier's (primary, first) component too: what accuracy reads
                t.reward = float(t.sample_id % 2)
                t.reward_components = {**t.reward_components, next(iter(t.reward_components)): t.reward}

    return score
