"""The Python API (docs/api.md): exports, the documented examples run as written,
reward_fn scoring and its checks, environments as objects, hub ids offline.

The two examples are taken from docs/api.md itself (its ```python blocks), so the page and
the tests cannot drift; they run with tiny settings (1 iteration, 2 tasks × 2 rollouts,
short budgets, no evaluation) put in place of the page's TrainConfig values. The tests
that train are marked slow (`make test` runs them, `make test-fast` does not).
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

import consequence as cq
from consequence.cli import app
from consequence.config import TrainConfig
from consequence.envs import registry
from consequence.envs.api import SingleTurnEnvironment
from consequence.harness.renderer import Renderer
from consequence.records import read_trajectories
from consequence.reward.scoring import score_trajectories
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"
TINY = {
    "iterations": 1,
    "tasks_per_iteration": 2,
    "group_size": 2,
    "max_new_tokens": 64,
    "eval_every": 0,
    "final_eval_episodes": 0,
}
QUIET = Console(quiet=True)


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def _run_doc_block(i: int, module: str, tmp_path, monkeypatch, **tiny) -> dict:
    """Run docs/api.md's i-th python block as a module named ``module``, in tmp_path, with
    TrainConfig's values replaced by the tiny settings; returns its namespace."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cq, "TrainConfig", lambda **kw: TrainConfig(**{**kw, **TINY, **tiny}))
    ns = {"__name__": module}  # its functions and classes name this module, which no other process has
    exec(compile(_blocks()[i], f"docs/api.md[{i}]", "exec"), ns)
    return ns


def _fn_name(fn) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


