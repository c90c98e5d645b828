"""Side by side: our GRPO against TRL's ``GRPOTrainer`` on the same model and task.

Two configurations (``--task``, ``--model``): the default, the bundled tiny warm start on a
single-turn repair task (``--task repair``), and SmolLM2-135M-Instruct on reasoning-gym's
letter counting (``--task letters``, the settings of ``configs/smollm2-reasoning-gym.yaml``).
The same model, the same prompts in the same order, the same reward function, batch
(B prompts × G completions), completion length, temperature, learning rate and number of
updates, on CPU, in one process and in lockstep: update u of every framework runs back to
back (never concurrently; TRL's trainer waits in a thread), so that load from other
processes on a shared machine falls on all of them alike. Measured per update: seconds of
generation, of reward (the same function for all) and of optimisation (log-probs, loss,
backward, AdamW step), reported as medians over updates 2..N; success on held-out
test-split instances before and after, greedy and sampled (at the training temperature),
with one evaluation function (our sampler) for every trained model (``--no-eval`` or
``--eval-tasks 0`` skips them). Before training, one identical batch is pushed through
both losses and the gradients are compared (``check_same_gradient``).

Frameworks (``--frameworks``): ``ours`` (the library's boxes, as ``train.py`` uses them, with
every row run through the forward/backward: the same computation as TRL), ``trl``
(``GRPOTrainer``) and ``ours-skip0``, ours with the rows of zero advantage left out of the
forward/backward and the others' advantages rescaled so that the gradient is the same
(see ``OursGRPO``; ``train.py``'s ``ppo_step`` skips such rows itself).

Repair task (``--task repair``, default). The prompt holds the request, the buggy code
exactly as ``read_code`` shows it and the visible-test report exactly as ``run_tests``
shows it; the model answers once. Its answer is parsed by our ``Renderer``; exactly one
valid ``replace_line`` call is applied and scored on the hidden tests (1.0 if all pass);
anything else scores 0.0.
``--prompt history`` (default) gives code and report as the results of earlier
``read_code`` / ``run_tests`` calls, the layout the warm start was fine-tuned on;
``--prompt user`` puts them in one user message (the warm start solves ~1.5 % of those
greedily, too few successes for a group to learn from in a few updates).

Letter counting (``--task letters``): ``load_environment("reasoning-gym", 0, LETTERS_ENV)``
(letter_counting, 3-6 words, 3000 items, 2 worked examples), as the shipped config. The
prompt is ``opening_messages(env.system_prompt, env.request(task), env.examples)`` rendered
by our ``Renderer``; the reward is the episode's own scorer, ``step({"answer": text})`` on
the reply (the decoded completion without its stop token, ``Renderer.parse``), as our
rollout gives it; a truncated reply scores 0, as in our rollout. Update u trains on
``env.sample("train", B, seed=1000 + u)``; evaluation uses the first ``--eval-tasks`` of
``env.split["test"]`` (300 problems). Defaults (the shipped config): ``--model
smollm2-135m-instruct``, B = 4, G = 8, 48 new tokens, temperature 0.7, learning rate
5e-6, micro-batch 16; any option given on the command line wins. ``--model`` also takes a
local Hugging Face folder. ``--layers K`` keeps the first K decoder layers only (smoke
runs; recorded in the JSON).

Equivalences (TRL 1.16 ``GRPOConfig`` field = our setting):
- ``loss_type="dapo"`` (token sum / tokens of the whole generation batch) = our
  ``reduction="token_mean"``; ``epsilon = epsilon_high = 0.2`` = ``clip_eps_low/high``;
- ``beta=0`` (no reference model; ours has no KL term), ``num_iterations=1``,
  one optimizer step per generation batch of B·G completions, accumulated over
  micro-batches of ``--micro-batch`` rows (TRL: ``per_device_train_batch_size`` =
  micro-batch, ``gradient_accumulation_steps`` = B·G / micro-batch, so
  ``steps_per_generation`` = the same; its dapo normaliser is the token count of the whole
  generation batch and ``loss_is_scaled_for_ga`` is set, so the step's gradient is the
  token mean over B·G rows, as ours);
- ``scale_rewards="group"``: TRL divides by the Bessel-corrected group std + 1e-4, so we
  call ``group_advantages(..., std_correction=1, eps=1e-4)`` (our default is the
  population std + 1e-6, docs/design.md §4);
- AdamW (β 0.9/0.999, ε 1e-8, weight decay 0), constant learning rate (TRL:
  ``lr_scheduler_type="constant"``, no warm-up), gradient-norm clip 1.0;
- ``temperature`` = ``--temperature`` (repair 1, letters 0.7) for sampling and for the
  log-probs of the loss (TRL divides the logits by it; ours ``UpdateConfig.temperature``),
  ``top_k=0``, ``top_p=1``; stop at ``<|im_end|>`` (kept as a target);
  truncated completions stay in the loss with reward 0 (``mask_truncated_completions=False``);
- prompts: TRL gets the rendered prompt text (standard, not conversational, format) and
  tokenizes it; the ids are checked equal to our ``Renderer.prompt_ids``;
  ``shuffle_dataset=False`` and the dataset lists the tasks in our order.
Ratios: TRL with ``num_iterations=1`` uses ``old = logp.detach()`` (ratio exactly 1);
ours uses the sampler's log-probs (ratio 1 up to float error). Both are on-policy.

Run: ``pip install -e '.[bench]'`` then

- ``python benchmarks/bench_trl.py``: the repair configuration (10-20 minutes on 2 CPU
  cores, most of it TRL and the four evaluations). Writes
  ``benchmarks/results/trl_vs_consequence.json``.
- ``python benchmarks/bench_trl.py --task letters --no-eval``: SmolLM2-135M (30 layers),
  8 updates of the three frameworks, B·G = 32 rows of ~225 prompt + 48 completion tokens
  (estimated 40-50 minutes on 2 idle CPU cores: one update of ours with 16 rows took 98 s,
  87 s of it optimisation, on one thread of a loaded machine; the gradient check adds ~5
  minutes; the four held-out evaluations, without ``--no-eval``, another ~10-15). Peak
  memory several GB (four model copies, three AdamW states, one micro-batch's
  activations). Writes ``benchmarks/results/trl_vs_consequence_smollm2_letters.json``
  (other models and ``--layers`` get their own names).
- Smoke test of that path (~70 s on one loaded core): ``python benchmarks/bench_trl.py
  --task letters --layers 2 --updates 2 --no-eval --prompts 1 --group 4 --micro-batch 4
  --max-new-tokens 8 --out /tmp/smoke.json`` (a model cut to 2 layers earns no reward, so
  the gradient check then uses stand-in rewards, recorded as such).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

import torch

import consequence.update.step as step_box
from consequence.credit.advantages import group_advantages
from consequence.distill.warmstart import BUNDLED
from consequence.envs.registry import load_environment
from consequence.envs.repair.env import SYSTEM_PROMPT, TOOLS, RepairEnv, verify
from consequence.envs.repair.problems import RepairTask, load_split, make_tasks
from consequence.evaluate.stats import paired_bootstrap_ci
from consequence.harness.renderer import Renderer
from consequence.policy.logprobs import token_logprobs
from consequence.policy.named import is_named, model_folder
from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.tiny import load_policy
from consequence.records import TrainingRow
from consequence.rollout.episodes import opening_messages
from consequence.sandbox.sandbox import clear_cache
from consequence.update.step import UpdateConfig, accumulate_gradients, ppo_step

RESULTS = Path(__file__).parent / "results"


@dataclass
class Args:
    """Benchmark settings (shared by every framework); the defaults are the repair task's,
    ``TASK_DEFAULTS`` holds another task's (an option given on the command line wins)."""

    task: str = "repair"  # 'repair' or 'letters' (see module docstring)
    model: str = "bundled"  # 'bundled' (the tiny warm start), a registered name, or a local HF folder
    layers: int = 0  # keep only the first K decoder layers (smoke runs); 0 = all
    prompts: int = 8  # B: prompts per update
    group: int = 8  # G: completions per prompt
    max_new_tokens: int = 48  # completion length budget
    temperature: float = 1.0  # sampling temperature (and the loss's log-probs), also of sampled evaluation
    lr: float = 2e-4  # AdamW learning rate
    updates: int = 16  # optimizer steps (one generation batch each)
    micro_batch: int = 16  # rows per forward/backward (gradient accumulation to B·G rows)
    eval_tasks: int = 256  # held-out test-split instances (0: no evaluation; also --no-eval)
    eval_samples: int = 4  # sampled completions per eval task
    prompt: str = "history"  # repair only: 'history' or 'user' (see module docstring)
    seed: int = 0  # seeds sampling (ours: the sampler's generator; TRL: GRPOConfig.seed)
    frameworks: str = "ours,ours-skip0,trl"  # any of ours, ours-skip0, trl
    out: str = ""  # default: results/trl_vs_consequence[_MODEL_TASK[_LK]].json (see default_out)


