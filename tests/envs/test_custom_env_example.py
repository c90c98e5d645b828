"""The bring-your-own-environment example (examples/custom_env, docs/environments.md), used
the way a newcomer uses it: built and installed as a package, found through its entry
point, trained and evaluated from the command line.

The package is installed non-editable with ``pip install --target`` into a temporary
folder that only the subprocesses get on ``PYTHONPATH``: it builds offline with the
setuptools already in the venv (``--no-build-isolation --no-index --no-deps``; a venv
without setuptools lets pip fetch it from the index), the
``.dist-info`` it writes makes the entry point visible to ``importlib.metadata``, and the
test venv is never changed (nothing to uninstall). The build runs on a copy of the
folder, so the repository gets no ``build/`` or ``*.egg-info``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_args import ONE_TINY_ITERATION
from consequence.envs.registry import BUILTINS
from consequence.records import read_trajectories

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_env"
SRC = EXAMPLE / "src"
MODULE = SRC / "consequence_vowels" / "env.py"
NAME = "vowel-count"
CLASS = "consequence_vowels.env:VowelCountEnvironment"
SCRIPT = Path(sys.executable).with_name("consequence")
CLI = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-c", "from consequence.cli import app; app()"]
# 40 problems: split 32 / 4 / 4 by problem (an option, so the run also shows options at work)
TRAIN = [
    "--env",
    NAME,
    "--env-option",
    "n_words=40",
    *ONE_TINY_ITERATION,
    "--max-turns",
    "2",
    "--max-new-tokens",
    "16",
]


def _source_hash() -> str:
    return hashlib.sha256(MODULE.read_bytes()).hexdigest()


def _run(args: list[str], path: Path | None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``args`` in a subprocess whose Python path has ``path`` in front (and nothing of the example otherwise)."""
    env = {**os.environ, "COLUMNS": "400", "PYTHONDONTWRITEBYTECODE": "1"}
    paths = [str(path)] if path is not None else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


PROBE = (
    "import json; from importlib.metadata import entry_points; from consequence.envs.registry import available;"
    "print(json.dumps([{e.name: e.value for e in entry_points(group='consequence.environments')}, available()]))"
)


BEFORE: dict[str, tuple] = {}


