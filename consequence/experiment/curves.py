"""What an experiment's runs did over training, and how success moves along a swept setting.

Two views beside the final table (``experiment.aggregate``):

- **learning curves**: per arm, each metric of ``metrics.jsonl`` named in :data:`CURVE_METRICS`
  against the training episodes spent so far (K·B·G after K iterations, the unit the
  experiment equalises), the mean over the arm's training seeds with a Student-t 95 % band
  over seeds (mean ± t₀.₉₇₅,S−1 · sd / √S: the seeds are the independent replicates here; the
  problems differ between seeds' iterations, so no problem-level term exists to add). One seed
  draws a line without a band.
- **scale sweeps**: a setting of :data:`SWEEP_KEYS` that takes two or more values among trained
  arms whose other settings (recipe and everything else but the swept keys) agree, e.g. arms
  ``{train_problems: 16}``, ``{train_problems: 64}`` and ``{}`` (all problems) of one recipe;
  their final success (the aggregate's two-level CI) is drawn against the setting's value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from consequence.figures import pyplot, save_figure

CURVE_METRICS: tuple[tuple[str, str], ...] = (
    ("success", "training success (the iteration's rollouts)"),
    ("val_success", "validation success"),
)
SWEEP_KEYS: tuple[str, ...] = (
    "train_problems",
    "group_size",
    "tasks_per_iteration",
    "iterations",
    "max_turns",
    "max_total_tokens",
)
# Settings that differ between runs of one arm or name the run, never an arm's treatment.
_PER_RUN = frozenset({"seed", "run_dir", "eval_seed", "report_to"})


def t_band(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None, float | None]:
    """``(mean, low, high)`` of per-seed ``values``: the mean ± the Student-t half-width
    t_{(1+confidence)/2, S−1} · s / √S (s the sample standard deviation, S = len(values));
    ``low``/``high`` are None for one value (no spread to estimate).

    Raises:
        ValueError: no values.
    """
    from scipy import stats

    if not values:
        raise ValueError("t_band needs at least one value")
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return mean, None, None
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _metric_series(run: Path, key: str) -> dict[int, float]:
    """iteration → the value of ``key`` in ``run``/metrics.jsonl (iterations without it left out)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            m = json.loads(line)
            v = m.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                out[int(m["iteration"])] = float(v)
    return out


def learning_curves(
    arms: Mapping[str, Sequence[Path]], episodes_per_iteration: Mapping[str, int]
) -> dict[str, dict[str, Any]]:
    """Per arm and metric of :data:`CURVE_METRICS`: ``episodes`` (training episodes after each
    iteration with data: (k + 1)·B·G), ``mean``, ``low``, ``high`` (:func:`t_band` over the
    seeds that logged the metric at that iteration) and ``n_seeds`` per point. Metrics no run
    of the arm logged are left out (a fixed-data SFT batch logs no policy success).

    Args:
        arms: trained arm → its run folders, one per training seed.
        episodes_per_iteration: arm → B·G of its runs.
    """
    out: dict[str, dict[str, Any]] = {}
    for arm, runs in arms.items():
        per_metric = {}
        for key, _ in CURVE_METRICS:
            series = [_metric_series(Path(r), key) for r in runs]
            its = sorted({i for s in series for i in s})
            if not its:
                continue
            bands = [t_band([s[i] for s in series if i in s]) for i in its]
            per_metric[key] = {
                "episodes": [(i + 1) * episodes_per_iteration[arm] for i in its],
                "mean": [b[0] for b in bands],
                "low": [b[1] for b in bands],
                "high": [b[2] for b in bands],
                "n_seeds": [sum(i in s for s in series) for i in its],
            }
        out[arm] = per_metric
    return out


def sweeps(settings: Mapping[str, Mapping[str, Any]], value_of: Callable[[str, str], float]) -> dict[str, Any]:
    """The swept settings among trained arms: ``{key: {"arms": {arm: value}}}`` for every key of
    :data:`SWEEP_KEYS` that takes two or more distinct values among arms whose settings agree
    once the swept keys (and per-run ones) are removed.

    Args:
        settings: trained arm → its resolved settings (one run's, a flat dict).
        value_of: ``(arm, key)`` → the value the run really used (e.g. the size of the whole
            train split when ``train_problems`` is unset).
    """
    families: dict[str, list[str]] = {}
    for arm, s in settings.items():
        rest = {k: v for k, v in s.items() if k not in SWEEP_KEYS and k not in _PER_RUN}
        families.setdefault(json.dumps(rest, sort_keys=True, default=str), []).append(arm)
    out: dict[str, Any] = {}
    for members in families.values():
        if len(members) < 2:
            continue
        for key in SWEEP_KEYS:
            values = {arm: value_of(arm, key) for arm in members}
            if len(set(values.values())) >= 2:
                out.setdefault(key, {"arms": {}})["arms"].update(values)
    return out


