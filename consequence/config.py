"""The one documented config of ``consequence train``.

Every field's description is also its ``--help`` text. A YAML file passed with
``--config`` holds the same keys; unknown keys and bad values are rejected with a message
that names the key and what is allowed.
"""

from __future__ import annotations

import difflib

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


BOXES: tuple[str, ...] = ("tasks", "policy", "rollout", "reward", "credit", "update", "evaluate")


def _f(default, box: str, description: str, **limits):
    """A config field tagged with the box of the loop it configures (or ``run``)."""
    return Field(default, description=description, json_schema_extra={"box": box}, **limits)


def box_of(name: str) -> str:
    """The box (one of BOXES, or ``run``) that config field ``name`` belongs to."""
    return TrainConfig.model_fields[name].json_schema_extra["box"]  # type: ignore[index]


class TrainConfig(BaseModel):
    """Settings of one training run (synchronous; defaults: GRPO on the code-repair task)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    run_dir: str = _f("runs/repair-grpo", "run", "Directory for checkpoints, trajectories, metrics, plots and the report.")
    recipe: str | None = _f(None, "run", "Start from this recipe (reinforce, rloo, ppo, grpo, dr_grpo, dapo, gspo, cispo, or a recipe YAML path; see `consequence explain`); other options override it.")
    model: str | None = _f(None, "policy", "Path of a local Hugging Face causal LM with a chat template; default: the bundled tiny warm-start checkpoint (built on first use, then cached).")
    seed: int = _f(0, "run", "Seed of RL sampling and task order (vary it for several training seeds); does not change the split or the warm start.")
    tasks: Literal["repair", "humaneval-repair"] = _f("repair", "tasks", "Task source: our generated repair problems, or HumanEval solutions with one injected bug (split by HumanEval task id).")
    split_seed: int = _f(0, "tasks", "Seed of the train/validation/test problem split; the tiny warm start is built on its train split, so another value rebuilds the warm start (about 30 min on 2 cores).")
    skip_checks: bool = _f(False, "run", "Skip the checks before the first optimizer step (docs/design.md §6); recorded in manifest.json.")
    iterations: int = _f(18, "run", "Number of RL iterations (collect a batch, then update).", ge=1)
    checkpoint_every: int = _f(1, "run", "Write a resume state (weights, optimizer, RNG, metrics; for `train --resume`) every this many iterations and after the last; the tiny model's takes ~23 MB and well under a second.", ge=1)
    tasks_per_iteration: int = _f(16, "tasks", "B: train tasks sampled per iteration.", ge=1)
    group_size: int = _f(8, "rollout", "G: rollouts per task; advantages are computed within each group.", ge=2)
    temperature: float = _f(1.0, "policy", "Sampling temperature of training rollouts.", gt=0)
    top_k: int = _f(0, "policy", "Top-k of training rollouts (0 = off); the trainer uses the same support.", ge=0)
    top_p: float = _f(1.0, "policy", "Top-p of training rollouts (1 = off); the trainer uses the same support.", gt=0, le=1)
    max_turns: int = _f(8, "rollout", "Budget: model calls per episode.", ge=1)
    max_new_tokens: int = _f(48, "rollout", "Budget: tokens per model call.", ge=1)
    max_total_tokens: int = _f(768, "rollout", "Budget: context + generated tokens per episode.", ge=16)
    dynamic_sampling: bool = _f(False, "rollout", "Drop groups whose rewards are all equal and sample more groups until the batch is full (DAPO §3.2).")
    dynamic_sampling_max_rounds: int = _f(3, "rollout", "Dynamic sampling: at most this many rounds of B tasks per iteration; then train on what was kept.", ge=1)
    overlong_buffer: int = _f(0, "reward", "DAPO overlong shaping: penalty rises linearly from 0 to −1 over the last this many tokens before max_total_tokens (0 = off).", ge=0)
    overlong_filter: bool = _f(False, "reward", "DAPO overlong filtering: truncated episodes count in group statistics but are left out of the loss.")
    advantage: Literal["reinforce", "batch_mean", "reinforce_pp", "rloo", "grpo", "dr_grpo", "gae"] = _f("grpo", "credit", "Advantage estimator; gae trains a value head (PPO).")
    grpo_std: Literal["population", "sample"] = _f("population", "credit", "Std of the GRPO group normalisation: population (correction 0) or sample (correction 1).")
    gamma: float = _f(1.0, "credit", "GAE: discount per generated token.", ge=0, le=1)
    gae_lambda: float = _f(0.95, "credit", "GAE: λ.", ge=0, le=1)
    value_learning_rate: float = _f(1e-3, "credit", "GAE: AdamW learning rate of the value head and its trunk.", gt=0)
    value_clip: float = _f(0.2, "credit", "GAE: value clipping range ε_v (0 = off).", ge=0)
    kl_coef: float = _f(0.0, "update", "β of the KL to the frozen reference (the starting policy); 0 = off.", ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k3", "update", "KL estimator (Schulman 2020).")
    kl_mode: Literal["loss", "reward"] = _f("loss", "update", "Apply the KL as a loss term or as a penalty on the reward.")
    surrogate: Literal["pg", "ppo_clip", "dual_clip", "gspo", "gspo_token", "cispo"] = _f("ppo_clip", "update", "Per-token objective of the update.")
    clip_eps: float = _f(0.2, "update", "Clip range ε (ε_low) of the ratio.", gt=0, le=1)
    clip_eps_high: float = _f(0.0, "update", "Upper clip range ε_high (0 = same as clip_eps; DAPO clip-higher 0.28).", ge=0)
    dual_clip_c: float = _f(3.0, "update", "Dual clip: bound c·A for negative advantages.", gt=1)
    tis_cap: float = _f(0.0, "update", "Truncated importance sampling cap C against the sampler's log-probs (0 = off).", ge=0)
    entropy_coef: float = _f(0.0, "update", "Entropy bonus c_H (0 = off).", ge=0)
    offpolicy_delta: float = _f(0.0, "update", "Off-policy sequence masking: drop negative-advantage rows whose KL to the behaviour policy exceeds this, nats/token (0 = off).", ge=0)
    reduction: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = _f("token_mean", "update", "How per-token terms are averaged over the optimizer step.")
    norm_const: int = _f(0, "update", "L_const of seq_mean_token_sum_norm (Dr.GRPO); 0 = the largest target count in the step.", ge=0)
    learning_rate: float = _f(2e-4, "update", "AdamW learning rate of the policy.", gt=0)
    epochs_per_batch: int = _f(1, "update", "Passes over each collected batch (ratios are measured against the behaviour snapshot).", ge=1)
    mini_batches: int = _f(1, "update", "Optimizer steps per pass over the batch (PPO mini-batches).", ge=1)
    micro_batch_size: int = _f(32, "update", "Rows per forward/backward; the loss reduction is over the whole step, so this changes memory, not the gradient.", ge=1)
    eval_every: int = _f(6, "evaluate", "Validate every this many iterations (0 = never).", ge=0)
    val_episodes: int = _f(128, "evaluate", "Episodes (greedy) of each periodic validation.", ge=0)
    final_eval_episodes: int = _f(400, "evaluate", "Episodes per split in the final warm-start vs RL comparison.", ge=0)
    final_eval_decoding: list[Literal["greedy", "sampled"]] = _f(["greedy", "sampled"], "evaluate", "Decodings of the final comparison (sampled uses the training temperature and the same seeds for both policies).")
    warmstart_demos: int = _f(4000, "policy", "Teacher demonstrations for building the tiny warm start.", ge=10)
    warmstart_epochs: float = _f(8.0, "policy", "SFT epochs over the demonstrations when building the tiny warm start.", gt=0)

    @classmethod
    def from_yaml(cls, path: str | Path, base: dict | None = None, **overrides) -> "TrainConfig":
        """Load a YAML config over ``base`` (e.g. a recipe's settings), then apply overrides.

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
        return cls.checked(**{**(base or {}), **data, **overrides})

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
                hint = err["msg"]
                if err["type"] == "extra_forbidden":
                    close = difflib.get_close_matches(str(err["loc"][0]), list(cls.model_fields), n=2)
                    hint = ("unknown option" + (f"; did you mean {' or '.join(close)}?" if close else "")
                            + " (see `consequence train --help`)")
                lines.append(f"  {key}: {hint} (got {err.get('input')!r})")
            raise ValueError("invalid training config:\n" + "\n".join(lines)) from None