def _plugins(path: Path | None) -> tuple[dict, dict]:
    """(entry points of the group, every name --env takes) as a process with ``path`` sees them."""
    res = _run([sys.executable, "-c", PROBE], path)
    assert res.returncode == 0, res.stderr
    return tuple(json.loads(res.stdout))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example installed into a folder of its own (see the module doc)."""
    tmp = tmp_path_factory.mktemp("custom_env")
    copy = tmp / "src_copy"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    BEFORE["plugins"] = _plugins(None)  # what the venv offers before the install
    # offline with the venv's setuptools; a venv without it (Python >= 3.12 makes none) lets pip fetch it
    offline = ["--no-build-isolation", "--no-index"] if importlib.util.find_spec("setuptools") else []
    res = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            *offline,
            "--disable-pip-version-check",
            "--quiet",
            "--target",
            str(target),
            str(copy),
        ],
        None,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return target


def test_the_environment_code_is_under_80_lines():
    lines = [ln for ln in MODULE.read_text().splitlines() if ln.strip()]
    assert 20 < len(lines) < 80, len(lines)
    assert "from consequence.envs.api import Environment" in MODULE.read_text()
    imports = [ln for ln in lines if ln.startswith(("import ", "from ")) and "consequence" in ln]
    assert imports == ["from consequence.envs.api import Environment"]  # the public API only


@pytest.mark.slow
def test_the_entry_point_is_found_only_where_installed(site):
    eps, names = _plugins(site)
    assert eps[NAME] == CLASS and names[NAME] == CLASS
    assert list(names)[: len(BUILTINS)] == list(BUILTINS)  # built-ins first, then plug-ins
    assert _plugins(None) == BEFORE["plugins"]  # the install changed nothing outside its folder
    assert (site / "consequence_vowels" / "env.py").read_bytes() == MODULE.read_bytes()


@pytest.mark.slow
def test_train_then_eval_from_the_command_line(site, tmp_path):
    """One test, so that a parallel run (pytest -n) never trains twice."""
    run = tmp_path / "vowels"
    res = _run([*CLI, "train", *TRAIN, "--run-dir", str(run)], site)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = json.loads((run / "manifest.json").read_text())
    env = m["environment"]
    assert (env["name"], env["version"], env["class"]) == (NAME, "1", CLASS)
    assert len(env["source_sha256"]) == 64 and env["source_sha256"] == _source_hash()
    assert env["options"] == {"n_words": 40} and env["tools"] == ["spell"]
    assert env["reward_components"] == ["accuracy", "format"] and env["reward_range"] == [0.0, 1.1]
    assert m["reward"]["components"] == ["accuracy", "format"]
    assert m["tasks"]["sizes"] == {"train": 32, "validation": 4, "test": 4}
    split = json.loads((run / "split.json").read_text())
    assert not set(split["train"]) & (set(split["validation"]) | set(split["test"]))
    trajs = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    assert len(trajs) == 4 and len({t.group_id for t in trajs}) == 2
    for t in trajs:
        assert set(t.reward_components) == {"accuracy", "format"}, t.reward_components
        assert t.reward is not None and 0.0 <= t.reward <= 1.1
        assert t.reward == pytest.approx(sum(t.reward_components.values()))
        assert t.task_id.split("#")[0] in split["train"]  # rollouts only on train problems
        assert "vowels" in t.messages[1]["content"] and t.messages[0]["content"].startswith("You count letters")

    out = tmp_path / "eval"
    ev = _run(
        [
            *CLI,
            "eval",
            "--model",
            str(run),
            "-n",
            "1",
            "-k",
            "1",
            "--problems",
            "2",
            "--no-recovery",
            "--out",
            str(out),
        ],
        site,
    )
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    got = json.loads((out / "eval.json").read_text())
    env = got["settings"]["environment"]
    assert (env["name"], env["source_sha256"], env["options"]) == (NAME, _source_hash(), {"n_words": 40})
    assert got["settings"]["provenance"]["keys"]["env"] == {"value": NAME, "from": "run", "runs": {"": NAME}}
    assert got["pass_at_k"]["1"]["tasks"] == 2 and got["outcomes"]["episodes"] == 2


def test_module_attr_loads_the_class_without_installing():
    probe = (
        "import json; from consequence.envs.registry import load_environment;"
        f"e = load_environment({CLASS!r}, 0, {{'n_words': 40}});"
        "import consequence_vowels.env as m; print(json.dumps([e.describe(), e.problem_ids(), m.__file__]))"
    )
    res = _run([sys.executable, "-c", probe], SRC)
    assert res.returncode == 0, res.stderr
    desc, ids, where = json.loads(res.stdout)
    assert Path(where) == MODULE  # imported from the source folder on PYTHONPATH
    assert (desc["name"], desc["class"], desc["source_sha256"]) == (NAME, CLASS, _source_hash())
    assert {k: len(v) for k, v in ids.items()} == {"train": 32, "validation": 4, "test": 4}
    assert len(set(sum(ids.values(), []))) == 40  # split by problem: no word in two splits


@pytest.mark.slow
def test_unknown_environment_exits_2_listing_the_valid_names(site, tmp_path):
    res = _run([*CLI, "train", "--env", "nope", "--run-dir", str(tmp_path / "r")], site)
    assert res.returncode == 2
    text = " ".join((res.stdout + res.stderr).split())
    assert "--env 'nope': unknown environment; valid: " in text
    for name in [*BUILTINS, NAME, "module:attr", ".jsonl"]:
        assert name in text, name
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_an_option_it_does_not_take_is_refused_from_the_cli_and_from_yaml(site, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"env: {NAME}\nenv_options:\n  colour: red\n")
    for args in (["--env", NAME, "--env-option", "colour=red"], ["--config", str(cfg)]):
        res = _run([*CLI, "train", *args, "--run-dir", str(tmp_path / "r")], site)
        text = " ".join((res.stdout + res.stderr).split())
        assert res.returncode == 2, text
        assert f"--env {NAME}: unknown option 'colour'; it takes n_words, max_length" in text


def test_a_scripted_policy_through_the_runner_earns_each_component(monkeypatch):
    """The real runner and reward box on two scripted episodes: spell then the right bare
    number (accuracy 1 + format 0.1), and a wrong number inside a sentence (0 + 0)."""
    from transformers import AutoTokenizer

    from consequence.distill.warmstart import BUNDLED
    from consequence.harness.renderer import Renderer
    from consequence.reward.scoring import score_trajectories
    from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes

    monkeypatch.syspath_prepend(str(SRC))
    from consequence_vowels.env import VowelCountEnvironment

    env = VowelCountEnvironment(n_words=40)
    task = env.sample("validation", 1, seed=0)[0]
    count = sum(c in "aeiou" for c in task.word)
    r = Renderer(AutoTokenizer.from_pretrained(str(BUNDLED)), env.tools)
    spell = r.encode(r.format_call("spell", {"word": task.word})) + [r.eot_id]
    turns = {
        0: iter([spell, r.encode(str(count)) + [r.eot_id]]),
        1: iter([r.encode(f"It has {count + 1} vowels.") + [r.eot_id]]),
    }

    def generate(prompts, max_new_tokens, idx):
        return [
            type(
                "S", (), {"output_ids": (ids := next(turns[i])), "logprobs": [-0.1] * len(ids), "stop_reason": "stop"}
            )()
            for i in idx
        ]

    specs = [EpisodeSpec(env.make_episode(task), task.task_id, "g", k, k) for k in (0, 1)]
    right, wrong = run_episodes(generate, r, specs, Budgets(max_turns=3), env.system_prompt)
    score_trajectories([right, wrong], components=env.reward_components, reward_range=env.reward_range)
    assert right.outcome == wrong.outcome == "finished"
    assert [c.reward for c in right.calls] == [0.0, pytest.approx(1.1)]  # the reward sits on the answering call
    assert right.tool_histogram == {"spell": 1} and " ".join(task.word) in str(right.messages)
    assert right.reward_components == {"accuracy": 1.0, "format": 0.1} and right.verifier_score == 1.0
    assert right.reward == pytest.approx(1.1)
    assert (wrong.reward, wrong.verifier_score, len(wrong.calls)) == (0.0, 0.0, 1)
    assert wrong.reward_components == {"accuracy": 0.0, "format": 0.0}