# configs/smollm2-reasoning-gym.yaml: B = 4 tasks × G = 8, temperature 0.7, 48 new tokens,
# learning rate 5e-6, micro-batch 16 (PPO-clip 0.2, token_mean, no KL: the fixed settings).
# 8 updates (the config runs 20 iterations): seven timed ones for the medians.
TASK_DEFAULTS: dict[str, dict] = {
    "repair": {},
    "letters": {
        "model": "smollm2-135m-instruct",
        "prompts": 4,
        "group": 8,
        "max_new_tokens": 48,
        "temperature": 0.7,
        "lr": 5e-6,
        "micro_batch": 16,
        "updates": 8,
    },
}
LETTERS_ENV = {"dataset": "letter_counting", "config": {"min_words": 3, "max_words": 6}, "size": 3000, "shots": 2}


def default_out(args: Args) -> str:
    """``trl_vs_consequence.json`` for the repair task on the bundled model (all layers),
    else ``trl_vs_consequence_{model}_{task}[_L{K}].json`` (model: a registered name's first
    part, e.g. ``smollm2``, or a folder's name)."""
    if args.task == "repair" and args.model == "bundled" and not args.layers:
        return str(RESULTS / "trl_vs_consequence.json")
    slug = args.model.split("-")[0] if is_named(args.model) else Path(args.model).name
    layers = f"_L{args.layers}" if args.layers else ""
    return str(RESULTS / f"trl_vs_consequence_{slug}_{args.task}{layers}.json")


def load_model(args: Args):
    """``(model, tokenizer)`` of ``--model``, cut to ``--layers`` decoder layers when set."""
    model, tokenizer = load_policy(BUNDLED if args.model == "bundled" else model_folder(args.model))
    if args.layers:
        inner = model.model
        if not 0 < args.layers <= len(inner.layers):
            raise ValueError(f"--layers {args.layers}: the model has {len(inner.layers)} decoder layers")
        inner.layers = inner.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[: args.layers]
    return model, tokenizer


