"""Evaluation of single-turn completions (pass@k) on HumanEval tasks."""

import json
from pathlib import Path

import pytest

from consequence.envs.humaneval.code_tasks import load_humaneval
from consequence.evaluate import completions as comp
from consequence.sandbox.sandbox import ENV_RETRIES, TestReport

TINY = Path(comp.__file__).parents[1] / "assets" / "tiny-repair"


@pytest.fixture(scope="module")
def he():
    tasks = load_humaneval()
    return tasks[0], tasks[2]  # has_close_elements, truncate_number


def test_extract_completion_raw_cuts_at_stop_sequences(he):
    t = he[0]
    assert comp.extract_completion("    return 1\n\ndef other():\n    pass", t, "raw") == "    return 1\n"
    assert comp.extract_completion("    x = 1\n# done\n", t, "raw") == "    x = 1"
    assert comp.extract_completion("    return 2", t, "raw") == "    return 2"


@pytest.mark.slow
def test_extract_completion_chat_takes_the_defining_block(he):
    t = he[0]
    reply = (
        "Sure.\n```python\nimport math\n```\nand\n```python\n"
        "def has_close_elements(numbers, threshold):\n    return False\n```\nDone."
    )
    assert comp.extract_completion(reply, t, "chat") == (
        "\ndef has_close_elements(numbers, threshold):\n    return False\n"
    )
    assert comp.extract_completion("```\n    return True\n```", t, "chat") == "    return True\n"
    assert comp.extract_completion("no code", t, "chat") == "no code"
    with pytest.raises(ValueError, match="unknown prompt mode"):
        comp.extract_completion("", t, "json")


@pytest.mark.slow
def test_score_completions_pass_at_k_values(he):
    a, b = he
    good_a = a.reference_code[len(a.prompt) :]
    res = comp.score_completions(
        [a, b],
        [[good_a, "", good_a], ["", "", "    return 0.0\n"]],
        ks=(1, 2),
        flags=[["stop", "length", "stop"], ["stop"] * 3],
    )
    # task a: n=3, c=2 -> pass@1 2/3, pass@2 = 1 (n - c < k); task b: c=0
    assert [r["correct"] for r in res.per_task] == [2, 0]
    assert res.pass_at_k[1] == pytest.approx((2 / 3 + 0) / 2)
    assert res.pass_at_k[2] == pytest.approx(0.5)
    assert (res.samples, res.truncated, res.env_errors, res.tasks_excluded) == (6, 1, 0, {1: 0, 2: 0})
    lo, hi = res.ci[1]
    assert 0.0 <= lo <= res.pass_at_k[1] <= hi <= 2 / 3
    assert "pass@1 = 0.333" in res.summary()


def test_env_errors_are_retried_then_dropped_from_n(he, monkeypatch):
    calls = []

    def flaky(task, completion, limits=None):
        calls.append(completion)
        if completion == "broken":
            return TestReport("sandbox_error", 0, 1, [], "spawn failed")
        return TestReport("ok", 1 if completion == "good" else 0, 1)

    monkeypatch.setattr(comp, "verify_completion", flaky)
    res = comp.score_completions(list(he), [["good", "broken"], ["good", "bad"]], ks=(1, 2))
    assert calls.count("broken") == 1 + ENV_RETRIES  # the stated retry limit, then dropped
    row = res.per_task[0]
    assert (row["n"], row["n_valid"], row["env_errors"], row["pass@1"], row["pass@2"]) == (2, 1, 1, 1.0, None)
    # pass@2 only over task b (n=2, c=1 -> 1.0); pass@1 over both: (1/1 + 1/2) / 2
    assert res.tasks_excluded == {1: 0, 2: 1} and res.pass_at_k[2] == pytest.approx(1.0)
    assert res.pass_at_k[1] == pytest.approx(0.75)


@pytest.mark.slow
def test_evaluate_tiny_model_end_to_end(he, tmp_path):
    res = comp.evaluate_completions(TINY, list(he), n=2, ks=(1, 2), temperature=1.0, seed=3, max_new_tokens=8)
    assert res.settings["prompt_mode"] == "chat" and res.settings["n"] == 2
    assert res.samples == 4 and res.env_errors == 0
    assert res.pass_at_k == {1: 0.0, 2: 0.0}  # the tiny model was trained on tool calls only
    assert all(len(r["completions"]) == 2 for r in res.per_task)
    again = comp.evaluate_completions(TINY, list(he), n=2, ks=(1,), temperature=1.0, seed=3, max_new_tokens=8)
    assert [r["completions"] for r in again.per_task] == [r["completions"] for r in res.per_task]
    path = comp.save_eval(res, tmp_path / "eval.json")
    saved = json.loads(path.read_text())
    assert saved["pass_at_k"] == {"1": 0.0, "2": 0.0} and "confinement" in saved["settings"]["isolation"]


def test_evaluate_argument_errors(he, tmp_path):
    with pytest.raises(ValueError, match="every k must be in 1..n=2"):
        comp.evaluate_completions(TINY, list(he), n=2, ks=(1, 10))
    with pytest.raises(FileNotFoundError):
        comp.evaluate_completions(tmp_path / "nope", list(he), n=1, ks=(1,))


def test_batches_group_by_prompt_length():
    assert comp.batches([5, 1, 3, 2], n=2, batch_rows=4) == [[1, 3], [2, 0]]
    assert comp.batches([5, 1, 3], n=4, batch_rows=2) == [[1], [2], [0]]  # at least one task per batch


@pytest.mark.slow
def test_a_samples_completion_does_not_depend_on_the_batching(he):
    """One stream per sample (seed_of(seed, task_id, j)): one task per batch, all tasks in one
    batch and the reversed task list give the same completions (a token could move only
    where a draw lands within float32 rounding of a CDF step: test_sampling_streams)."""
    model, tok = comp._load(TINY)
    tasks = list(he)
    one, _, _ = comp.sample_completions(model, tok, tasks, 2, 1.0, 5, max_new_tokens=8, batch_rows=2)
    together, _, _ = comp.sample_completions(model, tok, tasks, 2, 1.0, 5, max_new_tokens=8, batch_rows=64)
    backwards, _, _ = comp.sample_completions(model, tok, tasks[::-1], 2, 1.0, 5, max_new_tokens=8, batch_rows=64)
    assert one == together == backwards[::-1]
    other, _, _ = comp.sample_completions(model, tok, tasks, 2, 1.0, 6, max_new_tokens=8, batch_rows=2)
    assert other != one  # the seed is used


@pytest.mark.slow
def test_batched_sampling_is_reproducible_and_reports_progress(he):
    import io

    import torch
    from rich.console import Console

    from consequence.evaluate.progress import Phases

    buf = io.StringIO()
    threads = torch.get_num_threads()
    with Phases(Console(file=buf, force_terminal=False, width=200)) as phases:
        a = comp.evaluate_completions(TINY, list(he), n=2, ks=(1,), seed=4, max_new_tokens=8, phases=phases)
    b = comp.evaluate_completions(TINY, list(he), n=2, ks=(1,), seed=4, max_new_tokens=8)
    assert [r["completions"] for r in a.per_task] == [r["completions"] for r in b.per_task]
    assert a.settings["batch_rows"] == comp.BATCH_ROWS and a.settings["torch_threads"] >= 1
    assert torch.get_num_threads() == threads  # restored after sampling
    out = buf.getvalue()
    assert "completions sampled: start, 4 samples" in out and "completions sampled: done, 4/4 samples in" in out
    assert "completions scored (sandbox, overlapping the sampling): done, 4/4 samples" in out
