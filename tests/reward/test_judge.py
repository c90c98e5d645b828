"""An LLM judge as a reward (reward/judge.py, judge_client.py, judge_validity.py) against a fake
OpenAI-compatible judge on 127.0.0.1: strict scores, failures as env_errors (never 0), bounded
retries and concurrency, the cache, the validity command's numbers on a hand-made labelled set,
and a one-iteration training run. Loopback only; no real network."""

from __future__ import annotations

import hashlib
import json
import math
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from consequence.records import ModelCall, Trajectory, write_trajectories
from consequence.reward.judge import (
    CACHE_FILE,
    JUDGE_COMPONENT,
    PROMPT_TEMPLATE_SHA256,
    Judge,
    JudgeCache,
    apply_judge,
    episode_parts,
    judge_metrics,
    parse_choice,
    parse_score,
    resolve_rubric,
)
from consequence.reward.judge_client import JudgeClient, JudgeEndpoint, probe_judge
from consequence.reward.judge_validity import cohen_kappa, judge_validity, pearson

RUBRIC = "Give 10 to a right answer, 0 to a wrong one."
_MARK = re.compile(r"\[s=([\w:]+)\]")


class FakeJudge:
    """An OpenAI-compatible judge (GET /v1/models, POST /v1/chat/completions) on a free loopback
    port. A pointwise prompt is answered from the marker ``[s=...]`` in its response section:

    ``[s=N]`` → ``SCORE: N``; ``[s=bad]`` → a reply without a score line; ``[s=http500]`` /
    ``[s=http400]`` → that status every time; ``[s=flaky:K:N]`` → HTTP 500 to the first K
    requests of that prompt, then ``SCORE: N``; ``[s=slow]`` → ``SCORE: 5`` after ``slow_s``;
    ``[s=garbage]`` → a 200 whose body is not JSON; no marker → ``SCORE: len(response) % 11``.

    A pairwise prompt prefers the response with the larger ``[s=N]``, and A on a tie (a
    position bias by construction). Every request waits ``delay_s``; the server counts the
    requests and the most it ever held at once (``max_in_flight``).
    """

    def __init__(self, delay_s: float = 0.0, slow_s: float = 1.0):
        self.delay_s, self.slow_s = delay_s, slow_s
        self.requests: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0
        self.seen: dict[str, int] = {}
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: Any = None, raw: bytes | None = None) -> None:
                data = raw if raw is not None else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

            def _reply(self, text: str) -> None:
                msg = {"role": "assistant", "content": text}
                self._send(200, {"object": "chat.completion", "choices": [{"index": 0, "message": msg}]})

            def do_GET(self):
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake-judge", "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append({"headers": dict(self.headers), "body": body})
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    time.sleep(fake.delay_s)
                finally:  # released before the reply: a client that got its answer may send the next at once
                    with fake.lock:
                        fake.in_flight -= 1
                self._answer(body["messages"][-1]["content"])

            def _answer(self, user: str) -> None:
                if "# Response A\n" in user:
                    a, b = user.split("# Response A\n", 1)[1].split("\n\n# Response B\n")
                    sa, sb = (int(_MARK.search(x).group(1)) for x in (a, b))
                    return self._reply(f"Comparing.\nPREFERRED: {'B' if sb > sa else 'A'}")
                response = user.split("# Response\n", 1)[1]
                m = _MARK.search(response)
                mark = m.group(1) if m else None
                with fake.lock:
                    fake.seen[user] = fake.seen.get(user, 0) + 1
                    nth = fake.seen[user]
                if mark is None:
                    return self._reply(f"Graded.\nSCORE: {len(response) % 11}")
                if mark == "bad":
                    return self._reply("The response looks right to me.")
                if mark in ("http500", "http400"):
                    return self._send(int(mark[4:]), {"error": {"message": "the judge fell over"}})
                if mark == "garbage":
                    return self._send(200, raw=b"<html>gateway error</html>")
                if mark == "slow":
                    time.sleep(fake.slow_s)
                    return self._reply("SCORE: 5")
                if mark.startswith("flaky:"):
                    _, k, n = mark.split(":")
                    if nth <= int(k):
                        return self._send(500, {"error": {"message": "overloaded"}})
                    return self._reply(f"SCORE: {n}")
                return self._reply(f"Fine.\nSCORE: {mark}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False  # a sleeping handler must not hold the test
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> FakeJudge:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _episode(group: str, sample: int, response: str, solved: bool, outcome: str = "finished") -> Trajectory:
    """A single-turn episode of task ``group``; the environment's verdict follows the answer."""
    msgs = [
        {"role": "system", "content": "Answer the question."},
        {"role": "user", "content": f"question {group}"},
        {"role": "assistant", "content": response},
        {"role": "user", "content": "correct" if solved else "incorrect"},
    ]
    return Trajectory(
        f"t{group}", f"0/t{group}", sample, 0, 0, calls=[ModelCall([1, 2, 3], [4, 5], [-1.0, -1.0], "stop")],
        outcome=outcome, reward=None if outcome == "env_error" else float(solved),
        verifier_score=float(solved), reward_components={} if outcome == "env_error" else {"accuracy": float(solved)},
        messages=msgs,
    )  # fmt: skip


def _judge(fake: FakeJudge, tmp_cache=None, **kw) -> Judge:
    sleep = kw.pop("sleep", None)
    ep = JudgeEndpoint(fake.url, "fake-judge", **({"backoff_s": 0.0, "timeout_s": 5.0} | kw))
    client = JudgeClient(ep, sleep=sleep) if sleep else None
    return Judge(ep, RUBRIC, JudgeCache(tmp_cache), client)


# ---- parsing and what the judge sees --------------------------------------------------------
@pytest.mark.parametrize(
    "reply,score",
    [
        ("SCORE: 7", 7.0),
        ("It is right.\n\nSCORE: 10\n\n", 10.0),
        ("reasoning\n  SCORE:3.5  ", 3.5),
        ("SCORE: 0", 0.0),
    ],
)
def test_a_score_line_parses(reply, score):
    assert parse_score(reply) == score


@pytest.mark.parametrize(
    "reply,why",
    [
        ("", "empty"),
        ("SCORE: 7\nbecause it is right", "is not `SCORE"),
        ("**SCORE: 7**", "is not `SCORE"),
        ("SCORE: 7/10", "is not `SCORE"),
        ("SCORE: -1", "is not `SCORE"),
        ("SCORE: 11", "outside \\[0, 10\\]"),
        ("score: 7", "is not `SCORE"),
        ("SCORE: seven", "is not `SCORE"),
    ],
)
def test_anything_else_does_not_parse(reply, why):
    with pytest.raises(ValueError, match=why):
        parse_score(reply)


def test_a_choice_line_parses_strictly():
    assert parse_choice("A is shorter.\nPREFERRED: B") == "B" and parse_choice("PREFERRED:A") == "A"
    for bad in ("PREFERRED: C", "PREFERRED: A\nok", "Preferred: A", "PREFERRED: both"):
        with pytest.raises(ValueError, match="PREFERRED"):
            parse_choice(bad)


def test_the_judge_sees_the_request_and_the_policys_turns_but_not_the_verdict_after_them():
    single = _episode("a", 0, "It is 4.", True)
    assert episode_parts(single) == ("question a", "It is 4.")  # "correct" (the verifier's) is left out
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+2"}}}
    multi = Trajectory(
        "t", "0/t", 0, 0, 0, calls=[ModelCall([1], [2], [-1.0], "stop"), ModelCall([1], [2], [-1.0], "stop")],
        messages=[
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "shot question"},  # a worked example: not the request
            {"role": "assistant", "content": "shot answer"},
            {"role": "user", "content": "what is 2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": "4"},
            {"role": "assistant", "content": "<answer>4</answer>"},
            {"role": "user", "content": "correct"},
        ],
    )  # fmt: skip
    assert episode_parts(multi) == (
        "what is 2+2?",
        '[tool call] calculator {"expression": "2+2"}\n[tool calculator] 4\n[assistant] <answer>4</answer>',
    )
    assert episode_parts(Trajectory("t", "0/t", 0, 0, 0, messages=single.messages)) is None  # no model call


