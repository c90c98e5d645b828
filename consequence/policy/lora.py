"""LoRA adapters through PEFT: wrap a policy, load and merge adapter checkpoints, and give
the sampler the weights the trainer differentiates.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", §4.1) keeps a
pretrained weight W₀ [out, in] frozen and trains ``B`` [out, r] and ``A`` [r, in]; the layer
computes ``x W₀ᵀ + (α / r) · x Aᵀ Bᵀ``. ``B`` starts at zero, so the wrapped policy equals
the base model before its first step. Only ``A`` and ``B`` get gradients and AdamW state.

The trainer's forward (``policy.logprobs``) runs the PEFT model, so the adapter is in it.
The sampler's fast Llama path reads weight matrices directly, so it must read the
*effective* weight ``W₀ + (α / r) B A`` of every adapted layer (:func:`effective_weight`):
reading ``.weight`` of a PEFT layer gives W₀ alone, and then rollouts come from the base
model while the trainer scores them under the adapter, which looks like staleness (the
ratio drifts from 1 at every iteration after the first). The pre-step ratio check and the
``first_step_ratio_*`` metrics of every iteration measure exactly this.

A checkpoint of a LoRA run holds the adapter (``adapter_config.json`` +
``adapter_model.safetensors``, PEFT's format) and the tokenizer; ``adapter_config.json``
names the base model's folder (absolute). :func:`load_adapter_policy` loads one;
:func:`merge_adapter` (``consequence merge``) writes a plain Hugging Face folder with
``W₀ + (α / r) B A`` folded in.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, cast

import torch

# The checkpoint half (adapter folders, loading, saving) lives in policy.checkpoint, shared
# with policy.tiny; its names stay importable from here, where callers use them.
from consequence.policy.checkpoint import (
    ADAPTER_CONFIG,
    adapter_base,
    is_adapter_folder,
    load_adapter_policy,
    quiet_peft,
    save_policy,
)
from consequence.policy.checkpoint import is_model_folder as is_model_folder

# All linear projections of a Llama-layout block (attention and MLP): what "all-linear" means in PEFT
# for these models, and what QLoRA (Dettmers et al. 2023, §4) found necessary to match full fine-tuning.
DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_peft(model) -> bool:
    """Whether ``model`` is a PEFT model (has an adapter)."""
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def apply_lora(model, rank: int, alpha: float, targets: list[str] | tuple[str, ...], base_path) -> torch.nn.Module:
    """Wrap ``model`` with a fresh LoRA adapter (B = 0: the output is unchanged).

    Args:
        model: a Hugging Face causal LM (float32), not already a PEFT model.
        rank: r ≥ 1, the adapter's rank.
        alpha: α > 0; the update is scaled by α / r.
        targets: module names to adapt (e.g. ``q_proj``); each must name a linear layer.
        base_path: the base model's folder, recorded (absolute) in ``adapter_config.json``
            so that a checkpoint can be loaded offline.

    Returns:
        the ``PeftModel``; only the adapter's parameters require gradients.

    Raises:
        ValueError: as :func:`check_lora`.
    """
    from peft import LoraConfig, get_peft_model

    check_lora(model, rank, alpha, targets)
    cfg = LoraConfig(
        r=int(rank),
        # PEFT annotates lora_alpha as int but only divides it by r: a float alpha (--lora-alpha 0.5) is kept exact
        lora_alpha=float(alpha),  # type: ignore[arg-type]
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with quiet_peft():
        peft_model = get_peft_model(model, cfg)
    # set after wrapping: get_peft_model fills it from the model's (possibly relative) name_or_path
    peft_model.peft_config["default"].base_model_name_or_path = str(Path(base_path).resolve())
    return peft_model


def check_lora_folder(path, rank: int, alpha: float, targets: list[str] | tuple[str, ...]) -> None:
    """:func:`check_lora` against the model in folder ``path`` before any work, without its
    weights: the architecture is built from its ``config.json`` on the meta device (no memory
    for weights). A folder whose architecture cannot be built so is left to
    :func:`apply_lora`, which checks the same once the model is loaded.

    Raises:
        ValueError: as :func:`check_lora` (a LoRA checkpoint folder: it already has an adapter).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    p = Path(path)
    if is_adapter_folder(p):
        raise ValueError("the policy already has a LoRA adapter; merge it first (consequence merge) to train another")
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(p)))
    except Exception:  # not buildable without its weights: apply_lora checks once it is loaded
        return
    check_lora(skeleton, rank, alpha, targets)


