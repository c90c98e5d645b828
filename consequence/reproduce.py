"""``consequence reproduce RUN_DIR``: run a training job again from its manifest.

The new run uses the manifest's config (every box, seeds, budgets) in a new folder; it may
be shortened (``iterations``, ``final_eval_episodes``), and then only the iterations both
runs have are compared. Everything is checked (manifest, model, task file, the new folder)
before the new folder is made. Before it starts, what could make it differ is listed:
another git commit, other library versions, other model weights. After it ends, the
per-iteration metrics of both runs are compared; on CPU with the same seeds they match to
float precision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from consequence.config import MODEL_NAMES, TrainConfig, is_hub_id, saved_settings
from consequence.report.manifest import git_commit, library_versions, read_manifest, sha256_of

COMPARED = ("reward_mean", "success", "loss", "grad_norm", "entropy", "gen_tokens_mean")


def drift(manifest: dict[str, Any]) -> list[str]:
    """What differs between the recorded run's software and model and this machine's."""
    out = []
    then, now = manifest.get("git", {}), git_commit()
    if then.get("commit") != now.get("commit"):
        out.append(f"git commit {then.get('commit')} then, {now.get('commit')} now")
    libs = library_versions()
    for name, version in manifest.get("libraries", {}).items():
        if libs.get(name) != version:
            out.append(f"{name} {version} then, {libs.get(name)} now")
    model = manifest.get("model", {})
    if model.get("path") and sha256_of(Path(model["path"]) / "model.safetensors") != model.get("weights_sha256"):
        out.append(f"model weights at {model['path']} changed since the run (sha256 differs)")
    if model.get("source"):  # a registered model name: the package file it was converted from
        from consequence.policy.named import source_changes

        out += source_changes(model["source"])
    tasks = manifest.get("tasks", {})
    if tasks.get("file_sha256") and sha256_of(Path(tasks["source"])) != tasks["file_sha256"]:
        out.append(f"task file {tasks['source']} changed since the run (sha256 differs)")
    out += _environment_drift(manifest.get("environment", {}))
    return out


def _environment_drift(env: dict) -> list[str]:
    """The environment's version or source hash now, against the recorded ones."""
    if not env.get("class"):
        return []
    from consequence.envs.api import source_sha256
    from consequence.envs.registry import resolve

    try:
        cls = resolve(env["class"])
    except ValueError as e:
        return [f"environment {env.get('name')}: {e}"]
    out = []
    if str(getattr(cls, "version", None)) != str(env.get("version")):
        out.append(
            f"environment {env.get('name')} version {env.get('version')} then, {getattr(cls, 'version', None)} now"
        )
    if env.get("source_sha256") and source_sha256(cls) != env["source_sha256"]:
        out.append(f"environment {env.get('name')}: its source changed since the run (sha256 differs)")
    return out


def reproduce_config(
    run_dir: Path, new_dir: Path | None = None, overrides: dict[str, Any] | None = None
) -> TrainConfig:
    """The recorded config with ``run_dir`` set to the new folder (default RUN_DIR-reproduce)
    and ``overrides`` (``iterations``, ``final_eval_episodes``) applied.

    Paths recorded relative by older versions are taken relative to the folder the run was
    started from (``cwd`` in the manifest) when it is recorded.

    Raises:
        ValueError: no manifest or no recorded config, the new folder is the old one, an
            unknown override, or a recorded path (model, task file) that does not exist.
    """
    manifest = read_manifest(run_dir)
    if not isinstance(manifest.get("config"), dict):
        raise ValueError(f"{run_dir}/manifest.json has no config; it is not a manifest of `consequence train`")
    bad = set(overrides or {}) - {"iterations", "final_eval_episodes"}
    if bad:
        raise ValueError(f"reproduce can only shorten a run (iterations, final_eval_episodes), not set {sorted(bad)}")
    new = Path(new_dir) if new_dir else Path(f"{str(run_dir).rstrip('/')}-reproduce")
    if new.resolve() == Path(run_dir).resolve():
        raise ValueError("the reproduction needs its own folder; pass --run-dir with a new path")
    config = saved_settings(dict(manifest["config"]))
    cwd = manifest.get("cwd")
    for key, what in (("model", "model folder"), ("tasks", "task file")):
        value = config.get(key)
        if (
            not value
            or (key == "tasks" and not str(value).endswith(".jsonl"))
            or (key == "model" and value in MODEL_NAMES)
        ):
            continue
        recorded = manifest.get("model", {}).get("path")
        if key == "model" and is_hub_id(value) and recorded and Path(recorded) != Path(cwd or "") / value:
            continue  # a hub id the run fetched (its snapshot is elsewhere): fetched, or refused offline, again
        p = Path(value)
        if not p.is_absolute() and cwd:
            p = Path(cwd) / p
        if not p.exists():
            raise ValueError(
                f"the run's {what} {value} (--{key}) does not exist"
                + (
                    ""
                    if Path(value).is_absolute()
                    else " from here: the run recorded a relative path; "
                    "run `consequence reproduce` from the folder the run was started in"
                )
                + "; nothing was started"
            )
        config[key] = str(p)
    return TrainConfig.checked(**{**config, **(overrides or {}), "run_dir": str(new)})


def compare_metrics(a: Path, b: Path) -> list[dict[str, Any]]:
    """Per-iteration metrics of two runs side by side, with the largest absolute difference."""
    ma = [json.loads(x) for x in (Path(a) / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (Path(b) / "metrics.jsonl").read_text().splitlines()]
    rows = []
    for x, y in zip(ma, mb):  # only the iterations both runs have
        diffs = {
            k: abs(x[k] - y[k])
            for k in COMPARED
            if isinstance(x.get(k), float | int) and isinstance(y.get(k), float | int)
        }
        rows.append(
            {
                "iteration": x["iteration"],
                "reward_then": x["reward_mean"],
                "reward_now": y["reward_mean"],
                "max_abs_diff": max(diffs.values(), default=0.0),
            }
        )
    return rows
