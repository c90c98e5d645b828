"""The ``openenv`` adapter against real OpenEnv servers (``openenv-core``'s ``create_app``,
served by uvicorn on 127.0.0.1 in a background thread): environments written against
OpenEnv's own ``Environment`` / ``Action`` / ``Observation`` types, reached through
``load_environment("consequence.envs.openenv.env:OpenEnvEnvironment", ...)``.

Covered: the reset / step / reward mapping by hand (answer and tool mode, observation
text, an action the server refuses), episodes through the real runner and reward box with
the rewards the servers logged, env errors (the environment raises, no free session, the
server gone, a bad reply), option checks, and ``consequence train`` from the command line.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest

pytest.importorskip(
    "websockets", reason="the openenv adapter's client needs websockets: pip install 'consequence[openenv]'"
)
pytest.importorskip("uvicorn", reason="serving an OpenEnv environment needs uvicorn (with openenv-core)")
pytest.importorskip(
    "openenv.core.env_server",
    reason="openenv-core is not installed (make install installs it; by hand: pip install openenv-core==0.3.0)",
)

import uvicorn  # noqa: E402
from openenv.core.env_server import Action, Observation, State, create_app  # noqa: E402
from openenv.core.env_server import Environment as OpenEnvBase  # noqa: E402
from pydantic import Field  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from cli_args import ONE_TINY_ITERATION
from consequence.envs.openenv.env import OpenEnvEnvironment, observation_text, tool_name_of  # noqa: E402
from consequence.envs.registry import load_environment  # noqa: E402
from consequence.harness.renderer import Renderer  # noqa: E402
from consequence.reward.scoring import score_trajectories  # noqa: E402
from consequence.rollout.episodes import Budgets, EpisodeSpec, run_episodes  # noqa: E402
from replies import replay  # noqa: E402

TARGET = "consequence.envs.openenv.env:OpenEnvEnvironment"
WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "tiger", "ocean"]


# ---- the foreign environments: OpenEnv's interface, nothing of ours --------------------
def secret_word(seed: int) -> str:
    return WORDS[seed % len(WORDS)]


def secret_number(seed: int) -> int:
    return random.Random(seed).randint(1, 20)


class WordAction(Action):
    word: str = Field(..., description="your guess")


class WordObservation(Observation):
    prompt: str = ""


class WordEnv(OpenEnvBase):
    """Guess the secret word in 2 tries: 1.0 at the first try, 0.5 at the second, else 0."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    log: list = []  # (session, seed, word, reward, done) for every step the server ran
    resets: list = []  # the seed of every reset

    def __init__(self):
        super().__init__()
        self._state, self.seed = State(step_count=0), None

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.seed, self._state = seed, State(episode_id=episode_id, step_count=0)
        WordEnv.resets.append(seed)
        w = secret_word(seed)
        return WordObservation(prompt=f"Guess my {len(w)}-letter word; it starts with {w[0]}. 2 tries.")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        right = action.word.strip().lower() == secret_word(self.seed)
        reward = (1.0 if self._state.step_count == 1 else 0.5) if right else 0.0
        done = right or self._state.step_count >= 2
        WordEnv.log.append((id(self), self.seed, action.word, reward, done))
        return WordObservation(
            prompt="correct" if right else f"no, not {action.word.strip()}", reward=reward, done=done
        )

    @property
    def state(self):
        return self._state


class GuessAction(Action):
    """Guess the secret number."""

    guess: int = Field(..., ge=1, le=20, description="a whole number from 1 to 20")


class GuessObservation(Observation):
    message: str = ""
    guesses_left: int = 0


