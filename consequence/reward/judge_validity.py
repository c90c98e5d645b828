"""Can a judge be trusted? Its agreement with a verifier's labels, its position and length biases (reward box).

``consequence judge-check`` runs these on episodes a verifier labelled (a run's
trajectories: an episode is a pass when :func:`consequence.records.verified` holds, else a
fail; env errors and episodes without a reply carry no label), before anyone trains on the
judge. Every number comes with the count of items behind it (``n``); a number no item
measured is None, never 0.

- **Agreement** (pointwise prompt, :func:`consequence.reward.judge.pointwise_messages`): the
  judge passes an episode when score / 10 ≥ ``threshold``. ``agreement_accuracy`` is the share
  of judged items where that equals the label; ``cohen_kappa`` = (p_o − p_e) / (1 − p_e), p_e
  = p_judge(pass)·p_label(pass) + p_judge(fail)·p_label(fail) (Cohen 1960; None when p_e = 1).
- **Position bias** (Zheng et al. 2023 §3.3; pairwise prompt, :func:`consequence.reward.judge.pairwise_messages`):
  each (verified, failed) pair of one group (:func:`consequence.reward.preferences.preference_pairs`)
  is shown as A/B and again as B/A. ``position_flip_rate``: share of pairs, both orders
  parsed, whose preferred episode changes with the order (an unbiased judge: 0);
  ``first_position_share``: share of decisions for the response shown first (unbiased: ½);
  ``pairwise_accuracy``: share of decisions for the verified episode.
- **Length bias** (Zheng et al. 2023 §3.3, "verbosity"), the length being the characters of the
  response the judge sees: ``length_score_pearson``, Pearson's r of score and length over the
  judged items, and the same within the passed and within the failed items
  (``..._passed``, ``..._failed``: length against score with correctness held fixed);
  ``accuracy_shorter_half`` / ``accuracy_longer_half``: agreement on the judged items sorted by
  length (ties by position in the data) and cut in two, the shorter ⌈n/2⌉ first;
  ``longer_preferred_share``: share of pairwise decisions between responses of different
  lengths that chose the longer one.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from consequence.records import Trajectory, verified
from consequence.reward.judge import (
    SCORE_HIGH,
    Judge,
    Verdict,
    episode_parts,
    pairwise_messages,
    parse_choice,
    parse_score,
    pointwise_messages,
)
from consequence.reward.preferences import preference_pairs

__all__ = ["cohen_kappa", "judge_validity", "pearson"]


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson's r of paired samples; None with fewer than 2 pairs or a constant side."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = math.fsum((x - mx) ** 2 for x in xs), math.fsum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def cohen_kappa(pred: Sequence[int], label: Sequence[int]) -> float | None:
    """Cohen's κ of two binary raters (module doc); None without items or when p_e = 1."""
    n = len(pred)
    if n == 0:
        return None
    p_o = sum(p == y for p, y in zip(pred, label)) / n
    a, b = sum(pred) / n, sum(label) / n
    p_e = a * b + (1 - a) * (1 - b)
    return (p_o - p_e) / (1 - p_e) if p_e < 1 else None


def _m(value: float | None, n: int, what: str) -> dict[str, Any]:
    return {"value": value, "n": n, "what": what}


def _share(hits: int, n: int) -> float | None:
    return hits / n if n else None


def _reasons(verdicts: Sequence[Verdict]) -> dict[str, int]:
    return dict(Counter((v.error or "").split(":", 1)[0] for v in verdicts if v.error is not None))


