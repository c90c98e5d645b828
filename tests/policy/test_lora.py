"""LoRA through PEFT (policy/lora.py; issue 15): the sampler generates with the adapter the
trainer updates, so the behaviour/trainer ratio is 1 at every iteration, not only the
first; checkpoints hold the adapter, resume reproduces an uninterrupted run, and the
merged model's logits equal adapter + base.

All on the bundled tiny Llama (1.9 M parameters): the code paths are the ones SmolLM2 takes
(same architecture class, same fast sampler, same PEFT layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from typer.testing import CliRunner

from consequence.config import TrainConfig
from consequence.policy.logprobs import token_logprobs
from consequence.policy.lora import DEFAULT_TARGETS, apply_lora, effective_weight, is_peft
from consequence.policy.sampler import SamplingParams, generate
from consequence.policy.tiny import BUNDLED, load_policy
from consequence.records import read_trajectories
from reward_signal import ODD_SAMPLES_WIN


def _lora_tiny(rank=4, alpha=8.0, perturb=0.0, seed=0):
    model, tok = load_policy(BUNDLED)
    peft = apply_lora(model, rank, alpha, list(DEFAULT_TARGETS), BUNDLED)
    if perturb:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * perturb)
    return peft, tok


def _ids(tok, texts):
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_a_fresh_adapter_is_the_base_model_and_only_it_trains():
    base, tok = load_policy(BUNDLED)
    ids = torch.tensor(_ids(tok, ["def f(x):\n    return x + 1"]))
    with torch.no_grad():
        want = base(input_ids=ids).logits
    peft, _ = _lora_tiny(rank=4, alpha=8.0)
    with torch.no_grad():
        got = peft(input_ids=ids).logits
    assert torch.equal(got, want)  # B = 0 at the start (Hu et al. 2021, §4.1)
    trainable = {n for n, p in peft.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    n_layers = peft.config.num_hidden_layers
    assert len(trainable) == 2 * len(DEFAULT_TARGETS) * n_layers
    # the effective weight of one adapted layer is W0 + (alpha / r) B A, computed directly
    q = peft.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q.lora_B["default"].weight.fill_(0.01)
        direct = q.base_layer.weight + (8.0 / 4) * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(effective_weight(q), direct, atol=1e-7, rtol=0)


def test_the_sampler_generates_with_the_adapter_not_the_base_weights():
    """Sampled log-probs equal the trainer's under the adapter; under the base weights they do
    not (what an adapter that never reached the inference side would give)."""
    peft, tok = _lora_tiny(rank=4, alpha=8.0, perturb=0.05)
    prompts = _ids(tok, ["def add(a, b):", "import math\nx ="])
    samples = generate(
        peft, prompts, SamplingParams(1.0, 0, 1.0, 12), stop_ids=set(), generator=torch.Generator().manual_seed(3)
    )
    for prompt, s in zip(prompts, samples):
        ids = torch.tensor([prompt + s.output_ids])
        am = torch.ones_like(ids)
        with torch.no_grad():
            lp, _ = token_logprobs(peft, ids, am)
            with peft.disable_adapter():
                lp_base, _ = token_logprobs(peft, ids, am)
        mu = torch.tensor(s.logprobs)
        got, base = lp[0, len(prompt) - 1 :], lp_base[0, len(prompt) - 1 :]
        torch.testing.assert_close(got, mu, atol=1e-4, rtol=0)
        assert float((base - mu).abs().max()) > 0.05


def _cfg(run: Path, **kw) -> TrainConfig:
    return TrainConfig(
        run_dir=str(run),
        model=str(BUNDLED),
        env=ODD_SAMPLES_WIN,  # odd samples win, so that the adapter moves
        iterations=2,
        tasks_per_iteration=2,
        group_size=4,
        eval_every=0,
        final_eval_episodes=0,
        max_turns=3,
        max_new_tokens=24,
        lora_rank=8,
        lora_alpha=16.0,
        learning_rate=2e-2,
        **kw,
    )


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two LoRA iterations (odd samples win, so the adapter moves), pre-step checks on."""
    from consequence.loop.train import train

    run = tmp_path_factory.mktemp("lora") / "run"
    train(_cfg(run), Console(quiet=True))
    return run


