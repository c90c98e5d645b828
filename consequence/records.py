"""The data that flows through the loop: token-in, token-out (docs/design.md §2).

A trajectory is stored as the exact token ids that went into and came out of the model,
never as text to be re-tokenised. Re-tokenising breaks ratio = 1 (BPE merges, template
whitespace); see docs/cases.md (case 09).

Shape suffixes used across the package (defined once here):
``_N`` rows (trajectories or training rows) in a batch, ``_G`` members of one group,
``_T`` / ``_S`` token positions, ``_V`` vocabulary.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Outcome = Literal["finished", "truncated", "env_error"]
OUTCOMES: tuple[str, ...] = ("finished", "truncated", "env_error")


@dataclass
class ModelCall:
    """One call of the policy inside an episode.

    Attributes:
        context_ids: exact input token ids of this call (after the context builder).
        output_ids: sampled token ids, the end-of-turn / EOS token included when sampled.
        sample_logprobs: log μ(y_k | prefix) of each sampled token under the distribution
            actually sampled from (temperature / top-k / top-p applied); len == len(output_ids).
        stop_reason: ``"stop"`` (end-of-turn sampled) or ``"length"`` (max new tokens hit).
        tool_calls: parsed tool calls, each ``{"name": str, "arguments": dict}``.
        parse_error: why the output could not be parsed into a tool call, else ``None``.
        observation_ids: token ids appended after this call by the harness (template
            boundary, tool results, next assistant header); never targets.
        keep_ids: the keep-sampling mask: per sampled token, the ids of the support it
            was drawn from when top-k / top-p cut the vocabulary (the sampled id is one
            of them); ``None`` when the support was the whole vocabulary. The trainer
            scores π_θ and π_ref on exactly this support, however far the weights have
            moved since sampling (``consequence.policy.logprobs``).
        reward: the reward of the environment steps this call caused (its tool calls,
            or its answer): a per-turn / process reward; 0.0 when none; with ``--shaping
            potential`` plus the turn's shaping term γΦ(s') − Φ(s) (``reward.shaping``). The
            trajectory's reward is the sum over its calls (and shaping); GAE places each call's reward
            on that call's last sampled token (returns-to-go, docs/environments.md).
        invalid_calls: why the harness refused some of ``tool_calls`` before running them,
            one kind per refused call in order: ``"unknown_tool"`` (no declared tool of that
            name) or ``"bad_arguments"`` (arguments that do not match the tool's schema;
            ``harness.tools.call_problem``). Empty when every call ran, and in records
            written before the field existed (they read back with the default).
        constrained: sampled under a grammar (``consequence serve``'s constrained decoding:
            ``tool_choice`` required / named, ``response_format`` JSON): each ``keep_ids``
            entry is the grammar's allowed ids ∩ the top-k / top-p support, which top-k /
            top-p of the logits alone cannot recompute (``loop.checks.check_ratio`` checks
            such calls on their stored supports only).
    """

    context_ids: list[int]
    output_ids: list[int]
    sample_logprobs: list[float]
    stop_reason: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parse_error: str | None = None
    observation_ids: list[int] = field(default_factory=list)
    keep_ids: list[list[int]] | None = None
    reward: float = 0.0
    invalid_calls: list[str] = field(default_factory=list)
    constrained: bool = False

    def __post_init__(self) -> None:
        if self.stop_reason not in ("stop", "length"):
            raise ValueError(f"ModelCall: stop_reason must be 'stop' or 'length', got {self.stop_reason!r}")
        if len(self.output_ids) != len(self.sample_logprobs):
            raise ValueError(
                f"ModelCall: {len(self.output_ids)} output ids but {len(self.sample_logprobs)} "
                "sample log-probs; the sampler must return one log-prob per sampled token"
            )
        if self.keep_ids is not None:
            _check_supports(self.output_ids, self.keep_ids, "ModelCall")


def _check_supports(tokens: Sequence[int], supports: Sequence[Sequence[int] | None], who: str) -> None:
    """Raise ValueError unless there is one support per token and each holds its token."""
    if len(supports) != len(tokens):
        raise ValueError(
            f"{who}: {len(tokens)} tokens but {len(supports)} keep-id lists; the sampler "
            "must return one support per sampled token"
        )
    for k, (tok, keep) in enumerate(zip(tokens, supports)):
        if keep is not None and tok not in keep:
            raise ValueError(
                f"{who}: token {tok} at position {k} is outside its stored support "
                f"({len(keep)} ids); a sampled token is always inside the support it was drawn from"
            )


@dataclass
class Trajectory:
    """One episode of one rollout of one task.

    ``group_id`` is the task id plus the iteration: groups are built by identity, never by
    position in a batch (docs/cases.md, case 02).
    ``reward`` is ``None`` until the reward box scores the trajectory, and stays ``None``
    for an ``env_error`` (excluded from statistics and loss, never scored 0).
    ``env_retries`` counts re-runs of a sandbox that could not start, over all of the
    episode's environment steps (the limit per step is ``envs.sandbox.ENV_RETRIES``).
    ``env_rewards`` are the rewards the environment's steps gave, per named component and
    summed over steps (each step's reward is also on its call: ``ModelCall.reward``); the
    reward box turns them (plus shaping) into ``reward_components`` and ``reward``.
    """

    task_id: str
    group_id: str
    sample_id: int
    seed: int
    policy_version: int
    calls: list[ModelCall] = field(default_factory=list)
    outcome: Outcome = "finished"
    truncation_reason: str | None = None
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    verifier_score: float | None = None
    error: str | None = None
    n_tool_calls: int = 0
    tool_histogram: dict[str, int] = field(default_factory=dict)
    wall_time_s: float = 0.0
    final_code: str | None = None
    advantage: float | None = None
    env_retries: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)  # readable view; never trained on
    env_rewards: dict[str, float] = field(default_factory=dict)  # per component, summed over the steps
    # --shaping potential: Φ(s_0), Φ(s_1), … of the environment's state after reset and after each
    # call's turn (one more than calls; the environment's values, Φ(terminal) = 0 applied later by
    # reward.shaping); empty when not recorded
    potentials: list[float] = field(default_factory=list)
    # --context last:K / summary:K: calls whose context the harness rebuilt from the kept messages
    # after dropping turns (each starts a new training row); 0 in records written before the field
    context_rewrites: int = 0
    # --attempts k: answers the episode made (a wrong one reopened it with the verifier's feedback,
    # rollout.attempts); solved at attempt `attempts` when solved; 1 in records written before the field
    attempts: int = 1
    # the scale its last attempt's reward entered at (d**(attempts−1) of --attempt-discount d): the
    # reward box divides the primary component by it for the verifier's score; 1.0 without discount
    attempt_scale: float = 1.0

    @property
    def n_generated_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.calls)

    def to_dict(self) -> dict[str, Any]:
        """A plain-data copy, equal to ``dataclasses.asdict(self)``.

        Built field by field: ``asdict`` recurses into every token id, which made writing
        an iteration's trajectories take ~0.5 s on the bundled model (profiled).
        """
        d = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "calls"}
        d["calls"] = [{f.name: _plain(getattr(c, f.name)) for f in dataclasses.fields(c)} for c in self.calls]
        return {f.name: d[f.name] for f in dataclasses.fields(self)}  # field order, as asdict

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d["calls"] = [ModelCall(**c) for c in d.get("calls", [])]
        return cls(**d)


def verified(t: Trajectory) -> bool:
    """The verifier scored the episode 1 and it finished (not cut by a budget, no env error):
    what rejection sampling keeps and DPO / a reward model prefers."""
    return t.outcome == "finished" and t.verifier_score is not None and t.verifier_score >= 1.0


def credited(t: Trajectory) -> bool:
    """Whether ``t`` enters the credit box: scored (not an env_error) and with at least one
    target token, i.e. one token the policy sampled (``Trajectory.n_generated_tokens``: the
    target tokens of its rows are exactly its calls' ``output_ids``). A trajectory with no
    model call, or whose calls sampled nothing, has no action to credit and would only move
    its group's baseline (docs/cases.md, case 15)."""
    return t.reward is not None and t.n_generated_tokens > 0


@dataclass
class TrainingRow:
    """One causal training row built from an append-only run of model calls.

    All lists have the same length S. ``loss_mask[j] == 1`` only where token j was
    sampled by the policy (end-of-turn included); ``old_logprobs[j]`` is the sampling
    log-prob of token j where the mask is 1, else 0. ``keep_ids[j]`` is the support
    token j was sampled from (the calls' ``keep_ids``) where the mask is 1 and top-k /
    top-p cut the vocabulary, else ``None``; ``keep_ids is None`` when no call of the
    row stored supports. ``token_rewards[j]`` is the per-turn reward of the call whose
    last sampled token is j (``ModelCall.reward``), 0 elsewhere; ``None`` when not built
    from calls. Alignment for training: logits at position j predict token j+1, so pair
    ``logits[:, :-1]`` with ``input_ids[:, 1:]``, ``loss_mask[:, 1:]`` and
    ``old_logprobs[:, 1:]``. ``constrained``: some call of the row was sampled under a
    grammar (``ModelCall.constrained``).
    """

    input_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    traj_index: int = 0
    keep_ids: list[list[int] | None] | None = None
    token_rewards: list[float] | None = None
    constrained: bool = False

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.loss_mask) != n or len(self.old_logprobs) != n:
            raise ValueError(
                f"TrainingRow: lengths differ (ids {n}, mask {len(self.loss_mask)}, "
                f"old_logprobs {len(self.old_logprobs)})"
            )
        if self.keep_ids is not None:
            _check_supports(self.input_ids, self.keep_ids, "TrainingRow")
        if self.token_rewards is not None and len(self.token_rewards) != n:
            raise ValueError(f"TrainingRow: {n} ids but {len(self.token_rewards)} token rewards")


def trajectory_to_rows(traj: Trajectory, traj_index: int = 0) -> list[TrainingRow]:
    """Merge the calls of one trajectory into as few causal rows as possible.

    A call whose ``context_ids`` extend the previous row (previous context + output +
    observation) is appended to that row; otherwise (the context builder rewrote or
    truncated history) a new row starts with this call's own ``context_ids``.

    Returns:
        list of TrainingRow; each row's targets are exactly the sampled tokens.
    """
    rows: list[TrainingRow] = []
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    keeps: list[list[int] | None] = []
    rew: list[float] = []
    grammar = False  # a call of the current row was constrained
    for call in traj.calls:
        ctx = call.context_ids
        if ids and len(ctx) >= len(ids) and ctx[: len(ids)] == ids:
            extra = ctx[len(ids) :]  # tokens the harness added that we have not seen yet
        else:
            if ids:
                rows.append(_close_row(ids, mask, lps, keeps, rew, traj_index, grammar))
            ids, mask, lps, keeps, rew, extra, grammar = [], [], [], [], [], ctx, False
        grammar = grammar or call.constrained
        ids = ids + list(extra)
        mask = mask + [0] * len(extra)
        lps = lps + [0.0] * len(extra)
        keeps = keeps + [None] * len(extra)
        rew = rew + [0.0] * len(extra)
        ids += call.output_ids
        mask += [1] * len(call.output_ids)
        lps += list(call.sample_logprobs)
        keeps += list(call.keep_ids) if call.keep_ids is not None else [None] * len(call.output_ids)
        rew += [0.0] * len(call.output_ids)
        if call.output_ids:  # the turn's reward sits on its last sampled token
            rew[-1] = float(call.reward)
        # Observation ids after the last call are not trained and need no row.
        ids += call.observation_ids
        mask += [0] * len(call.observation_ids)
        lps += [0.0] * len(call.observation_ids)
        keeps += [None] * len(call.observation_ids)
        rew += [0.0] * len(call.observation_ids)
    if ids:
        rows.append(_close_row(ids, mask, lps, keeps, rew, traj_index, grammar))
    return rows


def _close_row(
    ids: list[int],
    mask: list[int],
    lps: list[float],
    keeps: list[list[int] | None],
    rewards: list[float],
    traj_index: int,
    constrained: bool = False,
) -> TrainingRow:
    """Drop trailing non-target tokens (the last observation): they carry no signal."""
    end = max((j for j, m in enumerate(mask) if m), default=len(mask) - 1) + 1
    stored = any(k is not None for k in keeps[:end])
    kept = keeps[:end] if stored else None
    return TrainingRow(ids[:end], mask[:end], lps[:end], traj_index, kept, rewards[:end], constrained)


# ---- storage: one Parquet file per iteration, written atomically -------------------
_JSON_FIELDS = ("reward_components", "tool_histogram", "messages", "env_rewards", "potentials")


def _plain(v: Any) -> Any:
    """A copy of a record field: flat lists of numbers by one C-level copy, anything else deep."""
    if isinstance(v, list) and all(type(x) in (int, float) for x in v):
        return list(v)
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        return [_plain(x) for x in v]
    return copy.deepcopy(v)


def write_trajectories(path, trajectories: list[Trajectory]) -> None:
    """Write trajectories to one Parquet file atomically (temporary file, then rename).

    Token ids stay lists of int64; nested free-form fields (messages, tool-call arguments)
    are stored as JSON text so that every file has the same schema.
    """
    import json
    import os
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    records = []
    for t in trajectories:
        d = t.to_dict()
        for k in _JSON_FIELDS:
            d[k] = json.dumps(d[k])
        for c in d["calls"]:
            c["tool_calls"] = json.dumps(c["tool_calls"])
        records.append(d)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(pa.Table.from_pylist(records), tmp)
        os.replace(tmp, path)
    except BaseException:  # e.g. disk full: no partial file stays behind
        tmp.unlink(missing_ok=True)
        raise


def read_trajectories(path) -> list[Trajectory]:
    """Read a Parquet file written by :func:`write_trajectories`."""
    import json

    import pyarrow.parquet as pq

    out = []
    for d in pq.read_table(path).to_pylist():
        for k in _JSON_FIELDS:
            if k in d:  # files of older versions lack newer fields: their defaults apply
                d[k] = json.loads(d[k])
        for c in d["calls"]:
            c["tool_calls"] = json.loads(c["tool_calls"])
        out.append(Trajectory.from_dict(d))
    return out


def pad_rows(rows: Sequence[TrainingRow], pad_id: int) -> dict[str, Any]:
    """Right-pad training rows into tensors.

    Returns:
        dict with ``input_ids`` [N, S] long (``pad_id`` on padding), ``attention_mask``
        [N, S] long (1 on real tokens), ``loss_mask`` [N, S] float32 and ``old_logprobs``
        [N, S] float32 (0 on padding); S = longest row. When some row stores supports
        (``keep_ids``), also ``keep_index`` [K, 3] long, one ``(row, position, kept id)``
        per id of every stored support (position indexes ``input_ids``; the argument of
        ``policy.logprobs.token_logprobs``), and ``keep_rows`` [N] bool (rows with
        stored supports).

    Raises:
        ValueError: no rows, or an empty row.
    """
    import torch  # noqa: PLC0415  (records are read without torch; only padding needs it)

    if len(rows) == 0:
        raise ValueError("pad_rows: no rows")
    S = max(len(r.input_ids) for r in rows)
    if S == 0:
        raise ValueError("pad_rows: every row is empty")
    N = len(rows)
    input_ids = torch.full((N, S), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((N, S), dtype=torch.long)
    loss_mask = torch.zeros((N, S), dtype=torch.float32)
    old_logprobs = torch.zeros((N, S), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        if n == 0:
            raise ValueError(f"pad_rows: row {i} is empty")
        input_ids[i, :n] = torch.tensor(r.input_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
        old_logprobs[i, :n] = torch.tensor(r.old_logprobs, dtype=torch.float32)
    out = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
    }
    if any(r.keep_ids is not None for r in rows):
        out["keep_index"] = _keep_index(rows, torch)
        out["keep_rows"] = torch.tensor([r.keep_ids is not None for r in rows], dtype=torch.bool)
    return out


def _keep_index(rows: Sequence[TrainingRow], torch) -> Any:
    """[K, 3] long ``(row, position, kept id)`` of every stored support of ``rows``."""
    where, sizes, ids = [], [], []
    for i, r in enumerate(rows):
        for j, keep in enumerate(r.keep_ids or ()):
            if keep is not None:
                where.append((i, j))
                sizes.append(len(keep))
                ids.extend(keep)
    if not ids:
        return torch.zeros((0, 3), dtype=torch.long)
    at = torch.repeat_interleave(torch.tensor(where, dtype=torch.long), torch.tensor(sizes), dim=0)
    return torch.cat([at, torch.tensor(ids, dtype=torch.long)[:, None]], 1)
