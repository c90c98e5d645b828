"""A learned reward: a Bradley-Terry scalar head on a causal LM's backbone (reward box, issue 38).

Where no verifier exists, a reward model learns one from preferences. Here the preferences
are the verifier's own (:func:`consequence.reward.preferences.preference_pairs`: in each
group, every verified episode over every failed one), so a reward model trained on one run's
episodes can be checked against the verifier it imitates: its held-out pairwise accuracy
before any RL, and, while a policy trains on it, the verifier's success beside the learned
reward (a learned reward optimised past the point where it agrees with the truth is
*over-optimisation*: Gao et al. 2023, "Scaling Laws for Reward Model Overoptimization").

The model is a Hugging Face ``AutoModelForSequenceClassification`` with one label, built
from a causal LM folder (its backbone; a new linear ``score`` head). An episode's score
r(τ) is the head on the backbone's last hidden state at the episode's last token; the
episode is its last training row (the full context the policy saw at its final call, in
the policy's tokens: the reward model must share the policy's tokenizer).

Loss (Bradley & Terry 1952; Ouyang et al. 2022, "Training language models to follow
instructions with human feedback", §3.5 eq. 1): for pairs (chosen w, rejected l),
L = −mean log σ(r(w) − r(l)).

As a reward (``--reward-model PATH --reward-model-weight w``), an episode gets the component
``reward_model`` = w·σ(r(τ)) — σ(r) is the Bradley-Terry probability that it beats an episode
of score 0, in (0, 1), so the environment's reward range still holds — and its other
components are scaled by (1 − w); w = 1 trains on the learned reward alone. The verifier's
score (``verifier_score``, what success means) is never changed.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from consequence.records import Trajectory, credited, trajectory_to_rows
from consequence.reward.preferences import preference_pairs
from consequence.seeding import seed_of

__all__ = [
    "REWARD_MODEL_COMPONENT",
    "RewardModel",
    "apply_reward_model",
    "bt_loss",
    "learned_reward_mean",
    "episode_ids",
    "split_pairs",
    "train_reward_model",
]

REWARD_MODEL_COMPONENT = "reward_model"
META = "reward_model.json"


def bt_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry loss −mean log σ(r_w − r_l) (module doc).

    Args:
        chosen, rejected: [P] float scores of the pairs' chosen and rejected episodes.

    Returns:
        a scalar tensor (nats), differentiable.
    """
    return -F.logsigmoid(chosen - rejected).mean()


def episode_ids(t: Trajectory, index: int = 0) -> list[int] | None:
    """The token ids a reward model scores for ``t``: its last training row (None without rows)."""
    if not credited(t):
        return None
    rows = trajectory_to_rows(t, index)
    return list(rows[-1].input_ids) if rows else None


