"""The endpoint's compatibility policy (consequence.serve.compat), /v1/completions, /v1/models/{id},
top_logprobs and token-by-token streaming, through the real `openai` client on 127.0.0.1 (docs/agents.md §5)."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer

from consequence.harness.renderer import Renderer
from consequence.policy.tiny import load_policy
from consequence.records import trajectory_to_rows
from consequence.serve import compat
from consequence.serve.app import BackgroundServer, ServeSettings, create_app, model_context_length
from consequence.serve.streaming import TextStream

BUNDLED = "consequence/assets/tiny-repair"
ROOT = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "fix add"}]
LONG_PROMPT = "def add(a, b):"  # the bundled model's greedy continuation runs to max_tokens (no end-of-turn)


@pytest.fixture(scope="module")
def policy():
    return load_policy(BUNDLED)


@pytest.fixture(scope="module")
def server(policy):
    model, tok = policy
    settings = ServeSettings(
        "tiny", model_context_length(model), temperature=0.0, max_tokens=16, aliases=("tiny-b179c9523d0e",)
    )
    with BackgroundServer(create_app(model, Renderer(tok, []), settings)) as s:
        yield s


def _client(server, session: str | None = None) -> openai.OpenAI:
    base = f"{server.url}/s/{session}/v1" if session else f"{server.url}/v1"
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0)


def _post(server, path: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _chat(server, **change) -> tuple[int, dict, dict]:
    return _post(server, "/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 2} | change)


# ---- the table and its documentation ---------------------------------------------------------
def test_the_docs_table_is_the_code_table():
    docs = (ROOT / "docs" / "agents.md").read_text()
    assert compat.markdown_table() in docs, (
        "regenerate the table in docs/agents.md §5 from serve.compat.markdown_table()"
    )
    assert compat.markdown_table().count("\n") == len(compat.FIELDS) + 1  # header, rule, one row per field


def test_every_field_of_the_table_has_one_rule_per_endpoint():
    for endpoint in compat.ALL:
        names = [f.name for f in compat.FIELDS if endpoint in f.endpoints]
        assert len(names) == len(set(names)), endpoint
    for f in compat.FIELDS:
        assert f.rule in (compat.HONOURED, compat.NEUTRAL, compat.REFUSED, compat.TEMPLATE, compat.IGNORED)
        assert bool(f.neutral) == (f.rule == compat.NEUTRAL), f.name


# ---- each rule on the wire ----------------------------------------------------------------------
def test_ignored_fields_are_accepted_and_named_in_the_header_in_body_order(server):
    status, out, headers = _chat(
        server, prompt_cache_key="k", zzz_new_field={"a": 1}, metadata={"x": "y"}, reasoning_effort="low"
    )
    assert status == 200 and out["choices"][0]["token_ids"]
    # the bundled template never names reasoning_effort: it cannot change the prompt, so it is ignored
    assert headers["x-consequence-ignored-fields"] == "prompt_cache_key, zzz_new_field, metadata, reasoning_effort"
    status, _out, headers = _chat(server, temperature=0.0, frequency_penalty=0, min_p=0.0, repetition_penalty=1)
    assert status == 200 and "x-consequence-ignored-fields" not in headers  # neutral values: honoured, not ignored


@pytest.mark.parametrize(
    "change,field,why",
    [
        ({"min_p": 0.1}, "min_p", "the sampler has no min-p filter"),
        ({"repetition_penalty": 1.2}, "repetition_penalty", "the sampler applies no penalty"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "the sampler applies no penalty"),
        ({"guided_json": {"type": "object"}}, "guided_json", "constrained decoding"),
        ({"stop_token_ids": [5]}, "stop_token_ids", "the model's own end ids stop"),
        ({"best_of": 2}, "best_of", "candidates are not ranked"),
        ({"functions": [{"name": "f"}]}, "functions", "deprecated: use `tools`"),
    ],
)
def test_fields_that_would_change_sampling_are_refused_naming_the_field_and_why(server, change, field, why):
    path = "/v1/completions" if field == "best_of" else "/v1/chat/completions"
    body = {"model": "tiny", "max_tokens": 2} | ({"prompt": "x"} if field == "best_of" else {"messages": HI}) | change
    status, out, _ = _post(server, path, body)
    assert status == 400 and out["error"]["param"] == field and out["error"]["code"] == "unsupported_parameter"
    assert why in out["error"]["message"] and out["error"]["message"].startswith(field)


def test_response_format_text_is_accepted_and_tool_choice_required_needs_tools(server):
    assert _chat(server, response_format={"type": "text"})[0] == 200
    status, out, _ = _chat(server, tool_choice="required")  # constrained replies: tests/serve/test_serve_constrained.py
    assert status == 400 and out["error"]["param"] == "tool_choice" and "needs tools" in out["error"]["message"]


def test_top_k_is_honoured_top_k_1_at_temperature_1_is_greedy(server):
    greedy = _chat(server, temperature=0.0, max_tokens=12)[1]["choices"][0]
    status, out, _ = _chat(server, temperature=1.0, top_k=1, seed=3, max_tokens=12)
    one = out["choices"][0]
    assert status == 200 and one["token_ids"] == greedy["token_ids"]
    assert one["token_logprobs"] == [0.0] * len(one["token_ids"])  # one token kept: log 1 = 0 exactly
    assert _chat(server, temperature=1.0, top_k=-1, seed=3)[0] == 200  # vLLM's "off"
    status, out, _ = _chat(server, top_k=-2)
    assert status == 400 and out["error"]["param"] == "top_k"


@pytest.fixture(scope="module")
def template_server(policy):
    """A server whose chat template reads `hint`, `reasoning_effort` and fails on `fail`."""
    model, _tok = policy
    tok = AutoTokenizer.from_pretrained(BUNDLED)
    tok.chat_template = (
        "{%- if hint is defined %}{{- 'HINT ' + hint + '\\n' }}{%- endif %}"
        "{%- if reasoning_effort is defined %}{{- 'EFFORT ' + reasoning_effort + '\\n' }}{%- endif %}"
        "{%- if fail is defined %}{{- raise_exception('asked to fail') }}{%- endif %}" + tok.chat_template
    )
    settings = ServeSettings("tiny", model_context_length(model), temperature=0.0)
    with BackgroundServer(create_app(model, Renderer(tok, []), settings)) as s:
        yield s, tok


def test_chat_template_kwargs_and_a_template_variable_reach_the_template(template_server):
    server, tok = template_server

    def expected(**kwargs):
        text = tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True, **kwargs)
        return tok.encode(text, add_special_tokens=False)

    status, out, headers = _chat(server, chat_template_kwargs={"hint": "be brief"}, reasoning_effort="high")
    assert status == 200 and "x-consequence-ignored-fields" not in headers
    assert out["prompt_token_ids"] == expected(hint="be brief", reasoning_effort="high")
    assert out["prompt_token_ids"] != expected()
    status, out, _ = _chat(server, chat_template_kwargs={"fail": True})
    assert (
        status == 400 and out["error"]["param"] == "chat_template_kwargs" and "asked to fail" in out["error"]["message"]
    )
    status, out, _ = _chat(server, chat_template_kwargs={"add_generation_prompt": False})
    assert status == 400 and "may not set add_generation_prompt" in out["error"]["message"]


# ---- names ---------------------------------------------------------------------------------------
def test_models_by_id_and_aliases(server):
    c = _client(server)
    assert [m.id for m in c.models.list().data] == ["tiny", "tiny-b179c9523d0e"]
    assert c.models.retrieve("tiny-b179c9523d0e").id == "tiny-b179c9523d0e"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = c.chat.completions.create(model="tiny-b179c9523d0e", messages=HI, max_tokens=2)
    assert r.model == "tiny-b179c9523d0e"  # the response names the model as the request did (as vLLM)


def test_a_registered_model_is_served_under_its_plain_name():
    from consequence.cli.serve import served_names

    folder = Path("/cache/models/smollm2-135m-instruct-b179c9523d0e")
    assert served_names("smollm2-135m-instruct", folder, []) == [
        "smollm2-135m-instruct",
        "smollm2-135m-instruct-b179c9523d0e",
    ]
    assert served_names("runs/x/checkpoints/final", Path("runs/x/checkpoints/final"), []) == ["final"]
    assert served_names("smollm2-135m-instruct", folder, ["a", "b", "a"]) == ["a", "b"]


# ---- top_logprobs: the processed distribution the token was sampled from --------------------------
def test_top_logprobs_are_the_processed_distribution_recomputed(server, policy):
    model, _tok = policy
    r = _client(server).chat.completions.create(
        model="tiny", messages=HI, max_tokens=6, temperature=0.7, seed=1, logprobs=True, top_logprobs=5
    )
    ch = r.choices[0]
    ids, prompt = ch.model_extra["token_ids"], r.model_extra["prompt_token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / 0.7, -1)  # temperature 0.7, no top-k / top-p: the whole vocabulary
    for j, entry in enumerate(ch.logprobs.content):
        want = logp[j].topk(5)
        got = [(a.logprob) for a in entry.top_logprobs]
        assert len(got) == 5 and got == sorted(got, reverse=True)
        # float32 forward passes of different shapes (decode with a cache vs one full pass): 1e-4
        assert max(abs(g - w) for g, w in zip(got, want.values.tolist())) < 1e-4
        assert abs(entry.logprob - logp[j, ids[j]].item()) < 1e-4


def test_top_logprobs_inside_a_top_k_support_renormalise(server):
    r = _client(server).chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=5,
        temperature=1.0,
        seed=2,
        logprobs=True,
        top_logprobs=10,
        extra_body={"top_k": 3},
    )
    for entry in r.choices[0].logprobs.content:
        tops = entry.top_logprobs
        assert len(tops) <= 3  # tokens outside the support (probability 0) are not listed
        assert abs(sum(torch.tensor([a.logprob for a in tops]).exp().tolist()) - 1) < 1e-5  # all the mass
        assert entry.logprob in [a.logprob for a in tops]


def test_top_logprobs_checks(server):
    status, out, _ = _chat(server, top_logprobs=3)
    assert status == 400 and out["error"]["message"] == "top_logprobs needs logprobs: true"
    status, out, _ = _chat(server, logprobs=True, top_logprobs=21)
    assert status == 400 and out["error"]["param"] == "top_logprobs"


# ---- /v1/completions ------------------------------------------------------------------------------
def test_completions_take_text_or_token_ids(server, policy):
    _model, tok = policy
    c = _client(server)
    text = c.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=8)
    ids = tok.encode(LONG_PROMPT, add_special_tokens=False)
    assert text.model_extra["prompt_token_ids"] == ids
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=8, logprobs=2)
    ch = by_ids.choices[0]
    assert ch.model_extra["token_ids"] == text.choices[0].model_extra["token_ids"]  # greedy: the same
    assert ch.text == text.choices[0].text == tok.decode(ch.model_extra["token_ids"])
    assert ch.finish_reason == "length" and by_ids.usage.completion_tokens == 8
    assert ch.logprobs.token_logprobs == ch.model_extra["token_logprobs"]
    assert ch.logprobs.tokens == [tok.decode([i]) for i in ch.model_extra["token_ids"]]
    assert all(len(t) <= 2 for t in ch.logprobs.top_logprobs)
    assert ch.logprobs.text_offset[0] == 0 and ch.logprobs.text_offset[1] == len(ch.logprobs.tokens[0])
    default = c.completions.create(model="tiny", prompt=ids)
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


@pytest.mark.parametrize(
    "prompt,says",
    [
        (["a", "b"], "one non-empty string or one non-empty list of token ids"),
        ([1, 10**6], "outside this model's vocabulary [0, 768)"),
        ("", "prompt is empty"),
        ([], "one non-empty string"),
    ],
)
def test_bad_prompts_are_refused(server, prompt, says):
    status, out, _ = _post(server, "/v1/completions", {"model": "tiny", "prompt": prompt})
    assert status == 400 and out["error"]["param"] == "prompt" and says in out["error"]["message"]


def test_completions_are_recorded_token_exactly_with_the_prefix_rule(server):
    c = _client(server, "cmpl-session")
    p1 = [282, 72, 411, 70]
    r1 = c.completions.create(model="tiny", prompt=p1, max_tokens=4)
    out1 = r1.choices[0].model_extra["token_ids"]
    obs = [10, 67]
    r2 = c.completions.create(model="tiny", prompt=p1 + out1 + obs, max_tokens=4)  # continues: same row
    r3 = c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4)  # anything else: a counted break
    rec = json.loads(urllib.request.urlopen(server.url + "/s/cmpl-session/record", timeout=10).read())
    c1, c2, c3 = rec["calls"]
    assert (c1["context_ids"], c1["output_ids"], c1["observation_ids"]) == (p1, out1, obs)
    assert c2["context_ids"] == p1 + out1 + obs and c2["output_ids"] == r2.choices[0].model_extra["token_ids"]
    assert c3["context_ids"] == [5, 6, 7] and c3["output_ids"] == r3.choices[0].model_extra["token_ids"]
    assert [b["call"] for b in rec["breaks"]] == [2] and "do not start with the last call" in rec["breaks"][0]["reason"]
    session = server.app.state.serve.sessions.get("cmpl-session", create=False)
    rows = trajectory_to_rows(session.trajectory)
    assert len(rows) == 2
    targets = [[(i, lp) for i, lp, m in zip(r.input_ids, r.old_logprobs, r.loss_mask) if m] for r in rows]
    assert targets[0] == list(zip(out1 + c2["output_ids"], c1["sample_logprobs"] + c2["sample_logprobs"]))


# ---- streaming, token by token ------------------------------------------------------------------------
def test_streamed_text_equals_the_whole_reply(server):
    c = _client(server)
    for stop in ([], ["[ ["]):  # greedy: ') ys ys[ [yyy...'; the stop string cuts it to ') ys ys'
        whole = c.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=20, stop=stop)
        chunks = list(c.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=20, stop=stop, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
        # the number of deltas depends on the load (tokens that arrived together are decoded together);
        # that they come while sampling runs: test_the_first_delta_comes_while_the_reply_is_still_being_sampled
        assert [ch for ch in chunks if ch.choices and ch.choices[0].text]
    assert whole.choices[0].text == ") ys ys" and whole.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model="tiny", messages=HI, n=2, temperature=1.0, seed=4, max_tokens=12)
    stream = c.chat.completions.create(
        model="tiny", messages=HI, n=2, temperature=1.0, seed=4, max_tokens=12, stream=True
    )
    got = {0: "", 1: ""}
    for ch in stream:
        for choice in ch.choices:
            got[choice.index] += choice.delta.content or ""
    assert [got[0], got[1]] == [ch.message.content or "" for ch in r.choices]


def test_the_first_delta_comes_while_the_reply_is_still_being_sampled(server):
    """Chunks are sent as tokens are sampled: when the first text arrives, the batch that
    samples the reply (200 tokens, no end-of-turn: greedy on this prompt) has not finished."""
    before = json.loads(urllib.request.urlopen(server.url + "/health", timeout=10).read())["batches"]
    stream = _client(server).completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=200, stream=True)
    for ch in stream:
        if ch.choices and ch.choices[0].text:
            health = json.loads(urllib.request.urlopen(server.url + "/health", timeout=10).read())
            break
    assert health["batches"] == before and health["in_flight"] == 1
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "length" and len(rest[-1].choices[0].model_extra["token_ids"]) == 200


def test_a_streamed_reply_is_recorded_even_when_the_client_leaves(server):
    c = _client(server, "left-stream")
    stream = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a " * 100}], max_tokens=60, stream=True
    )
    next(iter(stream))
    stream.close()  # gone after the first chunk
    deadline = threading.Event()
    for _ in range(200):
        rec = json.loads(urllib.request.urlopen(server.url + "/s/left-stream/record", timeout=10).read())
        if rec["calls"]:
            break
        deadline.wait(0.05)
    assert len(rec["calls"]) == 1 and len(rec["calls"][0]["output_ids"]) == 60


def test_text_stream_holds_back_what_the_end_may_change(policy):
    _model, tok = policy
    ids = tok.encode("abc STOP def", add_special_tokens=False)
    s = TextStream(tok, [], ["STOP"], strip=False)
    sent = [s.add([i]) for i in ids]
    assert "".join(sent) == s.sent == "abc "
    assert all("S" not in d for d in sent)  # a tail that may start the stop string waits
    assert s.rest("abc ") == ""
    lead = TextStream(tok, [], [], strip=True)
    assert [lead.add([i]) for i in tok.encode(" hi there", add_special_tokens=False)] == [""] * len(
        tok.encode(" hi there", add_special_tokens=False)
    )  # opens with whitespace: kept (cut at max_tokens) or stripped, the end decides
    assert lead.rest("hi there") == "hi there" and lead.rest(" hi there") == " hi there"


def test_the_table_rules_match_the_refusal_messages_for_every_refused_field(server):
    """Every `refused` field of the chat endpoint is a 400 naming it (none slips through as ignored)."""
    for f in compat.FIELDS:
        if f.rule != compat.REFUSED or compat.CHAT not in f.endpoints:
            continue
        value = {"string": "x", "object": {"a": 1}, "array": [1], "integer": 1}[f.types[0]]
        status, out, _ = _chat(server, **{f.name: value})
        assert status == 400 and out["error"]["param"] == f.name, f.name
        assert re.search(re.escape(f.why), out["error"]["message"]), f.name


def test_ignored_field_names_reach_the_header_as_printable_ascii(server):
    status, _out, headers = _chat(server, **{"bad\nname": 1, "é" * 100: 2})
    assert status == 200
    assert headers["x-consequence-ignored-fields"] == "bad\\nname, " + ("\\u00e9" * 100)[:64]
