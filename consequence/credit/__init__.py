"""The credit box: which actions deserve credit or blame (docs/design.md §4): group advantages
(REINFORCE, RLOO, GRPO, Dr.GRPO, ...), GAE with a value head, KL terms, rejection sampling, and
the batch of training rows they are assigned to."""

from consequence.exports import lazy

__all__ = [
    "Batch",
    "ValueModel",
    "accept",
    "assign_credit",
    "credit_rewards",
    "discounted_returns",
    "gae",
    "group_advantages",
    "kl_estimate",
    "mixed_group_fraction",
    "reverse_kl_advantages",
    "training_rows",
]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "group_advantages": "advantages",
        "mixed_group_fraction": "advantages",
        "Batch": "batch",
        "assign_credit": "batch",
        "training_rows": "batch",
        "credit_rewards": "batch",
        "kl_estimate": "kl",
        "reverse_kl_advantages": "kl",
        "gae": "returns",
        "discounted_returns": "returns",
        "ValueModel": "value",
        "accept": "rejection",
    },
)
