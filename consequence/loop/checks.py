"""Checks before the first optimizer step (docs/design.md §6).

They run on the first collected batch of every training run, print a pass/fail table and
stop the run with :class:`PreStepCheckError` on a failure; ``--skip-checks`` turns them
off and the manifest records that it did. Each check returns a :class:`CheckResult`;
each takes its inputs explicitly so that a test can feed it a broken batch.

1. ``ratio``: the trainer's log-probs of the behaviour snapshot, under the sampler's
   processed distribution (temperature, top-k, top-p), reproduce the sampling log-probs:
   max |logπ − logμ| over targets ≤ 1e-3 nats (ratio within 1 ± 0.1 %) in float32; in
   bfloat16 ≤ 12·2^-8·Z nats, Z the largest |logit| at the checked targets
   (``policy.device.logprob_tolerance`` derives it; the message states dtype and tolerance). When the rows
   store the sampler's supports (top-k / top-p on), twice: on the stored supports (what
   every optimizer step uses) and on supports recomputed from these weights' logits with
   the config's top-k / top-p (so the stored supports are the ones the config names).
2. ``mask``: every row's mask, ids and log-probs have one length; the targets of a
   trajectory's rows are exactly its sampled tokens in order (so prompt, observation,
   template-boundary and padding tokens are 0), including each end-of-turn that was
   sampled; every trajectory that trains has at least one target.
3. ``groups``: a group holds one task (one task id and instance) and distinct samples.
4. ``zero_gradient``: a group with equal rewards gives exactly zero policy gradient
   (for estimators with a group baseline; REINFORCE-style ones are reported n/a).
5. ``clip_direction``: with ρ beyond the clip range, a positive advantage gives no
   gradient (PPO-style surrogates) and a negative one pushes ρ down.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from consequence.credit.advantages import group_advantages
from consequence.credit.batch import credited
from consequence.policy.device import (
    FLOAT32_LOGPROB_TOL,
    TOLERANCE_UNITS,
    UNIT_ROUNDOFF,
    logprob_tolerance,
    model_device,
    precision,
)
from consequence.records import TrainingRow, Trajectory, pad_rows
from consequence.update.step import UpdateConfig, accumulate_gradients, compute_logprobs
from consequence.update.surrogates import surrogate_objective

RATIO_TOL = FLOAT32_LOGPROB_TOL  # nats per token: fp32 recomputation differs by ~1e-5 on the tiny model
GROUP_BASELINE = ("rloo", "grpo", "dr_grpo")


@dataclass
class CheckResult:
    name: str
    passed: bool | None  # None = not applicable
    detail: str
    tolerance: float | None = None  # the ratio check's, in nats (the first-step warning reads it)

    def as_dict(self) -> dict:
        """What the manifest keeps of it (``tolerance`` only where a check has one)."""
        return {k: v for k, v in vars(self).items() if k != "tolerance" or v is not None}


class PreStepCheckError(RuntimeError):
    """A check before the first optimizer step failed; the message lists which and why."""


def check_ratio(
    model,
    rows: Sequence[TrainingRow],
    pad_id: int,
    logprob_fn: Callable,
    temperature: float,
    tol: float | None = None,
    dtype: str = "float32",
) -> CheckResult:
    """Check 1: recomputed logπ_old equals the sampler's logμ on every target (± tol nats).

    Rows with stored supports (``TrainingRow.keep_ids``) are checked on those supports
    and again with the supports recomputed by ``logprob_fn`` from the current logits,
    except rows sampled under a grammar (``TrainingRow.constrained``): their supports hold
    the grammar's mask, which no top-k / top-p of the logits recomputes, so they are
    checked on their stored supports only.

    Args:
        tol: the tolerance in nats; ``None`` derives it from ``dtype``: :data:`RATIO_TOL` in
            float32, ``policy.device.logprob_tolerance(dtype, Z)`` otherwise, Z the largest
            |logit| of ``model`` at the rows' targets (one more forward pass over the rows).
        dtype: the precision the trainer recomputes in (``policy.device.precision``); the
            message names it with the tolerance.
    """
    how = dtype
    if tol is None and dtype == "float32":
        tol = RATIO_TOL
    elif tol is None:
        scale = logit_scale(model, rows, pad_id, dtype)
        tol = logprob_tolerance(dtype, scale)
        how = f"{dtype}: {TOLERANCE_UNITS} × u {UNIT_ROUNDOFF[dtype]:.2g} × max|logit| {scale:.3g}"
    worst, where = _worst_gap(model, rows, pad_id, logprob_fn, temperature, dtype)
    detail = f"max |logπ − logμ| = {worst:.2e} nats (tolerance {tol:.3g}, {how})"
    bare = [
        dataclasses.replace(r, keep_ids=None) for r in rows if not getattr(r, "constrained", False)
    ]  # constrained rows: the stored supports only (docstring)
    if bare and any(getattr(r, "keep_ids", None) is not None for r in rows):
        worst_b, where_b = _worst_gap(model, bare, pad_id, logprob_fn, temperature, dtype)
        detail = (
            f"max |logπ − logμ| = {worst:.2e} nats on the stored supports, {worst_b:.2e} on supports "
            f"recomputed with the config's top-k / top-p (tolerance {tol:.3g}, {how})"
        )
        if worst_b > worst:
            worst, where = worst_b, where_b
    ok = worst <= tol
    if not ok:
        at = f", at trajectory {where[0]} token {where[1]}" if where is not None else ""  # None: tol < 0
        detail += (
            f"{at}: the trainer does not see the distribution the "
            "sampler used (temperature / top-k / top-p must match, weights must be the behaviour snapshot)"
        )
    return CheckResult("ratio", ok, detail, tolerance=tol)


@torch.no_grad()
def logit_scale(
    model, rows: Sequence[TrainingRow], pad_id: int, dtype: str = "float32", micro_batch_size: int = 4
) -> float:
    """Z of ``policy.device.logprob_tolerance``: the largest |logit| (over the whole vocabulary)
    at the positions that predict the rows' targets, from ``model``'s forward in ``dtype``.
    Small micro-batches: the full ``[n, S, V]`` logits are held (no LM-head chunking here)."""
    device, scale = model_device(model), 0.0
    for start in range(0, len(rows), micro_batch_size):
        part = list(rows[start : start + micro_batch_size])
        batch = pad_rows(part, pad_id)
        targets = (batch["loss_mask"][:, 1:] > 0).to(device)
        if not bool(targets.any()):
            continue
        with precision(dtype, device):
            out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
        z = out.logits[:, :-1][targets].float()
        scale = max(scale, float(z.abs().max()))
    return scale


def _worst_gap(model, rows, pad_id, logprob_fn, temperature, dtype="float32") -> tuple[float, tuple[int, int] | None]:
    """Largest |logπ − logμ| over target tokens (inf for a non-finite one) and where it is."""
    recomputed = compute_logprobs(model, rows, pad_id, logprob_fn, temperature, dtype=dtype)
    worst, where = 0.0, None
    for r, lp in zip(rows, recomputed):
        for t, (m, a, b) in enumerate(zip(r.loss_mask, lp, r.old_logprobs)):
            d = abs(a - b) if m else 0.0
            if m and not math.isfinite(d):
                d = math.inf
            if d > worst:
                worst, where = d, (r.traj_index, t)
    return worst, where


def check_mask(
    trajs: Sequence[Trajectory], rows: Sequence[TrainingRow], stop_ids: set[int], expected: set[int] | None = None
) -> CheckResult:
    """Check 2: lengths agree; targets are exactly the sampled tokens, end-of-turn included.

    ``expected``: indices of the trajectories that should train (default: every scored
    trajectory with a sampled token, ``credit.batch.credited``; overlong filtering leaves
    some out on purpose).
    """
    for r in rows:
        if not (len(r.input_ids) == len(r.loss_mask) == len(r.old_logprobs)):
            return CheckResult(
                "mask",
                False,
                f"trajectory {r.traj_index}: ids {len(r.input_ids)}, mask "
                f"{len(r.loss_mask)}, log-probs {len(r.old_logprobs)} differ in length",
            )
    targets: dict[int, list[int]] = {}
    for r in rows:
        targets.setdefault(r.traj_index, []).extend(t for t, m in zip(r.input_ids, r.loss_mask) if m)
    n_eot = 0
    for i, traj in enumerate(trajs):
        should = credited(traj) if expected is None else i in expected
        if not should:
            continue
        sampled = [tok for c in traj.calls for tok in c.output_ids]
        got = targets.get(i, [])
        if not got:
            return CheckResult("mask", False, f"trajectory {i} ({traj.task_id}) trains but has no target token")
        if got != sampled:
            return CheckResult(
                "mask",
                False,
                f"trajectory {i} ({traj.task_id}): {len(got)} target tokens but "
                f"{len(sampled)} sampled; a prompt, observation or boundary token is a target, "
                "or a sampled token is not",
            )
        for c in traj.calls:
            if c.stop_reason == "stop":
                if not c.output_ids or c.output_ids[-1] not in stop_ids:
                    return CheckResult(
                        "mask",
                        False,
                        f"trajectory {i}: a call stopped without a sampled "
                        "end-of-turn token, so the stop is never trained",
                    )
                n_eot += 1
    n = sum(len(v) for v in targets.values())
    return CheckResult("mask", True, f"{n} targets = sampled tokens, {n_eot} end-of-turn tokens among them")


def check_groups(trajs: Sequence[Trajectory]) -> CheckResult:
    """Check 3: one task (id and instance) per group, distinct sample ids."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    for gid, members in groups.items():
        tasks = {t.task_id for t in members}
        if len(tasks) > 1:
            return CheckResult(
                "groups",
                False,
                f"group {gid!r} mixes tasks {sorted(tasks)[:3]}; groups must be "
                "built by task id, not by position (case 02)",
            )
        ids = [t.sample_id for t in members]
        if len(set(ids)) != len(ids):
            return CheckResult("groups", False, f"group {gid!r} repeats sample ids {ids}")
    sizes = sorted({len(m) for m in groups.values()})
    return CheckResult("groups", True, f"{len(groups)} groups, one task each, sizes {sizes}")


