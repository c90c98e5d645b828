"""SFT on demonstration records (distill/sft.py): the loss is the token mean over the whole
optimizer step (hand-computed), the same for every micro-batch split, and only the policy's
own tokens are targets (observations are context)."""

from __future__ import annotations

import pytest
import torch

from consequence.distill.sft import SFTConfig, sft_step_gradients, train_sft
from consequence.policy.tiny import BUNDLED, load_policy
from consequence.records import TrainingRow


class _Scale(torch.nn.Module):
    """logπ of every target = w · c[position]: the loss and its gradient by hand."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))


def _lp_fn(model, input_ids, attention_mask):
    c = -(input_ids[:, 1:].float() / 10.0)  # token id t at position j+1 scores -t/10 · w
    return model.w * c * attention_mask[:, 1:], None


def test_step_loss_is_the_token_mean_over_the_whole_step_by_hand():
    rows = [
        TrainingRow([1, 2, 3, 4], [0, 0, 1, 1], [0.0] * 4),  # targets: ids 3, 4
        TrainingRow([5, 6], [0, 1], [0.0] * 2),  # target: id 6
        TrainingRow([7, 8, 9], [0, 1, 0], [0.0] * 3),
    ]  # target: id 8 (id 9 is an observation)
    model = _Scale()
    m = sft_step_gradients(model, rows, 0, micro_batch_size=2, logprob_fn=_lp_fn)
    # L = -(1/T) Σ logπ = -(1/4) · (-(3 + 4 + 6 + 8) / 10) = 0.525, dL/dw the same (logπ linear in w)
    assert m["n_targets"] == 4 and m["loss"] == pytest.approx(0.525)
    assert float(model.w.grad) == pytest.approx(0.525)


def _rows(tok):
    texts = ["def f(x):\n    return x + 1", "print('hi')", "for i in range(3):\n    pass", "x = [1, 2, 3]"]
    rows = []
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False)
        mask = [0] * 3 + [1] * (len(ids) - 3)
        rows.append(TrainingRow(ids, mask, [0.0] * len(ids)))
    return rows


def test_the_step_gradient_does_not_depend_on_the_micro_batch_split():
    model, tok = load_policy(BUNDLED)
    rows = _rows(tok)
    grads = []
    for micro in (4, 1, 3):
        model.zero_grad(set_to_none=True)
        sft_step_gradients(model, rows, tok.pad_token_id, micro)
        grads.append([p.grad.clone() for p in model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_train_sft_lowers_the_loss_and_refuses_rows_without_targets():
    model, tok = load_policy(BUNDLED)
    rows = _rows(tok)
    seen = []
    losses = train_sft(
        model,
        rows,
        tok.pad_token_id,
        SFTConfig(learning_rate=1e-3, epochs=10, rows_per_step=4, micro_batch_size=2),
        log=lambda _: None,
        progress=lambda s, n, loss: seen.append((s, n)),
    )
    assert len(losses) == 10 and seen[-1] == (10, 10)
    assert losses[-1] < 0.5 * losses[0]
    with pytest.raises(ValueError, match="without a target token"):
        sft_step_gradients(model, [TrainingRow([1, 2], [1, 0], [0.0, 0.0])], 0, 1)
    with pytest.raises(ValueError, match="rows_per_step"):
        SFTConfig(rows_per_step=0)


@pytest.mark.slow
def test_cli_sft_cold_start_writes_a_model_that_loads(tmp_path):
    """``consequence sft``: teacher demos in the student's format, LoRA SFT merged into a
    plain folder with sft.json whose counts add up; an environment without a demonstrator
    (and no --demos-file) is refused before any work."""
    import json

    from typer.testing import CliRunner

    from consequence.cli import app

    out = tmp_path / "sft"
    res = CliRunner().invoke(
        app,
        [
            "sft",
            "--model",
            str(BUNDLED),
            "--demos",
            "8",
            "--epochs",
            "1",
            "--rows-per-step",
            "4",
            "--micro-batch-size",
            "2",
            "--lora-rank",
            "4",
            "--out",
            str(out),
        ],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "sft.json").read_text())
    assert {k: rec["teacher"][k] for k in ("kind", "episodes", "verified", "rejected", "acceptance_rate")} == {
        "kind": "scripted",
        "episodes": 8,
        "verified": 8,
        "rejected": {},
        "acceptance_rate": 1.0,
    }
    assert rec["rows"] == 8 and len(rec["losses"]) == 2  # int(1 epoch · 8 rows / 4 per step)
    assert 0 < rec["targets"] < rec["tokens"]  # the prompts and observations are context
    assert rec["tool_format"] == "native" and rec["settings"]["lora_rank"] == 4
    assert not (out / "adapter_config.json").exists()  # merged: a plain model folder
    model, _ = load_policy(out)
    base, _ = load_policy(BUNDLED)
    with torch.no_grad():
        moved = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), base.parameters()))
    assert moved > 0
    bad = CliRunner().invoke(
        app,
        ["sft", "--model", str(BUNDLED), "--env", "humaneval", "--out", str(tmp_path / "no")],
        env={"COLUMNS": "400"},
    )
    assert bad.exit_code == 2 and "no demonstrator" in bad.output and "--demos-file" in bad.output
    assert not (tmp_path / "no").exists()