@pytest.mark.slow
def test_two_lora_iterations_keep_the_ratio_at_one_while_the_policy_moves(lora_run):
    run = lora_run
    m = _metrics(run)
    assert [x["iteration"] for x in m] == [0, 1]
    for x in m:  # behaviour (sampler) vs trainer log-probs of the same tokens before each step
        assert abs(x["first_step_ratio_min"] - 1) < 1e-4 and abs(x["first_step_ratio_max"] - 1) < 1e-4, x
        assert x["grad_norm"] > 0
    # the ratio of iteration 1 is not trivially 1: its rollouts are far from the base model's
    base, tok = load_policy(BUNDLED)
    worst = 0.0
    for t in read_trajectories(run / "trajectories" / "iter_0001.parquet")[:4]:
        for call in t.calls:
            ids = torch.tensor([call.context_ids + call.output_ids])
            with torch.no_grad():
                lp, _ = token_logprobs(base, ids, torch.ones_like(ids))
            got = lp[0, len(call.context_ids) - 1 :]
            worst = max(worst, float((got - torch.tensor(call.sample_logprobs)).abs().max()))
    assert worst > 1e-2, worst
    final = run / "checkpoints" / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and Path(cfg["base_model_name_or_path"]) == BUNDLED.resolve()
    weights = load_file(final / "adapter_model.safetensors")
    assert any("lora_B" in k and float(v.abs().max()) > 0 for k, v in weights.items())
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["policy_training"]["lora"] == {"rank": 8, "alpha": 16.0, "targets": list(DEFAULT_TARGETS)}
    n = sum(v.numel() for v in weights.values())
    assert manifest["policy_training"]["trainable_parameters"] == n


@pytest.mark.slow
def test_resume_of_a_lora_run_matches_the_uninterrupted_one(lora_run, tmp_path):
    from consequence.loop.sources import Rollouts
    from consequence.loop.train import train

    run = lora_run
    real = Rollouts.next_batch

    def crash_in_second(self, it, *args, **kwargs):
        if it == 1:
            raise KeyboardInterrupt  # stands in for a kill after the first state was written
        return real(self, it, *args, **kwargs)

    other = tmp_path / "b"
    with pytest.MonkeyPatch.context() as m2, pytest.raises(KeyboardInterrupt):
        m2.setattr(Rollouts, "next_batch", crash_in_second)
        train(_cfg(other), Console(quiet=True))
    assert (other / "checkpoints" / "state-0001" / "policy" / "adapter_model.safetensors").is_file()
    train(_cfg(other), Console(quiet=True), resume=True)
    for x, y in zip(_metrics(run), _metrics(other), strict=True):
        for k in ("loss", "grad_norm", "reward_mean", "entropy", "first_step_ratio_max"):
            assert abs(x[k] - y[k]) <= 1e-6, (x["iteration"], k, x[k], y[k])
    wa = load_file(run / "checkpoints" / "final" / "adapter_model.safetensors")
    wb = load_file(other / "checkpoints" / "final" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)