@dataclass
class TaskSet:
    """One task's prompts and reward, the same for every framework.

    Attributes:
        tools: the tool specs the renderer shows.
        train_tasks, train_msgs: B per update, in update order, and their opening messages.
        eval_tasks, eval_msgs: held-out test-split tasks (each with a ``problem_id``).
        score_batch: ``(renderer, tasks, [(output_ids, stop_reason)]) -> [reward or None]``
            (None: the environment failed; excluded, never scored 0).
        about: what the JSON records of the task source.
    """

    tools: list[dict]
    train_tasks: list
    train_msgs: list[list[dict]]
    eval_tasks: list
    eval_msgs: list[list[dict]]
    score_batch: Callable[..., list[float | None]]
    about: dict = field(default_factory=dict)


def make_taskset(args: Args) -> TaskSet:
    """The ``--task``'s train tasks (B × updates) and held-out tasks. The instances do not
    depend on --seed (it seeds sampling only), so that runs with several seeds train on the
    same prompts and are evaluated on the same held-out set."""
    n_train = args.prompts * args.updates
    if args.task == "repair":
        split = load_split(0)
        train = make_tasks(split["train"], n_train, seed=1000)
        held = make_tasks(split["test"], args.eval_tasks, seed=2000)
        return TaskSet(
            TOOLS,
            train,
            [task_messages(t, args.prompt) for t in train],
            held,
            [task_messages(t, args.prompt) for t in held],
            score_batch,
            {"task": "repair"},
        )
    if args.task == "letters":
        env = load_environment("reasoning-gym", 0, copy.deepcopy(LETTERS_ENV))
        train = [t for u in range(args.updates) for t in env.sample("train", args.prompts, seed=1000 + u)]
        held = env.split["test"][: args.eval_tasks]
        msgs = lambda ts: [opening_messages(env.system_prompt, env.request(t), env.examples) for t in ts]  # noqa: E731
        return TaskSet(
            env.tools,
            train,
            msgs(train),
            held,
            msgs(held),
            functools.partial(score_answers, env),
            {
                "task": "letters",
                "env": env.label,
                "env_options": LETTERS_ENV,
                "split_sizes": {k: len(v) for k, v in env.split.items()},
            },
        )
    raise ValueError(f"--task must be 'repair' or 'letters', got {args.task!r}")


# ---- the single-turn task: prompt, reward, evaluation (one scoring function) ----------
def task_messages(task: RepairTask, style: str) -> list[dict]:
    """System + request with the code (``read_code`` output) and the visible-test report
    (``run_tests`` output); the model's next message is scored."""
    env = RepairEnv(task)
    request, _ = env.reset()
    code = env.step({"name": "read_code", "arguments": {}})[0]
    report = env.step({"name": "run_tests", "arguments": {}})[0]
    system = {"role": "system", "content": SYSTEM_PROMPT}
    if style == "user":
        return [
            system,
            {"role": "user", "content": f"{request}\n\n{code}\n\nTests:\n{report}\nReply with one replace_line call."},
        ]
    if style != "history":
        raise ValueError(f"--prompt must be 'history' or 'user', got {style!r}")

    def call(name):
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}],
        }

    return [
        system,
        {"role": "user", "content": request},
        call("read_code"),
        {"role": "tool", "name": "read_code", "content": code},
        call("run_tests"),
        {"role": "tool", "name": "run_tests", "content": report},
    ]


_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="verify")


def score(renderer: Renderer, task: RepairTask, output_ids: list[int], stop_reason: str) -> float | None:
    """1.0 iff the answer is exactly one valid ``replace_line`` call after which all hidden
    tests pass; 0.0 otherwise; ``None`` if the sandbox itself failed (env_error)."""
    parsed = renderer.parse(output_ids, stop_reason)
    if parsed.parse_error or len(parsed.tool_calls) != 1 or parsed.tool_calls[0]["name"] != "replace_line":
        return 0.0
    env = RepairEnv(task)
    env.reset()
    if env.step(parsed.tool_calls[0])[0] != "ok":
        return 0.0
    report = verify(task, env.code)
    if report.status == "sandbox_error":
        return None
    return 1.0 if report.all_passed else 0.0


def score_batch(renderer, tasks, outputs) -> list[float | None]:
    """``outputs``: (output_ids, stop_reason) per task; sandbox runs overlap in threads."""
    return list(_POOL.map(lambda a: score(renderer, a[0], *a[1]), zip(tasks, outputs)))


def score_answers(env, renderer: Renderer, tasks, outputs) -> list[float | None]:
    """A single-turn environment's own reward: ``step({"answer": text})`` of a fresh episode
    on the reply without its stop token (as our rollout gives it); a truncated reply ends
    the episode unscored (reward 0, as in our rollout); an episode that raises is None."""
    out: list[float | None] = []
    for task, (ids, stop_reason) in zip(tasks, outputs):
        if stop_reason == "length":
            out.append(0.0)
            continue
        text = renderer.parse(ids, stop_reason, answers=True).message.get("content") or ""
        try:
            episode = env.make_episode(task)
            episode.reset(seed=0)
            _, reward, *_, info = episode.step({"answer": text})
            out.append(None if info.get("env_error") else float(reward))
        except Exception:  # noqa: BLE001 - an environment failure is excluded, never 0
            out.append(None)
    return out


