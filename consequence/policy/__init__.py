"""The policy box: what probability the model gives each action (docs/design.md §1): models and
checkpoints, LoRA, the batched sampler, log-probs under the sampler's processed distribution,
registered models, the vLLM engine."""

from consequence.exports import lazy

__all__ = [
    "NamedModel",
    "SamplingParams",
    "VllmEngine",
    "apply_lora",
    "build_model",
    "build_tokenizer",
    "generate",
    "is_adapter_folder",
    "load_policy",
    "merge_adapter",
    "process_logits",
    "save_policy",
    "token_logprobs",
]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "load_policy": "checkpoint",
        "save_policy": "checkpoint",
        "is_adapter_folder": "checkpoint",
        "apply_lora": "lora",
        "merge_adapter": "lora",
        "SamplingParams": "sampler",
        "generate": "sampler",
        "token_logprobs": "logprobs",
        "process_logits": "logprobs",
        "NamedModel": "named",
        "VllmEngine": "vllm_engine",
        "build_model": "tiny",
        "build_tokenizer": "tiny",
    },
)