@pytest.mark.slow
def test_merge_gives_a_plain_model_with_the_adapter_logits(lora_run, tmp_path):
    from consequence.cli import app

    run = lora_run
    final = run / "checkpoints" / "final"
    out = tmp_path / "merged"
    res = CliRunner().invoke(app, ["merge", str(final), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    adapter, tok = load_policy(final)
    merged, _ = load_policy(out)
    assert is_peft(adapter) and not is_peft(merged)
    ids = torch.tensor(_ids(tok, ["def f(x):\n    return x * 2\n", "print(f(3))"])[:1])
    with torch.no_grad():
        a, b = adapter(input_ids=ids).logits, merged(input_ids=ids).logits
    assert float((a - b).abs().max()) < 1e-5
    base, _ = load_policy(BUNDLED)
    with torch.no_grad():
        assert float((base(input_ids=ids).logits - a).abs().max()) > 1e-3  # the adapter changed the model
    # refusals: not an adapter; writing over the adapter itself
    again = CliRunner().invoke(app, ["merge", str(out), "--out", str(tmp_path / "m2")])
    assert again.exit_code == 2 and "not a LoRA adapter checkpoint" in again.output
    same = CliRunner().invoke(app, ["merge", str(final), "--out", str(final)])
    assert same.exit_code == 2 and "is the adapter folder" in same.output


@pytest.mark.slow
def test_bad_lora_settings_are_refused_before_anything_is_written(lora_run, tmp_path):
    from consequence.loop.train import train

    run = lora_run
    with pytest.raises(ValueError, match="--lora-targets nope: no linear layer"):
        train(_cfg(tmp_path / "t", lora_targets="q_proj,nope"), Console(quiet=True))
    assert not (tmp_path / "t").exists()
    with pytest.raises(ValueError, match="is a LoRA adapter checkpoint: fold it"):
        train(
            _cfg(tmp_path / "u").model_copy(update={"model": str(run / "checkpoints" / "final")}), Console(quiet=True)
        )
    assert not (tmp_path / "u").exists()
    with pytest.raises(
        ValueError, match="--advantage gae .a learned value head, as the ppo recipe uses. is not supported"
    ):
        _cfg(tmp_path / "v", advantage="gae")
    assert TrainConfig(lora_rank=4, lora_targets="q_proj, v_proj,q_proj").lora_targets == ["q_proj", "v_proj"]


@pytest.mark.slow
def test_merge_refuses_every_out_that_would_destroy_something(lora_run, tmp_path, monkeypatch):
    """--out may be a new folder or an earlier merge; never the adapter, its run, its base,
    a file, or a folder of other files. Nothing is written or deleted on a refusal."""
    from consequence.cli import app

    run = lora_run
    final = run / "checkpoints" / "final"
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("keep me")
    (tmp_path / "afile").write_text("x")
    cases = {
        str(run): "inside it or above it",
        str(final / "sub"): "inside it or above it",
        str(BUNDLED): "base model",
        str(notes): "holds other files",
        str(tmp_path / "afile"): "existing file",
    }
    before = sorted(p.name for p in run.rglob("*"))
    for out, why in cases.items():
        res = CliRunner().invoke(app, ["merge", str(final), "--out", out])
        assert res.exit_code == 2 and why in res.output, (out, res.output)
    monkeypatch.chdir(notes)  # "." is the current folder: refused like any folder of other files
    res = CliRunner().invoke(app, ["merge", str(final), "--out", "."])
    assert res.exit_code == 2 and "holds other files" in res.output
    assert (notes / "mine.txt").read_text() == "keep me" and sorted(p.name for p in run.rglob("*")) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    out = tmp_path / "merged"
    assert CliRunner().invoke(app, ["merge", str(final), "--out", str(out)]).exit_code == 0
    assert (
        CliRunner().invoke(app, ["merge", str(final), "--out", str(out)]).exit_code == 0
    )  # an earlier merge: replaced


@pytest.mark.slow
def test_evaluation_and_the_viewer_find_an_adapter_checkpoint(lora_run):
    from consequence.evaluate.run import resolve_model
    from consequence.report.viewer import checkpoint_after

    run = lora_run
    final = run / "checkpoints" / "final"
    assert resolve_model(str(run)) == final and resolve_model(str(final)) == final
    assert checkpoint_after(run, 1) == final
    assert not (final / "README.md").exists()  # PEFT's empty model-card template is not kept


def test_lora_settings_without_lora_and_impossible_adapters_are_refused():
    with pytest.raises(ValueError, match="--lora-targets is a LoRA setting, but --lora-rank is 0"):
        TrainConfig(lora_targets="q_proj")
    with pytest.raises(ValueError, match="--lora-alpha is a LoRA setting"):
        TrainConfig(lora_alpha=64)
    assert TrainConfig(**TrainConfig().model_dump()).lora_rank == 0  # a saved config.yaml reloads (resume)
    model, _ = load_policy(BUNDLED)
    with pytest.raises(ValueError, match="--lora-rank 100000 is above the smallest dimension"):
        apply_lora(model, 100000, 8.0, ["q_proj"], BUNDLED)
    with pytest.raises(ValueError, match="ties its LM head to the input embedding"):
        apply_lora(model, 4, 8.0, ["lm_head"], BUNDLED)