def evaluate(
    model, renderer, tasks, prompts, n_samples: int, seed: int, max_new: int, score: Callable, temperature: float = 1.0
) -> dict[str, float]:
    """Greedy and sampled (at ``temperature``) success of ``model`` on ``tasks`` (our sampler for any model)."""
    greedy = generate(model, prompts, SamplingParams(0.0, max_new_tokens=max_new), renderer.stop_ids)
    g = score(renderer, tasks, [(s.output_ids, s.stop_reason) for s in greedy])
    rep_p = [p for p in prompts for _ in range(n_samples)]
    rep_t = [t for t in tasks for _ in range(n_samples)]
    sampled = generate(
        model,
        rep_p,
        SamplingParams(temperature, max_new_tokens=max_new),
        renderer.stop_ids,
        generator=torch.Generator().manual_seed(seed),
    )
    s = score(renderer, rep_t, [(x.output_ids, x.stop_reason) for x in sampled])
    return {
        "greedy": _mean_valid(g),
        "sampled": _mean_valid(s),
        "n_tasks": len(tasks),
        "n_sampled": len(s),
        "scores": {"greedy": g, "sampled": s},
    }


def _mean_valid(xs: list[float | None]) -> float:
    """Mean over scored episodes; sandbox failures (None) are excluded, never scored 0."""
    v = [x for x in xs if x is not None]
    return sum(v) / max(1, len(v))


def compare(a: dict, b: dict, tasks: list[RepairTask], n_samples: int) -> dict:
    """95 % paired bootstrap CIs of success(b) − success(a) on the same held-out episodes,
    resampled by problem (instances of one problem stay together); pairs where either
    episode hit a sandbox error are dropped."""
    out = {}
    for decoding, reps in (("greedy", 1), ("sampled", n_samples)):
        groups = [t.problem_id for t in tasks for _ in range(reps)]
        keep = [
            i
            for i, (x, y) in enumerate(zip(a["scores"][decoding], b["scores"][decoding]))
            if x is not None and y is not None
        ]
        ci = paired_bootstrap_ci(
            [a["scores"][decoding][i] for i in keep],
            [b["scores"][decoding][i] for i in keep],
            groups=[groups[i] for i in keep],
        )
        out[decoding] = {k: ci[k] for k in ("diff", "low", "high", "n", "n_groups")}
    return out


# ---- our GRPO: sampler → reward → group advantages → one PPO-clip step ----------------
def every_row_runs(on: bool = True):
    """While on, ``accumulate_gradients`` runs every row, zero-advantage ones included (the
    library skips them: ``consequence.update.step._contributes_nothing``); the gradient is
    the same, the computation is TRL's."""
    if not on:
        return contextlib.nullcontext()
    return mock.patch.object(step_box, "_contributes_nothing", lambda adv, cfg: False)


class OursGRPO:
    """Our boxes glued into a single-turn GRPO loop; ``update(u)`` runs update ``u``.

    ``skip_zero_advantage``: rows whose advantage is 0 (every group whose G rewards are
    equal) add exactly nothing to the clipped objective, only their tokens to the
    token-mean denominator T. Passing only the other rows (T' tokens) with advantages
    scaled by T'/T gives the same gradient (the objective is linear in a positive
    advantage scale) without their forward/backward. The library's ``ppo_step`` skips
    such rows itself (keeping them in the totals; ``train.py`` runs that), so without
    ``skip_zero_advantage`` that skip is turned off here (:func:`every_row_runs`): every
    row runs, the same computation as TRL's, and an all-zero batch still takes AdamW's
    step on its momentum, as TRL does.
    """

    def __init__(self, args: Args, model, renderer, ts: TaskSet, skip_zero_advantage=False):
        self.skip_zero_advantage = skip_zero_advantage
        self.args, self.model, self.renderer = args, model, renderer
        self.tasks, self.msgs, self.score = ts.train_tasks, ts.train_msgs, ts.score_batch
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
        self.ucfg = UpdateConfig(
            clip_eps_low=0.2,
            clip_eps_high=0.2,
            reduction="token_mean",
            micro_batch_size=args.micro_batch,
            max_grad_norm=1.0,
            temperature=args.temperature,
        )
        self.params = SamplingParams(
            temperature=args.temperature, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens
        )
        self.rng = torch.Generator().manual_seed(args.seed)
        self.logprob_fn = functools.partial(token_logprobs, with_entropy=True)  # as train.py
        self.steps: list[dict] = []
        self.train_reward: list[float] = []

    def update(self, u: int) -> None:
        B, G, r = self.args.prompts, self.args.group, self.renderer
        tasks = self.tasks[u * B : (u + 1) * B]
        t0 = time.perf_counter()
        prompts = [r.prompt_ids(m) for m in self.msgs[u * B : (u + 1) * B]]
        prompts_N = [p for p in prompts for _ in range(G)]
        samples = generate(self.model, prompts_N, self.params, r.stop_ids, generator=self.rng)
        t1 = time.perf_counter()
        rewards_N = self.score(
            r, [t for t in tasks for _ in range(G)], [(s.output_ids, s.stop_reason) for s in samples]
        )
        t2 = time.perf_counter()
        group_ids = [f"{u}/{i // G}" for i in range(B * G)]
        adv_N = group_advantages(rewards_N, group_ids, estimator="grpo", eps=1e-4, std_correction=1)
        rows, row_adv = [], []
        for p, s, a in zip(prompts_N, samples, adv_N):
            if a is None:  # env_error: excluded, never scored 0
                continue
            n = len(s.output_ids)
            rows.append(TrainingRow(p + s.output_ids, [0] * len(p) + [1] * n, [0.0] * len(p) + s.logprobs))
            row_adv.append(a)
        if self.skip_zero_advantage:
            n_all = sum(sum(x.loss_mask) for x in rows)
            keep = [i for i, a in enumerate(row_adv) if a != 0.0]
            n_kept = sum(sum(rows[i].loss_mask) for i in keep)
            rows, row_adv = [rows[i] for i in keep], [row_adv[i] * n_kept / n_all for i in keep]
        self.model.train()
        if rows:
            with every_row_runs(not self.skip_zero_advantage):
                m = ppo_step(
                    self.model, self.optimizer, rows, row_adv, self.ucfg, r.tokenizer.pad_token_id, self.logprob_fn
                )
            if not self.skip_zero_advantage and m["n_rows_trained"] != len(rows):
                raise RuntimeError(f"ours: {m['n_rows_trained']:g} of {len(rows)} rows ran (some had no target?)")
        else:  # the step all-zero advantages would take: AdamW moves on its momentum alone
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.steps.append(
            {
                "generation_s": t1 - t0,
                "reward_s": t2 - t1,
                "optimisation_s": t3 - t2,
                "total_s": t3 - t0,
                "rows_trained": len(rows),
            }
        )
        self.train_reward.append(_mean_valid(rewards_N))


