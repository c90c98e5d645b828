"""The update box: change the parameters (docs/design.md §5): surrogates, loss reductions,
regularisers, the optimizer step, data-parallel ranks."""

from consequence.exports import lazy

__all__ = [
    "DataParallelUpdate",
    "NonFiniteError",
    "UpdateConfig",
    "accumulate_gradients",
    "clipped_surrogate",
    "compute_logprobs",
    "max_update_ranks",
    "offpolicy_sequence_mask",
    "ppo_step",
    "reduce_tokens",
    "surrogate_objective",
    "tis_weights",
]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "UpdateConfig": "step",
        "NonFiniteError": "step",
        "ppo_step": "step",
        "accumulate_gradients": "step",
        "compute_logprobs": "step",
        "surrogate_objective": "surrogates",
        "clipped_surrogate": "surrogates",
        "reduce_tokens": "losses",
        "tis_weights": "regularizers",
        "offpolicy_sequence_mask": "regularizers",
        "DataParallelUpdate": "data_parallel",
        "max_update_ranks": "data_parallel",
    },
)