# ---- exports --------------------------------------------------------------------------------
@pytest.mark.slow
def test_import_consequence_exports_exactly_all_and_imports_nothing_heavy():
    code = (
        "import sys, consequence as cq; print(cq.__file__ is not None, sorted(m for m in ('torch', 'transformers', "
        "'pydantic', 'consequence.loop') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True).stdout
    assert out.strip() == "True []"  # a regular package, lazily filled: `consequence --help` pays nothing
    ns: dict = {}
    exec("from consequence import *", ns)
    assert sorted(k for k in ns if k != "__builtins__") == sorted(cq.__all__)
    assert sorted(cq.__all__) == sorted(
        [
            "TrainConfig",
            "train",
            "Run",
            "evaluate",
            "compare",
            "Environment",
            "Episode",
            "SingleTurnEnvironment",
            "register_env",
            "RECIPES",
            "__version__",
        ]
    )
    from importlib import metadata

    import consequence.evaluate as evaluate_package  # the evaluation box stays a package with its contents
    import consequence.evaluate.stats  # noqa: F401  (binds the submodule on the package)
    from consequence import api
    from consequence.api import Run
    from consequence.envs.api import Environment

    assert cq.__version__ == metadata.version("consequence") and cq.Run is Run and cq.Environment is Environment
    assert cq.train is api.train and cq.evaluate is evaluate_package and callable(cq.evaluate)
    assert evaluate_package.stats is not None  # its modules as before
    assert issubclass(cq.SingleTurnEnvironment, cq.Environment) and cq.TrainConfig is TrainConfig
    assert list(cq.RECIPES) == sorted(p.stem for p in (ROOT / "consequence" / "recipes").glob("*.yaml"))
    assert cq.RECIPES["grpo"].train_config(iterations=1).advantage == "grpo"
    with pytest.raises(KeyError, match="not a bundled recipe; bundled: cispo"):
        cq.RECIPES["nope"]
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        cq.nope  # noqa: B018


def test_the_documented_examples_are_as_short_as_promised():
    single, multi = _blocks()
    assert len(single.rstrip("\n").split("\n")) <= 15 and len(multi.rstrip("\n").split("\n")) <= 40
    assert "reward_fn=reward" in single and "env=GuessNumber" in multi


# ---- the single-turn example of docs/api.md ---------------------------------------------------
@pytest.mark.slow  # a training run (~5-20 s on 2 cores)
def test_single_turn_example_from_the_docs_trains_and_scores_with_its_reward_fn(tmp_path, monkeypatch):
    ns = _run_doc_block(0, "docs_api_single_turn", tmp_path, monkeypatch, max_turns=1)
    run, data = ns["run"], ns["data"]
    assert run.status == "finished" and run.dir == (tmp_path / "runs" / "add").resolve()
    assert run.config.env == "python:docs_api_single_turn:reward"  # what config.yaml records (docs/api.md §4)
    for path in (run.final_checkpoint / "model.safetensors", run.report_md, run.curves, run.manifest):
        assert path.is_file(), path
    assert run.checkpoints == (run.final_checkpoint,) and run.report == json.loads(
        (run.dir / "report.json").read_text()
    )
    manifest = json.loads(run.manifest.read_text())
    assert manifest["environment"]["reward_fn"] == "docs_api_single_turn:reward"
    assert manifest["environment"]["dataset_records"] == 100
    trajs = read_trajectories(run.dir / "trajectories" / "iter_0000.parquet")
    assert len(trajs) == 4 and len(run.metrics) == 1
    for t in trajs:  # the docs' reward, recomputed from the reply each episode recorded
        answer = data[int(t.task_id.split("#")[0])]["answer"]
        want = (1.0 if t.final_code.strip() == answer else 0.0) if t.outcome == "finished" else 0.0
        assert t.reward == want and t.reward_components == {"reward": want}
    # a mean of 4 numbers each 0 or 1: exact in float64 on both sides
    assert run.metrics[0]["reward_mean"] == sum(t.reward for t in trajs) / len(trajs)


# ---- reward_fn: its scores, its failures ----------------------------------------------------
CALLS: list[tuple[str, str, dict]] = []


def reward(prompt, completion, mode, **info):
    """len(completion) % 2, or a failure chosen by the record's mode."""
    CALLS.append((prompt, completion, {"mode": mode, **info}))
    if mode == "raise":
        raise KeyError("boom")
    return float("nan") if mode == "nan" else len(completion) % 2


def _dataset() -> list[dict]:
    """5 problems (split 4 / 0 / 1 by split_by_problem); of the 4 train ones, the first raises,
    the second returns NaN, the other two score len(completion) % 2."""
    data = [{"prompt": f"Say the word {w}.", "word": w, "mode": "len"} for w in ("ant", "bee", "cat", "dog", "eel")]
    train_ids = [t.task_id for t in SingleTurnEnvironment(data, reward).split["train"]]
    assert len(train_ids) == 4
    data[int(train_ids[0])]["mode"], data[int(train_ids[1])]["mode"] = "raise", "nan"
    return data


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory):
    """One iteration over every train problem (B = 4: the seeded permutation draws each once), G = 2."""
    CALLS.clear()
    data = _dataset()
    cfg = TrainConfig(
        run_dir=str(tmp_path_factory.mktemp("scored") / "run"),
        **{**TINY, "tasks_per_iteration": 4},
        max_turns=1,
        learning_rate=1e-3,
    )
    run = cq.train(cfg, env=data, reward_fn=reward, console=QUIET)
    return run, data, list(CALLS)


@pytest.mark.slow  # a training run (~5-20 s on 2 cores)
def test_reward_fn_scores_appear_exactly_and_its_failures_are_env_errors(scored_run):
    run, data, calls = scored_run
    trajs = read_trajectories(run.dir / "trajectories" / "iter_0000.parquet")
    mode = {t.task_id: data[int(t.task_id.split("#")[0])]["mode"] for t in trajs}
    assert sorted(mode[t.task_id] for t in trajs) == ["len"] * 4 + ["nan"] * 2 + ["raise"] * 2
    name = _fn_name(reward)
    scored = []
    for t in trajs:
        if t.outcome == "truncated":  # no reply reached the scorer: 0, as for any verifier
            assert t.reward == 0.0
        elif mode[t.task_id] == "raise":
            assert (t.outcome, t.reward, t.error) == ("env_error", None, f"reward_fn {name} raised KeyError: 'boom'")
        elif mode[t.task_id] == "nan":
            assert (t.outcome, t.reward, t.error) == (
                "env_error",
                None,
                f"reward_fn {name} returned nan (float), not a finite number",
            )
        else:
            assert t.outcome == "finished" and t.reward == len(t.final_code) % 2
            assert t.reward_components == {"reward": t.reward} and t.verifier_score == t.reward
            scored.append(t.final_code)
    # the function saw exactly the replies that were scored (and those that failed), with the record's fields
    assert sorted(c for _, c, i in calls if i["mode"] == "len") == sorted(scored)
    assert all(i["word"] in p and set(i) == {"mode", "word"} for p, _, i in calls)
    m = run.metrics[0]
    valid = [t.reward for t in trajs if t.reward is not None]
    assert m["env_errors"] == sum(t.outcome == "env_error" for t in trajs) == 4
    assert m["reward_mean"] == sum(valid) / len(valid)  # ≤ 4 values of 0 / 1: exact in float64
    assert m["success"] == sum(t.reward == 1.0 for t in trajs if t.outcome != "env_error") / len(valid)