def test_the_rubric_comes_from_the_file_or_the_environment(tmp_path):
    from consequence.envs.registry import load_environment

    (tmp_path / "r.txt").write_text("criteria\n")
    assert resolve_rubric(str(tmp_path / "r.txt"), None) == ("criteria\n", str(tmp_path / "r.txt"))
    calc = load_environment("calculator", 0, {"n_problems": 10})
    text, source = resolve_rubric(None, calc)
    assert text == calc.rubric and "<answer>" in text and source == "environment calculator"
    with pytest.raises(ValueError, match="--env repair defines no rubric; give one with --judge-rubric FILE"):
        resolve_rubric(None, load_environment("repair"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="--judge-rubric .*empty.txt: the file is empty"):
        resolve_rubric(str(tmp_path / "empty.txt"), calc)


# ---- the reward, its failures, retries, cache and concurrency ----------------------------------
def test_scores_become_a_weighted_component_and_the_verifier_is_kept():
    trajs = [_episode("a", 0, "[s=8] four", True), _episode("a", 1, "[s=3] five", False)]
    trajs.append(_episode("a", 2, "[s=9]", True, outcome="env_error"))  # left alone: no request sent
    trajs.append(Trajectory("ta", "0/ta", 3, 0, 0, reward=0.0, reward_components={"accuracy": 0.0}))  # no token
    with FakeJudge() as fake:
        apply_judge(trajs, _judge(fake), weight=0.25)
    a, b = trajs[0], trajs[1]
    # w = 0.25: accuracy × 0.75, judge = 0.25 × score / 10
    assert a.reward_components == {"accuracy": 0.75, JUDGE_COMPONENT: 0.25 * 0.8} and a.reward == 0.75 + 0.2
    assert b.reward_components == {"accuracy": 0.0, JUDGE_COMPONENT: 0.25 * 0.3} and b.reward == pytest.approx(0.075)
    assert a.verifier_score == 1.0 and b.verifier_score == 0.0 and a.outcome == b.outcome == "finished"
    assert trajs[2].reward is None and trajs[3].reward == 0.0 and len(fake.requests) == 2
    body = fake.requests[0]["body"]
    assert body["model"] == "fake-judge" and body["temperature"] == 0.0 and body["seed"] == 0
    assert RUBRIC in body["messages"][1]["content"] and "correct" not in body["messages"][1]["content"]
    assert judge_metrics(trajs, 0.25) == {"judge_score_mean": pytest.approx((0.8 + 0.3) / 2), "judge_errors": 0}
    with pytest.raises(ValueError, match="--judge-weight must lie in \\(0, 1\\]"):
        apply_judge(trajs, _judge(fake), weight=0.0)


@pytest.mark.parametrize(
    "mark,reason",
    [
        ("bad", "judge_unparsable_score: the last line 'The response looks right to me.' is not `SCORE: <number>`"),
        ("garbage", "judge_unparsable_reply: not a chat completion"),
        ("http400", "judge_http_error: HTTP 400: the judge fell over"),
    ],
)
def test_a_reply_that_does_not_parse_or_a_client_error_is_an_env_error_at_once(mark, reason):
    trajs = [_episode("a", 0, f"[s={mark}]", True), _episode("a", 1, "[s=6]", False)]
    with FakeJudge() as fake:
        apply_judge(trajs, _judge(fake, retries=3), weight=1.0)
    bad, ok = trajs
    assert bad.outcome == "env_error" and bad.reward is None and bad.reward_components == {}
    assert bad.error.startswith(f"judge: {reason}")
    assert ok.reward == 0.6 and len(fake.requests) == 2  # not retried: the same prompt gets the same reply
    assert judge_metrics(trajs, 1.0) == {"judge_score_mean": 0.6, "judge_errors": 1}


def test_a_timeout_is_an_env_error_after_the_retries():
    trajs = [_episode("a", 0, "[s=slow]", True)]
    with FakeJudge(slow_s=1.0) as fake:
        t0 = time.perf_counter()
        apply_judge(trajs, _judge(fake, timeout_s=0.2, retries=1), weight=1.0)
        took = time.perf_counter() - t0
    assert trajs[0].outcome == "env_error" and trajs[0].reward is None
    assert trajs[0].error == "judge: judge_timeout: no reply within 0.2 s (attempt 2 of 2)"
    assert len(fake.requests) == 2 and took < 1.5  # two attempts of 0.2 s, not the server's 1 s each


def test_http_500_within_the_retries_is_scored_with_exponential_backoff():
    waits: list[float] = []
    trajs = [_episode("a", 0, "[s=flaky:2:7]", True)]
    with FakeJudge() as fake:
        judge = _judge(fake, retries=2, backoff_s=0.5, sleep=waits.append)
        apply_judge(trajs, judge, weight=1.0)
    assert trajs[0].reward == 0.7 and trajs[0].outcome == "finished"
    assert len(fake.requests) == 3 and waits == [0.5, 1.0]  # 0.5 · 2^0, 0.5 · 2^1
    assert (judge.client.counts.requests, judge.client.counts.retries) == (3, 2)


def test_http_500_beyond_the_retries_is_an_env_error():
    waits: list[float] = []
    trajs = [_episode("a", 0, "[s=flaky:3:7]", True)]
    with FakeJudge() as fake:
        apply_judge(trajs, _judge(fake, retries=2, backoff_s=0.5, sleep=waits.append), weight=1.0)
    assert trajs[0].outcome == "env_error" and trajs[0].reward is None
    assert trajs[0].error == "judge: judge_http_error: HTTP 500: overloaded (attempt 3 of 3)"
    assert len(fake.requests) == 3 and waits == [0.5, 1.0]


def test_a_server_that_is_not_there_is_an_env_error_and_refused_by_the_probe():
    ep = JudgeEndpoint(_dead_url(), "fake-judge", retries=1, backoff_s=0.0, timeout_s=2.0)
    trajs = [_episode("a", 0, "[s=5]", True)]
    apply_judge(trajs, Judge(ep, RUBRIC), weight=1.0)
    assert trajs[0].outcome == "env_error" and trajs[0].error.startswith("judge: judge_connection_error: ")
    with pytest.raises(ValueError, match="--judge-url .*: the server cannot be reached"):
        probe_judge(ep)
    with FakeJudge() as fake:
        probe_judge(JudgeEndpoint(fake.url, "fake-judge"))
        with pytest.raises(ValueError, match="--judge-model other: .* serves 'fake-judge'; give one of them"):
            probe_judge(JudgeEndpoint(fake.url, "other"))


def test_the_cache_never_sends_an_episode_twice(tmp_path):
    cache = tmp_path / CACHE_FILE
    trajs = [_episode("a", k, f"[s={k + 2}]", k % 2 == 0) for k in range(3)]
    trajs.append(_episode("a", 3, "[s=2]", True))  # the same request and response as episode 0
    with FakeJudge() as fake:
        judge = _judge(fake, cache)
        apply_judge(trajs, judge, weight=1.0)
        assert len(fake.requests) == 3 and (judge.asked, judge.cache_hits) == (3, 1)
        assert trajs[3].reward == trajs[0].reward == 0.2
        again = [_episode("a", k, f"[s={k + 2}]", k % 2 == 0) for k in range(3)]
        apply_judge(again, judge, weight=1.0)  # the same episodes, judged before: nothing sent
        assert len(fake.requests) == 3 and [t.reward for t in again] == [0.2, 0.3, 0.4]
        fresh = _judge(fake, cache)  # a resumed run: the cache file is read back
        apply_judge([_episode("a", 0, "[s=2]", True)], fresh, weight=1.0)
        assert len(fake.requests) == 3 and fresh.cache_hits == 1
    on_disk = json.loads(cache.read_text())
    assert sorted(on_disk.values()) == [2.0, 3.0, 4.0] and all(len(k) == 64 for k in on_disk)
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically: no temporary file left


@pytest.mark.parametrize("concurrency", [1, 3])
def test_the_concurrency_bound_is_respected(concurrency):
    trajs = [_episode("a", k, f"[s={k % 11}] {k}", True) for k in range(9)]
    with FakeJudge(delay_s=0.15) as fake:
        apply_judge(trajs, _judge(fake, concurrency=concurrency), weight=1.0)
    # 9 requests of 0.15 s each in ≤ concurrency threads: the bound is reached and never passed
    assert len(fake.requests) == 9 and fake.max_in_flight == concurrency
    assert [t.reward for t in trajs] == [k / 10 for k in range(9)]


def test_the_api_key_comes_from_the_named_variable(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test-123")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with FakeJudge() as fake:
        apply_judge([_episode("a", 0, "[s=5]", True)], _judge(fake, api_key_env="MY_JUDGE_KEY"), weight=1.0)
        apply_judge([_episode("a", 0, "[s=6]", True)], _judge(fake), weight=1.0)  # default, unset: no key
    assert fake.requests[0]["headers"]["Authorization"] == "Bearer sk-test-123"
    assert "Authorization" not in fake.requests[1]["headers"]
    with pytest.raises(
        ValueError, match="--judge-api-key-env UNSET_VAR_X: the environment variable UNSET_VAR_X is not set"
    ):
        JudgeEndpoint("http://127.0.0.1:1", "m", api_key_env="UNSET_VAR_X").check()
    assert "sk-test-123" not in json.dumps(JudgeEndpoint("http://h", "m", api_key_env="MY_JUDGE_KEY").as_dict())


# ---- the validity command ---------------------------------------------------------------------
# Eight labelled episodes of four tasks, one verified (w) and one failed (l) each, the fake judge's
# score in the marker; the responses' lengths are 5, 13, 5, 20, 7, 6, 16, 8 characters.
HAND = [
    ("1", "[s=9]", True),
    ("1", "[s=2]xxxxxxxx", False),
    ("2", "[s=8]", True),
    ("2", "[s=8]xxxxxxxxxxxxxxx", False),
    ("3", "[s=3]xx", True),
    ("3", "[s=1]x", False),
    ("4", "[s=10]xxxxxxxxxx", True),
    ("4", "[s=6]xxx", False),
]


def _hand_set() -> list[Trajectory]:
    trajs = [_episode(g, k, r, ok) for k, (g, r, ok) in enumerate(HAND)]
    trajs.append(_episode("5", 0, "[s=bad]", False))  # labelled, but the judge's reply does not parse
    trajs.append(_episode("6", 0, "[s=9]", True, outcome="env_error"))  # no label
    return trajs


def test_the_validity_numbers_on_a_hand_made_labelled_set():
    seen: list[tuple[str, int, int]] = []
    with FakeJudge() as fake:
        rep = judge_validity(_hand_set(), _judge(fake), max_items=50, max_pairs=50, progress=lambda *a: seen.append(a))
    # the progress bar's feed: every judgement sent, counted once, in each phase's total
    assert sorted(seen) == [("pairwise", d, 8) for d in range(1, 9)] + [("pointwise", d, 9) for d in range(1, 10)]
    m = {k: (v["value"], v["n"]) for k, v in rep["measures"].items()}
    assert rep["items"] == {
        "episodes": 10, "labelled": 9, "judged_pointwise": 9, "passed": 4, "pairs_available": 4, "pairs_judged": 4,
    }  # fmt: skip
    assert rep["failures"] == {"pointwise": {"judge_unparsable_score": 1}, "pairwise": {}}
    # scores 9 2 8 8 3 1 10 6 → the judge passes (≥ 5) w1 w2 l2 w4 l4; it is right on w1 l1 w2 l3 w4: 5 of 8
    assert m["agreement_accuracy"] == (5 / 8, 8)
    # p_e = 5/8 · 4/8 + 3/8 · 4/8 = 1/2; κ = (5/8 − 1/2) / (1 − 1/2) = 1/4
    assert m["cohen_kappa"] == (0.25, 8) and m["judge_pass_rate"] == (5 / 8, 8) and m["verifier_pass_rate"] == (0.5, 8)
    # Σs = 47, ΣL = 80, ΣsL = 506, ΣL² = 1024, Σs² = 359: S_xy = 506 − 470 = 36, S_LL = 224, S_ss = 82.875
    assert m["length_score_pearson"][0] == pytest.approx(36 / math.sqrt(224 * 82.875), rel=1e-12)
    # passed: s 9 8 3 10, L 5 5 7 16: S_xy = 266 − 247.5 = 18.5, S_LL = 82.75, S_ss = 29
    assert m["length_score_pearson_passed"][0] == pytest.approx(18.5 / math.sqrt(82.75 * 29), rel=1e-12)
    # failed: s 2 8 1 6, L 13 20 6 8: S_xy = 240 − 199.75 = 40.25, S_LL = 116.75, S_ss = 32.75
    assert m["length_score_pearson_failed"][0] == pytest.approx(40.25 / math.sqrt(116.75 * 32.75), rel=1e-12)
    assert m["length_score_pearson_passed"][1] == m["length_score_pearson_failed"][1] == 4
    # by length: w1 w2 l3 w3 | l4 l1 w4 l2 → right on 3 of the shorter 4, 2 of the longer 4
    assert m["accuracy_shorter_half"] == (0.75, 4) and m["accuracy_longer_half"] == (0.5, 4)
    # pairs: the larger score wins, A on a tie; only task 2 (8 vs 8) flips with the order
    assert m["position_flip_rate"] == (0.25, 4)
    assert m["first_position_share"] == (5 / 8, 8)  # A, B | A, A | A, B | A, B
    assert m["pairwise_accuracy"] == (7 / 8, 8)
    # the longer one is l1, l2, w3, w4: chosen 0 + 1 + 2 + 2 of 8 decisions
    assert m["longer_preferred_share"] == (5 / 8, 8)
    assert len(fake.requests) == 9 + 8  # 9 pointwise, 4 pairs × 2 orders


def test_the_helpers_and_the_refusals_of_the_validity_check():
    assert pearson([1, 2], [3, 3]) is None and pearson([1], [2]) is None
    # x − x̄ = −1, 0, 1; y − ȳ = −7/3, −1/3, 8/3: S_xy = 5, S_xx = 2, S_yy = 114/9
    assert pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(5 / math.sqrt(2 * 114 / 9), rel=1e-12)
    assert cohen_kappa([1, 1], [1, 1]) is None and cohen_kappa([], []) is None
    assert cohen_kappa([1, 0, 1, 0], [1, 0, 0, 1]) == 0.0
    with FakeJudge() as fake:
        with pytest.raises(ValueError, match="no labelled episode among 1"):
            judge_validity([_episode("6", 0, "x", True, outcome="env_error")], _judge(fake))
        rep = judge_validity(_hand_set(), _judge(fake), max_items=3, max_pairs=1, seed=4)
    assert rep["items"]["judged_pointwise"] == 3 and rep["items"]["pairs_judged"] == 1
    assert rep["measures"]["agreement_accuracy"]["n"] + sum(rep["failures"]["pointwise"].values()) == 3


def test_the_cli_prints_the_table_and_writes_the_report(tmp_path):
    from typer.testing import CliRunner

    from consequence.cli import app

    write_trajectories(tmp_path / "eps.parquet", _hand_set())
    (tmp_path / "rubric.txt").write_text(RUBRIC)
    with FakeJudge() as fake:
        args = ["judge-check", "--data", str(tmp_path / "eps.parquet"), "--judge-url", fake.url]
        args += ["--judge-model", "fake-judge", "--judge-rubric", str(tmp_path / "rubric.txt")]
        res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "check.json")], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        rep = json.loads((tmp_path / "check.json").read_text())
        flip = rep["measures"]["position_flip_rate"]
        assert (flip["value"], flip["n"]) == (0.25, 4)
        assert rep["requests"] == {"judgements": 17, "cache_hits": 0, "http_requests": 17, "retries": 0}
        assert rep["settings"]["model"] == "fake-judge" and "position_flip_rate" in res.output
        assert "judge_unparsable_score" in res.output
        no_rubric = CliRunner().invoke(app, [*args[:-2], "--out", str(tmp_path / "x.json")])
        assert no_rubric.exit_code == 2 and "no rubric: give --judge-rubric FILE" in no_rubric.output
        assert not (tmp_path / "x.json").exists()
    down = [a if a != fake.url else _dead_url() for a in args]
    res = CliRunner().invoke(app, [*down, "--out", str(tmp_path / "y.json")], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "the server cannot be reached" in res.output and "Traceback" not in res.output


# ---- settings and a training run ---------------------------------------------------------------
def test_the_judge_settings_are_checked_before_any_work(tmp_path):
    from consequence.config import TrainConfig

    with pytest.raises(ValueError, match="--judge-model has no effect with no --judge-url"):
        TrainConfig(judge_model="m")
    with pytest.raises(ValueError, match="--judge-url needs --judge-model NAME"):
        TrainConfig(judge_url="http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="--judge-rubric .*nope.txt: no such file"):
        TrainConfig(judge_url="http://127.0.0.1:1/v1", judge_model="m", judge_rubric=str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="--judge-url with --rollout-workers is not supported yet"):
        TrainConfig(judge_url="http://127.0.0.1:1/v1", judge_model="m", rollout_workers=1)
    cfg = TrainConfig(judge_url="http://127.0.0.1:1/v1", judge_model="m", judge_weight=0.5, judge_retries=0)
    assert (cfg.judge_weight, cfg.judge_retries, cfg.judge_api_key_env) == (0.5, 0, "OPENAI_API_KEY")


def test_a_run_with_a_judge_that_is_not_there_is_refused_before_the_model_loads(tmp_path):
    from rich.console import Console

    from consequence.config import TrainConfig
    from consequence.loop.train import train

    (tmp_path / "r.txt").write_text(RUBRIC)
    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"), judge_url=_dead_url(), judge_model="m", judge_rubric=str(tmp_path / "r.txt"),
        iterations=1, tasks_per_iteration=1, group_size=2, eval_every=0, final_eval_episodes=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="the server cannot be reached"):
        train(cfg, Console(quiet=True))
    assert not (tmp_path / "run" / "manifest.json").exists()


@pytest.mark.slow
def test_a_run_trains_on_the_judge_against_the_fake_server(tmp_path, monkeypatch):
    """One iteration of the default task with the judge at weight ½ (the fake judge gives
    len(response) % 11): every scored episode's reward is ½ × its components + ½ × score/10,
    judge_score_mean is the mean score/10, success stays the verifier's, the manifest holds the
    judge's model and hashes but never the key, and every distinct prompt was sent once."""
    from rich.console import Console

    from consequence.config import TrainConfig
    from consequence.loop.train import train
    from consequence.records import read_trajectories

    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-secret-judge-key")
    (tmp_path / "rubric.txt").write_text(RUBRIC)
    run = tmp_path / "run"
    with FakeJudge() as fake:
        cfg = TrainConfig(
            run_dir=str(run), judge_url=fake.url, judge_model="fake-judge", judge_rubric=str(tmp_path / "rubric.txt"),
            judge_weight=0.5, judge_api_key_env="JUDGE_TEST_KEY", judge_concurrency=2, iterations=1,
            tasks_per_iteration=2, group_size=2, eval_every=0, final_eval_episodes=0, max_turns=2, max_new_tokens=16,
        )  # fmt: skip
        train(cfg, Console(quiet=True))
    m = json.loads((run / "metrics.jsonl").read_text())
    trajs = read_trajectories(run / "trajectories" / "iter_0000.parquet")
    scored = [t for t in trajs if t.reward is not None]
    assert scored and m["env_errors"] == 0 and m["judge_errors"] == 0
    expected = []
    for t in scored:
        s = (len(episode_parts(t)[1]) % 11) / 10
        expected.append(s)
        assert t.reward_components[JUDGE_COMPONENT] == pytest.approx(0.5 * s, abs=1e-12)
        verifier = t.verifier_score if t.outcome == "finished" and t.verifier_score is not None else 0.0
        assert t.reward_components["hidden_tests"] == 0.5 * verifier  # the environment's, × (1 − w)
        assert t.reward == pytest.approx(0.5 * verifier + 0.5 * s, abs=1e-12)
    assert m["judge_score_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-12)
    assert m["success"] == sum(t.verifier_score == 1.0 and t.outcome == "finished" for t in scored) / len(scored)
    distinct = {hashlib.sha256(json.dumps(r["body"]["messages"]).encode()).hexdigest() for r in fake.requests}
    assert len(fake.requests) == len(distinct) <= len(scored) and fake.max_in_flight <= 2
    assert all(r["headers"]["Authorization"] == "Bearer sk-secret-judge-key" for r in fake.requests)
    assert len(json.loads((run / CACHE_FILE).read_text())) == len(distinct)
    manifest = json.loads((run / "manifest.json").read_text())
    rec = manifest["reward"]["judge"]
    assert rec["model"] == "fake-judge" and rec["prompt_template_sha256"] == PROMPT_TEMPLATE_SHA256
    assert (
        rec["rubric_sha256"] == hashlib.sha256(RUBRIC.encode()).hexdigest() and rec["api_key_env"] == "JUDGE_TEST_KEY"
    )
    assert JUDGE_COMPONENT in manifest["reward"]["components"]
    for f in ("manifest.json", "config.yaml"):
        assert "sk-secret-judge-key" not in (run / f).read_text()