def check_zero_gradient(
    model,
    rows: Sequence[TrainingRow],
    estimator: str,
    ucfg: UpdateConfig,
    pad_id: int,
    logprob_fn: Callable,
    advantage_fn: Callable = group_advantages,
) -> CheckResult:
    """Check 4: rows of one group with equal rewards → every parameter gradient exactly 0."""
    if estimator not in GROUP_BASELINE:
        return CheckResult("zero_gradient", None, f"n/a: {estimator} has no group baseline")
    sample = list(rows[: min(4, len(rows))])
    adv = advantage_fn([1.0] * len(sample), ["g"] * len(sample), estimator)
    # the policy-gradient part alone: KL, entropy, TIS, masking and a distillation loss need
    # inputs not at hand here (and the divergence has a gradient whatever the rewards)
    plain = dataclasses.replace(
        ucfg, kl_coef=0.0, entropy_coef=0.0, tis_cap=0.0, offpolicy_delta=0.0, distill_loss="none", pg_coef=1.0
    )
    model.zero_grad(set_to_none=True)
    try:  # in the run's precision (plain.dtype): an exact 0 must survive bfloat16 autocast too
        accumulate_gradients(model, sample, adv, plain, pad_id, logprob_fn)
        worst = max((float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None), default=0.0)
    finally:
        model.zero_grad(set_to_none=True)
    ok = worst == 0.0
    return CheckResult(
        "zero_gradient",
        ok,
        f"max |grad| = {worst:.1e} for a group with equal rewards"
        + ("" if ok else ": the baseline does not cancel equal rewards"),
    )


