"""Side by side: our GRPO against TRL's ``GRPOTrainer`` on a single-turn repair task.

The same tiny model (the bundled warm start), the same prompts in the same order, the
same reward function, batch (B prompts × G completions), completion length, temperature,
learning rate and number of updates; both run in one process, one after the other, on
CPU. Measured per update: seconds of generation, of reward (the sandboxed hidden tests,
the same function for both) and of optimisation (log-probs, loss, backward, AdamW step);
and success on held-out test-split instances before and after, greedy and sampled, with
one evaluation function (our sampler) for both trained models.

Single-turn task. The prompt holds the request, the buggy code exactly as ``read_code``
shows it and the visible-test report exactly as ``run_tests`` shows it; the model answers
once. Its answer is parsed by our ``Renderer``; exactly one valid ``replace_line`` call is
applied and scored on the hidden tests (1.0 if all pass); anything else scores 0.0.
``--prompt history`` (default) gives code and report as the results of earlier
``read_code`` / ``run_tests`` calls, the layout the warm start was fine-tuned on;
``--prompt user`` puts them in one user message (the warm start solves ~1.5 % of those
greedily, too few successes for a group to learn from in a few updates).

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
  population std + 1e-6, DESIGN.md §4);
- AdamW (β 0.9/0.999, ε 1e-8, weight decay 0), constant learning rate (TRL:
  ``lr_scheduler_type="constant"``, no warm-up), gradient-norm clip 1.0;
- temperature 1, ``top_k=0``, ``top_p=1``; stop at ``<|im_end|>`` (kept as a target);
  truncated completions stay in the loss with reward 0 (``mask_truncated_completions=False``);
- prompts: TRL gets the rendered prompt text (standard, not conversational, format) and
  tokenizes it; the ids are checked equal to our ``Renderer.prompt_ids``;
  ``shuffle_dataset=False`` and the dataset lists the tasks in our order.
Ratios: TRL with ``num_iterations=1`` uses ``old = logp.detach()`` (ratio exactly 1);
ours uses the sampler's log-probs (ratio 1 up to float error). Both are on-policy.

Run: ``pip install -e '.[bench]'`` then ``python benchmarks/bench_trl.py`` (about 10
minutes on 2 CPU cores). Writes ``benchmarks/results/trl_vs_consequence.json``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from consequence.credit.advantages import group_advantages
from consequence.envs.repair_env import SYSTEM_PROMPT, TOOLS, RepairEnv, verify
from consequence.envs.sandbox import clear_cache
from consequence.harness.renderer import Renderer
from consequence.policy.logprobs import token_logprobs
from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.tiny import load_policy
from consequence.records import TrainingRow
from consequence.tasks.repair import RepairTask, load_split, make_tasks
from consequence.update.step import UpdateConfig, ppo_step
from consequence.warmstart import BUNDLED


@dataclass
class Args:
    """Benchmark settings (shared by both frameworks)."""

    prompts: int = 8  # B: prompts per update
    group: int = 8  # G: completions per prompt
    max_new_tokens: int = 48  # completion length budget
    lr: float = 2e-4  # AdamW learning rate
    updates: int = 16  # optimizer steps (one generation batch each)
    micro_batch: int = 16  # rows per forward/backward (gradient accumulation to B·G rows)
    eval_tasks: int = 256  # held-out test-split instances
    eval_samples: int = 4  # sampled (T = 1) completions per eval task
    prompt: str = "history"  # 'history' or 'user' (see module docstring)
    seed: int = 0
    frameworks: str = "ours,trl"
    out: str = str(Path(__file__).parent / "results" / "trl_vs_consequence.json")


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
        return [system, {"role": "user", "content": f"{request}\n\n{code}\n\nTests:\n{report}\n"
                                                    "Reply with one replace_line call."}]
    if style != "history":
        raise ValueError(f"--prompt must be 'history' or 'user', got {style!r}")

    def call(name):
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}

    return [system, {"role": "user", "content": request},
            call("read_code"), {"role": "tool", "name": "read_code", "content": code},
            call("run_tests"), {"role": "tool", "name": "run_tests", "content": report}]


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


def evaluate(model, renderer, tasks, prompts, n_samples: int, seed: int, max_new: int) -> dict[str, float]:
    """Greedy and sampled (T = 1) success of ``model`` on ``tasks`` (our sampler for any model)."""
    greedy = generate(model, prompts, SamplingParams(0.0, max_new_tokens=max_new), renderer.stop_ids)
    g = score_batch(renderer, tasks, [(s.output_ids, s.stop_reason) for s in greedy])
    rep_p = [p for p in prompts for _ in range(n_samples)]
    rep_t = [t for t in tasks for _ in range(n_samples)]
    sampled = generate(model, rep_p, SamplingParams(1.0, max_new_tokens=max_new), renderer.stop_ids,
                       generator=torch.Generator().manual_seed(seed))
    s = score_batch(renderer, rep_t, [(x.output_ids, x.stop_reason) for x in sampled])
    mean = lambda xs: sum(x or 0.0 for x in xs) / len(xs)  # noqa: E731
    return {"greedy": mean(g), "sampled": mean(s), "n_tasks": len(tasks), "n_sampled": len(s)}


# ---- our GRPO: sampler → reward → group advantages → one PPO-clip step ----------------
def run_ours(args: Args, model, renderer, train_tasks, train_msgs) -> dict:
    B, G = args.prompts, args.group
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0)
    ucfg = UpdateConfig(clip_eps_low=0.2, clip_eps_high=0.2, reduction="token_mean",
                        micro_batch_size=args.micro_batch, max_grad_norm=1.0, temperature=1.0)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens)
    rng = torch.Generator().manual_seed(args.seed)
    logprob_fn = functools.partial(token_logprobs, with_entropy=True)
    steps, rewards_mean = [], []
    model.train()
    for u in range(args.updates):
        tasks = train_tasks[u * B:(u + 1) * B]
        t0 = time.perf_counter()
        prompts = [renderer.prompt_ids(m) for m in train_msgs[u * B:(u + 1) * B]]
        prompts_N = [p for p in prompts for _ in range(G)]
        samples = generate(model, prompts_N, params, renderer.stop_ids, generator=rng)
        t1 = time.perf_counter()
        rewards_N = score_batch(renderer, [t for t in tasks for _ in range(G)],
                                [(s.output_ids, s.stop_reason) for s in samples])
        t2 = time.perf_counter()
        group_ids = [str(i // G) for i in range(B * G)]
        adv_N = group_advantages(rewards_N, group_ids, estimator="grpo", eps=1e-4, std_correction=1)
        rows, row_adv = [], []
        for p, s, a in zip(prompts_N, samples, adv_N):
            if a is None:  # env_error: excluded, never scored 0
                continue
            n = len(s.output_ids)
            rows.append(TrainingRow(p + s.output_ids, [0] * len(p) + [1] * n, [0.0] * len(p) + s.logprobs))
            row_adv.append(a)
        ppo_step(model, optimizer, rows, row_adv, ucfg, renderer.tokenizer.pad_token_id, logprob_fn)
        t3 = time.perf_counter()
        steps.append({"generation_s": t1 - t0, "reward_s": t2 - t1, "optimisation_s": t3 - t2, "total_s": t3 - t0})
        rewards_mean.append(sum(r or 0.0 for r in rewards_N) / len(rewards_N))
        print(f"  ours  update {u + 1:>2}/{args.updates}  reward {rewards_mean[-1]:.3f}  {t3 - t0:6.2f} s", flush=True)
    model.eval()
    return {"steps": steps, "train_reward": rewards_mean}


# ---- TRL's GRPOTrainer, configured to the same algorithm ------------------------------
def run_trl(args: Args, model, tokenizer, renderer, train_tasks, train_msgs) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    B, G = args.prompts, args.group
    texts = [renderer.render_text(m, add_generation_prompt=True) for m in train_msgs]
    # TRL tokenizes standard-format prompts with ``processing_class(text=...)``: same ids?
    for text, m in zip(texts[:B], train_msgs[:B]):
        assert tokenizer(text=[text])["input_ids"][0] == renderer.prompt_ids(m), "prompt ids differ"
    dataset = Dataset.from_list([{"prompt": t, "task_index": i} for i, t in enumerate(texts)])
    timing: dict[str, list[float]] = {"generation_s": [], "reward_s": [], "rollout_s": [], "total_s": []}
    rewards_mean: list[float] = []

    def reward_fn(prompts, completions, completion_ids, task_index, **_):
        outs = [(ids, "stop" if ids and ids[-1] in renderer.stop_ids else "length") for ids in completion_ids]
        r = score_batch(renderer, [train_tasks[i] for i in task_index], outs)
        rewards_mean.append(sum(x or 0.0 for x in r) / len(r))
        return r

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            timing["generation_s"].append(time.perf_counter() - t0)
            return out

        def _calculate_rewards(self, *a, **k):
            t0 = time.perf_counter()
            out = super()._calculate_rewards(*a, **k)
            timing["reward_s"].append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            timing["rollout_s"].append(time.perf_counter() - t0)
            return out

    class StepClock(TrainerCallback):  # an update = from one optimizer step's end to the next
        def on_train_begin(self, a, state, control, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **k):
            t = time.perf_counter()
            timing["total_s"].append(t - self.t0)
            self.t0 = t
            print(f"  trl   update {state.global_step:>2}/{args.updates}  reward {rewards_mean[-1]:.3f}  "
                  f"{timing['total_s'][-1]:6.2f} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out_dir:
        cfg = GRPOConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=B * G // args.micro_batch,
            num_generations=G,
            max_completion_length=args.max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
            beta=0.0, num_iterations=1, epsilon=0.2, epsilon_high=0.2, loss_type="dapo",
            scale_rewards="group", mask_truncated_completions=False, shuffle_dataset=False,
            max_steps=args.updates, seed=args.seed, logging_steps=1, report_to="none",
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = Timed(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=dataset,
                        processing_class=tokenizer, callbacks=[StepClock()])
        trainer.train()
    n = len(timing["total_s"])
    steps = [{"generation_s": timing["generation_s"][i], "reward_s": timing["reward_s"][i],
              "optimisation_s": timing["total_s"][i] - timing["rollout_s"][i], "total_s": timing["total_s"][i],
              "rollout_other_s": timing["rollout_s"][i] - timing["generation_s"][i] - timing["reward_s"][i]}
             for i in range(n)]
    trained = trainer.model
    trained.eval()
    return {"steps": steps, "train_reward": rewards_mean, "model": trained}


# ---- plumbing -------------------------------------------------------------------------
def _mean(steps: list[dict], key: str) -> float:
    """Mean over updates 2..N: the first one pays one-off warm-up (allocator, kernels)."""
    warm = steps[1:] or steps
    return statistics.fmean(s[key] for s in warm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for k, v in asdict(Args()).items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    args = Args(**vars(ap.parse_args()))
    if (args.prompts * args.group) % args.micro_batch:
        ap.error("--micro-batch must divide prompts × group")
    torch.manual_seed(args.seed)
    frameworks = [f for f in args.frameworks.split(",") if f]

    model0, tokenizer = load_policy(BUNDLED)
    renderer = Renderer(tokenizer, TOOLS)
    split = load_split(0)
    train_tasks = make_tasks(split["train"], args.prompts * args.updates, seed=args.seed + 1000)
    train_msgs = [task_messages(t, args.prompt) for t in train_tasks]
    eval_tasks = make_tasks(split["test"], args.eval_tasks, seed=args.seed + 2000)
    eval_prompts = [renderer.prompt_ids(task_messages(t, args.prompt)) for t in eval_tasks]
    ev = functools.partial(evaluate, renderer=renderer, tasks=eval_tasks, prompts=eval_prompts,
                           n_samples=args.eval_samples, seed=args.seed,
                           max_new=args.max_new_tokens)

    results = {"before": ev(model0)}
    print(f"before: {results['before']}", flush=True)
    for fw in frameworks:
        clear_cache()  # neither run may reuse the other's sandbox results
        model = copy.deepcopy(model0)
        t0 = time.perf_counter()
        if fw == "ours":
            res = run_ours(args, model, renderer, train_tasks, train_msgs)
        elif fw == "trl":
            res = run_trl(args, model, tokenizer, renderer, train_tasks, train_msgs)
            model = res.pop("model")
        else:
            raise ValueError(f"unknown framework {fw!r}; use ours,trl")
        res["wall_s"] = time.perf_counter() - t0
        res["after"] = ev(model)
        print(f"{fw} after: {res['after']}", flush=True)
        results[fw] = res

    rows = []
    for fw in frameworks:
        st = results[fw]["steps"]
        rows.append({
            "framework": {"ours": "consequence", "trl": "TRL GRPOTrainer"}[fw],
            "s_per_update": _mean(st, "total_s"), "generation_s": _mean(st, "generation_s"),
            "reward_s": _mean(st, "reward_s"), "optimisation_s": _mean(st, "optimisation_s"),
            "gen_plus_opt_s": _mean(st, "generation_s") + _mean(st, "optimisation_s"),
            "train_reward_first": statistics.fmean(results[fw]["train_reward"][:3]),
            "train_reward_last": statistics.fmean(results[fw]["train_reward"][-3:]),
            "greedy_after": results[fw]["after"]["greedy"], "sampled_after": results[fw]["after"]["sampled"],
        })
    b = results["before"]
    print(f"\nB={args.prompts} prompts × G={args.group}, {args.max_new_tokens} new tokens, lr {args.lr}, "
          f"{args.updates} updates (seconds: mean of updates 2..N), micro-batch {args.micro_batch}, "
          f"prompt '{args.prompt}', {torch.get_num_threads()} threads")
    print(f"held-out success before: greedy {b['greedy']:.3f}, sampled {b['sampled']:.3f} "
          f"({b['n_tasks']} test-split tasks, {b['n_sampled']} samples)\n")
    print("| framework | s / update | generation | reward | optimisation | gen + opt | "
          "train reward (first 3 → last 3) | held-out greedy | held-out sampled |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['framework']} | {r['s_per_update']:.2f} | {r['generation_s']:.2f} | {r['reward_s']:.2f} | "
              f"{r['optimisation_s']:.2f} | {r['gen_plus_opt_s']:.2f} | {r['train_reward_first']:.3f} → "
              f"{r['train_reward_last']:.3f} | {r['greedy_after']:.3f} | {r['sampled_after']:.3f} |")
    if len(rows) == 2:
        s = rows[1]["s_per_update"] / rows[0]["s_per_update"]
        s2 = rows[1]["gen_plus_opt_s"] / rows[0]["gen_plus_opt_s"]
        print(f"\nspeed-up of ours: {s:.2f}× per update, {s2:.2f}× on generation + optimisation")
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
            "machine": platform.machine(), "cpu_count": __import__("os").cpu_count()}
    for name in ("transformers", "trl", "accelerate", "datasets"):
        try:
            meta[name] = __import__(name).__version__
        except ImportError:
            pass
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "args": asdict(args), "summary": rows, "results": results},
                              indent=2) + "\n")


if __name__ == "__main__":
    main()