def _scripted(renderer, text):
    ids = renderer.encode(text) + [renderer.eot_id]
    return lambda prompts, max_new_tokens, idx: [
        SimpleNamespace(output_ids=ids, logprobs=[-0.5] * len(ids), stop_reason="stop") for _ in prompts
    ]


@pytest.mark.parametrize(
    "returned, error",
    [
        (0.25, None),
        ({"reward": 0.5, "bonus": 0.25}, None),
        (float("nan"), "returned nan (float), not a finite number"),
        (float("inf"), "returned inf (float), not a finite number"),
        ("0.5", "returned '0.5' (str), not a finite number"),
        (True, "returned True (bool), not a finite number"),
        (
            1.5,
            "returned a total of 1.5, outside the declared reward_range [0.0, 1.0] (declare reward_range=(low, high))",
        ),
        (
            {"reward": 0.5, "style": 0.1},
            "returned components 'style', which the environment does not declare "
            "(reward_components=('reward', 'bonus'); declare them)",
        ),
        ({"reward": float("nan")}, "returned {'reward': nan}, not finite numbers (components {'reward': nan})"),
        ({}, "returned an empty dict of components"),
    ],
)
def test_every_reward_fn_value_is_checked_like_a_verifiers(returned, error, tiny_tokenizer):
    def constant(prompt, completion, **info):
        return returned

    env = SingleTurnEnvironment(
        [{"prompt": f"q{i}"} for i in range(10)], constant, reward_components=("reward", "bonus")
    )
    renderer = Renderer(tiny_tokenizer, env.tools)
    task = env.split["train"][0]
    [t] = run_episodes(
        _scripted(renderer, "ab"),
        renderer,
        [EpisodeSpec(env.make_episode(task), task.task_id, "g", 0, 0)],
        Budgets(max_turns=2, max_new_tokens=16, max_total_tokens=400),
        env.system_prompt,
    )
    score_trajectories([t], components=env.reward_components, reward_range=env.reward_range)
    if error is None:
        parts = {"reward": returned} if isinstance(returned, float) else returned
        assert t.outcome == "finished" and t.reward == sum(parts.values())
        assert t.reward_components == {"reward": 0.0, "bonus": 0.0, **parts} and len(t.calls) == 1
    else:  # an env_error, never a 0
        assert (t.outcome, t.reward, t.error) == ("env_error", None, f"reward_fn {_fn_name(constant)} {error}")


def test_bad_datasets_and_multi_turn_environments_are_refused_clearly():
    def fn(prompt, completion, **info):
        return 0.0

    with pytest.raises(ValueError, match="the dataset is empty"):
        SingleTurnEnvironment([], fn)
    with pytest.raises(ValueError, match=r"dataset\[1\] has no 'prompt' \(a non-empty str\); its keys: question"):
        SingleTurnEnvironment([{"prompt": "a"}, {"question": "b"}], fn)
    with pytest.raises(ValueError, match="reward_fn must be a function"):
        SingleTurnEnvironment([{"prompt": "a"}], "exact-match")
    with pytest.raises(ValueError, match="env is a dataset .* give reward_fn="):
        cq.train(TrainConfig(), env=[{"prompt": "a"}])
    from env_fixtures import ReverseEnvironment

    with pytest.raises(
        ValueError,
        match=r"a reward_fn scores a single-turn task .* environment 'reverse' is "
        r"multi-turn: it has tools \(hint\)",
    ):
        SingleTurnEnvironment.scoring(ReverseEnvironment(), fn)
    env = SingleTurnEnvironment(
        [{"prompt": "x", "problem_id": "p"}, {"prompt": "y", "problem_id": "p"}, {"prompt": "z"}]
        + [{"prompt": f"w{i}"} for i in range(7)],
        fn,
    )
    homes = {s for s, ts in env.split.items() for t in ts if t.problem_id == "p"}
    assert len(homes) == 1 and sum(map(len, env.split.values())) == 10  # one problem: one split
    assert env.label == f"single-turn:{env.dataset_sha256()[:12]}"