class GuessEnv(OpenEnvBase):
    """A number from 1 to 20 in 3 guesses: -0.25 per wrong guess, 1.0 for the right one;
    ``difficulty`` (a reset keyword) only shows in the message."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    log: list = []

    def __init__(self):
        super().__init__()
        self._state, self.seed, self.left = State(step_count=0), None, 0

    def reset(self, seed=None, episode_id=None, difficulty="easy", **kwargs):
        self.seed, self.left, self._state = seed, 3, State(episode_id=episode_id, step_count=0)
        return GuessObservation(message=f"Guess a number from 1 to 20 ({difficulty}).", guesses_left=3)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        self.left -= 1
        secret = secret_number(self.seed)
        right = action.guess == secret
        reward = 1.0 if right else -0.25
        done = right or self.left == 0
        GuessEnv.log.append((id(self), self.seed, action.guess, reward, done))
        msg = "right" if right else ("higher" if action.guess < secret else "lower")
        return GuessObservation(message=msg, guesses_left=self.left, reward=reward, done=done)

    @property
    def state(self):
        return self._state


class BrokenEnv(WordEnv):
    """Resets fine; every step raises (a crashed grader), or returns a reward out of range with ``explode``."""

    def step(self, action, timeout_s=None, **kwargs):
        if action.word == "explode":
            return WordObservation(prompt="boom", reward=1e6, done=True)
        raise RuntimeError("the grader crashed")


# ---- serving them on 127.0.0.1 -------------------------------------------------------
class Served:
    """A uvicorn server of one OpenEnv app on a free loopback port, in a daemon thread."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def servers():
    apps = {
        "word": create_app(WordEnv, WordAction, WordObservation, max_concurrent_envs=16),
        "guess": create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=16),
        "broken": create_app(BrokenEnv, WordAction, WordObservation, max_concurrent_envs=16),
        "single": create_app(WordEnv, WordAction, WordObservation),
    }  # OpenEnv's default: one session
    served = {k: Served(a) for k, a in apps.items()}
    yield {k: s.url for k, s in served.items()}
    for s in served.values():
        s.stop()


def _env(url, **options):
    return load_environment(TARGET, 0, {"base_url": url, **options})


def _sessions(log, since=0):
    """The server's own record: per session, the rewards it returned, in order."""
    out: dict[int, list[float]] = {}
    for sid, _seed, _a, reward, _done in log[since:]:
        out.setdefault(sid, []).append(reward)
    return list(out.values())


# ---- (a) the mapping by hand -------------------------------------------------------
@pytest.mark.slow
def test_answer_mode_reset_step_and_rewards(servers):
    env = _env(servers["word"], n_problems=16)
    assert (env.name, env.tools, env.answer_ends_episode, env.answer_field) == ("openenv", [], True, "word")
    assert env.reward_components == ("reward",) and env.reward_range == (0.0, 1.0)
    assert {k: len(v) for k, v in env.split.items()} == {"train": 13, "validation": 2, "test": 1}
    assert sorted(t.seed for v in env.split.values() for t in v) == list(range(16))
    task = next(t for t in env.split["train"] if t.seed == 10)
    assert (task.task_id, task.problem_id) == ("seed-10", "seed-10")
    ep = env.make_episode(task)
    obs, info = ep.reset(seed=123)  # the runner's seed is not the problem: the task's seed is sent
    assert obs == "Guess my 5-letter word; it starts with s. 2 tries."  # secret_word(10) == "stone"
    assert (info["openenv_seed"], info["observation"]) == (10, {"prompt": obs})
    n = len(WordEnv.log)
    assert ep.step({"answer": "river"}) == (
        "no, not river",
        0.0,
        False,
        False,
        {
            "task_id": "seed-10",
            "problem_id": "seed-10",
            "openenv_seed": 10,
            "reward_components": {"reward": 0.0},
            "observation": {"prompt": "no, not river"},
            "openenv_reward": 0.0,
        },
    )
    obs, r, term, trunc, info = ep.step({"answer": " Stone\n"})
    assert (obs, r, term, trunc, info["reward_components"]) == ("correct", 0.5, True, False, {"reward": 0.5})
    assert [e[2:] for e in WordEnv.log[n:]] == [("river", 0.0, False), (" Stone\n", 0.5, True)]
    assert ep.code == " Stone\n" and ep._session is None  # the session closed with done
    with pytest.raises(RuntimeError, match="step without an open session"):
        ep.step({"answer": "stone"})
    assert env.request(task) == "Guess my 5-letter word; it starts with s. 2 tries."
    assert env.label == "openenv:WordEnv:16"