# ---- TRL's GRPOTrainer, configured to the same algorithm ------------------------------
class TRLGRPO:
    """``GRPOTrainer.train()`` in a worker thread, parked at the start of every optimizer
    step; ``update(u)`` lets it run exactly one and waits until it is parked again (or done),
    so TRL never runs at the same time as the other frameworks. An update's seconds run
    from the release to the next park: TRL's bookkeeping between steps counts as its own."""

    def __init__(self, args: Args, model, tokenizer, renderer, ts: TaskSet):
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        B, G = args.prompts, args.group
        train_tasks, train_msgs = ts.train_tasks, ts.train_msgs
        texts = [renderer.render_text(m, add_generation_prompt=True) for m in train_msgs]
        # TRL tokenizes standard-format prompts with ``processing_class(text=...)``: same ids as ours.
        for text, m in zip(texts[:B], train_msgs[:B]):
            assert tokenizer(text=[text])["input_ids"][0] == renderer.prompt_ids(m), "prompt ids differ"
        dataset = Dataset.from_list([{"prompt": t, "task_index": i} for i, t in enumerate(texts)])
        self.steps: list[dict] = []
        self.train_reward: list[float] = []
        self._go, self._parked = threading.Semaphore(0), threading.Semaphore(0)
        self._error: BaseException | None = None
        cur: dict[str, float] = {}
        bench = self

        def reward_fn(prompts, completions, completion_ids, task_index, **_):
            outs = [(ids, "stop" if ids and ids[-1] in renderer.stop_ids else "length") for ids in completion_ids]
            r = ts.score_batch(renderer, [train_tasks[i] for i in task_index], outs)
            bench.train_reward.append(_mean_valid(r))
            return r

        class Timed(GRPOTrainer):
            def _generate(self, prompts):
                t0 = time.perf_counter()
                out = super()._generate(prompts)
                cur["generation_s"] = time.perf_counter() - t0
                return out

            def _calculate_rewards(self, *a, **k):
                t0 = time.perf_counter()
                out = super()._calculate_rewards(*a, **k)
                cur["reward_s"] = time.perf_counter() - t0
                return out

            def _generate_and_score_completions(self, inputs):
                t0 = time.perf_counter()
                out = super()._generate_and_score_completions(inputs)
                cur["rollout_s"] = time.perf_counter() - t0
                return out

        class Gate(TrainerCallback):
            def on_step_begin(self, a, state, control, **k):
                bench._parked.release()
                bench._go.acquire()

            def on_train_end(self, a, state, control, **k):
                bench._parked.release()

        self._dir = tempfile.TemporaryDirectory(prefix="bench-trl-")
        cfg = GRPOConfig(
            output_dir=self._dir.name,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=B * G // args.micro_batch,
            num_generations=G,
            max_completion_length=args.max_new_tokens,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            optim="adamw_torch",
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            max_grad_norm=1.0,
            beta=0.0,
            num_iterations=1,
            epsilon=0.2,
            epsilon_high=0.2,
            loss_type="dapo",
            scale_rewards="group",
            mask_truncated_completions=False,
            shuffle_dataset=False,
            max_steps=args.updates,
            seed=args.seed,
            logging_steps=args.updates,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        self.trainer = Timed(
            model=model,
            reward_funcs=reward_fn,
            args=cfg,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Gate()],
        )
        self._thread = threading.Thread(target=self._train, name="trl", daemon=True)
        self._thread.start()
        self._wait()  # the trainer's set-up runs here, before any update is timed
        self._cur = cur

    def _train(self) -> None:
        try:
            self.trainer.train()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            self._error = e
            self._parked.release()

    def _wait(self) -> None:
        self._parked.acquire()
        if self._error is not None:
            raise RuntimeError("TRL's trainer failed") from self._error

    def update(self, u: int) -> None:
        t0 = time.perf_counter()
        self._go.release()
        self._wait()
        total, c = time.perf_counter() - t0, self._cur
        self.steps.append(
            {
                "generation_s": c["generation_s"],
                "reward_s": c["reward_s"],
                "optimisation_s": total - c["rollout_s"],
                "total_s": total,
                "rollout_other_s": c["rollout_s"] - c["generation_s"] - c["reward_s"],
            }
        )

    @property
    def model(self):
        self._thread.join()
        self._dir.cleanup()
        return self.trainer.model.eval()


