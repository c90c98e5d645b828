"""`consequence demos` and `consequence sft` refuse, before any work, what cannot give a usable
result (an environment without a train split, one without a demonstrator, a LoRA target the
student lacks, an --out name of no known format), each as one error line; `demos --out X.jsonl`
writes OpenAI chat messages that read back as the same verified demonstrations."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from consequence.cli import app
from consequence.distill.demonstrations import file_demo_set, read_demonstration_file
from consequence.envs.registry import load_environment
from consequence.harness.renderer import Renderer
from consequence.policy.tiny import BUNDLED, load_policy
from consequence.records import read_trajectories

WIDE = {"COLUMNS": "400"}  # one error line, not wrapped


def _run(command: str, out, *args: str):
    model = ["--model", str(BUNDLED)] if command == "sft" else []
    return CliRunner().invoke(app, [command, *model, *args, "--out", str(out)], env=WIDE)


@pytest.mark.parametrize("command", ["demos", "sft"])
def test_the_calculator_shift_has_no_train_split_and_is_refused_up_front(tmp_path, command):
    out = tmp_path / ("d.parquet" if command == "demos" else "sft")
    res = _run(command, out, "--env", "calculator", "--env-option", "shift=true")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    errors = [line for line in res.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and "option shift=true is the held-out shift, for evaluation only: it has no train split" in errors[0]  # fmt: skip
    assert f"and `consequence {command}` needs one; " in errors[0] and "no task to draw from" not in res.output
    assert not out.exists()


@pytest.mark.parametrize("command", ["demos", "sft"])
def test_no_demonstrator_names_the_other_sources(tmp_path, command):
    out = tmp_path / ("d.parquet" if command == "demos" else "sft")
    res = _run(command, out, "--env", "humaneval")
    assert res.exit_code == 2 and "--env humaneval: this environment has no demonstrator" in res.output
    assert "`consequence sft --demos-file FILE`" in res.output and "`--teacher-url URL`" in res.output
    # the same for a demonstrator that cannot demonstrate with these options (calculator, no call allowed)
    res = _run(command, out, "--env", "calculator", "--env-option", "max_calls=0")
    assert res.exit_code == 2 and "its demonstrator cannot demonstrate here (option max_calls=0" in res.output
    assert "--demos-file" in res.output and "--teacher-url" in res.output and not out.exists()


def test_a_bad_lora_target_is_refused_before_the_demonstrations_are_collected(tmp_path, monkeypatch):
    def collected(*args, **kwargs):
        raise AssertionError("the demonstrations were collected before --lora-targets was checked")

    monkeypatch.setattr("consequence.distill.coldstart.collect_demonstrations", collected)
    out = tmp_path / "sft"
    res = _run("sft", out, "--env", "calculator", "--demos", "2", "--lora-targets", "q_proj,qproj")
    assert res.exit_code == 2, res.output
    assert (
        "error: --lora-targets qproj: no linear layer of that name in LlamaForCausalLM; it has down_proj" in res.output
    )
    assert not out.exists()


def test_demos_out_takes_parquet_or_jsonl_and_refuses_any_other_name(tmp_path):
    for name in ("d.json", "d.txt", "demos"):
        res = _run("demos", tmp_path / name, "--env", "calculator", "-n", "2")
        assert res.exit_code == 2 and f"error: --out {tmp_path / name}: unknown format" in res.output, res.output
        assert "name a .parquet file" in res.output and not (tmp_path / name).exists()
    parquet, jsonl = tmp_path / "d.parquet", tmp_path / "d.jsonl"
    for out in (parquet, jsonl):  # the same draw, in both formats
        res = _run("demos", out, "--env", "calculator", "-n", "3")
        assert res.exit_code == 0 and "3/3 demonstrations verified" in res.output, res.output
    trajs = read_trajectories(parquet)
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [x["task_id"] for x in lines] == [t.task_id for t in trajs]
    call = lines[0]["messages"][2]["tool_calls"][0]  # the OpenAI shape: arguments as a JSON string, linked by id
    assert call["type"] == "function" and isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == trajs[0].messages[2]["tool_calls"][0]["function"]["arguments"]
    assert lines[0]["messages"][3]["role"] == "tool" and lines[0]["messages"][3]["tool_call_id"] == call["id"]
    # read back: every row is replayed and verified again, to the same tokens as the parquet file
    env = load_environment("calculator", 0)
    assert all(r.problem is None for r in read_demonstration_file(jsonl))
    again = file_demo_set(jsonl, env, Renderer(load_policy(BUNDLED)[1], env.tools), log=lambda _: None)
    assert (len(again.kept), again.total) == (3, 3)
    assert [c.output_ids for t in again.kept for c in t.calls] == [c.output_ids for t in trajs for c in t.calls]