def test_tool_mode_observation_json_and_refused_action(servers):
    env = _env(
        servers["guess"], action="tool", reward_range=[-1, 1], n_problems=20, reset_kwargs={"difficulty": "hard"}
    )
    assert tool_name_of({"title": "GuessAction"}) == "guess" and tool_name_of({"title": "MyCodeAction"}) == "my_code"
    [tool] = env.tools
    assert tool["function"]["name"] == "guess" and tool["function"]["description"] == "Guess the secret number."
    params = tool["function"]["parameters"]
    assert params["required"] == ["guess"] and set(params["properties"]) == {"guess"}  # metadata dropped
    assert (params["properties"]["guess"]["minimum"], params["properties"]["guess"]["maximum"]) == (1, 20)
    assert env.answer_ends_episode is False and env.reward_range == (-1.0, 1.0)
    task = env.split["train"][0]
    secret = secret_number(task.seed)
    ep = env.make_episode(task)
    obs, _ = ep.reset()
    assert json.loads(obs) == {"message": "Guess a number from 1 to 20 (hard).", "guesses_left": 3}
    assert obs == '{"guesses_left": 3, "message": "Guess a number from 1 to 20 (hard)."}'  # sorted JSON
    wrong = 20 if secret < 20 else 19
    obs, r, term, _, info = ep.step({"name": "guess", "arguments": {"guess": wrong}})
    assert (json.loads(obs), r, term, info["reward_components"]) == (
        {"message": "lower", "guesses_left": 2},
        -0.25,
        False,
        {"reward": -0.25},
    )
    # an action the server's action model refuses is the policy's error, not the environment's
    obs, r, term, _, info = ep.step({"name": "guess", "arguments": {"guess": 0}})
    assert (r, term, "env_error" in info) == (0.0, False, False)
    assert obs.startswith('error: the environment refused the action {"guess": 0}: guess: Input should be greater')
    assert info["invalid_action"]["code"] == "VALIDATION_ERROR"
    obs, r, term, _, _ = ep.step({"name": "guess", "arguments": {"guess": secret}})
    assert (json.loads(obs), r, term) == ({"message": "right", "guesses_left": 1}, 1.0, True)
    other = env.make_episode(task)
    other.reset()
    with pytest.raises(ValueError, match="unknown tool 'finish'; the only tool is 'guess'"):
        other.step({"name": "finish", "arguments": {}})
    other.close()


def test_answer_into_a_number_field_and_observation_field(servers):
    env = _env(servers["guess"], observation_field="message", reward_range=[-1, 1], n_problems=20)
    assert env.answer_field == "guess" and env.tools == []  # the action's only field, although an integer
    task = env.split["train"][1]
    ep = env.make_episode(task)
    assert ep.reset()[0] == "Guess a number from 1 to 20 (easy)."
    obs, r, term, _, _ = ep.step({"answer": "seven"})  # pydantic cannot read it as an int: refused
    assert (r, term) == (0.0, False) and "guess: Input should be a valid integer" in obs
    obs, r, term, _, _ = ep.step({"answer": str(secret_number(task.seed))})  # lax int parsing of "7"
    assert (obs, r, term) == ("right", 1.0, True)
    assert observation_text({"a": 1, "b": [2]}) == '{"a": 1, "b": [2]}' and observation_text({"a": 3}) == "3"
    with pytest.raises(ValueError, match="no field 'c' .* it has 'a', 'b'"):
        observation_text({"a": 1, "b": 2}, "c")


