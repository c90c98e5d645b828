"""`consequence train --model PATH` with other Hugging Face architectures (built locally)."""

import json

import pytest
import transformers

from consequence.config import TrainConfig
from consequence.distill.warmstart import BUNDLED
from consequence.policy.tiny import load_policy, save_policy


def _config(kind, vocab):
    if kind == "qwen2":  # fast sampling path (Llama-style blocks)
        return transformers.Qwen2Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
    return transformers.GPT2Config(
        vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=1024
    )  # HF fallback path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_train_runs_on_a_local_checkpoint_of_another_architecture(tmp_path, kind):
    from rich.console import Console

    from consequence.loop.train import train

    _, tok = load_policy(BUNDLED)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, len(tok)))
    save_policy(model, tok, tmp_path / "model")
    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"),
        model=str(tmp_path / "model"),
        iterations=1,
        tasks_per_iteration=2,
        group_size=2,
        eval_every=0,
        final_eval_episodes=3,
        final_eval_decoding=["greedy"],
        final_eval_splits=["test"],
        max_turns=2,
        max_new_tokens=8,
    )
    train(cfg, Console(quiet=True))
    [m] = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # a random model rarely calls a tool: its episodes end by budget, and each is recorded
    assert m["truncated_fraction"] + m["success"] <= 1.0 and m["gen_tokens_mean"] > 0
    assert (tmp_path / "run" / "checkpoints" / "final" / "config.json").exists()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [r["split"] for r in report["results"]] == ["test (unseen problems)"]  # --final-eval-splits test
    assert sorted(p.name for p in (tmp_path / "run" / "eval").iterdir()) == [
        "test-greedy-rl.parquet",
        "test-greedy-warmstart.parquet",
    ]
    assert [t["split"] for t in report["splits_touched"] if t["purpose"].startswith("final")] == ["test"]