class RewardModel:
    """A scalar head on a causal LM backbone (module doc).

    Args:
        model: a ``*ForSequenceClassification`` with ``num_labels == 1`` (its ``score`` head
            and the backbone under ``model.base_model_prefix``).
        pad_id: the token that pads a batch (never read as content: the last real token is
            found from the lengths, since a chat's own end-of-turn token may be the pad).
    """

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model, self.pad_id = model, int(pad_id)  # Any: a transformers model's heads are attributes

    @classmethod
    def from_causal_lm(cls, path: str | Path) -> RewardModel:
        """A new reward model on the backbone of the causal LM folder ``path`` (the head
        initialised by transformers, seeded by torch's global seed).

        Raises:
            ValueError: the folder cannot be loaded as a sequence classifier.
        """
        return cls(_load_classifier(path), _pad_of(path))

    @classmethod
    def load(cls, path: str | Path) -> RewardModel:
        """A reward model written by :meth:`save` (``--reward-model PATH``).

        Raises:
            ValueError: ``path`` is not such a folder (no ``reward_model.json``), or transformers
                cannot load it.
        """
        p = Path(path)
        if not (p / META).is_file():
            raise ValueError(
                f"--reward-model {p}: not a reward model folder (no {META}); train one with "
                "`consequence reward-model train --data RUN/trajectories --model M --out DIR`"
            )
        return cls(_load_classifier(p), json.loads((p / META).read_text())["pad_id"])

    def scores(self, seqs: Sequence[Sequence[int]], batch_size: int = 8) -> torch.Tensor:
        """r(τ) of each token sequence: [N] float32, differentiable when grad is enabled.

        Raises:
            ValueError: an empty sequence.
        """
        if any(len(s) == 0 for s in seqs):
            raise ValueError("a reward model cannot score an empty sequence")
        out = [self._batch(seqs[a : a + batch_size]) for a in range(0, len(seqs), batch_size)]
        return torch.cat(out) if out else torch.zeros(0)

    def _batch(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        n, S = len(seqs), max(len(s) for s in seqs)
        ids = torch.full((n, S), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, S), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(list(s))
            mask[i, : len(s)] = 1
        backbone = getattr(self.model, str(self.model.base_model_prefix))
        hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state  # [n, S, H]
        last = hidden[torch.arange(n), mask.sum(dim=1) - 1]  # [n, H]: the last real token
        return self.model.score(last).squeeze(-1).float()

    def save(self, out: str | Path, tokenizer: Any, meta: dict[str, Any]) -> Path:
        """Write the model, its tokenizer and ``reward_model.json`` (``meta`` + the pad id) to
        ``out`` atomically: a temporary folder beside it, renamed when complete.

        Raises:
            FileExistsError: ``out`` exists (nothing is overwritten).
        """
        out = Path(out)
        if out.exists():
            raise FileExistsError(f"--out {out} exists; give a new folder (a reward model is never overwritten)")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            self.model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / META).write_text(json.dumps(meta | {"pad_id": self.pad_id}, indent=2) + "\n")
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out