def test_a_single_turn_builtin_is_scored_by_reward_fn_with_its_task_fields():
    def accuracy(prompt, completion, answer, **info):
        return float(completion.strip() == answer)

    base = registry.load_environment("reasoning-gym", 0, {"dataset": "chain_sum", "size": 20})
    env = SingleTurnEnvironment.scoring(base, accuracy)
    assert env.split == base.split and env.system_prompt == base.system_prompt
    task = env.split["train"][0]
    episode = env.make_episode(task)
    assert episode.reset(seed=0)[0] == task.question
    assert episode.step({"answer": task.answer})[1:3] == (1.0, True)
    assert env.make_episode(task).step({"answer": "no"})[4]["reward_components"] == {"accuracy": 0.0}


# ---- environments given as objects, by name, and a run elsewhere ------------------------------
def test_register_env_makes_a_name_usable_in_this_process(monkeypatch):
    from env_fixtures import ReverseEnvironment

    monkeypatch.setattr(registry, "_IN_PROCESS", {})
    cq.register_env("reverse-words", ReverseEnvironment)
    env = registry.load_environment("reverse-words", 0, {"words": ["ab", "cd", "ef", "gh"]})
    assert isinstance(env, ReverseEnvironment) and [t.word for t in env.split["train"]] == ["ab", "cd"]
    assert "reverse-words" in registry.available()
    instance = ReverseEnvironment(split_seed=2)
    cq.register_env("one-reverse", instance)
    assert registry.load_environment("one-reverse", 2) is instance
    with pytest.raises(ValueError, match="made with split_seed 2 and the config asks for split_seed 0"):
        registry.load_environment("one-reverse", 0)
    with pytest.raises(ValueError, match="unknown option 'words'; it takes none"):
        registry.load_environment("one-reverse", 2, {"words": ["x"]})
    with pytest.raises(ValueError, match="'repair' is a built-in environment"):
        cq.register_env("repair", ReverseEnvironment)
    with pytest.raises(ValueError, match="without ':'"):
        cq.register_env("a:b", ReverseEnvironment)
    with pytest.raises(ValueError, match="exists only in the Python process that registered it"):
        registry.load_environment("never-registered")
    with pytest.raises(ValueError, match="rollout workers are other processes"):
        cq.train(TrainConfig(rollout_workers=1), env=instance)


@pytest.mark.slow  # a training run (~5-20 s on 2 cores)
def test_multi_turn_example_from_the_docs_trains_and_another_process_says_it_cannot_remake_it(tmp_path, monkeypatch):
    ns = _run_doc_block(1, "docs_api_multi_turn", tmp_path, monkeypatch, max_turns=2)
    run = ns["run"]
    assert run.status == "finished" and run.config.env == "python:docs_api_multi_turn:GuessNumber"
    trajs = read_trajectories(run.dir / "trajectories" / "iter_0000.parquet")
    numbers = {t.task_id: t.number for t in ns["GuessNumber"]().split["train"]}
    for t in trajs:  # replay the episode's rules on the replies it recorded
        parts = {"solved": 0.0, "guesses": 0.0}
        replies = [m["content"] for m in t.messages if m["role"] == "assistant"]
        for call, guess in zip(t.calls, replies):
            if call.stop_reason == "length":  # cut at the token limit: never given to step
                break
            if guess == str(numbers[t.task_id.split("#")[0]]):
                parts["solved"] += 1.0
                break
            parts["guesses"] += -0.1  # the same additions in the same order as the loop: exact
        assert t.reward_components == parts and t.reward == math.fsum(parts.values())
    # Another process (simulated: the in-process registry emptied) cannot make the object again.
    monkeypatch.setattr(registry, "_IN_PROCESS", {})
    manifest = json.loads(run.manifest.read_text())
    (run.dir / "manifest.json").write_text(json.dumps({**manifest, "status": "interrupted"}))
    for args in (
        ["train", "--resume", str(run.dir)],
        ["reproduce", str(run.dir), "--run-dir", str(tmp_path / "again")],
    ):
        res = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
        text = " ".join(res.output.split())
        assert (
            res.exit_code == 2
            and "--env python:docs_api_multi_turn:GuessNumber: this run's environment was a "
            "Python object given to consequence.train(env=...)"
            in text
        ), res.output
        assert "cannot be re-created from the run's config" in text and "Traceback" not in res.output
    assert not (tmp_path / "again").exists()