FULL_GRADIENT_MAX = 20_000_000  # parameters; above, check_same_gradient compares a few tensors


def compared_parameters(model) -> list[str]:
    """Every parameter of a small model; of a larger one (SmolLM2-135M: 28 M of 135 M) the
    (tied) embedding, the first and the last decoder layer and the final norm, so that the
    three gradients held at once stay small."""
    named = dict(model.named_parameters())
    if sum(p.numel() for p in named.values()) <= FULL_GRADIENT_MAX:
        return list(named)
    n = len(model.model.layers)
    wanted = ("model.embed_tokens.", "model.layers.0.", f"model.layers.{n - 1}.", "model.norm.", "lm_head.")
    return [k for k in named if k.startswith(wanted)]


def check_same_gradient(args: Args, model, tokenizer, renderer, ts: TaskSet) -> dict:
    """Relative L2 differences between TRL's ``compute_loss`` gradient and ours (all rows;
    zero-advantage rows skipped) on one identical sampled batch (same completions, same
    advantages, same micro-batches). ~1e-5 means the same function: ours measures the
    ratio against the sampler's log-probs (1 up to float error), TRL's is exactly 1.
    On a large model (``compared_parameters``) the differences and the cosine cover the
    compared tensors, and the global gradient norms of the three are recorded too."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import nanstd, pad

    B, G, MB = args.prompts, args.group, args.micro_batch
    tasks, msgs = ts.train_tasks, ts.train_msgs
    prompts_N = [renderer.prompt_ids(m) for m in msgs[:B] for _ in range(G)]
    samples = generate(
        model,
        prompts_N,
        SamplingParams(args.temperature, max_new_tokens=args.max_new_tokens),
        renderer.stop_ids,
        generator=torch.Generator().manual_seed(args.seed + 7),
    )
    rewards = ts.score_batch(
        renderer, [t for t in tasks[:B] for _ in range(G)], [(s.output_ids, s.stop_reason) for s in samples]
    )
    R = torch.tensor([r or 0.0 for r in rewards])
    stand_in = not bool((R.view(-1, G) != R.view(-1, G)[:, :1]).any())
    if stand_in:  # every group's rewards equal (e.g. a model cut by --layers): no gradient to compare,
        R = torch.tensor([float(i % G < G // 2) for i in range(B * G)])  # so half of each group scores 1
    mean = R.view(-1, G).mean(1).repeat_interleave(G)  # TRL's formula, written out
    adv_trl = (R - mean) / (nanstd(R.view(-1, G), dim=1).repeat_interleave(G) + 1e-4)
    adv = group_advantages(R.tolist(), [str(i // G) for i in range(B * G)], "grpo", eps=1e-4, std_correction=1)
    assert torch.allclose(torch.tensor(adv), adv_trl), "advantages differ"

    named = dict(model.named_parameters())
    compared = compared_parameters(model)
    norms: list[float] = []

    def grads():
        norms.append(float(torch.stack([p.grad.norm() for p in named.values() if p.grad is not None]).norm()))
        g = torch.cat([named[k].grad.flatten() for k in compared])
        model.zero_grad(set_to_none=True)
        return g

    model.train()
    rows = [
        TrainingRow(p + s.output_ids, [0] * len(p) + [1] * len(s.output_ids), [0.0] * len(p) + s.logprobs)
        for p, s in zip(prompts_N, samples)
    ]
    fn = functools.partial(token_logprobs, with_entropy=True)
    ucfg = UpdateConfig(micro_batch_size=MB, temperature=args.temperature)
    with every_row_runs():
        accumulate_gradients(model, rows, adv, ucfg, renderer.tokenizer.pad_token_id, fn)
    g_ours = grads()
    keep = [i for i, a in enumerate(adv) if a != 0.0]  # the skip-zero-advantage variant
    scale = sum(sum(rows[i].loss_mask) for i in keep) / sum(sum(x.loss_mask) for x in rows)
    if keep:
        accumulate_gradients(
            model, [rows[i] for i in keep], [adv[i] * scale for i in keep], ucfg, renderer.tokenizer.pad_token_id, fn
        )
        g_skip = grads()
    else:  # every advantage 0 (no batch above had one): the skipped variant runs nothing
        g_skip = torch.zeros_like(g_ours)
        norms.append(0.0)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out_dir:
        cfg = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=MB,
            gradient_accumulation_steps=B * G // MB,
            num_generations=G,
            max_completion_length=args.max_new_tokens,
            temperature=args.temperature,
            top_k=0,
            beta=0.0,
            loss_type="dapo",
            report_to="none",
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda prompts, **_: [0.0] * len(prompts),
            args=cfg,
            train_dataset=Dataset.from_list([{"prompt": "x"}] * B),
            processing_class=tokenizer,
        )
        trainer.current_gradient_accumulation_steps = B * G // MB  # set by Trainer.train in a real run
        total = torch.tensor(sum(len(s.output_ids) for s in samples))
        for c in range(0, B * G, MB):
            ids = range(c, c + MB)
            ones = lambda xs: [torch.ones(len(x), dtype=torch.long) for x in xs]  # noqa: E731
            p_ids, c_ids = [prompts_N[i] for i in ids], [samples[i].output_ids for i in ids]
            inputs = {
                "prompt_ids": pad([torch.tensor(x) for x in p_ids], tokenizer.pad_token_id, "left"),
                "prompt_mask": pad(ones(p_ids), 0, "left"),
                "completion_ids": pad([torch.tensor(x) for x in c_ids], tokenizer.pad_token_id, "right"),
                "completion_mask": pad(ones(c_ids), 0, "right"),
                "advantages": adv_trl[c : c + MB],
                "num_items_in_batch": total,
            }
            trainer.compute_loss(model, inputs).backward()
    g_trl = grads()
    model.eval()
    rel = lambda g: float((g - g_trl).norm() / g_trl.norm())  # noqa: E731
    out = {"ours_vs_trl": rel(g_ours), "ours-skip0_vs_trl": rel(g_skip), "rows_kept": len(keep), "rows": len(rows)}
    if stand_in:
        out["rewards"] = "stand-in: half of each group 1 (the sampled rewards were equal in every group)"
    if len(compared) < len(named):
        # float64: in float32 the dot product and norms of ~35 M entries are off by ~1e-3 (a "cosine" of 1.002)
        cos = lambda g: float(torch.nn.functional.cosine_similarity(g.double(), g_trl.double(), dim=0))  # noqa: E731
        out |= {
            "parameters_compared": len(compared),
            "parameters": len(named),
            "numel_compared": int(g_trl.numel()),
            "cosine_ours_trl": cos(g_ours),
            "cosine_ours-skip0_trl": cos(g_skip),
            "grad_norm": dict(zip(("ours", "ours-skip0", "trl"), norms)),
        }
    return out


# ---- plumbing -------------------------------------------------------------------------
FRAMEWORK_NAMES = {
    "ours": "consequence",
    "ours-skip0": "consequence, zero-advantage rows skipped",
    "trl": "TRL GRPOTrainer",
}


def _median(steps: list[dict], key: str) -> float:
    """Median over updates 2..N: the first pays one-off warm-up, and the median is robust
    to bursts of load from other processes on a shared machine."""
    warm = steps[1:] or steps
    return statistics.median(s[key] for s in warm)


def parse_args(argv: list[str] | None = None) -> Args:
    """Options: the fields of :class:`Args`; unset ones come from ``TASK_DEFAULTS[--task]``,
    then from ``Args``; ``--no-eval`` sets ``--eval-tasks 0``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for k, v in asdict(Args()).items():
        ap.add_argument(
            f"--{k.replace('_', '-')}",
            type=type(v),
            default=None,
            help=f"default {v!r}" + (" (repair; see TASK_DEFAULTS)" if k in TASK_DEFAULTS["letters"] else ""),
        )
    ap.add_argument("--no-eval", action="store_true", help="no held-out evaluation before and after (= --eval-tasks 0)")
    ns = vars(ap.parse_args(argv))
    no_eval = ns.pop("no_eval")
    given = {k: v for k, v in ns.items() if v is not None}
    task = given.get("task", Args.task)
    if task not in TASK_DEFAULTS:
        ap.error(f"--task must be one of {', '.join(TASK_DEFAULTS)}, got {task!r}")
    args = Args(**{**TASK_DEFAULTS[task], **given})
    if no_eval:
        args.eval_tasks = 0
    if (args.prompts * args.group) % args.micro_batch:
        ap.error("--micro-batch must divide prompts × group")
    if not args.out:
        args.out = default_out(args)
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    frameworks = [f for f in args.frameworks.split(",") if f]
    for fw in frameworks:
        if fw not in FRAMEWORK_NAMES:
            raise ValueError(f"unknown framework {fw!r}; use ours, ours-skip0, trl")
    do_eval = args.eval_tasks > 0

    model0, tokenizer = load_model(args)
    ts = make_taskset(args)
    renderer = Renderer(tokenizer, ts.tools)
    eval_prompts = [renderer.prompt_ids(m) for m in ts.eval_msgs]
    ev = functools.partial(
        evaluate,
        renderer=renderer,
        tasks=ts.eval_tasks,
        prompts=eval_prompts,
        n_samples=args.eval_samples,
        seed=args.seed,
        max_new=args.max_new_tokens,
        score=ts.score_batch,
        temperature=args.temperature,
    )

    results: dict = {"load_average_at_start": os.getloadavg()}  # other processes on a shared machine
    if args.task != "repair":
        results["task"] = ts.about
    if "trl" in frameworks:
        t0 = time.perf_counter()
        results["gradient_check"] = check_same_gradient(args, copy.deepcopy(model0), tokenizer, renderer, ts)
        print(
            f"same batch, gradient vs TRL's (relative L2 difference): {results['gradient_check']} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    if do_eval:
        results["before"] = ev(model0)
        print(
            f"before: greedy {results['before']['greedy']:.3f}, sampled {results['before']['sampled']:.3f}", flush=True
        )
    runs = {}
    for fw in frameworks:
        if fw in ("ours", "ours-skip0"):
            runs[fw] = OursGRPO(args, copy.deepcopy(model0), renderer, ts, skip_zero_advantage=fw == "ours-skip0")
        else:
            runs[fw] = TRLGRPO(args, copy.deepcopy(model0), tokenizer, renderer, ts)
    # Lockstep: update u of each framework back to back, so that load from other processes
    # on a shared machine falls on both alike; the sandbox cache is emptied before each.
    for u in range(args.updates):
        line = f"update {u + 1:>2}/{args.updates}"
        for fw, run in runs.items():
            clear_cache()
            run.update(u)
            line += f"   {fw}: {run.steps[-1]['total_s']:6.2f} s, reward {run.train_reward[-1]:.3f}"
        print(line, flush=True)
    for fw, run in runs.items():
        clear_cache()
        trained = run.model  # TRL: waits for its trainer to finish
        results[fw] = {"steps": run.steps, "train_reward": run.train_reward}
        if do_eval:
            after = ev(trained)
            print(f"{fw} after: greedy {after['greedy']:.3f}, sampled {after['sampled']:.3f}", flush=True)
            results[fw]["after"] = after
    if do_eval:
        ev_kw = {"tasks": ts.eval_tasks, "n_samples": args.eval_samples}
        for fw in frameworks:
            results[fw]["after_minus_before"] = compare(results["before"], results[fw]["after"], **ev_kw)
            if fw != "trl" and "trl" in frameworks:
                results[fw]["after_minus_trl_after"] = compare(results["trl"]["after"], results[fw]["after"], **ev_kw)
        for r in [results["before"]] + [results[fw]["after"] for fw in frameworks]:
            r.pop("scores")  # per-episode scores: used above, too long for the JSON

    rows = []
    for fw in frameworks:
        st = results[fw]["steps"]
        after = results[fw].get("after", {})
        rows.append(
            {
                "framework": FRAMEWORK_NAMES[fw],
                **{k: _median(st, k) for k in ("total_s", "generation_s", "reward_s", "optimisation_s")},
                "gen_plus_opt_s": statistics.median(s["generation_s"] + s["optimisation_s"] for s in st[1:] or st),
                "train_reward_first": statistics.fmean(results[fw]["train_reward"][:4]),
                "train_reward_last": statistics.fmean(results[fw]["train_reward"][-4:]),
                "greedy_after": after.get("greedy"),
                "sampled_after": after.get("sampled"),
            }
        )
    layers = len(model0.model.layers) if hasattr(model0, "model") and hasattr(model0.model, "layers") else None
    print(
        f"\nmodel {args.model}"
        + (f" (first {args.layers} layers)" if args.layers else f" ({layers} layers)")
        + f", task {args.task}: B={args.prompts} prompts × G={args.group}, {args.max_new_tokens} new tokens, "
        f"temperature {args.temperature}, lr {args.lr}, {args.updates} updates, micro-batch {args.micro_batch}"
        + (f", prompt '{args.prompt}'" if args.task == "repair" else "")
        + f", {torch.get_num_threads()} threads; seconds = median of updates 2..N"
    )
    if do_eval:
        b = results["before"]
        print(
            f"held-out success before: greedy {b['greedy']:.3f}, sampled {b['sampled']:.3f} "
            f"({b['n_tasks']} test-split tasks, {b['n_sampled']} samples)\n"
        )
    else:
        print("no held-out evaluation (--no-eval)\n")
    fmt = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    print(
        "| framework | s / update | generation | reward | optimisation | gen + opt | "
        "train reward (first 4 → last 4) | held-out greedy | held-out sampled |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['framework']} | {r['total_s']:.2f} | {r['generation_s']:.2f} | {r['reward_s']:.2f} | "
            f"{r['optimisation_s']:.2f} | {r['gen_plus_opt_s']:.2f} | {r['train_reward_first']:.3f} → "
            f"{r['train_reward_last']:.3f} | {fmt(r['greedy_after'])} | {fmt(r['sampled_after'])} |"
        )
    for fw in [f for f in frameworks if f != "trl" and "trl" in frameworks]:
        pairs = list(zip(results[fw]["steps"], results["trl"]["steps"]))
        pairs = pairs[1:] or pairs
        sp = {
            k: statistics.median(t[k] / o[k] for o, t in pairs) for k in ("total_s", "generation_s", "optimisation_s")
        }
        sp["gen_plus_opt_s"] = statistics.median(
            (t["generation_s"] + t["optimisation_s"]) / (o["generation_s"] + o["optimisation_s"]) for o, t in pairs
        )
        results[fw]["speedup_vs_trl"] = sp
        how = " at equal computation (every row run)" if fw == "ours" else ""
        print(
            f"\nspeed-up of {FRAMEWORK_NAMES[fw]}{how} (median over updates 2..N of TRL s / our s): "
            f"{sp['total_s']:.2f}× per update, {sp['gen_plus_opt_s']:.2f}× generation + optimisation, "
            f"{sp['generation_s']:.2f}× generation, {sp['optimisation_s']:.2f}× optimisation"
        )
    for fw in frameworks:
        for key, label in (("after_minus_before", "after − before"), ("after_minus_trl_after", "after − TRL after")):
            if key in results[fw]:
                c = results[fw][key]
                print(
                    f"{FRAMEWORK_NAMES[fw]}, success {label} (95 % CI, by problem): "
                    + ", ".join(f"{d} {c[d]['diff']:+.3f} [{c[d]['low']:+.3f}, {c[d]['high']:+.3f}]" for d in c)
                )
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
    }
    for name in ("transformers", "trl", "accelerate", "datasets"):
        with contextlib.suppress(ImportError):  # a package not installed has no version to record
            meta[name] = __import__(name).__version__
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"meta": meta, "args": asdict(args), "summary": rows, "results": results}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
