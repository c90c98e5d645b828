"""pass@k of single-turn code completions (HumanEval; any ``completion`` CodeTask).

Protocol (docs/design.md §7; Chen et al. 2021 §2.1 for pass@k):

- n samples per task from a local Hugging Face checkpoint with
  :func:`consequence.policy.sampler.generate` (temperature, top-p), batched across tasks
  (about ``batch_rows`` rows per call), one random stream per sample (see
  :func:`sample_completions`);
- prompt: ``"chat"`` renders one user message (the instruction below plus the prompt in
  a fenced block) with the tokenizer's chat template; ``"raw"`` feeds the prompt text
  itself (base models). ``"auto"`` = chat when the tokenizer has a chat template;
- completion: raw mode cuts the text at the Codex stop sequences (``\\ndef``,
  ``\\nclass``, ``\\nif``, ``\\nprint``, ``\\n#``); chat mode takes the fenced block that
  defines the entry point (else the first block, else the whole reply) and appends it
  after the prompt (a full ``def`` replaces the stub; a bare body continues it);
- score: :func:`consequence.envs.humaneval.code_tasks.verify_completion` (the same function as
  the training reward), on ``workers`` threads while the model keeps sampling;
- rules: a sample cut by ``max_new_tokens`` or whose prompt does not fit the model's
  context stays in n as a failure (docs/cases.md, case 04); a sandbox error is retried up to
  ``sandbox.ENV_RETRIES`` times, then dropped from that task's n and counted; a task
  left with fewer than k samples is excluded from pass@k and counted; pass@k is
  computed per task, then averaged, with a percentile bootstrap CI over tasks.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from consequence.envs.humaneval.code_tasks import (
    CHAT_INSTRUCTION,
    STOP_SEQUENCES,
    chat_request,
    extract_completion,
    verify_completion,
)
from consequence.envs.repair.jsonl import CodeTask
from consequence.evaluate.progress import SILENT, Phases
from consequence.evaluate.stats import bootstrap_mean_ci, pass_at_k
from consequence.fileio import write_text_atomic
from consequence.sandbox.judge import PROGRAM_LIMITS
from consequence.sandbox.sandbox import ENV_RETRIES, SandboxLimits, isolation_report, with_retries
from consequence.seeding import seed_of

__all__ = [
    "CHAT_INSTRUCTION",
    "STOP_SEQUENCES",
    "CompletionEval",
    "extract_completion",
    "score_completions",
    "sample_completions",
    "evaluate_completions",
    "save_eval",
]

BATCH_ROWS = 32  # sampled rows per batched generate call (tasks × n)


@dataclass
class CompletionEval:
    """Result of :func:`score_completions` / :func:`evaluate_completions`.

    ``pass_at_k[k]`` is the mean over included tasks of the unbiased per-task pass@k;
    ``ci[k] = (low, high)`` its bootstrap CI; ``per_task`` has one dict per task
    (task_id, n, n_valid, correct, truncated, env_errors, pass@k); counts are samples.
    """

    ks: tuple[int, ...]
    n: int
    pass_at_k: dict[int, float]
    ci: dict[int, tuple[float, float]]
    tasks: int
    tasks_excluded: dict[int, int]
    samples: int
    env_errors: int
    truncated: int
    prompt_too_long: int
    per_task: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One line per k: ``pass@1 = 0.412 [0.337, 0.488] over 164 tasks``."""
        lines = [
            f"pass@{k} = {self.pass_at_k[k]:.3f} [{self.ci[k][0]:.3f}, {self.ci[k][1]:.3f}]"
            f" over {self.tasks - self.tasks_excluded[k]} tasks"
            for k in self.ks
        ]
        lines.append(
            f"samples {self.samples}: env errors {self.env_errors}, cut by "
            f"max_new_tokens {self.truncated}, prompt too long {self.prompt_too_long}"
        )
        return "\n".join(lines)