def check_clip_direction(ucfg: UpdateConfig, surrogate_fn: Callable = surrogate_objective) -> CheckResult:
    """Check 5: ρ above 1+ε_high — A > 0 gives no gradient (PPO-style) or a capped weight
    (CISPO); A < 0 gives a loss gradient > 0 on logπ, i.e. descent lowers ρ."""
    if ucfg.surrogate == "pg":
        return CheckResult("clip_direction", None, "n/a: the policy-gradient surrogate has no clip")
    rho = 1.0 + 2.0 * ucfg.clip_eps_high
    grads = {}
    for a in (1.0, -1.0):
        lp = torch.tensor([[math.log(rho), math.log(rho)]], dtype=torch.float64, requires_grad=True)
        obj, _, _ = surrogate_fn(
            ucfg.surrogate,
            lp,
            torch.zeros_like(lp),
            torch.tensor([a], dtype=torch.float64),
            torch.ones_like(lp),
            eps_low=ucfg.clip_eps_low,
            eps_high=ucfg.clip_eps_high,
            dual_clip_c=ucfg.dual_clip_c,
        )
        (-obj.sum()).backward()
        assert lp.grad is not None  # a leaf that requires grad, after backward
        grads[a] = lp.grad[0, 0].item()
    if ucfg.surrogate == "cispo":
        pos_ok = math.isclose(-grads[1.0], 1.0 + ucfg.clip_eps_high, rel_tol=1e-6)
        pos_txt = f"A>0: weight {-grads[1.0]:.4f} (cap {1 + ucfg.clip_eps_high:g})"
    else:
        pos_ok = grads[1.0] == 0.0
        pos_txt = f"A>0: grad {grads[1.0]:.3g} (want 0)"
    neg_ok = grads[-1.0] > 0.0
    ok = pos_ok and neg_ok
    return CheckResult("clip_direction", ok, f"ρ = {rho:g}: {pos_txt}; A<0: loss grad {grads[-1.0]:.3g} (want > 0)")