def judge_validity(
    trajs: Sequence[Trajectory],
    judge: Judge,
    max_items: int = 200,
    max_pairs: int = 50,
    seed: int = 0,
    threshold: float = 0.5,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """The judge's agreement and biases on the labelled episodes of ``trajs`` (module doc).

    Args:
        trajs: episodes with the verifier's labels (``verifier_score``, ``outcome``) and messages.
        judge: the judge (its rubric and endpoint).
        max_items: labelled episodes judged pointwise at most (a seeded sample when more).
        max_pairs: (verified, failed) pairs judged in both orders at most (a seeded sample).
        seed: seeds both samples.
        threshold: score / 10 at or above which the judge passes an episode.
        progress: ``progress(phase, done, total)`` as judgements finish; phase "pointwise" or
            "pairwise" (a progress bar).

    Returns:
        ``{"items": {...counts}, "measures": {name: {"value", "n", "what"}}, "failures":
        {"pointwise": {reason: count}, "pairwise": {...}}}``.

    Raises:
        ValueError: no labelled episode, or a setting out of range.
    """
    if max_items < 1 or max_pairs < 0 or not 0.0 < threshold <= 1.0:
        raise ValueError(f"max_items ≥ 1, max_pairs ≥ 0, 0 < threshold ≤ 1; got {max_items}, {max_pairs}, {threshold}")
    parts = [episode_parts(t) if t.outcome != "env_error" else None for t in trajs]
    labelled = [i for i, p in enumerate(parts) if p is not None]
    if not labelled:
        raise ValueError(
            f"no labelled episode among {len(trajs)}: give episodes a verifier scored (a run's trajectories/), "
            "not env errors"
        )
    rng = random.Random(seed)
    items = sorted(rng.sample(labelled, max_items)) if len(labelled) > max_items else labelled
    shown = (lambda phase: lambda d, n: progress(phase, d, n)) if progress is not None else (lambda phase: None)
    point = judge.ask(
        [pointwise_messages(judge.rubric, *parts[i]) for i in items],  # type: ignore[misc]
        parse_score,
        shown("pointwise"),
    )
    measures = _agreement(trajs, parts, items, point, threshold)
    pairs = preference_pairs(trajs, [p is not None for p in parts])
    chosen = sorted(random.Random(seed + 1).sample(pairs, max_pairs)) if len(pairs) > max_pairs else pairs
    prompts = []
    for w, lost in chosen:
        request, a, b = parts[w][0], parts[w][1], parts[lost][1]  # type: ignore[index]
        prompts += [pairwise_messages(judge.rubric, request, a, b), pairwise_messages(judge.rubric, request, b, a)]
    pair_verdicts = judge.ask(prompts, parse_choice, shown("pairwise")) if prompts else []
    measures |= _position(parts, chosen, pair_verdicts)
    return {
        "items": {
            "episodes": len(trajs),
            "labelled": len(labelled),
            "judged_pointwise": len(items),
            "passed": sum(verified(trajs[i]) for i in items),
            "pairs_available": len(pairs),
            "pairs_judged": len(chosen),
        },
        "measures": measures,
        "failures": {"pointwise": _reasons(point), "pairwise": _reasons(pair_verdicts)},
    }


def _agreement(trajs, parts, items, point, threshold) -> dict[str, dict[str, Any]]:
    """Agreement and the length measures of the pointwise verdicts that parsed."""
    ok = [(i, float(v.value)) for i, v in zip(items, point) if v.error is None]
    label = [int(verified(trajs[i])) for i, _ in ok]
    pred = [int(s / SCORE_HIGH >= threshold) for _, s in ok]
    length = [len(parts[i][1]) for i, _ in ok]
    n = len(ok)
    right = [int(p == y) for p, y in zip(pred, label)]
    order = sorted(range(n), key=lambda k: (length[k], k))
    short, long_ = order[: (n + 1) // 2], order[(n + 1) // 2 :]
    scores = [s for _, s in ok]
    out = {
        "agreement_accuracy": _m(_share(sum(right), n), n, "judge pass (score/10 ≥ threshold) = verifier pass"),
        "cohen_kappa": _m(cohen_kappa(pred, label), n, "agreement beyond chance, (p_o − p_e)/(1 − p_e)"),
        "judge_pass_rate": _m(_share(sum(pred), n), n, "share the judge passes"),
        "verifier_pass_rate": _m(_share(sum(label), n), n, "share the verifier passes (same items)"),
        "length_score_pearson": _m(pearson(scores, length), n, "Pearson r of score and response characters"),
    }
    for name, want in (("passed", 1), ("failed", 0)):
        sub = [k for k in range(n) if label[k] == want]
        out[f"length_score_pearson_{name}"] = _m(
            pearson([scores[k] for k in sub], [length[k] for k in sub]), len(sub), f"the same, {name} items only"
        )
    for name, half in (("shorter", short), ("longer", long_)):
        out[f"accuracy_{name}_half"] = _m(
            _share(sum(right[k] for k in half), len(half)), len(half), f"agreement on the {name} half by length"
        )
    return out


def _position(parts, chosen, verdicts) -> dict[str, dict[str, Any]]:
    """Position and pairwise length measures of the pairs whose two orders both parsed."""
    flips = first = right = longer = differ = both = 0
    for k, (w, lost) in enumerate(chosen):
        ab, ba = verdicts[2 * k], verdicts[2 * k + 1]
        if ab.error is not None or ba.error is not None:
            continue
        both += 1
        pick_ab = w if ab.value == "A" else lost  # A/B: the verified one shown first
        pick_ba = lost if ba.value == "A" else w  # B/A: the failed one shown first
        flips += pick_ab != pick_ba
        first += (ab.value == "A") + (ba.value == "A")
        right += (pick_ab == w) + (pick_ba == w)
        lw, ll = len(parts[w][1]), len(parts[lost][1])
        if lw != ll:
            differ += 2
            longest = w if lw > ll else lost
            longer += (pick_ab == longest) + (pick_ba == longest)
    return {
        "position_flip_rate": _m(_share(flips, both), both, "pairs whose choice changes when A/B are swapped"),
        "first_position_share": _m(_share(first, 2 * both), 2 * both, "decisions for the response shown first"),
        "pairwise_accuracy": _m(_share(right, 2 * both), 2 * both, "decisions for the verified episode"),
        "longer_preferred_share": _m(_share(longer, differ), differ, "decisions for the longer response"),
    }