# ---- evaluate / compare -------------------------------------------------------------------------
@pytest.mark.slow  # a training run (~5-20 s on 2 cores)
def test_evaluate_and_compare_return_what_they_write(scored_run, tmp_path):
    run, data, _ = scored_run
    out = tmp_path / "eval"  # the run folder: its config.yaml gives the environment (this process has it)
    result = cq.evaluate(str(run.dir), split="test", n=2, k=[1, 2], temperature=1.0, out=out, max_turns=1)
    assert result == json.loads((out / "eval.json").read_text())
    assert result["settings"]["environment"]["reward_fn"] == _fn_name(reward) and result["settings"]["n"] == 2
    episodes = read_trajectories(out / "episodes.parquet")
    assert len(episodes) == 2 and all(t.reward == len(t.final_code) % 2 for t in episodes if t.outcome == "finished")
    from consequence.policy.tiny import BUNDLED

    clean = [{**r, "mode": "len"} for r in data]  # no failing record: every pair of episodes counts
    res = cq.compare(
        BUNDLED,
        run.final_checkpoint,
        env=clean,
        reward_fn=reward,
        split="train",
        n=1,
        problems=2,
        recovery=False,
        max_turns=1,
        out=tmp_path / "cmp",
    )
    assert res == json.loads((tmp_path / "cmp" / "compare.json").read_text())
    paired = res["paired"]
    assert paired["n_groups"] == 2 and paired["low"] <= paired["diff"] <= paired["high"]
    assert (paired["a"], paired["b"]) == (str(BUNDLED), str(run.final_checkpoint))
    with pytest.raises(ValueError, match="same checkpoint folder"):
        cq.compare(BUNDLED, BUNDLED, out=tmp_path / "c2")


# ---- a Hugging Face hub id on a machine without hub access ----------------------------------------
HUB_ID = "consequence-tests/no-such-model"


def test_a_hub_id_offline_is_a_clear_error_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing below may reach a hub
    cfg = TrainConfig(model=HUB_ID, run_dir=str(tmp_path / "r"))
    assert cfg.model == HUB_ID  # kept as an id, not made an absolute path
    with pytest.raises(ValueError) as e:
        cq.train(cfg, console=QUIET)
    message = str(e.value)
    assert message.startswith(
        f"--model {HUB_ID}: no such local folder, so it is read as a Hugging Face hub id; "
        "hub ids are fetched only when the machine is online, and HF_HUB_OFFLINE is set"
    )
    assert f"hf download {HUB_ID} --local-dir DIR" in message and "unset HF_HUB_OFFLINE" in message
    assert not (tmp_path / "r").exists()
    for args in (["train", "--model", HUB_ID, "--run-dir", str(tmp_path / "r")], ["eval", "--model", HUB_ID]):
        res = CliRunner().invoke(app, args, env={"COLUMNS": "300", "HF_HUB_OFFLINE": "1"})
        assert res.exit_code == 2 and "read as a Hugging Face hub id" in res.output, res.output
        assert "Traceback" not in res.output and not (tmp_path / "r").exists()
    # a path, not a hub id: a folder of ours (runs/...), or ORG/NAME where ORG is a folder here
    assert TrainConfig(model="runs/sft-model").model == str(tmp_path / "runs" / "sft-model")
    (tmp_path / "consequence-tests").mkdir()
    assert TrainConfig(model=HUB_ID).model == str(tmp_path / HUB_ID)
    res = CliRunner().invoke(app, ["train", "--model", HUB_ID, "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and "no such directory" in res.output and "hub id" not in res.output