# ---- (b) the real runner and the reward box -----------------------------------------
def test_episodes_through_the_runner_score_what_the_server_returned(servers, tiny_tokenizer):
    env = _env(servers["guess"], action="tool", observation_field="message", reward_range=[-1, 1], n_problems=20)
    renderer = Renderer(tiny_tokenizer, env.tools)
    call = renderer.format_call
    task = env.split["train"][2]
    secret = secret_number(task.seed)
    low, high = (secret - 1, secret + 1) if 1 < secret < 20 else ((2, 3) if secret == 1 else (18, 19))
    script = replay(
        renderer,
        [
            [call("guess", {"guess": low}), call("guess", {"guess": secret})],  # -0.25 then 1.0
            [call("guess", {"guess": low}), call("guess", {"guess": high}), call("guess", {"guess": low})],  # 3 wrong
            ["I think it is 7.", call("guess", {"guess": secret})],  # a turn without a call, then right
        ],
    )
    n = len(GuessEnv.log)
    specs = [
        EpisodeSpec(e, task.task_id, "g", j, 100 + j, answer_ends_episode=env.answer_ends_episode)
        for j, e in enumerate(env.make_group(task, 3))
    ]
    trajs = run_episodes(script, renderer, specs, Budgets(max_turns=4), env.system_prompt)
    right, wrong, chatty = trajs
    assert [c.reward for c in right.calls] == [-0.25, 1.0] and right.env_rewards == {"reward": 0.75}
    assert [c.reward for c in wrong.calls] == [-0.25, -0.25, -0.25]
    assert [c.reward for c in chatty.calls] == [0.0, 1.0] and chatty.n_tool_calls == 1
    assert [m["content"] for m in right.messages if m["role"] == "tool"] == [
        "higher" if low < secret else "lower",
        "right",
    ]
    assert [t.outcome for t in trajs] == ["finished"] * 3
    score_trajectories(trajs, components=env.reward_components, reward_range=env.reward_range)
    assert [t.reward for t in trajs] == [0.75, -0.75, 1.0]
    assert [t.reward_components for t in trajs] == [{"reward": 0.75}, {"reward": -0.75}, {"reward": 1.0}]
    served = _sessions(GuessEnv.log, n)  # what the foreign environment itself returned, per session
    assert sorted(served) == sorted([[-0.25, 1.0], [-0.25, -0.25, -0.25], [1.0]])
    assert sorted(sum(s) for s in served) == sorted(t.reward for t in trajs)
    assert {e[1] for e in GuessEnv.log[n:]} == {task.seed}  # one problem: every episode reset with its seed


def test_answers_through_the_runner(servers, tiny_tokenizer):
    env = _env(servers["word"], n_problems=16)
    renderer = Renderer(tiny_tokenizer, env.tools)
    task = env.split["train"][0]
    word = secret_word(task.seed)
    script = replay(renderer, [[word], ["zebra", word.upper()], ["zebra", "yak"]])
    n = len(WordEnv.log)
    specs = [EpisodeSpec(env.make_episode(task), task.task_id, "g", j, j) for j in range(3)]
    trajs = run_episodes(script, renderer, specs, Budgets(max_turns=2), env.system_prompt)
    assert [t.outcome for t in trajs] == ["finished"] * 3
    assert trajs[1].messages[-2:] == [
        {"role": "assistant", "content": word.upper()},
        {"role": "user", "content": "correct"},
    ]
    score_trajectories(trajs, components=env.reward_components, reward_range=env.reward_range)
    assert [t.reward for t in trajs] == [1.0, 0.5, 0.0]
    assert sorted(_sessions(WordEnv.log, n)) == [[0.0, 0.0], [0.0, 0.5], [1.0]]
    assert trajs[0].verifier_score == 1.0 and trajs[0].final_code == word


