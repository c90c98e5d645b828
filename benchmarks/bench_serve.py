"""Throughput of the OpenAI-compatible endpoint (consequence.serve) against the in-process sampler.

Two measurements with the bundled tiny model on repair tasks (validation split), temperature 1:

1. **single calls**: S concurrent sessions (default 32) each send one chat-completions call
   (the task's opening messages and tools, ``max_tokens`` 48) through the stock
   ``openai.AsyncOpenAI`` client to a live server on 127.0.0.1; against one in-process
   sampler call of the same S prompts (``generate_with_prefix``, as rollouts call it: the
   shared opening prefix is prefilled once, as the endpoint's batcher does).
2. **episodes**: the same S multi-turn repair episodes (budgets 8 calls, 48 tokens per call,
   768 per episode) run by the agent-runner (``serve.runner``, S concurrent agents) and by
   the in-process harness (``rollout.episodes.run_episodes``). The harness advances all
   episodes in lock-step (every turn waits for the slowest sandboxed tool run); the agents
   do not, so the endpoint samples some episodes while others run their tools.

Each is repeated ``--repeats`` times; the median wall time is reported. Prints a table and
writes ``benchmarks/results/bench_serve.json``.

Run: ``python benchmarks/bench_serve.py [--sessions 32] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import openai
import torch

from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.policy.prefix_cache import PrefixCache, generate_with_prefix
from consequence.policy.sampler import SamplingParams
from consequence.policy.tiny import load_policy
from consequence.rollout.episodes import Budgets, EpisodeSpec, opening_messages, run_episodes
from consequence.rollout.sampling import policy_generate_fn
from consequence.serve.app import BackgroundServer, ServeSettings, create_app, model_context_length
from consequence.serve.runner import run_agent_episodes

BUNDLED = Path(__file__).resolve().parent.parent / "consequence" / "assets" / "tiny-repair"
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=48)
BUDGETS = Budgets(8, 48, 768)


async def _calls(url: str, prompts: list[list[dict]], tools: list[dict]) -> list[int]:
    async def one(k: int, messages: list[dict]) -> int:
        c = openai.AsyncOpenAI(base_url=f"{url}/s/bench-{time.monotonic_ns()}-{k}/v1", api_key="x", max_retries=0)
        try:
            r = await c.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=48)
            return r.usage.completion_tokens
        finally:
            await c.close()

    return list(await asyncio.gather(*(one(k, m) for k, m in enumerate(prompts))))


def single_calls(model, renderer, env, sessions: int, repeats: int) -> list[dict]:
    tasks = env.sample("validation", sessions, seed=11)
    convs = [opening_messages(env.system_prompt, env.make_episode(t).reset(seed=0)[0], env.examples) for t in tasks]
    app = create_app(model, Renderer(renderer.tokenizer, []), ServeSettings("tiny", model_context_length(model)))
    served, local = [], []
    stats = app.state.serve.batcher.stats
    with BackgroundServer(app) as server:
        asyncio.run(_calls(server.url, convs[:2], env.tools))  # warm-up: first-request costs out of the timing
        for _ in range(repeats):
            before = stats.batches
            t0 = time.perf_counter()
            toks = asyncio.run(_calls(server.url, convs, env.tools))
            served.append((time.perf_counter() - t0, sum(toks), sessions, stats.batches - before))
    prompts = [renderer.prompt_ids(c) for c in convs]
    for r in range(repeats):  # what a rollout calls: a shared opening prefix is prefilled once, as in the endpoint
        t0 = time.perf_counter()
        out = generate_with_prefix(
            model,
            prompts,
            list(range(sessions)),
            PARAMS,
            renderer.stop_ids,
            PrefixCache(),
            torch.Generator().manual_seed(r),
        )
        local.append((time.perf_counter() - t0, sum(len(s.output_ids) for s in out), sessions, 1))
    return [
        _row("single calls", "endpoint (openai client)", sessions, served),
        _row("single calls", "in-process sampler", sessions, local),
    ]


def _agent():
    """The shipped example agent (examples/openai_agent/agent.py), loaded as --agent loads it."""
    from consequence.serve.runner import load_agent

    return load_agent(str(Path(__file__).resolve().parents[1] / "examples/openai_agent/agent.py") + ":agent")


def episodes(model, renderer, env, sessions: int, repeats: int) -> list[dict]:
    tasks = env.sample("validation", sessions, seed=11)

    def specs():
        return [
            EpisodeSpec(
                env.make_episode(t), t.task_id, t.task_id, 0, 1000 + i, answer_ends_episode=env.answer_ends_episode
            )
            for i, t in enumerate(tasks)
        ]

    served, local = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        trajs, stats = run_agent_episodes(
            _agent(), model, renderer, specs(), BUDGETS, PARAMS, env.system_prompt, seed=r, examples=env.examples
        )
        served.append(
            (
                time.perf_counter() - t0,
                sum(t.n_generated_tokens for t in trajs),
                stats["agent_calls"],
                stats["agent_batches"],
            )
        )
        t0 = time.perf_counter()
        gen = policy_generate_fn(model, PARAMS, renderer.stop_ids, seed=r)
        trajs = run_episodes(gen, renderer, specs(), BUDGETS, env.system_prompt, examples=env.examples)
        calls = [len(t.calls) for t in trajs]
        local.append((time.perf_counter() - t0, sum(t.n_generated_tokens for t in trajs), sum(calls), max(calls)))
    return [
        _row("episodes", "agent-runner (endpoint)", sessions, served),
        _row("episodes", "in-process harness", sessions, local),
    ]


def _row(what: str, path: str, sessions: int, runs: list[tuple]) -> dict:
    """The median run (by wall time) of ``runs``: (wall s, tokens, requests, generate calls)."""
    k = sorted(range(len(runs)), key=lambda i: runs[i][0])[len(runs) // 2]
    wall, tokens, reqs, batches = runs[k]
    return {
        "measurement": what,
        "path": path,
        "sessions": sessions,
        "requests": int(reqs),
        "tokens": int(tokens),
        "generate_calls": int(batches),
        "wall_s": round(wall, 3),
        "requests_per_s": round(reqs / wall, 1),
        "tokens_per_s": round(tokens / wall, 1),
        "wall_s_all": [round(r[0], 3) for r in runs],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_serve.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    load = os.getloadavg()  # other work on the machine makes every number slower
    model, tok = load_policy(BUNDLED)
    env = load_environment("repair", 0)
    renderer = Renderer(tok, env.tools)
    rows = single_calls(model, renderer, env, args.sessions, args.repeats)
    rows += episodes(model, renderer, env, args.sessions, args.repeats)
    print(
        f"{'measurement':<13} {'path':<26} {'sessions':>8} {'requests':>8} {'tokens':>7} {'generate':>8} "
        f"{'wall s':>7} {'req/s':>7} {'tok/s':>8}"
    )
    for r in rows:
        print(
            f"{r['measurement']:<13} {r['path']:<26} {r['sessions']:>8} {r['requests']:>8} {r['tokens']:>7} "
            f"{r['generate_calls']:>8} {r['wall_s']:>7.2f} {r['requests_per_s']:>7.1f} {r['tokens_per_s']:>8.1f}"
        )
    print(
        "generate = sampler calls (endpoint: batches; harness: turns of the slowest episode); median of "
        f"{args.repeats} runs; load average before: {load[0]:.1f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "rows": rows,
                "model": "bundled tiny-repair",
                "temperature": PARAMS.temperature,
                "max_tokens": PARAMS.max_new_tokens,
                "budgets": dataclasses.asdict(BUDGETS),
                "torch_threads": torch.get_num_threads(),
                "load_average_before": list(load),
                "cpu_count": os.cpu_count(),
                "machine": platform.machine(),
                "openai": openai.__version__,
                "command": f"python benchmarks/bench_serve.py --sessions {args.sessions} --repeats {args.repeats}",
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
