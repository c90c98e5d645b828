"""What an experiment's arms did, over their training seeds (issue 32): per-problem success
read from each run's final-evaluation episodes, then the statistics of ``evaluate.seeds``.

An experiment runs arms × training seeds, each an ordinary ``consequence train`` run folder,
all evaluated on the same episodes (the same ``--eval-seed``: the same task ids, the same
sample ids). For one (split, decoding) and one arm:

* per-problem success p_{s,j}: the share of problem j's episodes that succeeded in seed s's
  evaluation (success as ``evaluate.compare.summarize`` counts it: the environment ended the
  episode and the verifier's score is 1; env_error episodes are left out of the denominator);
* per-seed score x_s = (1/P_s)·Σ_j p_{s,j}: the mean over problems (each problem weighs the
  same, whatever its number of episodes);
* the arm's estimate: (1/S)·Σ_s x_s, with the two-level bootstrap CI (seeds, then problems
  within each: ``seeds.two_level_bootstrap``), the IQM of the x_s (``seeds.iqm``) and, for
  every ordered pair of arms (X, Y), the probability of improvement P(x_X > x_Y) + ½·P(=)
  over seed pairs (``seeds.probability_of_improvement``).

All scores are fractions in [0, 1]; the report shows them as percentages.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from consequence.evaluate import seeds
from consequence.evaluate.episode_eval import solved
from consequence.experiment.curves import plot_curves, plot_sweeps
from consequence.figures import pyplot, save_figure
from consequence.fileio import strict_json, write_text_atomic
from consequence.records import Trajectory, read_trajectories

POLICIES = ("rl", "warmstart")  # the trained policy, the starting policy: eval/{split}-{decoding}-{policy}.parquet
SUCCESS_DEFINITION = (
    "per-seed success = mean over problems of the problem's success (its solved episodes over its "
    "episodes without an environment error); the arm's estimate = mean over seeds"
)


def eval_file(run_dir: str | Path, split: str, decoding: str, policy: str) -> Path:
    """``<run_dir>/eval/{split}-{decoding}-{policy}.parquet``, the final evaluation's episodes.

    Raises:
        ValueError: ``policy`` is neither "rl" nor "warmstart".
    """
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: give one of {', '.join(POLICIES)}")
    return Path(run_dir) / "eval" / f"{split}-{decoding}-{policy}.parquet"


def _episodes(run_dir: str | Path, split: str, decoding: str, policy: str) -> list[Trajectory]:
    """The episodes of one evaluation file; a missing or unreadable file is named."""
    path = eval_file(run_dir, split, decoding, policy)
    if not path.is_file():
        raise ValueError(
            f"{path} is missing: the run has no final evaluation of split {split!r} with {decoding} decoding "
            "(a finished `consequence train` run with --final-eval-episodes > 0 and that split and decoding "
            "in --final-eval-splits / --final-eval-decoding writes it)"
        )
    try:
        return read_trajectories(path)
    except Exception as e:  # pyarrow's errors, a foreign schema: the file is named, not traced back
        raise ValueError(
            f"{path} is not a readable episode file ({str(e).splitlines()[0] if str(e) else e!r})"
        ) from None


def _problem_success(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """problem → share of its valid episodes solved; a problem whose every episode had an
    environment error has no success and is left out."""
    wins: dict[str, list[int]] = {}
    for t in trajs:
        if t.outcome != "env_error":
            wins.setdefault(t.task_id.split("#")[0], []).append(int(solved(t)))
    return {p: sum(w) / len(w) for p, w in sorted(wins.items())}


def per_problem_success(run_dir: str | Path, split: str, decoding: str, policy: str) -> dict[str, float]:
    """Problem → mean success over its episodes in ``eval/{split}-{decoding}-{policy}.parquet``.

    A problem is ``task_id.split("#")[0]`` (the instances of one problem count together).
    Success of an episode: ``evaluate.episode_eval.solved`` (the environment ended it and the
    verifier's score is 1), as ``evaluate.compare.summarize`` counts it; an env_error episode
    is left out of its problem's denominator, and a problem with only env_error episodes is
    left out of the result.

    Args:
        run_dir: a ``consequence train`` run folder.
        split: "test" or "train" (the file name's prefix).
        decoding: "sampled" or "greedy".
        policy: "rl" (the trained policy) or "warmstart" (the starting policy).

    Returns:
        problem → success in [0, 1], sorted by problem.

    Raises:
        ValueError: an unknown ``policy``; the file is missing or unreadable (it is named).
    """
    return _problem_success(_episodes(run_dir, split, decoding, policy))


def _evaluated_pairs(run_dir: Path) -> list[tuple[str, str]]:
    """(split, decoding) of every file the run's report.json lists, in its order."""
    report = run_dir / "report.json"
    if not report.is_file():
        raise ValueError(
            f"{report} is missing: {run_dir} has no final evaluation (is it a finished `consequence train` run?)"
        )
    try:
        files = json.loads(report.read_text(encoding="utf-8")).get("evaluation_files") or []
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{report} is not a JSON report (cut short?)") from None
    pairs: list[tuple[str, str]] = []
    for f in files:
        parts = Path(f).stem.rsplit("-", 2)  # eval/{split}-{decoding}-{policy}.parquet
        if len(parts) != 3:
            raise ValueError(f"{report} lists {f}, not an eval/SPLIT-DECODING-POLICY.parquet file")
        split, decoding = parts[0], parts[1]
        if (split, decoding) not in pairs:
            pairs.append((split, decoding))
    if not pairs:
        raise ValueError(f"{report} lists no evaluation file: the run skipped its final evaluation")
    return pairs


def _check_arms(arms: Mapping[str, Sequence[str | Path]], no_training: Collection[str]) -> None:
    if not arms:
        raise ValueError("no arm: give at least one arm name with its run folders")
    for name, runs in arms.items():
        if not runs:
            raise ValueError(f"arm {name!r} has no run folder: give one per training seed")
    unknown = sorted(set(no_training) - set(arms))
    if unknown:
        raise ValueError(f"no_training names {', '.join(unknown)}, which is not an arm of {', '.join(arms)}")


def _episode_ids(trajs: Iterable[Trajectory]) -> list[tuple[str, int]]:
    return sorted((t.task_id, t.sample_id) for t in trajs)


def aggregate(
    arms: Mapping[str, Sequence[str | Path]],
    splits: Sequence[str] | None = None,
    decodings: Sequence[str] | None = None,
    no_training: Collection[str] = frozenset(),
    confidence: float = 0.95,
    n_boot: int = 10_000,
    seed: int = 0,
) -> dict[str, Any]:
    """Each arm's success over its training seeds, per (split, decoding), and every ordered
    pair's probability of improvement.

    For each arm and each (split, decoding): the per-seed scores x_s (the mean over problems of
    :func:`per_problem_success`, a fraction in [0, 1]), ``mean`` = (1/S)·Σ_s x_s with its
    two-level bootstrap percentile CI ``low``/``high`` (``seeds.two_level_bootstrap``: resample
    seeds, then problems within each), ``iqm`` (``seeds.iqm`` of the x_s), ``n_seeds`` (S),
    ``n_problems`` (distinct problems evaluated), ``n_episodes`` (episodes per seed, env errors
    included) and ``env_errors`` (over all seeds). ``probability_of_improvement[X][Y]`` is
    P(x_X > x_Y) + ½·P(x_X = x_Y) over the S_X·S_Y pairs of seeds, for X ≠ Y.

    Args:
        arms: arm name → its run folders, one per training seed.
        splits: the splits to read ("test", "train"); None: those of the first run's report.json.
        decodings: "sampled" / "greedy"; None: those of the first run's report.json.
        no_training: arms that stand for the starting policy: each of their runs is read from
            its "warmstart" files instead of its "rl" files.
        confidence: of the bootstrap interval (0.95: a 95 % interval).
        n_boot: bootstrap resamples.
        seed: of the bootstrap generator (the interval is deterministic in it).

    Returns:
        a JSON-ready dict: ``arms`` (name → runs and the policy read), ``results`` (one entry per
        (split, decoding), with ``arms`` and ``probability_of_improvement``), and the settings.

    Raises:
        ValueError: no arm, an arm without runs, a ``no_training`` name that is no arm; a run
            without report.json or a missing or unreadable evaluation file (named); runs not
            evaluated on the same episodes (same task ids and sample ids; both runs are named);
            a run whose every episode had an environment error.
    """
    _check_arms(arms, no_training)
    first = Path(next(iter(arms.values()))[0])
    pairs = _evaluated_pairs(first) if splits is None or decodings is None else []
    split_list = list(splits) if splits is not None else list(dict.fromkeys(s for s, _ in pairs))
    decoding_list = list(decodings) if decodings is not None else list(dict.fromkeys(d for _, d in pairs))
    policy = {name: "warmstart" if name in no_training else "rl" for name in arms}
    results = [
        _aggregate_one(arms, policy, split, decoding, confidence, n_boot, seed)
        for split in split_list
        for decoding in decoding_list
    ]
    return {
        "definition": SUCCESS_DEFINITION,
        "confidence": confidence,
        "n_boot": n_boot,
        "bootstrap_seed": seed,
        "arms": {name: {"runs": [str(r) for r in runs], "policy": policy[name]} for name, runs in arms.items()},
        "results": results,
    }


def _aggregate_one(
    arms: Mapping[str, Sequence[str | Path]],
    policy: Mapping[str, str],
    split: str,
    decoding: str,
    confidence: float,
    n_boot: int,
    seed: int,
) -> dict[str, Any]:
    """One (split, decoding): every arm's statistics and the probability-of-improvement matrix."""
    reference: tuple[Path, list[tuple[str, int]]] | None = None
    out: dict[str, Any] = {}
    for name, runs in arms.items():
        tables: list[dict[str, float]] = []
        n_episodes, env_errors = 0, 0
        for run in map(Path, runs):
            trajs = _episodes(run, split, decoding, policy[name])
            ids = _episode_ids(trajs)
            if reference is None:
                reference = (run, ids)
            elif ids != reference[1]:
                raise ValueError(
                    f"runs {reference[0]} and {run} were not evaluated on the same episodes ({split}, {decoding}: "
                    "the task ids or sample ids differ), so their success is not comparable: give every run of "
                    "the experiment the same --eval-seed, --final-eval-episodes and task set"
                )
            table = _problem_success(trajs)
            if not table:
                raise ValueError(f"{eval_file(run, split, decoding, policy[name])}: every episode had an env_error")
            tables.append(table)
            n_episodes = len(trajs)
            env_errors += sum(t.outcome == "env_error" for t in trajs)
        out[name] = _arm_stats(
            tables, n_episodes, env_errors, reference[1] if reference else [], confidence, n_boot, seed
        )
        out[name]["policy"] = policy[name]
    poi = {
        x: {y: seeds.probability_of_improvement(out[x]["per_seed"], out[y]["per_seed"]) for y in out if y != x}
        for x in out
    }
    starts = [n for n in out if policy[n] == "warmstart"]
    for name in (n for n in out if policy[n] != "warmstart"):
        out[name]["vs"] = {
            b: paired_difference(out[name]["per_problem"], out[b]["per_problem"], confidence, n_boot, seed)
            for b in starts
        }
    trained = [n for n in out if policy[n] != "warmstart"]
    between: dict[str, dict[str, dict[str, Any]]] = {x: {} for x in trained}
    for i, x in enumerate(trained):  # one bootstrap per pair; y − x is its mirror, so the matrix is antisymmetric
        for y in trained[i + 1 :]:
            d = arm_difference(out[x]["per_problem"], out[y]["per_problem"], confidence, n_boot, seed)
            between[x][y] = d
            between[y][x] = {**d, "mean": -d["mean"], "low": -d["high"], "high": -d["low"]}
    return {
        "split": split,
        "decoding": decoding,
        "arms": out,
        "probability_of_improvement": poi,
        "differences_between_arms": between,
    }


def arm_difference(
    tables: Sequence[Mapping[str, float]],
    other: Sequence[Mapping[str, float]],
    confidence: float = 0.95,
    n_boot: int = 10_000,
    seed: int = 0,
) -> dict[str, Any]:
    """Arm − other arm, each with its own training seeds, on the problems every seed of both
    scored (``seeds.arm_difference``: problems resampled once for both, seeds per arm); the
    difference of the mean success, a fraction, with its CI and the number of problems.

    Raises:
        ValueError: no problem scored by every seed of both arms.
    """
    common = sorted(set.intersection(*(set(t) for t in [*tables, *other])))
    if not common:
        raise ValueError("no problem scored by every seed of both arms")
    rows = [[t[p] for p in common] for t in tables]
    rows_other = [[t[p] for p in common] for t in other]
    mean, low, high = seeds.arm_difference(rows, rows_other, confidence=confidence, n_boot=n_boot, seed=seed)
    return {"mean": mean, "low": low, "high": high, "n_problems": len(common)}


def paired_difference(
    tables: Sequence[Mapping[str, float]],
    baseline: Sequence[Mapping[str, float]],
    confidence: float = 0.95,
    n_boot: int = 10_000,
    seed: int = 0,
) -> dict[str, Any]:
    """Arm − baseline on the same episodes: per seed i, the per-problem differences
    ``tables[i][p] − baseline[i][p]`` over the problems both scored; their mean over problems,
    then over seeds, with the two-level bootstrap CI of those difference tables (seeds, then
    problems). Pairing by problem removes the problems' own spread, which separate CIs keep.

    Raises:
        ValueError: different numbers of seeds, or a seed with no problem in common.
    """
    if len(tables) != len(baseline):
        raise ValueError(f"{len(tables)} seeds against a baseline of {len(baseline)}")
    diffs = []
    for i, (a, b) in enumerate(zip(tables, baseline)):
        common = [p for p in a if p in b]
        if not common:
            raise ValueError(f"seed {i}: no problem scored by both")
        diffs.append([a[p] - b[p] for p in common])
    mean, low, high = seeds.two_level_bootstrap(diffs, confidence=confidence, n_boot=n_boot, seed=seed)
    return {"mean": mean, "low": low, "high": high, "per_seed": [sum(d) / len(d) for d in diffs]}


PROFILE_THRESHOLDS = [round(0.05 * k, 2) for k in range(21)]


def _arm_stats(
    tables: list[dict[str, float]],
    n_episodes: int,
    env_errors: int,
    ids: list[tuple[str, int]],
    confidence: float,
    n_boot: int,
    seed: int,
) -> dict[str, Any]:
    """The statistics of one arm from its per-seed problem → success tables."""
    rows = [list(t.values()) for t in tables]
    per_seed = [sum(r) / len(r) for r in rows]
    mean, low, high = seeds.two_level_bootstrap(rows, confidence=confidence, n_boot=n_boot, seed=seed)
    return {
        "mean": mean,
        "low": low,
        "high": high,
        "iqm": seeds.iqm(per_seed),
        "per_seed": per_seed,
        # the share of seeds whose success exceeds τ, for τ = 0, 0.05, …, 1 (a run-score distribution)
        "performance_profile": {
            "thresholds": PROFILE_THRESHOLDS,
            "share_above": seeds.performance_profile(per_seed, PROFILE_THRESHOLDS),
        },
        "n_seeds": len(tables),
        "n_problems": len({task.split("#")[0] for task, _ in ids}),
        "n_episodes": n_episodes,
        "env_errors": env_errors,
        "per_problem": tables,
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _markdown(
    result: Mapping[str, Any],
    spent: Mapping[str, list[dict[str, Any]]] | None,
    swept: Mapping[str, Any] | None = None,
    figures: Sequence[str] = (),
) -> str:
    """The readable report: one table per (split, decoding), its probability-of-improvement
    matrix, the sweeps' tables, what each arm spent, and the figures."""
    conf = f"{100 * result['confidence']:g} %"
    lines = [
        "# Experiment: success over training seeds",
        "",
        f"Success is a percentage: {result['definition']}. CI: {conf} two-level bootstrap (seeds, then "
        f"problems within each; {result['n_boot']} resamples, seed {result['bootstrap_seed']}). IQM: "
        "interquartile mean of the per-seed scores. Every number is over the training seeds in its row.",
        "",
        "| arm | policy | runs |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {a['policy']} | {', '.join(a['runs'])} |" for n, a in result["arms"].items()]
    for res in result["results"]:
        lines += [
            "",
            f"## {res['split']}, {res['decoding']}",
            "",
            f"| arm | mean success % | {conf} CI (two-level) | IQM % | seeds | problems | episodes per seed |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, a in res["arms"].items():
            lines.append(
                f"| {name} | {_pct(a['mean'])} ({a['n_seeds']} seeds) | [{_pct(a['low'])}, {_pct(a['high'])}] | "
                f"{_pct(a['iqm'])} | {a['n_seeds']} | {a['n_problems']} | {a['n_episodes']} |"
            )
        lines += _difference_lines(res, conf)
        lines += _between_lines(res, conf)
        lines += _poi_lines(res)
    lines += _sweep_lines(result, swept or {}, conf)
    if spent:
        lines += _spent_lines(spent)
    if figures:
        lines += ["", "## Figures", ""] + [f"![{name}]({name})" for name in figures]
    return "\n".join(lines) + "\n"


def _sweep_lines(result: Mapping[str, Any], swept: Mapping[str, Any], conf: str) -> list[str]:
    """Per swept setting: its value, the arm, and each (split, decoding)'s mean with its CI."""
    lines: list[str] = []
    for key, sw in swept.items():
        heads = [f"{r['split']}, {r['decoding']}: mean % [{conf} CI]" for r in result["results"]]
        lines += ["", f"## Success against {key}", "", f"| {key} | arm | " + " | ".join(heads) + " |"]
        lines.append("|---|---|" + "---|" * len(heads))
        for value, arm in sorted((v, a) for a, v in sw["arms"].items()):
            cells = [
                f"{_pct(r['arms'][arm]['mean'])} ({r['arms'][arm]['n_seeds']} seeds) "
                f"[{_pct(r['arms'][arm]['low'])}, {_pct(r['arms'][arm]['high'])}]"
                if arm in r["arms"]
                else "—"
                for r in result["results"]
            ]
            lines.append(f"| {value:g} | {arm} | " + " | ".join(cells) + " |")
    return lines


def _difference_lines(res: Mapping[str, Any], conf: str) -> list[str]:
    """Each trained arm minus each no-training arm, paired by problem on the same episodes."""
    rows = [(n, b, d) for n, a in res["arms"].items() for b, d in a.get("vs", {}).items()]
    if not rows:
        return []
    lines = [
        "",
        f"Difference to the starting policy, paired by problem on the same episodes ({conf} two-level CI):",
        "",
        "| arm | minus | difference (pts) | CI | per seed (pts) |",
        "|---|---|---|---|---|",
    ]
    for name, base, d in rows:
        per_seed = ", ".join(f"{100 * x:+.1f}" for x in d["per_seed"])
        lines.append(
            f"| {name} | {base} | {100 * d['mean']:+.1f} ({len(d['per_seed'])} seeds) | "
            f"[{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] | {per_seed} |"
        )
    return lines


def _between_lines(res: Mapping[str, Any], conf: str) -> list[str]:
    """Every pair of trained arms: row − column in points, the CI, and which pairs' CI excludes 0."""
    between = res.get("differences_between_arms") or {}
    names = list(between)
    if len(names) < 2:
        return []
    seeds_of = {n: res["arms"][n]["n_seeds"] for n in names}
    lines = [
        "",
        f"Differences between trained arms, row − column in points ({conf} CI of the crossed bootstrap: the "
        "problems resampled once for both arms, each arm's seeds on their own; * where the CI excludes 0):",
        "",
        "| row − column | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for x in names:
        cells = []
        for y in names:
            if y == x:
                cells.append("—")
                continue
            d = between[x][y]
            mark = "*" if d["low"] > 0 or d["high"] < 0 else ""
            cells.append(f"{100 * d['mean']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]{mark}")
        lines.append(f"| {x} ({seeds_of[x]} seeds) | " + " | ".join(cells) + " |")
    survive = [
        f"{x} − {y}: {100 * d['mean']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] pts "
        f"({seeds_of[x]} and {seeds_of[y]} seeds)"
        for i, x in enumerate(names)
        for y in names[i + 1 :]
        if (d := between[x][y])["low"] > 0 or d["high"] < 0
    ]
    lines += ["", "Differences whose CI excludes 0: " + ("; ".join(survive) if survive else "none") + "."]
    return lines


def _poi_lines(res: Mapping[str, Any]) -> list[str]:
    names = list(res["arms"])
    if len(names) < 2:
        return []
    lines = [
        "",
        "Probability of improvement P(row > column) + ½·P(row = column) over pairs of per-seed scores "
        "(row seeds × column seeds):",
        "",
        "| row \\ column | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for x in names:
        cells = [
            "—"
            if y == x
            else f"{res['probability_of_improvement'][x][y]:.3f} "
            f"({res['arms'][x]['n_seeds']}×{res['arms'][y]['n_seeds']} seeds)"
            for y in names
        ]
        lines.append(f"| {x} | " + " | ".join(cells) + " |")
    return lines


def _line_dict(x: Any) -> dict[str, Any]:
    """A budget line (``experiment.budget.BudgetLine`` or its dict) as a plain dict."""
    if isinstance(x, Mapping):
        return {k: x[k] for k in ("quantity", "formula", "value", "unit") if k in x}
    return {"quantity": x.quantity, "formula": x.formula, "value": x.value, "unit": x.unit}


def _spent_table(spent: Mapping[str, Sequence[Any]]) -> dict[str, list[dict[str, Any]]]:
    """arm → per quantity: the mean per seed, the total over seeds and the seeds that report it.

    ``spent[arm]`` holds one list of budget lines per run (``budget.read_spent(run)[1]``); a flat
    list of lines is one run's."""
    out: dict[str, list[dict[str, Any]]] = {}
    for arm, runs in spent.items():
        per_run = [runs] if runs and not isinstance(runs[0], (list, tuple)) else list(runs)
        rows: dict[str, dict[str, Any]] = {}
        for lines in per_run:
            for line in map(_line_dict, lines):
                row = rows.setdefault(
                    line["quantity"], {"quantity": line["quantity"], "unit": line["unit"], "values": []}
                )
                row["values"].append(line["value"])
        for row in rows.values():
            row["n_seeds"] = len(row["values"])
            row["mean_per_seed"] = sum(row["values"]) / len(row["values"])
            row["total"] = None if row["unit"] in _RATIOS else sum(row["values"])  # a ratio has no total
        out[arm] = list(rows.values())
    return out


_RATIOS = ("fraction", "tokens per trajectory")


def _spent_lines(table: Mapping[str, list[dict[str, Any]]]) -> list[str]:
    lines = [
        "",
        "## Spent",
        "",
        "Per arm, each quantity's mean per training seed and total over its seeds (a ratio has no total).",
        "",
        "| arm | quantity | unit | mean per seed | total | seeds |",
        "|---|---|---|---|---|---|",
    ]
    for arm, rows in table.items():
        for r in rows:
            total = "—" if r["total"] is None else f"{r['total']:,.6g}"
            lines.append(
                f"| {arm} | {r['quantity']} | {r['unit']} | {r['mean_per_seed']:,.6g} | {total} | {r['n_seeds']} |"
            )
    return lines


def _plot(result: Mapping[str, Any], out_dir: Path) -> Path:
    """One panel per (split, decoding): each arm's mean with its CI bar, its per-seed dots beside it."""
    plt = pyplot()
    panels = result["results"]
    most = max((len(res["arms"]) for res in panels), default=1)
    width = max(3.6, 0.75 * most + 1.0)  # inches per panel: ten arms' labels must not overlap
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(width * max(1, len(panels)), 4.2), squeeze=False)
    for ax, res in zip(axes[0], panels):
        names = list(res["arms"])
        for i, name in enumerate(names):
            a = res["arms"][name]
            ax.errorbar(
                [i],
                [a["mean"]],
                yerr=[[a["mean"] - a["low"]], [a["high"] - a["mean"]]],
                fmt="o",
                capsize=4,
                color="C0",
            )
            ax.plot([i + 0.2] * a["n_seeds"], a["per_seed"], ".", color="C1", alpha=0.8)
        ax.set_xticks(range(len(names)), [f"{n}\n({res['arms'][n]['n_seeds']} seeds)" for n in names])
        if len(names) > 3:
            ax.tick_params(axis="x", labelrotation=35, labelsize=8)
            for label in ax.get_xticklabels():
                label.set_horizontalalignment("right")
        ax.set_xlim(-0.5, len(names) - 0.3)
        ax.set_ylim(-0.03, 1.03)  # a seed at 0 or 1 stays inside the frame
        ax.set_ylabel("success (mean over problems)")
        ax.set_title(f"{res['split']}, {res['decoding']}")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"mean ± {100 * result['confidence']:g} % two-level CI; dots: seeds")
    return save_figure(fig, out_dir, "experiment")


def write_report(
    out_dir: str | Path,
    result: Mapping[str, Any],
    spent: Mapping[str, list] | None = None,
    curves: Mapping[str, Any] | None = None,
    swept: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write ``experiment.json`` (``result`` whole, exact numbers; with ``spent``, its table under
    "spent"), ``experiment.md`` (per (split, decoding): arm, mean success %, the two-level CI,
    IQM, seeds, problems, episodes; the probability-of-improvement matrix; what each arm spent)
    and ``experiment.png`` (per (split, decoding): each arm's mean with its CI bar and per-seed
    dots), each atomically.

    Args:
        out_dir: the folder to write into (created).
        result: what :func:`aggregate` returned.
        spent: arm → one list of budget lines per run (``experiment.budget.read_spent(run)[1]``,
            ``BudgetLine`` or its dict); the report gives each quantity's mean per seed and total.
        curves: ``experiment.curves.learning_curves`` of the trained arms: drawn into
            ``experiment_curves.png`` and kept in the json under "curves".
        swept: ``experiment.curves.sweeps``: success against each swept setting, drawn into
            ``experiment_scale.png``, tabled in the markdown, kept in the json under "sweeps".

    Returns:
        the paths written: json, md, png, then the curves' and sweeps' png when drawn.

    Raises:
        OSError: a write failed (no half-written file stays behind).
    """
    out = Path(out_dir)
    table = _spent_table(spent) if spent else None
    data = {**result, "spent": table} if table else dict(result)
    data |= {"curves": dict(curves or {}), "sweeps": dict(swept or {})}
    figures = [_plot(result, out), plot_curves(curves or {}, out), plot_sweeps(result, swept or {}, out)]
    drawn = [f for f in figures if f is not None]
    paths = [
        write_text_atomic(out / "experiment.json", strict_json(data, indent=2) + "\n"),
        write_text_atomic(out / "experiment.md", _markdown(result, table, swept or {}, [f.name for f in drawn])),
    ]
    return [*paths, *drawn]