def check_lora(model, rank: int, alpha: float, targets: list[str] | tuple[str, ...]) -> None:
    """Refuse a LoRA adapter that :func:`apply_lora` could not put on ``model``.

    Raises:
        ValueError: a bad rank or alpha, ``model`` already has an adapter, a target names no
            linear layer of the model (the message lists the ones it has), ``lm_head`` of a
            model that ties it to the embedding, or a rank above a target layer's smallest
            dimension.
    """
    if rank < 1 or not alpha > 0:
        raise ValueError(f"--lora-rank must be >= 1 and --lora-alpha > 0 (got {rank}, {alpha})")
    if is_peft(model):
        raise ValueError("the policy already has a LoRA adapter; merge it first (consequence merge) to train another")
    layers = [(n.rsplit(".", 1)[-1], m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    linear = sorted({n for n, _ in layers})
    missing = [t for t in targets if t not in linear]
    if missing or not targets:
        raise ValueError(
            f"--lora-targets {','.join(missing) or '(empty)'}: no linear layer of that name in "
            f"{type(model).__name__}; it has {', '.join(linear)}"
        )
    if "lm_head" in targets and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(
            "--lora-targets lm_head: this model ties its LM head to the input embedding, so an adapter "
            "there would also change the embedding and could not be merged exactly; leave lm_head out"
        )
    widest = min(min(m.in_features, m.out_features) for n, m in layers if n in targets)
    if rank > widest:
        raise ValueError(
            f"--lora-rank {rank} is above the smallest dimension ({widest}) of the target layers: a "
            f"rank-{widest} adapter already spans every update there; use --lora-rank {widest} or less"
        )


def effective_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight [out, in] a linear layer applies: ``W₀ + Σ (α / r) B A`` over its active
    LoRA adapters for a PEFT layer (unless merged or disabled), else ``layer.weight``."""
    base = getattr(layer, "base_layer", None)
    if base is None:
        return cast(torch.Tensor, layer.weight)  # a Linear's; torch types module attributes Tensor | Module
    w = base.weight
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return w
    lora_layer: Any = layer  # a PEFT LoraLayer: active_adapters and get_delta_weight are PEFT's, untyped
    for name in lora_layer.active_adapters:
        if name in getattr(layer, "lora_A", {}):
            w = w + lora_layer.get_delta_weight(name).to(w.dtype)
    return w


def unwrap(model) -> torch.nn.Module:
    """The Hugging Face model inside a PEFT model (its layers carry the adapter), else ``model``."""
    return model.get_base_model() if is_peft(model) else model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` for inference only: LoRA adapters folded into the weights
    (W₀ + (α/r)BA, a plain model with the adapter model's logits to float32 rounding),
    ``eval()``, no parameter requiring a gradient; ``model`` is not changed."""
    copy_: Any = copy.deepcopy(model)
    if is_peft(copy_):
        copy_ = copy_.merge_and_unload()
    return cast(torch.nn.Module, copy_).eval().requires_grad_(False)


def merge_adapter(path, out) -> Path:
    """Fold an adapter checkpoint into its base weights and save a plain Hugging Face folder.

    Args:
        path: an adapter checkpoint (e.g. ``runs/<run>/checkpoints/final`` of a LoRA run).
        out: the folder to write (atomically; replaced if it exists).

    Returns:
        ``out``; its logits equal the adapter model's to float32 rounding.

    Raises:
        ValueError: ``path`` is not an adapter checkpoint, or as :func:`load_adapter_policy`.
    """
    if not is_adapter_folder(path):
        raise ValueError(f"{path}: not a LoRA adapter checkpoint (no {ADAPTER_CONFIG}); it is already a plain model")
    check_merge_target(path, out)
    model, tokenizer = load_adapter_policy(path, trainable=False)
    merged = model.merge_and_unload()
    out = Path(out).resolve()  # "." or "sub/.." named relatively cannot be renamed onto
    merged.config.name_or_path = str(out)
    return save_policy(merged, tokenizer, out)


def check_merge_target(adapter, out) -> None:
    """Where a merged model may be written: a new folder, or an earlier merge's output.

    Raises:
        ValueError: ``out`` is empty, an existing file, the adapter folder, inside it or
            above it, the adapter's base model, or an existing folder that is not a
            plain model folder (its files would be replaced: name a new folder).
    """
    from consequence.fileio import check_model_out

    a = Path(adapter).resolve()
    check_model_out(out, {"the adapter folder": a, "the adapter's base model": adapter_base(a)}, "the merged model")