# ---- (c) a server that errors is an env_error, never 0 --------------------------------
def test_server_errors_are_env_errors(servers, tiny_tokenizer):
    env = _env(servers["broken"], n_problems=8)
    renderer = Renderer(tiny_tokenizer, env.tools)
    task = env.split["train"][0]
    script = replay(renderer, [["stone"], ["explode"]])
    specs = [EpisodeSpec(env.make_episode(task), task.task_id, "g", j, j) for j in range(2)]
    trajs = run_episodes(script, renderer, specs, Budgets(max_turns=2), env.system_prompt)
    score_trajectories(trajs, components=env.reward_components, reward_range=env.reward_range)
    crashed, exploded = trajs
    assert (crashed.outcome, crashed.reward) == ("env_error", None)
    assert crashed.error == "OpenEnv server: step failed: the grader crashed (code EXECUTION_ERROR)"
    assert (exploded.outcome, exploded.reward) == ("env_error", None)  # 1e6 is outside [0, 1]: rejected
    assert "outside the declared range" in exploded.error


def test_no_free_session_and_a_gone_server_are_env_errors(servers, tiny_tokenizer):
    env = _env(servers["single"], n_problems=8)
    renderer = Renderer(tiny_tokenizer, env.tools)
    task = env.split["train"][0]
    specs = [EpisodeSpec(env.make_episode(task), task.task_id, "g", j, j) for j in range(2)]
    trajs = run_episodes(replay(renderer, [["zebra"], ["zebra"]]), renderer, specs, Budgets(max_turns=1), "")
    score_trajectories(trajs, components=env.reward_components, reward_range=env.reward_range)
    first, second = trajs
    assert (first.outcome, first.reward) == ("truncated", 0.0)  # its session worked
    assert (second.outcome, second.reward, second.calls) == ("env_error", None, [])
    assert "(code CAPACITY_REACHED); the server holds at most 1 sessions" in second.error
    assert "max_concurrent_envs=N" in second.error
    # a server that was there when the environment was made, and is gone when an episode starts
    extra = Served(create_app(WordEnv, WordAction, WordObservation, max_concurrent_envs=4))
    env = _env(extra.url, n_problems=8)
    ep = env.make_episode(task)
    ep.reset()
    extra.stop()
    specs = [EpisodeSpec(env.make_episode(task), task.task_id, "g", 0, 0)]
    [t] = run_episodes(replay(renderer, [["zebra"]]), renderer, specs, Budgets(max_turns=1), "")
    assert t.outcome == "env_error" and t.error.startswith("environment reset raised ")
    from websockets.exceptions import ConnectionClosed

    with pytest.raises(ConnectionClosed):  # the open session died with its server (the runner: env_error)
        ep.step({"answer": "zebra"})
    assert ep._session is None


def test_a_reply_outside_the_protocol_is_an_error(monkeypatch, servers):
    env = _env(servers["word"], n_problems=8)
    ep = env.make_episode(env.split["train"][0])
    ep.reset()
    monkeypatch.setattr(
        ep._session.conn,
        "recv",
        lambda timeout=None: '{"type": "observation", "data": {"reward": NaN, "done": false, "observation": {}}}',
    )
    _, r, term, _, info = ep.step({"answer": "x"})
    assert (r, term, info["env_error"]) == (
        0.0,
        True,
        "OpenEnv server: step returned a reward that is not a finite number: nan",
    )
    ep.reset()
    monkeypatch.setattr(ep._session.conn, "recv", lambda timeout=None: "<html>")
    with pytest.raises(RuntimeError, match="the reply is not JSON"):
        ep.step({"answer": "x"})


