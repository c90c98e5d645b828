"""Episodes in flight at once (``run_episodes(max_live=...)``) and the K/V bound that sets it.

A large evaluation (60 problems × n = 8 of SmolLM2) once ran all 480 episodes in one batch
and held 16.7 GB of K/V; waves bound that without changing any episode.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes
from consequence.rollout.sampling import episodes_in_flight, kv_bytes_per_token


class _Echo:
    """An environment of ``turns`` tool calls: each ``echo`` call returns its text; any answer ends it."""

    answer_ends_episode = True

    def reset(self, seed=None):
        return f"task seed {seed}", {}

    def step(self, action):
        if "answer" in action:
            return "", 1.0, True, False, {}
        return f"echo {action['arguments'].get('text', '')}", 0.0, False, False, {}


def _script(renderer, turns_by_episode, calls):
    """A generate_fn replaying each episode's turns in order; it records the episode indices of every call."""
    queues = [[renderer.encode(t) + [renderer.eot_id] for t in turns] for turns in turns_by_episode]

    def generate(prompts, max_new_tokens, idx):
        calls.append(list(idx))
        outs = [queues[i].pop(0) for i in idx]
        return [SimpleNamespace(output_ids=o, logprobs=[-0.5] * len(o), stop_reason="stop") for o in outs]

    return generate


def _turns(renderer):
    call = renderer.format_call("run_tests", {})
    # episodes of 3, 1, 2, 1 and 3 model calls: waves end at different turns
    return [[call, call, "done 0"], ["done 1"], [call, "done 2"], ["done 3"], [call, call, "done 4"]]


def _run(renderer, max_live):
    calls: list[list[int]] = []
    shown: list[int] = []
    specs = [EpisodeSpec(_Echo(), f"t{i}", f"t{i}", 0, 100 + i) for i in range(5)]
    trajs = run_episodes(
        _script(renderer, _turns(renderer), calls),
        renderer,
        specs,
        Budgets(max_turns=4),
        "sys",
        progress=shown.append,
        max_live=max_live,
    )
    return trajs, calls, shown


def test_waves_bound_the_batch_and_change_no_episode(renderer):
    whole, whole_calls, _ = _run(renderer, None)
    waved, calls, shown = _run(renderer, 2)
    assert whole_calls == [[0, 1, 2, 3, 4], [0, 2, 4], [0, 4]]
    # waves {0, 1}, {2, 3}, {4}: each runs to its end, episodes keep their global index (stream, cache key)
    assert calls == [[0, 1], [0], [0], [2, 3], [2], [4], [4], [4]]
    assert [t.messages for t in waved] == [t.messages for t in whole]
    assert [(t.outcome, t.n_tool_calls, t.seed) for t in waved] == [(t.outcome, t.n_tool_calls, t.seed) for t in whole]
    assert [len(t.calls) for t in waved] == [3, 1, 2, 1, 3]
    assert shown == sorted(shown) and shown[-1] == 5  # progress counts earlier waves' episodes


def test_max_live_below_one_is_refused(renderer):
    with pytest.raises(ValueError, match="max_live"):
        _run(renderer, 0)


def test_kv_bytes_and_episodes_in_flight_by_hand():
    # SmolLM2-135M: 30 layers, 9 heads of 64 (hidden 576), 3 K/V heads, float32
    smol = torch.nn.Linear(1, 1)
    smol.config = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_bytes_per_token(smol) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert episodes_in_flight(smol, 1024) == (4 << 30) // (46_080 * 1024) == 91
    assert episodes_in_flight(smol, 1024, budget_bytes=1) == 1  # never 0: one episode always runs
    smol.half()
    assert kv_bytes_per_token(smol) == 23_040  # the parameters' dtype
    assert kv_bytes_per_token(torch.nn.Linear(1, 1)) is None and episodes_in_flight(torch.nn.Linear(1, 1), 8) is None