def plot_curves(curves: Mapping[str, Mapping[str, Any]], out_dir: Path) -> Path | None:
    """``experiment_curves.png``: one panel per metric, each arm's mean over seeds against
    training episodes with its t band; None when no arm logged any curve metric."""
    keys = [(k, label) for k, label in CURVE_METRICS if any(k in c for c in curves.values())]
    if not keys:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 3.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], keys):
        for n, (arm, c) in enumerate(curves.items()):
            if key not in c:
                continue
            d = c[key]
            ax.plot(
                d["episodes"], d["mean"], "-o", ms=3, color=f"C{n % 10}", label=f"{arm} ({max(d['n_seeds'])} seeds)"
            )
            # a success share lies in [0, 1]: the band is drawn inside it (the json keeps the t values)
            band = [
                (x, max(lo, 0.0), min(hi, 1.0))
                for x, lo, hi in zip(d["episodes"], d["low"], d["high"])
                if lo is not None
            ]
            if band:
                xs, lo, hi = zip(*band)
                ax.fill_between(xs, lo, hi, color=f"C{n % 10}", alpha=0.12, linewidth=0)
        ax.set_xlabel("training episodes (K·B·G)")
        ax.set_ylabel(label)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("mean over training seeds; band: Student-t 95 % over seeds")
    return save_figure(fig, out_dir, "experiment_curves")


def plot_sweeps(result: Mapping[str, Any], swept: Mapping[str, Any], out_dir: Path) -> Path | None:
    """``experiment_scale.png``: per swept key (rows) and (split, decoding) of the final
    evaluation (columns), each arm's mean success with its two-level CI against the key's
    value, its seeds as dots, a no-training arm's mean as a dashed line; a log x axis when the
    values span 8× or more; None without a sweep."""
    if not swept:
        return None
    no_training = {n for n, a in result["arms"].items() if a.get("policy") == "warmstart"}
    plt = pyplot()
    panels = result["results"]
    fig, axes = plt.subplots(
        len(swept), len(panels), figsize=(max(6.5, 4.4 * len(panels)), 3.6 * len(swept)), squeeze=False
    )
    for row, (key, sw) in zip(axes, swept.items()):
        for ax, res in zip(row, panels):
            pts = sorted((v, arm) for arm, v in sw["arms"].items() if arm in res["arms"])
            for v, arm in pts:
                a = res["arms"][arm]
                ax.errorbar(
                    [v],
                    [a["mean"]],
                    yerr=[[a["mean"] - a["low"]], [a["high"] - a["mean"]]],
                    fmt="o",
                    capsize=4,
                    color="C0",
                )
                ax.plot([v] * a["n_seeds"], a["per_seed"], ".", color="C1", alpha=0.8)
            ax.plot([v for v, _ in pts], [res["arms"][a]["mean"] for _, a in pts], "-", color="C0", alpha=0.5)
            for k, (name, a) in enumerate((n, a) for n, a in res["arms"].items() if n in no_training):
                ax.axhline(a["mean"], ls="--", color=f"C{2 + k}", lw=1, label=f"{name} (no training)")
            if any(n in no_training for n in res["arms"]):
                ax.legend(fontsize=7)
            values = [v for v, _ in pts]
            if values and min(values) > 0 and max(values) / min(values) >= 8:
                ax.set_xscale("log")
            ax.set_xlabel(key)
            ax.set_ylabel("success (mean over problems)")
            ax.set_ylim(-0.03, 1.03)
            ax.set_title(f"{res['split']}, {res['decoding']}")
            ax.grid(alpha=0.3)
    fig.suptitle(f"mean ± {100 * result['confidence']:g} % two-level CI (seeds, then problems); dots: seeds")
    return save_figure(fig, out_dir, "experiment_scale")


def report_views(exp: Any, trained: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(learning curves, sweeps)`` of the ``trained`` arms of the experiment ``exp`` (an
    ``experiment.spec.Experiment``), from their run folders and resolved settings; an unset
    ``train_problems`` counts the whole train split of the arm's environment.

    Raises:
        ValueError: an arm's settings are refused, or its environment cannot be loaded.
    """
    from consequence.envs.registry import env_of
    from consequence.experiment.run import run_config

    cfgs = {a.name: run_config(exp, a, exp.seeds[0]) for a in trained}
    runs = {a.name: [exp.run_dir(a.name, s) for s in exp.seeds] for a in trained}
    curves = learning_curves(runs, {n: c.tasks_per_iteration * c.group_size for n, c in cfgs.items()})

    def value_of(arm: str, key: str) -> float:
        cfg = cfgs[arm]
        if key == "train_problems" and not cfg.train_problems:
            return len(env_of(cfg).split["train"])
        return getattr(cfg, key)

    return curves, sweeps({n: c.model_dump() for n, c in cfgs.items()}, value_of)
