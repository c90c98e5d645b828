"""The collected cases (docs/cases.md) on the paths a real run takes, not only in the fixed function."""

import math
from types import SimpleNamespace

import pytest
import torch

from consequence.config import TrainConfig
from consequence.loop.learner import credit, logprob_fn
from consequence.policy.logprobs import process_logits, token_logprobs
from consequence.records import ModelCall, TrainingRow, Trajectory
from consequence.update.step import UpdateConfig, accumulate_gradients

NO_CRITIC = SimpleNamespace(reference=None, critic=None, teacher=None)


def _traj(sample_id, reward, outcome="finished", calls=1):
    t = Trajectory(
        task_id="p#0",
        group_id="p#0@0",
        sample_id=sample_id,
        seed=sample_id,
        policy_version=0,
        calls=[ModelCall([1, 2 + k], [3, 4], [-0.1, -0.2], "stop") for k in range(calls)],
        outcome=outcome,
        reward=reward,
    )
    return t


def test_case_03_11_an_env_error_leaves_the_training_batch_and_the_baseline():
    # rewards [1, 0, 1, <verifier crashed>]: mean 2/3 and population std sqrt(2)/3 over the three
    trajs = [_traj(0, 1.0), _traj(1, 0.0), _traj(2, 1.0), _traj(3, None, outcome="env_error")]
    batch = credit(trajs, TrainConfig(advantage="grpo"), NO_CRITIC, pad_id=0)
    s = math.sqrt(2) / 3
    assert [t.advantage for t in trajs[:3]] == pytest.approx([(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s], abs=1e-5)
    assert trajs[3].advantage is None
    assert [r.traj_index for r in batch.rows] == [0, 1, 2]  # no row of the failed rollout
    assert batch.advantages == pytest.approx([0.7071, -1.4142, 0.7071], abs=1e-4)


def test_case_05_a_truncated_episode_enters_the_baseline_and_overlong_filtering_drops_its_rows():
    # truncated in the third of three calls: outcome truncated, reward 0
    trajs = [_traj(0, 1.0), _traj(1, 0.0, outcome="truncated", calls=3)]
    batch = credit(trajs, TrainConfig(advantage="grpo", overlong_filter=True), NO_CRITIC, pad_id=0)
    assert [t.advantage for t in trajs] == pytest.approx([1.0, -1.0], abs=1e-5)  # it counted in the group
    assert [r.traj_index for r in batch.rows] == [0] and batch.advantages == pytest.approx([1.0], abs=1e-5)
    kept = credit(
        [_traj(0, 1.0), _traj(1, 0.0, outcome="truncated", calls=3)], TrainConfig(advantage="grpo"), NO_CRITIC, pad_id=0
    )
    assert sorted({r.traj_index for r in kept.rows}) == [0, 1]  # without the filter it is trained on


@pytest.mark.slow
def test_case_04_humaneval_prompt_too_long_stays_in_n():
    from consequence.envs.humaneval.code_tasks import load_humaneval
    from consequence.evaluate.completions import score_completions

    tasks = load_humaneval()
    a, b = tasks[0], tasks[2]
    good_a = a.reference_code[len(a.prompt) :]
    res = score_completions([a, b], [[good_a], [""]], ks=(1,), flags=[["stop"], ["too_long"]])
    assert res.pass_at_k[1] == pytest.approx(0.5)  # not 1/1 = 1.0 with the long prompt dropped
    assert res.prompt_too_long == 1 and res.samples == 2


def test_case_06_07_temperature_is_applied_before_top_p():
    # z = [2, 1, 0] at T = 0.5 gives p = [0.867, 0.117, 0.016]: top-p 0.8 keeps only token 0
    lp = torch.log_softmax(process_logits(torch.tensor([2.0, 1.0, 0.0]), temperature=0.5, top_p=0.8), -1)
    assert lp[0].item() == pytest.approx(0.0, abs=1e-6)
    # top-p first (at T = 1, p = [0.665, 0.245, 0.090]) would keep two tokens and give -0.1269
    wrong = torch.log_softmax(torch.tensor([2.0, 1.0]) / 0.5, -1)[0].item()
    assert wrong == pytest.approx(-0.1269, abs=1e-4) and lp[0].item() != pytest.approx(wrong, abs=1e-3)


class _ToyLM(torch.nn.Module):
    def __init__(self, vocab=11):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, input_ids, attention_mask=None):
        h = torch.tanh(self.emb(input_ids).cumsum(1))
        return SimpleNamespace(logits=self.head(h))


