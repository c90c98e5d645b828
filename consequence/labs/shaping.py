"""Lab ``shaping``: potential-based shaping keeps the ranking of policies; a bonus does not.

A small episodic MDP that mirrors the repair task, with a budget of T = 10 actions and
discount γ = 0.95. Actions: ``run_tests`` (reveals whether the bug is fixed; afterwards a
patch is better informed), ``patch`` (fixes the bug with probability 0.8 once tests have
been run, 0.3 blind), ``finish`` (ends the episode with reward 1 if fixed, 0 if not).
Running out of budget ends the episode with reward 0. Every episode ends in the absorbing
terminal state.

Each named policy's expected discounted return is computed exactly, by enumerating the
patch outcomes, under three rewards:

- true: the task reward;
- shaped: true + F(s, s') with F = γΦ(s') − Φ(s) (Ng, Harada & Russell 1999), Φ(s) =
  0.2 + 0.5·[tests have been run] on non-terminal states and Φ(terminal) = 0. The shaping
  terms telescope to γ^T Φ(s_T) − Φ(s_0) = −Φ(s_0) = −0.2 on every episode, so every
  policy's return moves by the same −0.2 and the ranking is unchanged;
- bonus: true + 0.1 per ``run_tests`` call (not a potential difference): stalling on tests
  now beats fixing the bug quickly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from consequence.figures import pyplot, save_figure

T, GAMMA = 10, 0.95
P_PATCH_TESTED, P_PATCH_BLIND = 0.8, 0.3
BONUS = 0.1
PHI0, PHI_TESTED = 0.2, 0.5

# observation the policy sees: (t, n_patches, last_test) with last_test in {None, "fail", "pass"}
Obs = tuple[int, int, "str | None"]


def _retry(obs: Obs) -> str:
    t, n_patches, last = obs
    if last is None:  # start: test; after the first patch: retest; after the second: finish
        return ("run_tests", "run_tests", "finish")[n_patches]
    return "finish" if last == "pass" else "patch"


POLICIES: dict[str, Callable[[Obs], str]] = {
    "patch blind, finish": lambda o: ["patch", "finish"][min(o[0], 1)],
    "patch blind x2, finish": lambda o: ["patch", "patch", "finish"][min(o[0], 2)],
    "test, patch, finish": lambda o: ["run_tests", "patch", "finish"][min(o[0], 2)],
    "test, patch, retest, repatch if failing, finish": _retry,
    "stall: test x8, patch, finish": lambda o: "run_tests" if o[0] < 8 else ("patch" if o[0] == 8 else "finish"),
    "spam tests until budget": lambda o: "run_tests",
}
HONEST = "test, patch, retest, repatch if failing, finish"
STALL = "stall: test x8, patch, finish"


def phi(tested: bool, done: bool) -> float:
    """Potential Φ(s): 0.2 + 0.5·[tests have been run]; 0 at the terminal state."""
    return 0.0 if done else PHI0 + PHI_TESTED * tested


def _reward(kind: str, r_true: float, action: str, s: tuple[bool, bool], s2: tuple[bool, bool]) -> float:
    if kind == "true":
        return r_true
    if kind == "shaped":
        return r_true + GAMMA * phi(*s2) - phi(*s)
    if kind == "bonus":
        return r_true + BONUS * (action == "run_tests")
    raise ValueError(f"unknown reward {kind!r}")


def expected_return(policy: Callable[[Obs], str], kind: str) -> float:
    """Exact expected discounted return of ``policy`` under reward ``kind`` (true/shaped/bonus)."""

    def value(t: int, tested: bool, fixed: bool, n_patches: int, last: str | None) -> float:
        action = policy((t, n_patches, last))
        # outcomes: (prob, tested', fixed', last', done, true reward)
        outs: list[tuple[float, bool, bool, str | None, bool, float]]
        if action == "run_tests":
            outs = [(1.0, True, fixed, "pass" if fixed else "fail", False, 0.0)]
        elif action == "patch":
            p = 1.0 if fixed else (P_PATCH_TESTED if tested else P_PATCH_BLIND)
            outs = [(q, tested, f, None, False, 0.0) for q, f in ((p, True), (1.0 - p, False)) if q > 0]
        elif action == "finish":
            outs = [(1.0, tested, fixed, last, True, float(fixed))]
        else:
            raise ValueError(f"unknown action {action!r}")
        total = 0.0
        for q, tested2, fixed2, last2, done, r in outs:
            done = done or t + 1 == T  # out of budget: the episode ends with no task reward
            r = _reward(kind, r, action, (tested, False), (tested2, done))
            cont = 0.0 if done else GAMMA * value(t + 1, tested2, fixed2, n_patches + (action == "patch"), last2)
            total += q * (r + cont)
        return total

    return value(0, False, False, 0, None)


def ranking(returns: dict[str, float]) -> list[str]:
    """Policy names from best to worst expected return."""
    return sorted(returns, key=lambda n: -returns[n])


def run(out_dir: Path, seed: int = 0) -> dict:
    kinds = ("true", "shaped", "bonus")
    rets = {k: {n: expected_return(pol, k) for n, pol in POLICIES.items()} for k in kinds}
    out: dict = {}
    for k in kinds:
        for n in POLICIES:
            out[f"{k}: {n}"] = rets[k][n]
    for n in POLICIES:
        out[f"shaped - true: {n}"] = rets["shaped"][n] - rets["true"][n]
    out["expected shift Φ(s_T) - Φ(s_0)"] = phi(False, True) - phi(False, False)
    for k in kinds:
        out[f"ranking {k}"] = " > ".join(str(list(POLICIES).index(n) + 1) for n in ranking(rets[k]))
    out["same ranking true/shaped"] = ranking(rets["true"]) == ranking(rets["shaped"])
    out["same ranking true/bonus"] = ranking(rets["true"]) == ranking(rets["bonus"])

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.8))
    x = np.arange(len(POLICIES))
    for j, (k, lab) in enumerate(
        zip(kinds, ("true reward", "true + γΦ(s')−Φ(s), Φ = 0.2 + 0.5·[tested]", f"true + {BONUS} per run_tests"))
    ):
        vals = [rets[k][n] for n in POLICIES]
        ax.bar(x + (j - 1) * 0.27, vals, 0.27, label=f"{lab}  (ranking {out['ranking ' + k]})")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x, [f"{i + 1}. {n}" for i, n in enumerate(POLICIES)], rotation=15, ha="right", fontsize=8)
    ax.set(title=f"exact expected return of each policy (budget {T}, γ = {GAMMA})", ylabel="expected return")
    ax.legend(fontsize=8)
    out["png"] = str(save_figure(fig, out_dir, "shaping"))
    return out
