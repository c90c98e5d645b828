"""The one documented config of ``consequence train``.

Every field's description is also its ``--help`` text. A YAML file passed with
``--config`` holds the same keys; unknown keys and bad values are rejected with a message
that names the key and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class TrainConfig(BaseModel):
    """Settings of one training run (GRPO, synchronous, on the code-repair task)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    run_dir: str = Field("runs/repair-grpo", description="Directory for checkpoints, trajectories, metrics, plots and the report.")
    model: str | None = Field(None, description="Path of a local Hugging Face causal LM with a chat template; default: the bundled tiny warm-start checkpoint (built on first use, then cached).")
    seed: int = Field(0, description="Seed of RL sampling and task order (vary it for several training seeds); does not change the split or the warm start.")
    split_seed: int = Field(0, description="Seed of the train/validation/test problem split; the tiny warm start is built on its train split, so another value rebuilds the warm start (about 30 min on 2 cores).")
    iterations: int = Field(18, ge=1, description="Number of RL iterations (collect a batch, then update).")
    tasks_per_iteration: int = Field(16, ge=1, description="B: train tasks sampled per iteration.")
    group_size: int = Field(8, ge=2, description="G: rollouts per task; advantages are computed within each group.")
    learning_rate: float = Field(2e-4, gt=0, description="AdamW learning rate of the policy.")
    epochs_per_batch: int = Field(1, ge=1, description="Passes over each collected batch (ratios are measured against the behaviour snapshot).")
    micro_batch_size: int = Field(32, ge=1, description="Rows per forward/backward; the loss reduction is over the whole step, so this changes memory, not the gradient.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO clip range ε of the ratio.")
    reduction: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field("token_mean", description="How per-token terms are averaged over the optimizer step.")
    advantage: Literal["grpo", "dr_grpo", "rloo", "batch_mean", "reinforce"] = Field("grpo", description="Advantage estimator (credit box).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of training rollouts.")
    top_k: int = Field(0, ge=0, description="Top-k of training rollouts (0 = off); the trainer uses the same support.")
    top_p: float = Field(1.0, gt=0, le=1, description="Top-p of training rollouts (1 = off); the trainer uses the same support.")
    max_turns: int = Field(8, ge=1, description="Budget: model calls per episode.")
    max_new_tokens: int = Field(48, ge=1, description="Budget: tokens per model call.")
    max_total_tokens: int = Field(768, ge=16, description="Budget: context + generated tokens per episode.")
    eval_every: int = Field(6, ge=0, description="Validate every this many iterations (0 = never).")
    val_episodes: int = Field(128, ge=0, description="Episodes (greedy) of each periodic validation.")
    final_eval_episodes: int = Field(400, ge=0, description="Episodes per split in the final warm-start vs RL comparison.")
    final_eval_decoding: list[Literal["greedy", "sampled"]] = Field(["greedy", "sampled"], description="Decodings of the final comparison (sampled uses the training temperature and the same seeds for both policies).")
    warmstart_demos: int = Field(4000, ge=10, description="Teacher demonstrations for building the tiny warm start.")
    warmstart_epochs: float = Field(8.0, gt=0, description="SFT epochs over the demonstrations when building the tiny warm start.")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "TrainConfig":
        """Load a YAML config, then apply command-line overrides.

        Raises:
            ValueError: the file is missing, not a mapping, or has bad keys/values.
        """
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} " + ("is a directory" if p.is_dir() else "does not exist"))
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {p} must hold a mapping of option: value")
        return cls.checked(**{**data, **overrides})

    @classmethod
    def checked(cls, **values) -> "TrainConfig":
        """Validate values with a readable error (one line per bad key)."""
        try:
            return cls(**values)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                key = ".".join(str(x) for x in err["loc"])
                key = f"{key} (--{key.replace('_', '-')})"
                hint = "unknown option; see `consequence train --help`" if err["type"] == "extra_forbidden" else err["msg"]
                lines.append(f"  {key}: {hint} (got {err.get('input')!r})")
            raise ValueError("invalid training config:\n" + "\n".join(lines)) from None
