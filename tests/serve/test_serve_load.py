"""The endpoint under load (consequence.serve): the body-size limit, tokenising off the event loop,
session lifetimes, the 4xx log and /metrics, on 127.0.0.1 with the bundled tiny model.

Latencies are measured by benchmarks/bench_serve_load.py; these tests check behaviour only
(what is refused, what still answers, what is counted)."""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from consequence.harness.renderer import Renderer
from consequence.policy.tiny import load_policy
from consequence.records import Trajectory
from consequence.serve.app import BackgroundServer, ServeSettings, create_app, model_context_length
from consequence.serve.sessions import Session, SessionStore

BUNDLED = "consequence/assets/tiny-repair"
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def policy():
    return load_policy(BUNDLED)


def _server(policy, max_context: int | None = None, **settings) -> BackgroundServer:
    model, tok = policy
    context = max_context or model_context_length(model)
    base = {"temperature": 0.0, "max_tokens": 4, "max_body_bytes": LIMIT} | settings
    return BackgroundServer(create_app(model, Renderer(tok, []), ServeSettings("tiny", context, **base)))


@pytest.fixture(scope="module")
def server(policy):
    with _server(policy, session_ttl_s=0.0) as s:
        yield s


def _get(server, path: str) -> dict:
    with urllib.request.urlopen(server.url + path, timeout=30) as r:
        return json.loads(r.read())


def _post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, body, {"Content-Type": "application/json"} | (headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _chat_body(text: str, **extra) -> bytes:
    return json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2} | extra
    ).encode()


# ---- the body-size limit -------------------------------------------------------------------------
def test_a_body_over_the_limit_is_a_413_naming_the_limit_and_the_option(server):
    body = _chat_body("x" * (LIMIT + 1))
    status, out = _post(server, "/v1/chat/completions", body)
    assert status == 413
    assert out["error"]["code"] == "request_too_large" and out["error"]["type"] == "invalid_request_error"
    assert f"is {len(body)} bytes, over this server's limit of {LIMIT} bytes" in out["error"]["message"]
    assert "--max-body-bytes" in out["error"]["message"]
    assert _post(server, "/v1/chat/completions", _chat_body("x" * 100))[0] == 200  # under it: served


def test_a_chunked_body_over_the_limit_is_a_413_too(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = _chat_body("y" * (2 * LIMIT))
    pieces = (body[i : i + 8192] for i in range(0, len(body), 8192))  # no Content-Length: counted as it comes
    conn.request("POST", "/v1/chat/completions", pieces, {"Content-Type": "application/json"}, encode_chunked=True)
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    assert r.status == 413 and "more than 65536 bytes" in out["error"]["message"]


def test_health_answers_while_a_5_mb_body_is_refused(server):
    done: dict = {}

    def big():
        done["result"] = _post(server, "/v1/chat/completions", _chat_body("z" * 5_000_000))
        done["t"] = time.monotonic()

    t = threading.Thread(target=big)
    t.start()
    health = []
    while True:  # at least once, however fast the 413 comes
        health.append(_get(server, "/health")["queued"] == 0)
        if not t.is_alive():
            break
    t.join()
    assert done["result"][0] == 413 and health and all(health)


def test_tokenising_runs_off_the_event_loop(policy):
    """A 1 MB message under a 16 MiB limit and a 131072-token context passes the cheap length
    bound and is tokenised in full (about 0.7 M tokens: seconds), then refused by its count.
    /health answers meanwhile: with tokenising on the event loop no answer could come back
    before the big request's."""
    with _server(policy, max_body_bytes=16 * 2**20, max_context=131072) as server:
        finished: dict = {}

        def big():
            finished["result"] = _post(server, "/v1/chat/completions", _chat_body("hello world " * 85_000))
            finished["t"] = time.monotonic()

        t = threading.Thread(target=big)
        t.start()
        answered = []
        while t.is_alive():
            _get(server, "/health")
            answered.append(time.monotonic())
            time.sleep(0.02)
        t.join()
    status, out = finished["result"]
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    assert "the messages take" in out["error"]["message"]  # the exact count: it was tokenised
    early = [a for a in answered if a < finished["t"] - 0.3]
    assert len(early) >= 3, (len(answered), answered[-1] - finished["t"] if answered else None)


def test_text_that_cannot_fit_the_context_is_refused_before_tokenising(policy):
    with _server(policy, max_body_bytes=16 * 2**20) as server:
        t0 = time.monotonic()
        status, out = _post(server, "/v1/chat/completions", _chat_body("w" * 5_000_000))
        took = time.monotonic() - t0
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    # 5e6 characters, at most 16 per token (the bundled vocabulary's longest), halved: >= 156250 tokens
    assert "take at least 156250 tokens (5000000 characters)" in out["error"]["message"]
    assert took < 5  # tokenising 5 MB takes ~17 s on this machine; the bound is a division


# ---- sessions --------------------------------------------------------------------------------------
def test_a_refused_request_leaves_no_session(server):
    before = _get(server, "/health")["sessions"]
    for body in (_chat_body("hi", max_tokens=-1), _chat_body("hi", model_x=1, min_p=0.5), b"{not json"):
        status, _ = _post(server, "/s/refused-1/v1/chat/completions", body)
        assert status == 400
    assert _get(server, "/health")["sessions"] == before
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(server, "/s/refused-1/record")
    assert e.value.code == 404
    assert _post(server, "/s/refused-1/v1/chat/completions", _chat_body("hi"))[0] == 200  # then a real call
    rec = _get(server, "/s/refused-1/record")
    assert len(rec["calls"]) == 1 and rec["prefix_breaks"] == 0


def test_idle_sessions_expire(policy):
    with _server(policy, session_ttl_s=0.3) as server:
        assert _post(server, "/s/short-lived/v1/chat/completions", _chat_body("hi"))[0] == 200
        assert len(_get(server, "/s/short-lived/record")["calls"]) == 1
        deadline = time.monotonic() + 10
        while _get(server, "/health")["sessions"]:
            assert time.monotonic() < deadline, "the idle session was never forgotten"
            time.sleep(0.05)
        assert "short-lived" not in server.app.state.serve.batcher.cache.entries  # its K/V went with it
        with pytest.raises(urllib.error.HTTPError):
            _get(server, "/s/short-lived/record")


def test_expiry_spares_busy_sessions_and_bound_episodes():
    store = SessionStore()
    idle = store.enter("idle")
    idle.trajectory.calls.append(object())  # a recorded call: kept after leave
    store.leave(idle)
    busy = store.enter("busy")
    store.add(Session("episode-0", Trajectory("t", "g", 0, 0, 0), episode=object()))
    idle.last_used = busy.last_used = time.monotonic() - 100
    assert store.expire(10) == ["idle"]
    assert sorted(store.ids()) == ["busy", "episode-0"]
    store.leave(busy)  # no call recorded: forgotten when its last call ends
    assert store.ids() == ["episode-0"]


# ---- the 4xx log and /metrics ---------------------------------------------------------------------
def test_every_4xx_is_logged_with_its_reason(server, caplog):
    caplog.set_level(logging.INFO, logger="consequence.serve")
    _post(server, "/v1/chat/completions", _chat_body("hi", max_tokens=-1))
    _post(server, "/v1/chat/completions", _chat_body("x" * (LIMIT + 10)))
    _post(server, "/v1/chat/completions", _chat_body("hi", prompt_cache_key="k"))
    time.sleep(0.1)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "consequence.serve")
    assert (
        "POST /v1/chat/completions -> 400 invalid_value (param max_tokens): max_tokens must be a positive integer"
        in text
    )
    assert "POST /v1/chat/completions -> 413 request_too_large" in text
    assert "/v1/chat/completions: ignored field(s) prompt_cache_key" in text