def test_case_07_training_uses_the_samplers_top_p_through_logprob_fn():
    model = _ToyLM()
    rows = []
    for start in ([1, 2], [3, 4], [5, 6]):
        ids = list(start)
        with torch.no_grad():
            for _ in range(4):  # greedy tokens: inside the top-p support whatever p is
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            lp, _ = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids)), top_p=0.8)
        mask = [0, 0, 1, 1, 1, 1]
        rows.append(TrainingRow(ids, mask, [0.0] + [float(x) if m else 0.0 for x, m in zip(lp[0], mask[1:])]))
    adv = [1.0, -1.0, 0.5]
    m = accumulate_gradients(model, rows, adv, UpdateConfig(), 0, logprob_fn(TrainConfig(top_p=0.8)))
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    model.zero_grad(set_to_none=True)
    m1 = accumulate_gradients(model, rows, adv, UpdateConfig(), 0, logprob_fn(TrainConfig()))
    assert m1["ratio_mean"] < 1.0 - 1e-3  # negative control: the full softmax puts mass off the support


def test_case_13_two_tool_calls_in_one_sampled_turn_share_one_observation(tmp_path):
    from consequence.distill.warmstart import BUNDLED
    from consequence.envs.repair.env import SYSTEM_PROMPT, TOOLS, RepairEnv
    from consequence.envs.repair.problems import load_split, make_tasks
    from consequence.harness.renderer import Renderer
    from consequence.policy.sampler import Sample
    from consequence.policy.tiny import load_policy
    from consequence.records import trajectory_to_rows
    from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes

    renderer = Renderer(load_policy(BUNDLED)[1], TOOLS)
    task = make_tasks(load_split(0)["validation"], 1, seed=0)[0]
    turns = [
        renderer.format_call("run_tests", {}) + "\n" + renderer.format_call("read_code", {}),
        renderer.format_call("finish", {}),
    ]

    def gen(prompts, max_new, idx):
        text = turns[min(len(gen.calls), 1)]
        gen.calls.append(prompts[0])
        ids = renderer.encode(text) + [renderer.eot_id]
        return [Sample(ids, [0.0] * len(ids), "stop")]

    gen.calls = []

    [t] = run_episodes(
        gen,
        renderer,
        [EpisodeSpec(RepairEnv(task), task.task_id, task.task_id, 0, 0)],
        Budgets(max_new_tokens=96),
        SYSTEM_PROMPT,
    )
    assert t.outcome == "finished" and t.n_tool_calls == 3
    [row] = trajectory_to_rows(t)
    first, second = t.calls
    assert len(row.input_ids) == len(row.loss_mask) == len(row.old_logprobs)
    # exact mask: context, sampled turn 1 (both calls + end-of-turn), ONE observation, turn 2
    assert row.loss_mask == (
        [0] * len(first.context_ids)
        + [1] * len(first.output_ids)
        + [0] * len(first.observation_ids)
        + [1] * len(second.output_ids)
    )
    obs = renderer.tokenizer.decode(first.observation_ids)
    assert obs.count("<tool_response>") == 2 and second.context_ids == row.input_ids[: len(second.context_ids)]
    # the row is the template's own rendering of the conversation (no re-tokenisation drift)
    text = renderer.render_text(t.messages[:-2], add_generation_prompt=True)  # before the finish turn
    assert renderer.tokenizer.decode(second.context_ids) == text


def test_case_08_a_template_that_rewrites_earlier_turns_is_refused(tiny_tokenizer):
    import copy

    from consequence.harness.renderer import Renderer

    tok = copy.deepcopy(tiny_tokenizer)
    # the turn count is printed first, so every new message changes the text before it
    tok.chat_template = (
        "{{ messages|length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    r = Renderer(tok, [])
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    with pytest.raises(ValueError, match="re-renders earlier turns differently"):
        r.observation_ids(history, {"role": "assistant", "content": "a"}, [{"role": "tool", "content": "ok"}])