def _aggregate(
    tasks: Sequence[CodeTask], reports: list[list], ks: Sequence[int], flags: list[list[str]], seed: int
) -> CompletionEval:
    per_task: list[dict[str, Any]] = []
    counts = []
    for task, reps, fl in zip(tasks, reports, flags):
        valid = [r for r in reps if r.status != "sandbox_error"]
        c = sum(1 for r in valid if r.all_passed)
        row: dict[str, Any] = {
            "task_id": task.task_id,
            "n": len(reps),
            "n_valid": len(valid),
            "correct": c,
            "env_errors": len(reps) - len(valid),
            "truncated": fl.count("length"),
            "prompt_too_long": fl.count("too_long"),
        }
        for k in ks:
            row[f"pass@{k}"] = pass_at_k(len(valid), c, k) if len(valid) >= k else None
        per_task.append(row)
        counts.append((len(valid), c))
    pak, ci, excl = {}, {}, {}
    for k in ks:
        vals = [r[f"pass@{k}"] for r in per_task if r[f"pass@{k}"] is not None]
        excl[k] = len(per_task) - len(vals)
        pak[k] = sum(vals) / len(vals) if vals else float("nan")
        ci[k] = bootstrap_mean_ci(vals, seed=seed) if len(vals) >= 2 else (pak[k], pak[k])
    return CompletionEval(
        ks=tuple(ks),
        n=max((r["n"] for r in per_task), default=0),
        pass_at_k=pak,
        ci=ci,
        tasks=len(per_task),
        tasks_excluded=excl,
        samples=sum(r["n"] for r in per_task),
        env_errors=sum(r["env_errors"] for r in per_task),
        truncated=sum(r["truncated"] for r in per_task),
        prompt_too_long=sum(r["prompt_too_long"] for r in per_task),
        per_task=per_task,
    )


def _score_one(task: CodeTask, completion: str, limits: SandboxLimits | None):
    # a sandbox error is a failure of the host, not of the sample: re-run the same check up
    # to the stated limit (the same as training episodes), then it is dropped and counted
    return with_retries(lambda: verify_completion(task, completion, limits), ENV_RETRIES)


def score_completions(
    tasks: Sequence[CodeTask],
    completions: Sequence[Sequence[str]],
    ks: Sequence[int],
    flags: Sequence[Sequence[str]] | None = None,
    limits: SandboxLimits | None = None,
    workers: int = 2,
    seed: int = 0,
) -> CompletionEval:
    """Score given completions (``completions[i]`` = the samples of ``tasks[i]``).

    ``flags[i][j]`` is ``"stop"``, ``"length"`` (cut by max_new_tokens) or ``"too_long"``
    (prompt did not fit; the completion is then empty). Raises ValueError when lengths
    differ or a k is < 1.
    """
    if len(tasks) != len(completions):
        raise ValueError(f"{len(tasks)} tasks but {len(completions)} completion lists")
    if any(k < 1 for k in ks):
        raise ValueError(f"every k must be >= 1, got {list(ks)}")
    flags = flags or [["stop"] * len(c) for c in completions]
    with ThreadPoolExecutor(max(1, workers)) as ex:
        futs = [[ex.submit(_score_one, t, c, limits) for c in cs] for t, cs in zip(tasks, completions)]
        reports = [[f.result() for f in fs] for fs in futs]
    return _aggregate(tasks, reports, ks, [list(f) for f in flags], seed)


def _load(model_path: str | os.PathLike):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"no model folder at {path} (a local Hugging Face checkpoint)")
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    return model.eval(), tok


