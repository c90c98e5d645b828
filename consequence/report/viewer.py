"""``consequence view``: one static HTML page to see exactly what the loss sees.

Each trajectory is shown as the training rows the trainer builds from it
(:func:`consequence.records.trajectory_to_rows`, padded with
:func:`consequence.records.pad_rows`), so the colours come from the same loss mask, not
from a second masking code path (STYLE.md 6). Every token gets one role:

=========== ===============================================================================
role        rule (first that applies)
=========== ===============================================================================
``pad``     ``attention_mask == 0``: positions ``pad_rows`` adds when this trajectory's rows
            are stacked into one tensor (only when it has rows of different lengths).
``target``  ``loss_mask == 1``: a token the policy sampled, end-of-turn included.
``boundary`` not sampled, and a chat-template token: a token of the tokenizer's added
            vocabulary (``<|im_start|>``, ``<|im_end|>``, ``<tool_response>`` …), a role
            header (the tokens after ``<|im_start|>`` up to and including the first one whose
            text holds a newline, e.g. ``assistant`` ``\\n``) or a whitespace-only token right
            after ``<|im_end|>`` (the separator between turns).
``prompt``  any other token before the row's first sampled token (the task's context).
``obs``     any other token after it: tool results and error messages the harness appended.
=========== ===============================================================================

The page embeds compact JSON (token ids, one role letter per token, log-probs rounded to
4 decimals, the text of only the ids used) and renders one trajectory at a time, so it
stays small: about 20 bytes per token, at most ``limit`` trajectories (default 200).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from consequence.config import flat_settings
from consequence.fileio import write_text_atomic
from consequence.records import Trajectory, pad_rows, read_trajectories, trajectory_to_rows

DEFAULT_LIMIT = 200  # trajectories per page; whole groups, spread over the iterations
ROLES = {"pad": "D", "target": "T", "boundary": "B", "prompt": "P", "obs": "O"}  # role → letter in the JSON
_ITER_RE = re.compile(r"iter_(\d+)\.parquet$")


class ViewerError(ValueError):
    """The run directory cannot be viewed (missing, no trajectories, bad option)."""


@dataclass
class RunFiles:
    """What the viewer reads from a run directory.

    Attributes:
        run_dir: the run directory (``consequence train --run-dir``).
        trajectory_files: iteration number (0-based, as in ``iter_NNNN.parquet``) → path.
        config: ``config.yaml`` as a plain dict (empty when the file is absent).
    """

    run_dir: Path
    trajectory_files: dict[int, Path]
    config: dict[str, Any]


def find_run_files(run_dir: str | os.PathLike) -> RunFiles:
    """Locate the trajectory files and the config of a run directory.

    Raises:
        ViewerError: ``run_dir`` is not a directory, or holds no ``trajectories/iter_NNNN.parquet``.
    """
    import yaml

    run = Path(run_dir)
    if not run.is_dir():
        what = "is a file, not a folder" if run.exists() else "no such directory"
        raise ViewerError(f"run directory {run}: {what} (give the --run-dir of a training run)")
    files = {}
    for p in sorted((run / "trajectories").glob("iter_*.parquet")):
        m = _ITER_RE.search(p.name)
        if m:
            files[int(m.group(1))] = p
    if not files:
        raise ViewerError(
            f"run directory {run}: no trajectories/iter_NNNN.parquet files "
            "(is it the run directory of `consequence train`, and has an iteration finished?)"
        )
    cfg_path = run / "config.yaml"
    config = flat_settings(yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.is_file() else {}
    return RunFiles(run, files, config)


def select_trajectories(by_iter: dict[int, list[Trajectory]], limit: int) -> tuple[list[tuple[int, Trajectory]], int]:
    """Keep at most ``limit`` trajectories, as whole groups spread over the iterations.

    Groups are taken one per iteration per pass, iterations visited latest first and then
    spread out (latest, middle, quarters, …), until the next group no longer fits. If not
    even one group fits, the first ``limit`` members of the latest iteration's first group
    are shown.

    Returns:
        ``(kept, n_left_out)`` with ``kept`` a list of ``(iteration, trajectory)`` in
        iteration order, then stored order.

    >>> t = lambda g: Trajectory(task_id=g, group_id=g, sample_id=0, seed=0, policy_version=0)
    >>> kept, left = select_trajectories({0: [t("a"), t("a"), t("b")], 1: [t("c")]}, 3)
    >>> [(i, x.group_id) for i, x in kept], left
    ([(0, 'a'), (0, 'a'), (1, 'c')], 1)
    >>> _spread(5)
    [4, 2, 3, 1, 0]
    """
    if limit < 1:
        raise ViewerError(f"limit must be at least 1, got {limit}")
    iters = sorted(by_iter)
    groups: dict[int, list[list[int]]] = {}  # iteration → groups as lists of indices into by_iter[it]
    for it in iters:
        by_id: dict[str, list[int]] = {}
        for k, t in enumerate(by_iter[it]):
            by_id.setdefault(t.group_id, []).append(k)
        groups[it] = list(by_id.values())
    taken: dict[int, list[int]] = {it: [] for it in iters}
    total = 0
    for p in range(max(len(g) for g in groups.values())):
        for it in (iters[i] for i in _spread(len(iters))):
            if p < len(groups[it]) and total + len(groups[it][p]) <= limit:
                taken[it] += groups[it][p]
                total += len(groups[it][p])
    if total == 0:
        taken[iters[-1]] = groups[iters[-1]][0][:limit]
    kept = [(it, by_iter[it][k]) for it in iters for k in sorted(taken[it])]
    return kept, sum(len(v) for v in by_iter.values()) - len(kept)


def _spread(n: int) -> list[int]:
    """0..n-1 ordered latest first, then halving the gaps (van der Corput sequence)."""
    order: list[int] = []
    seen: set[int] = set()
    i = 0
    while len(order) < n:
        x, f, j = 0.0, 0.5, i  # x = i-th van der Corput number in [0, 1)
        while j:
            x, j, f = x + f * (j & 1), j >> 1, f / 2
        idx = n - 1 - int(x * n)
        if idx not in seen:
            seen.add(idx)
            order.append(idx)
        i += 1
    return order


def token_roles(
    ids: list[int],
    loss_mask: list[int],
    attention_mask: list[int],
    added_ids: set[int],
    im_start_id: int | None,
    im_end_id: int | None,
    text_of,
) -> str:
    """One role letter per position of one padded row (rules in the module docstring).

    Args:
        ids, loss_mask, attention_mask: one row of :func:`pad_rows`, each of length S.
        added_ids: ids of the tokenizer's added vocabulary (special and template tokens).
        im_start_id, im_end_id: ids of the turn markers, or ``None`` when the vocabulary lacks them.
        text_of: id → decoded text of that single token.

    Returns:
        str of length S over the letters of :data:`ROLES`.

    >>> txt = {1: "<s>", 2: "</s>", 5: "user", 6: "\\n", 7: "hi", 8: "ok"}.get
    >>> token_roles([1, 5, 6, 7, 2, 6, 8, 2, 0], [0, 0, 0, 0, 0, 0, 1, 1, 0], [1] * 8 + [0], {1, 2}, 1, 2, txt)
    'BBBPBBTTD'
    """
    out = []
    header = False  # inside a role header (after <|im_start|>, until a newline)
    seen_target = False
    prev = None
    for tid, m, a in zip(ids, loss_mask, attention_mask):
        text = text_of(tid)
        if not a:
            role = "pad"
        elif m:
            role, header, seen_target = "target", False, True
        elif tid in added_ids or header or (prev == im_end_id and text.strip() == ""):
            role = "boundary"
            if header and "\n" in text:
                header = False
            elif tid == im_start_id:
                header = True
        else:
            role = "obs" if seen_target else "prompt"
        out.append(ROLES[role])
        prev = tid
    return "".join(out)


def _round(x: float | None, nd: int = 4) -> float | str | None:
    """A JSON-safe number: rounded; NaN → None; ±inf → "-inf" / "inf" (JSON has no infinities)."""
    if x is None or math.isnan(x):
        return None
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return round(float(x), nd)


def trajectory_record(
    it: int,
    t: Trajectory,
    tokenizer,
    vocab_used: dict[int, str],
    trained_filter: bool,
    current: list[list[float | None]] | None = None,
    checkpoint: str | None = None,
) -> dict[str, Any]:
    """The compact JSON record of one trajectory (see the module docstring for the roles).

    Args:
        current: per row, per position the current policy's log-prob of that token
            (``None`` at position 0 and on padding), or ``None`` when not computed.
        checkpoint: name of the checkpoint that computed ``current``.
        trained_filter: the run dropped truncated trajectories from the loss (overlong_filter).
    """
    added = set(tokenizer.get_added_vocab().values())
    vocab = tokenizer.get_vocab()
    text_of = lambda i: _text(tokenizer, i, vocab_used)  # noqa: E731
    rows_out = []
    rows = trajectory_to_rows(t)
    if rows:
        batch = pad_rows(rows, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        for k in range(len(rows)):
            ids = batch["input_ids"][k].tolist()
            mask = [int(x) for x in batch["loss_mask"][k].tolist()]
            att = batch["attention_mask"][k].tolist()
            roles = token_roles(ids, mask, att, added, vocab.get("<|im_start|>"), vocab.get("<|im_end|>"), text_of)
            slp = [_round(x) for x, m in zip(batch["old_logprobs"][k].tolist(), mask) if m]
            rows_out.append(
                {
                    "ids": ids,
                    "roles": roles,
                    "slp": slp,
                    "clp": [_round(x) for x in current[k]] if current is not None else None,
                }
            )
    if t.reward is None or not t.n_generated_tokens:  # the credit box's rule (docs/cases.md, case 15)
        trained = (
            "no: no reward (environment error)"
            if t.reward is None
            else "no: no model call"
            if not t.calls
            else "no: no token generated"
        )
    elif trained_filter and t.outcome == "truncated":
        trained = "no: truncated, dropped by overlong_filter"
    else:
        trained = "yes"
    return {
        "it": it,
        "task": t.task_id,
        "group": t.group_id,
        "sample": t.sample_id,
        "version": t.policy_version,
        "reward": _round(t.reward),
        "adv": _round(t.advantage),
        "outcome": t.outcome,
        "trunc": t.truncation_reason,
        "verifier": _round(t.verifier_score),
        "components": {k: _round(v) for k, v in t.reward_components.items()},
        "error": t.error,
        "n_tools": t.n_tool_calls,
        "n_gen": t.n_generated_tokens,
        "trained": trained,
        "wall_s": _round(t.wall_time_s, 2),
        "ckpt": checkpoint,
        "calls": [
            {"stop": c.stop_reason, "tools": c.tool_calls, "parse_error": c.parse_error, "n_out": len(c.output_ids)}
            for c in t.calls
        ],
        "rows": rows_out,
    }


def _text(tokenizer, i: int, cache: dict[int, str]) -> str:
    if i not in cache:
        cache[i] = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return cache[i]


def checkpoint_after(run: Path, it: int) -> Path | None:
    """The checkpoint saved after iteration ``it`` (0-based), else ``final``, else ``None``.

    ``consequence train`` writes ``trajectories/iter_{it:04d}`` before the update of
    iteration ``it`` and ``checkpoints/iter_{it+1:04d}`` after it.
    """
    from consequence.policy.lora import is_model_folder

    for p in (run / "checkpoints" / f"iter_{it + 1:04d}", run / "checkpoints" / "final"):
        if is_model_folder(p):
            return p
    return None


def current_logprobs(
    model, tokenizer, t: Trajectory, temperature: float, top_k: int, top_p: float
) -> list[list[float | None]]:
    """The current policy's log-prob of every token of each training row (one forward pass).

    Uses the trainer's :func:`consequence.policy.logprobs.token_logprobs` under the run's
    sampling settings, so that on the behaviour policy ratio = exp(current − sampling) = 1.

    Returns:
        per row, a list of length S (the padded row length): ``None`` at position 0 (no
        prefix) and on padding, else log π(token_j | tokens_<j) in nats.
    """
    import torch

    from consequence.policy.logprobs import token_logprobs

    rows = trajectory_to_rows(t)
    if not rows:
        return []
    batch = pad_rows(rows, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    with torch.inference_mode():
        # Sampled targets are scored on the support they were drawn from (the stored keep
        # mask), not on a top-k / top-p support recomputed from the checkpoint's logits.
        lp, _ = token_logprobs(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            temperature,
            top_k,
            top_p,
            keep_index=batch.get("keep_index"),
            keep_rows=batch.get("keep_rows"),
        )  # [N, S-1]
    out = []
    for k in range(len(rows)):
        att = batch["attention_mask"][k].tolist()
        out.append([None] + [x if a else None for x, a in zip(lp[k].tolist(), att[1:])])
    return out


def build_page(
    run_dir: str | os.PathLike,
    iteration: int | None = None,
    with_current_logprobs: bool = False,
    limit: int = DEFAULT_LIMIT,
    log=print,
) -> tuple[str, dict[str, Any]]:
    """Build the HTML page of a run directory.

    Args:
        run_dir: a ``consequence train`` run directory.
        iteration: show only this iteration (0-based, as in ``iter_NNNN.parquet``); default all.
        with_current_logprobs: recompute every token's log-prob with the checkpoint saved
            after the trajectory's iteration (else ``final``): one forward pass per trajectory.
        limit: most trajectories on the page (whole groups, spread over the iterations).
        log: called with progress messages.

    Returns:
        ``(html, summary)``; summary has ``n_shown``, ``n_left_out``, ``iterations``.

    Raises:
        ViewerError: bad run directory, unknown iteration, no trajectories, or no checkpoint
            when ``with_current_logprobs`` is set.
    """
    import jinja2

    from consequence.policy.tiny import load_policy

    files = find_run_files(run_dir)
    run = files.run_dir
    if iteration is not None:
        if iteration not in files.trajectory_files:
            raise ViewerError(
                f"--iteration {iteration}: no trajectories/iter_{iteration:04d}.parquet in {run} "
                f"(iterations present: {', '.join(map(str, sorted(files.trajectory_files)))})"
            )
        files.trajectory_files = {iteration: files.trajectory_files[iteration]}
    by_iter = {it: read_trajectories(p) for it, p in files.trajectory_files.items()}
    if not any(by_iter.values()):
        raise ViewerError(f"run directory {run}: the trajectory files hold no trajectories")
    by_iter = {it: ts for it, ts in by_iter.items() if ts}
    kept, left_out = select_trajectories(by_iter, limit)

    cfg = files.config
    temperature, top_k, top_p = (
        float(cfg.get("temperature", 1.0)),
        int(cfg.get("top_k", 0)),
        float(cfg.get("top_p", 1.0)),
    )
    from consequence.policy.named import model_folder  # a registered model name: its converted folder

    tok_path = checkpoint_after(run, max(by_iter)) or (
        model_folder(cfg["model"], log=log) if cfg.get("model") else None
    )
    if tok_path is None:
        from consequence.policy.tiny import BUNDLED

        tok_path = BUNDLED
    models: dict[Path, Any] = {}

    def policy(path: Path):
        if path not in models:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            models[path] = load_policy(path)[0]
        return models[path]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tok_path))
    vocab_used: dict[int, str] = {}
    records = []
    for n, (it, t) in enumerate(kept):
        current, ckpt_name = None, None
        if with_current_logprobs:
            ckpt = checkpoint_after(run, it)
            if ckpt is None:
                raise ViewerError(
                    f"--with-current-logprobs: {run} has neither checkpoints/iter_{it + 1:04d} nor checkpoints/final"
                )
            model = policy(ckpt)
            current, ckpt_name = current_logprobs(model, tokenizer, t, temperature, top_k, top_p), ckpt.name
            if n % 20 == 0 or n + 1 == len(kept):
                log(f"recomputing current log-probs: trajectory {n + 1} of {len(kept)}")
        records.append(
            trajectory_record(it, t, tokenizer, vocab_used, bool(cfg.get("overlong_filter")), current, ckpt_name)
        )

    data = {
        "run": str(run.resolve()),
        "recipe": _run_label(run, cfg),
        "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p},
        "n_total": len(kept) + left_out,
        "n_left_out": left_out,
        "limit": limit,
        "with_current": with_current_logprobs,
        "vocab": {str(k): v for k, v in sorted(vocab_used.items())},
        "trajectories": records,
    }
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent), autoescape=True)
    # JSON inside <script>: escape "<" so no "</script>" or "<!--" in token text can end it.
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False).replace("<", "\\u003c")
    html = env.get_template("viewer.html.jinja").render(title=f"consequence view: {run.name}", data_json=payload)
    return html, {"n_shown": len(kept), "n_left_out": left_out, "iterations": sorted(by_iter)}


def _run_label(run: Path, cfg: dict) -> str:
    """What the run is, as its manifest names it (``run_label``, and its environment's name and
    version); older runs: the recipe, or the default loop."""
    try:
        manifest = json.loads((run / "manifest.json").read_text())
        label, env = manifest.get("run_label"), manifest.get("environment", {})
    except (OSError, ValueError, AttributeError):
        label, env = None, {}
    label = label or cfg.get("recipe") or "default (GRPO advantages, token-mean, no KL)"
    name = env.get("name") if isinstance(env, dict) else None
    return f"{label} · environment {name} v{env.get('version')}" if name else label


def write_page(html: str, out: str | os.PathLike) -> Path:
    """Write ``html`` to ``out`` atomically (temporary sibling file, then rename)."""
    return write_text_atomic(out, html)