def _load_classifier(path: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialized" is the point, not a warning
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"{path}: transformers cannot load it as a reward model ({str(e).splitlines()[0]})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if not hasattr(model, "score"):
        raise ValueError(f"{path}: {type(model).__name__} has no `score` head; give a decoder LM such as Llama")
    return model


def _pad_of(path: str | Path) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


# ---- training -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pairs:
    """(chosen ids, rejected ids) of the pairs, and the tasks they come from."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    tasks: list[str]


def split_pairs(trajs: Sequence[Trajectory], heldout_fraction: float, seed: int) -> tuple[Pairs, Pairs]:
    """The verifier's pairs of ``trajs``, split by task into (train, held-out): a seeded
    ``heldout_fraction`` of the tasks that have a pair is held out whole, so no held-out
    prompt is seen in training.

    Raises:
        ValueError: no pair at all, or a split without a pair (too few tasks for the fraction).
    """
    ids = [episode_ids(t, i) for i, t in enumerate(trajs)]
    pairs = preference_pairs(trajs, [x is not None for x in ids])
    tasks = sorted({trajs[w].task_id for w, _ in pairs})
    if not pairs:
        raise ValueError(
            f"no (verified, failed) pair among {len(trajs)} episodes: a reward model learns from a task's "
            "verified episode against a failed one of the same group; give episodes of a run that both "
            "solved and failed its tasks (its trajectories/ folder)"
        )
    order = list(tasks)
    random.Random(seed_of(seed, "reward-model-heldout")).shuffle(order)
    n_held = math.ceil(heldout_fraction * len(order)) if heldout_fraction > 0 else 0
    held = set(order[:n_held])
    if n_held >= len(order) or (heldout_fraction > 0 and not held):
        raise ValueError(
            f"--heldout {heldout_fraction:g} of {len(order)} tasks with a pair leaves no task on one side; "
            "give more episodes or another fraction"
        )

    def side(keep: bool) -> Pairs:
        sel = [(w, r) for w, r in pairs if (trajs[w].task_id in held) == keep]
        return Pairs([ids[w] for w, _ in sel], [ids[r] for _, r in sel], [trajs[w].task_id for w, _ in sel])  # type: ignore[misc]

    return side(False), side(True)


def _evaluate(rm: RewardModel, pairs: Pairs, batch_size: int) -> dict[str, float | None]:
    """Held-out pairwise accuracy (share with r(w) > r(l)) and BT loss, without gradient."""
    if not pairs.chosen:
        return {"accuracy": None, "loss": None, "pairs": 0.0}
    with torch.no_grad():
        w, r = rm.scores(pairs.chosen, batch_size), rm.scores(pairs.rejected, batch_size)
    return {"accuracy": float((w > r).float().mean()), "loss": float(bt_loss(w, r)), "pairs": float(len(w))}


def train_reward_model(
    rm: RewardModel,
    train: Pairs,
    heldout: Pairs,
    epochs: int = 2,
    lr: float = 1e-4,
    pairs_per_step: int = 8,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Train ``rm`` with the Bradley-Terry loss (AdamW, full fine-tuning of backbone and head).

    Each epoch shuffles the training pairs (seeded) and takes one optimizer step per
    ``pairs_per_step`` pairs. ``progress(step, total_steps)`` after every step.

    Returns:
        ``{"before": {...}, "epochs": [{"epoch", "train_loss", "heldout_accuracy",
        "heldout_loss"}, ...], "after": {...}}`` where before / after are the held-out
        accuracy, loss and pair count (:func:`_evaluate`).

    Raises:
        ValueError: no training pair, or a non-positive setting.
    """
    if not train.chosen:
        raise ValueError("no training pair")
    if epochs < 1 or pairs_per_step < 1 or lr <= 0:
        raise ValueError(f"epochs, pairs_per_step and lr must be positive, got {epochs}, {pairs_per_step}, {lr}")
    opt = torch.optim.AdamW([p for p in rm.model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    report: dict[str, Any] = {"before": _evaluate(rm, heldout, pairs_per_step), "epochs": []}
    n = len(train.chosen)
    total, step = epochs * math.ceil(n / pairs_per_step), 0
    for epoch in range(epochs):
        order = list(range(n))
        random.Random(seed_of(seed, "reward-model", epoch)).shuffle(order)
        rm.model.train()
        losses = []
        for a in range(0, n, pairs_per_step):
            part = order[a : a + pairs_per_step]
            loss = bt_loss(
                rm.scores([train.chosen[i] for i in part], pairs_per_step),
                rm.scores([train.rejected[i] for i in part], pairs_per_step),
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()) * len(part))
            step += 1
            if progress is not None:
                progress(step, total)
        rm.model.eval()
        held = _evaluate(rm, heldout, pairs_per_step)
        report["epochs"].append(
            {
                "epoch": epoch,
                "train_loss": math.fsum(losses) / n,
                "heldout_accuracy": held["accuracy"],
                "heldout_loss": held["loss"],
            }
        )
    report["after"] = _evaluate(rm, heldout, pairs_per_step)
    return report


# ---- as a reward ----------------------------------------------------------------------------
def apply_reward_model(trajs: Sequence[Trajectory], rm: RewardModel, weight: float) -> None:
    """Add the learned reward to scored episodes (module doc): component ``reward_model`` =
    w·σ(r(τ)), the other components × (1 − w), ``reward`` their sum. An env_error or an
    episode without a sampled token is left as it is (it leaves the batch anyway);
    ``verifier_score`` is never changed.

    Raises:
        ValueError: ``weight`` outside [0, 1].
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"--reward-model-weight must lie in [0, 1], got {weight}")
    todo = [(t, ids) for i, t in enumerate(trajs) if (ids := episode_ids(t, i)) is not None]
    if not todo:
        return
    with torch.no_grad():
        r = rm.scores([ids for _, ids in todo])
    for (t, _), score in zip(todo, torch.sigmoid(r).tolist()):
        parts = {k: (1.0 - weight) * v for k, v in t.reward_components.items()}
        parts[REWARD_MODEL_COMPONENT] = weight * score
        t.reward_components, t.reward = parts, math.fsum(parts.values())


def learned_reward_mean(trajs: Sequence[Trajectory], weight: float) -> float | None:
    """Mean σ(r(τ)) over the episodes that carry the learned reward (its component / w);
    None when none does or w = 0 (then it is not recorded on them)."""
    got = [t.reward_components[REWARD_MODEL_COMPONENT] for t in trajs if REWARD_MODEL_COMPONENT in t.reward_components]
    return math.fsum(got) / (weight * len(got)) if got and weight > 0 else None