def _prompt_ids(tok, task: CodeTask, mode: str) -> list[int]:
    if mode == "raw":
        return list(tok(task.prompt)["input_ids"])
    msgs = [{"role": "user", "content": chat_request(task)}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _stop_ids(model, tok) -> set[int]:
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    end = tok.get_vocab().get("<|im_end|>")
    return ids | ({end} if end is not None else set())


def batches(lengths: Sequence[int], n: int, batch_rows: int) -> list[list[int]]:
    """Task indices per ``generate`` call: tasks sorted by prompt length (stable, so that a
    batch pads little), cut into runs of ``max(1, batch_rows // n)`` tasks.

    >>> batches([5, 1, 3, 2], n=2, batch_rows=4)
    [[1, 3], [2, 0]]
    """
    per = max(1, batch_rows // max(1, n))
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[j : j + per] for j in range(0, len(order), per)]


def sample_completions(
    model,
    tok,
    tasks: Sequence[CodeTask],
    n: int,
    temperature: float,
    seed: int,
    max_new_tokens: int = 384,
    top_p: float = 1.0,
    prompt_mode: str = "auto",
    on_task: Callable[[int, list[str], list[str]], None] | None = None,
    batch_rows: int = BATCH_ROWS,
) -> tuple[list[list[str]], list[list[str]], str]:
    """n completions per task; returns (completions, flags, prompt mode used), in task order.

    Batching and seeds: the tasks whose prompt fits are grouped by :func:`batches` (about
    ``batch_rows`` sampled rows per batched ``generate`` call, n rows per task). Sample j
    of a task draws from its own generator, seeded ``seed_of(seed, task_id, j)``
    (``sampler.draw``), so a completion depends on the seed, its task and j only: another
    ``batch_rows``, another task list (e.g. another ``--problems``) or another order gives
    the same completion for the same task (up to float32 differences of batched matmuls,
    which move a token only where its draw lands within rounding of a CDF step).
    ``on_task(i, completions, flags)`` is called for each task once its batch is done
    (used to score while the next batch samples). Stop tokens are removed before decoding.
    """
    import torch

    from consequence.policy.sampler import SamplingParams, generate

    mode = prompt_mode if prompt_mode != "auto" else ("chat" if getattr(tok, "chat_template", None) else "raw")
    ctx = getattr(model.config, "max_position_embeddings", None) or 10**9
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    stops = _stop_ids(model, tok)
    ids = [_prompt_ids(tok, task, mode) for task in tasks]
    comps: list[list[str]] = [[] for _ in tasks]
    flags: list[list[str]] = [[] for _ in tasks]
    fits = [i for i in range(len(tasks)) if len(ids[i]) + max_new_tokens <= ctx]
    for i in sorted(set(range(len(tasks))) - set(fits)):
        comps[i], flags[i] = [""] * n, ["too_long"] * n
        if on_task is not None:
            on_task(i, comps[i], flags[i])
    for batch in batches([len(ids[i]) for i in fits], n, batch_rows):
        members = [fits[j] for j in batch]
        streams = [torch.Generator().manual_seed(seed_of(seed, tasks[i].task_id, j)) for i in members for j in range(n)]
        samples = generate(model, [ids[i] for i in members for _ in range(n)], params, stops, streams)
        for r, i in enumerate(members):
            mine = samples[r * n : (r + 1) * n]
            comps[i] = [
                extract_completion(
                    tok.decode([t for t in s.output_ids if t not in stops], skip_special_tokens=True), tasks[i], mode
                )
                for s in mine
            ]
            flags[i] = [s.stop_reason for s in mine]
            if on_task is not None:
                on_task(i, comps[i], flags[i])
    return comps, flags, mode


def evaluate_completions(
    model_path: str | os.PathLike,
    tasks: Sequence[CodeTask],
    n: int = 10,
    ks: Sequence[int] = (1, 10),
    temperature: float = 0.8,
    seed: int = 0,
    max_new_tokens: int = 384,
    top_p: float = 1.0,
    prompt_mode: str = "auto",
    limits: SandboxLimits | None = None,
    workers: int = 2,
    batch_rows: int = BATCH_ROWS,
    threads: int | None = None,
    phases: Phases = SILENT,
    device: Any = "cpu",
) -> CompletionEval:
    """Sample ``n`` completions per task from the local checkpoint and report pass@k.

    Args:
        model_path: folder of a Hugging Face causal LM + tokenizer (no download).
        tasks: ``completion`` CodeTasks (e.g. ``consequence.envs.humaneval.code_tasks.load_humaneval()``).
        n: samples per task; every k in ``ks`` must be <= n.
        temperature, top_p, max_new_tokens: sampling budget (reported in ``settings``).
        seed: sampling seed (one random stream per sample, :func:`sample_completions`) and
            bootstrap seed.
        prompt_mode: ``"auto"``, ``"chat"`` or ``"raw"`` (module docstring).
        limits: sandbox limits of the verifier (default: ``judge.PROGRAM_LIMITS``).
        workers: scoring threads (each run is two sandbox processes); scoring of a batch
            runs while the next batch samples.
        batch_rows: sampled rows per batched ``generate`` call (tasks × n; at least one
            task per call); speed only (each sample has its own stream).
        threads: torch threads while sampling (restored afterwards); default: the CPU
            count minus ``workers``, at least 1, so that the sandbox processes scoring the
            previous batch get cores of their own (on 2 cores, 2 torch threads next to
            the sandbox made the whole evaluation several times slower: ``benchmarks/bench_eval.py``).
        phases: progress of sampling and scoring (samples done / total, samples/s).
        device: where the model computes (a ``torch.device`` or its name, already checked:
            ``policy.device.resolve_device``).

    Returns:
        :class:`CompletionEval`; ``settings`` records model, n, ks, sampling, mode,
        batch_rows, torch threads, limits, sandbox isolation and wall time.

    Raises:
        FileNotFoundError: no model folder. ValueError: a k > n or < 1, n < 1, no tasks,
        a task that is not ``completion`` kind.
    """
    if n < 1 or not tasks:
        raise ValueError(f"need n >= 1 and at least one task (n={n}, {len(tasks)} tasks)")
    if any(k < 1 or k > n for k in ks):
        raise ValueError(f"every k must be in 1..n={n}, got {list(ks)}")
    bad = [t.task_id for t in tasks if t.kind != "completion"]
    if bad:
        raise ValueError(f"evaluate_completions needs completion tasks; {bad[:3]} are not")
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    t0 = time.perf_counter()
    model, tok = _load(model_path)
    model.to(device)
    threads = threads if threads is not None else max(1, (os.cpu_count() or 1) - max(1, workers))
    ex = ThreadPoolExecutor(max(1, workers))
    futs: list[list[Future]] = [[] for _ in tasks]
    total = len(tasks) * n
    try:
        with phases.phase("completions scored (sandbox, overlapping the sampling)", total, "samples") as scored:
            add_scored = phases.counter(scored)
            with phases.phase("completions sampled", total, "samples") as sampled:
                add_sampled = phases.counter(sampled)

                def submit(i: int, cs: list[str], fl: list[str]) -> None:
                    futs[i] = [ex.submit(_score_one, tasks[i], c, limits) for c in cs]
                    for f in futs[i]:
                        f.add_done_callback(lambda _f: add_scored(1))
                    add_sampled(len(cs))

                with _torch_threads(threads):
                    comps, flags, mode = sample_completions(
                        model, tok, tasks, n, temperature, seed, max_new_tokens, top_p, prompt_mode, submit, batch_rows
                    )
            reports = [[f.result() for f in fs] for fs in futs]
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    res = _aggregate(tasks, reports, ks, flags, seed)
    for row, cs in zip(res.per_task, comps):
        row["completions"] = cs
    res.settings = {
        "model": str(model_path),
        "n": n,
        "ks": list(ks),
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "prompt_mode": mode,
        "seed": seed,
        "batch_rows": batch_rows,
        "torch_threads": threads,
        "device": str(device),
        "limits": asdict(limits or PROGRAM_LIMITS),
        "isolation": isolation_report(),
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    return res


@contextmanager
def _torch_threads(k: int):
    """torch's intra-op thread count set to ``k`` for the block, then restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(k)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def save_eval(result: CompletionEval, path: str | os.PathLike) -> Path:
    """Write ``result`` as JSON atomically (temporary sibling, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    obj = asdict(result)
    obj["pass_at_k"] = {str(k): v for k, v in result.pass_at_k.items()}
    obj["ci"] = {str(k): list(v) for k, v in result.ci.items()}
    obj["tasks_excluded"] = {str(k): v for k, v in result.tasks_excluded.items()}
    return write_text_atomic(path, json.dumps(obj, indent=1))