def run_pre_step_checks(
    *,
    model,
    trajs,
    rows,
    pad_id,
    stop_ids,
    logprob_fn,
    cfg,
    ucfg: UpdateConfig,
    expected: set[int] | None = None,
    console=None,
) -> list[CheckResult]:
    """All five checks on the first batch; prints the table; raises on a failure.

    Raises:
        PreStepCheckError: any check failed (message lists each failure and the flag
            that skips the checks).
    """
    results = [
        check_ratio(model, rows, pad_id, logprob_fn, cfg.temperature, dtype=getattr(cfg, "dtype", "float32"))
        if rows
        else CheckResult("ratio", False, "no training rows in the first batch"),
        check_mask(trajs, rows, stop_ids, expected),
        check_groups(trajs),
        check_zero_gradient(model, rows, cfg.advantage, ucfg, pad_id, logprob_fn)
        if rows
        else CheckResult("zero_gradient", None, "n/a: no rows"),
        check_clip_direction(ucfg),
    ]
    if console is not None:
        _print(results, console)
    failed = [r for r in results if r.passed is False]
    if failed:
        raise PreStepCheckError(
            "checks before the first optimizer step failed:\n"
            + "\n".join(f"  {r.name}: {r.detail}" for r in failed)
            + "\nFix the cause; --skip-checks runs anyway "
            "(recorded in manifest.json)."
        )
    return results


def _print(results: list[CheckResult], console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="checks before the first optimizer step (docs/design.md §6)")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for r in results:
        mark = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[dim]n/a[/]"}[r.passed]
        table.add_row(r.name, mark, escape(r.detail))
    console.print(table)