# ---- options -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, match",
    [
        ({"base_url": None}, "base_url=None must be the server's URL"),
        ({"base_url": "127.0.0.1:8000"}, "base_url='127.0.0.1:8000' must be the server's URL"),
        ({"n_problems": 0}, "n_problems=0 must be an integer from 1"),
        ({"action": "mcp"}, "action='mcp' must be one of answer, tool"),
        ({"reward_range": [1, 0]}, r"reward_range=\[1, 0\] must be \[low, high\]"),
        ({"reward_range": "01"}, "reward_range='01' must be"),
        ({"reset_kwargs": [1]}, "reset_kwargs=.* must be a JSON mapping"),
        ({"timeout_s": 0}, "timeout_s=0 must be"),
        ({"answer_field": "text"}, "answer_field='text' is not a field of the action; it has 'word'"),
        ({"action": "tool", "answer_field": "word"}, "answer_field is for action=answer"),
        ({"tool_name": "guess"}, "tool_name is for action=tool"),
        ({"colour": "red"}, "unknown option 'colour'; it takes base_url, n_problems, action"),
    ],
)
def test_bad_options_are_refused(servers, options, match):
    options = {"base_url": servers["word"], **options}
    if options["base_url"] is None:
        del options["base_url"]  # not given at all
    with pytest.raises(ValueError, match=match):
        load_environment(TARGET, 0, options)


def test_no_server_and_missing_package_name_the_fix(monkeypatch):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(
        ValueError,
        match=rf"cannot read http://127.0.0.1:{port}/schema .*is an OpenEnv server "
        "running there",
    ):
        _env(f"http://127.0.0.1:{port}")
    import builtins

    real = builtins.__import__

    def no_websockets(name, *a, **k):
        if name.startswith("websockets"):
            raise ImportError("No module named 'websockets'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_websockets)
    with pytest.raises(ValueError, match=r"needs the websockets package .*pip install 'consequence\[openenv\]'"):
        OpenEnvEnvironment(base_url="http://127.0.0.1:1")


def test_two_field_action_needs_a_field_or_tool_mode(servers):
    class Two(Action):
        a: str
        b: str

    app = create_app(WordEnv, Two, WordObservation)
    s = Served(app)
    try:
        with pytest.raises(ValueError, match="the action has the fields 'a', 'b', so an answer cannot fill it"):
            _env(s.url)
        assert _env(s.url, answer_field="b").answer_field == "b"
        assert _env(s.url, action="tool", tool_name="pair").tools[0]["function"]["name"] == "pair"
    finally:
        s.stop()


# ---- (d) the command line ------------------------------------------------------------
@pytest.mark.slow
def test_cli_train(servers, tmp_path):
    from consequence.cli import app
    from consequence.records import read_trajectories

    run = tmp_path / "run"
    k = len(WordEnv.resets)
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--env",
            TARGET,
            "--env-option",
            f"base_url={servers['word']}",
            *ONE_TINY_ITERATION,
            "--max-turns",
            "2",
            "--max-new-tokens",
            "16",
            "--run-dir",
            str(run),
        ],
        env={"COLUMNS": "250"},
    )
    assert res.exit_code == 0, res.output
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["environment"]["name"] == "openenv"
    assert manifest["environment"]["options"] == {"base_url": servers["word"]}
    assert manifest["environment"]["server"]["metadata"]["name"] == "WordEnv"
    trajs = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    assert len(trajs) == 4 and all(t.task_id.startswith("seed-") for t in trajs)
    assert all(t.outcome in ("finished", "truncated") and t.reward in (0.0, 0.5, 1.0) for t in trajs)
    seeds = [int(t.task_id.split("#")[0].removeprefix("seed-")) for t in trajs]
    assert set(seeds) <= set(WordEnv.resets[k:])  # every rollout reset its problem on the server
    assert len(WordEnv.resets) - k >= 80 + 4 + 2  # the prompt-length check (80 train problems), 4 rollouts, 2 evals
    res = CliRunner().invoke(
        app,
        [
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
            str(tmp_path / "eval"),
        ],
        env={"COLUMNS": "250"},
    )
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["settings"]["environment"]["name"] == "openenv"
    assert result["settings"]["tasks"] == "openenv:WordEnv:100"