def _metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def test_metrics_count_requests_batches_sessions_and_tokens(server):
    before = _metrics(server)
    ok = '{endpoint="chat_completions",status="200"}'
    bad = '{endpoint="chat_completions",status="400"}'
    big = '{endpoint="chat_completions",status="413"}'
    status, out = _post(server, "/s/metered/v1/chat/completions", _chat_body("hi", max_tokens=3))
    assert status == 200
    _post(server, "/v1/chat/completions", _chat_body("hi", max_tokens=0))
    _post(server, "/v1/chat/completions", _chat_body("x" * (LIMIT + 1)))
    after = _metrics(server)
    assert after[f"consequence_requests_total{ok}"] - before.get(f"consequence_requests_total{ok}", 0) == 1
    assert after[f"consequence_requests_total{bad}"] - before.get(f"consequence_requests_total{bad}", 0) == 1
    assert after[f"consequence_requests_total{big}"] - before.get(f"consequence_requests_total{big}", 0) == 1
    tokens = out["usage"]["completion_tokens"]
    assert after["consequence_generated_tokens_total"] - before["consequence_generated_tokens_total"] == tokens
    assert after["consequence_batch_size_count"] - before["consequence_batch_size_count"] == 1
    assert after['consequence_batch_size_bucket{le="1"}'] - before['consequence_batch_size_bucket{le="1"}'] == 1
    assert after["consequence_sessions_open"] == _get(server, "/health")["sessions"] >= 1
    assert after["consequence_queue_length"] == 0 and after["consequence_generated_tokens_per_second"] > 0


@pytest.mark.parametrize(
    ("arrived", "waiting", "rounds", "expected"),
    [
        (0, 1, 1, False),  # a lone request: one wait, then it is sampled
        (3, 4, 1, True),  # a burst still arriving: wait again
        (3, 64, 1, False),  # the batch is full (max_batch 64)
        (3, 40, 9, True),  # the 10th wait is the last
        (3, 40, 10, False),
    ],
)
def test_a_batch_waits_while_a_burst_keeps_arriving(arrived, waiting, rounds, expected):
    from consequence.serve.batcher import MAX_WAIT_ROUNDS, keep_waiting

    assert MAX_WAIT_ROUNDS == 10
    assert keep_waiting(arrived, waiting, 64, rounds) is expected
