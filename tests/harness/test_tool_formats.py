"""Tool-call formats of model families (consequence/harness/tool_formats.py) and the renderer's
``tool_format`` (``--tool-format``).

For each format: a round trip (write → parse → the same names and arguments), the hard
cases (nested JSON, quotes, newlines, the closing marker inside a string argument), several
calls per reply, malformed replies that give a parse error naming what is wrong, and the
renderer on a small chat template of the family's published shape (written below, after
the templates the models ship and vLLM's examples; no downloads): the template's own
rendering of a call is recognised, and the token stream of an episode is the template's
rendering of the whole conversation. With the default (``auto``) the bundled tiny model's
replies parse exactly as the regular-expression reader before the registry did.
Tokenizers only, no weights.
"""

from __future__ import annotations

import copy
import json
import re
import typing

import pytest

from consequence.harness.renderer import TOOL_FORMATS, Renderer
from consequence.harness.tool_formats import (
    FORMATS,
    LLAMA_TOOLS_HEAD,
    QWEN3_CODER_TAIL,
    declare,
    get_format,
)
from tool_specs import TOOLS

NAMES = list(FORMATS)
# every argument a model could get wrong: nested JSON, both quotes, newlines, backslashes,
# and each format's closing markers inside a string
HARD = {
    "line": 2,
    "code": (
        "x = \"</tool_call>\"; y = '</parameter>'\n</function>\n])}; [TOOL_CALLS] <|python_tag|>\n"
        "print(f(a=1), '\\\\n')"
    ),
}
NESTED = {"opts": {"a": [1, 2.5, {"b": None, "c": False}], "q": '"quoted"'}, "empty": "", "neg": -3}
SPECS = TOOLS + [
    {
        "type": "function",
        "function": {
            "name": "configure",
            "description": "Set options.",
            "parameters": {
                "type": "object",
                "properties": {"opts": {"type": "object"}, "empty": {"type": "string"}, "neg": {"type": "integer"}},
            },
        },
    }
]


# ---- the registry ----------------------------------------------------------------------------
def test_the_option_offers_exactly_the_registered_formats():
    from consequence.config import TrainConfig

    assert NAMES == ["hermes", "qwen3_coder", "llama3_json", "mistral", "pythonic"]
    assert TOOL_FORMATS == ("auto", "native", *NAMES)
    assert typing.get_args(TrainConfig.model_fields["tool_format"].annotation) == TOOL_FORMATS
    assert TrainConfig().tool_format == "auto"
    with pytest.raises(ValueError, match="tool_format"):
        TrainConfig(tool_format="json")
    with pytest.raises(ValueError, match="unknown tool-call format 'json'; registered: hermes, qwen3_coder"):
        get_format("json")


# ---- write → parse ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_of_several_calls_with_hard_arguments(name):
    fmt = FORMATS[name]
    calls = [("replace_line", HARD), ("configure", NESTED), ("run_tests", {})]
    text = fmt.write(calls)
    assert fmt.parse(text, SPECS) == ([{"name": n, "arguments": a} for n, a in calls], None)
    one = fmt.write([("replace_line", json.dumps(HARD))])  # the OpenAI wire shape: arguments as a JSON string
    assert fmt.parse(one, SPECS) == ([{"name": "replace_line", "arguments": HARD}], None)
    content, got, error = fmt.split("I will fix it.\n" + one, SPECS)
    if name in ("llama3_json", "pythonic"):  # the reply is the call(s) and nothing else: text before makes it text
        assert (content, got, error) == ("I will fix it.\n" + one, [], None)
    else:
        assert (content, got, error) == ("I will fix it.", [{"name": "replace_line", "arguments": HARD}], None)


# What each format writes, character for character (the families' published shapes).
WRITTEN = {
    "hermes": '<tool_call>\n{"name": "replace_line", "arguments": {"line": 2, "code": "a\\nb"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=replace_line>\n<parameter=line>\n2\n</parameter>\n<parameter=code>\na\nb\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run_tests>\n</function>\n</tool_call>",
    "llama3_json": '{"name": "replace_line", "parameters": {"line": 2, "code": "a\\nb"}}; '
    '{"name": "run_tests", "parameters": {}}',
    "mistral": '[TOOL_CALLS] [{"name": "replace_line", "arguments": {"line": 2, "code": "a\\nb"}}, '
    '{"name": "run_tests", "arguments": {}}]',
    "pythonic": '[replace_line(line=2, code="a\\nb"), run_tests()]',
}


@pytest.mark.parametrize("name", NAMES)
def test_each_format_writes_its_published_shape(name):
    assert FORMATS[name].write([("replace_line", {"line": 2, "code": "a\nb"}), ("run_tests", {})]) == WRITTEN[name]


# Replies as a model writes them (not as our writer does), and what they read as.
HARD_REPLIES = [
    # hermes: a </tool_call> inside a string argument, pretty-printed JSON, arguments as a JSON string
    (
        "hermes",
        'Let me fix it.\n<tool_call>\n{"name": "replace_line",\n "arguments": {"line": 2, "code": "s = \'</tool_call>\'"}}'
        '\n</tool_call>\n<tool_call>{"name": "run_tests", "arguments": "{}"}</tool_call>',
        [("replace_line", {"line": 2, "code": "s = '</tool_call>'"}), ("run_tests", {})],
        "Let me fix it.",
    ),
    # qwen3_coder: multi-line code holding </parameter>, </function> and </tool_call>; typed by the schema
    (
        "qwen3_coder",
        "<tool_call>\n<function=replace_line>\n<parameter=code>\nif a:\n    s = '</parameter>'\n</function>\n"
        "</tool_call>\n</parameter>\n<parameter=line>\n7\n</parameter>\n</function>\n</tool_call>",
        [("replace_line", {"code": "if a:\n    s = '</parameter>'\n</function>\n</tool_call>", "line": 7})],
        "",
    ),
    # qwen3_coder: a string-typed value that reads as JSON stays a string; an untyped one is decoded
    (
        "qwen3_coder",
        '<tool_call>\n<function=configure>\n<parameter=empty>\n{"a": 1}\n</parameter>\n<parameter=opts>\n'
        '{"a": [1, "}"]}\n</parameter>\n</function>\n</tool_call>',
        [("configure", {"empty": '{"a": 1}', "opts": {"a": [1, "}"]}})],
        "",
    ),
    # llama3_json: <|python_tag|>, "arguments" instead of "parameters", ';' and '}' inside strings
    (
        "llama3_json",
        'Checking. <|python_tag|>{"name": "replace_line", "parameters": {"line": 1, "code": "a; b}"}};\n'
        '{"name": "run_tests", "arguments": {}}',
        [("replace_line", {"line": 1, "code": "a; b}"}), ("run_tests", {})],
        "Checking.",
    ),
    # mistral: ids in the items are ignored; a ']' inside a string; two [TOOL_CALLS] lists
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "replace_line", "arguments": {"line": 3, "code": "x = [1]]"}, "id": "a1b2c3d4e"}]'
        '[TOOL_CALLS][{"name": "run_tests", "arguments": {}}]',
        [("replace_line", {"line": 3, "code": "x = [1]]"}), ("run_tests", {})],
        "",
    ),
    # pythonic: single quotes, a ')]' inside a string, a tuple, JSON spellings, a multi-line list
    (
        "pythonic",
        "[replace_line(line=4, code='f(x)]  # \"q\"\\n'),\n configure(opts={'a': (1, -2.5), 'b': null, 'c': true}),"
        " run_tests()]",
        [
            ("replace_line", {"line": 4, "code": 'f(x)]  # "q"\n'}),
            ("configure", {"opts": {"a": [1, -2.5], "b": None, "c": True}}),
            ("run_tests", {}),
        ],
        "",
    ),
]


@pytest.mark.parametrize(("name", "reply", "calls", "content"), HARD_REPLIES)
def test_replies_as_models_write_them(name, reply, calls, content):
    assert FORMATS[name].split(reply, SPECS) == (content, [{"name": n, "arguments": a} for n, a in calls], None)


MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "run_tests", "arguments": {\n</tool_call>', "tool call is not valid JSON ("),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', 'tool call must be an object with a string "name"'),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "tool call arguments must be a JSON object"),
    (
        "qwen3_coder",
        "<tool_call>\nrun_tests()\n</tool_call>",
        "tool call 1: expected <function=NAME> after <tool_call>",
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=replace_line>\n<parameter=line>\n2\n</function>\n</tool_call>",
        "tool call 1 (replace_line): parameter 'line' is not closed with </parameter>",
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=run_tests>\n</function>\n",
        "tool call 1 (run_tests): expected </tool_call> after </function>",
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>",
        "tool call 1 (f): parameter 'a' is given twice",
    ),
    ("qwen3_coder", "<function=run_tests>\n</function>", "a <function=...> block outside <tool_call>...</tool_call>"),
    ("llama3_json", '{"name": "run_tests", "parameters": {', "tool call 1 is not valid JSON ("),
    ("llama3_json", '{"name": "a", "parameters": {}} {"name": "b"}', 'unexpected text after tool call 1: \'{"name"'),
    ("llama3_json", '{"name": "a", "parameters": {}, "arguments": {}}', "has both 'parameters' and 'arguments'"),
    ("llama3_json", "<|python_tag|>  ", "nothing after <|python_tag|>: expected a JSON tool call"),
    ("llama3_json", '{"tool": "run_tests"}', 'tool call 1 must be an object with a string "name"'),
    ("mistral", '[TOOL_CALLS] {"name": "run_tests", "arguments": {}}', "expected a JSON list after [TOOL_CALLS]"),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "run_tests", "arguments": {}]',
        "the tool call list after [TOOL_CALLS] is not valid",
    ),
    ("mistral", "[TOOL_CALLS] []", "the tool call list after [TOOL_CALLS] is empty"),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}] and more', "unexpected text after the tool call list"),
    ("pythonic", "[run_tests(1)]", "call 1 (run_tests): positional arguments are not allowed"),
    ("pythonic", '[run_tests(x=os.system("ls"))]', "run_tests(x=...): only literals are allowed"),
    ("pythonic", "[run_tests(x=1), 5]", "item 2 of the list is not a function call"),
    ("pythonic", "[run_tests(x=1)", "the tool call list is not valid Python ('[' was never closed"),
    ("pythonic", "[tools.run(x=1)]", "call 1: the function must be a plain name, got 'tools.run'"),
    ("pythonic", "[f(**kw)]", "call 1 (f): **arguments are not allowed"),
]


@pytest.mark.parametrize(("name", "reply", "needle"), MALFORMED)
def test_a_malformed_reply_is_a_parse_error_naming_what_is_wrong(name, reply, needle):
    content, calls, error = FORMATS[name].split(reply, SPECS)
    assert calls == [] and error is not None and needle in error, error
    assert content == reply.strip()


@pytest.mark.parametrize("name", NAMES)
def test_a_reply_without_a_call_is_content(name):
    for reply in ("The answer is 42.", "  [1, 2] is a list  ", "x = {1: 2}"):
        assert FORMATS[name].split(reply, SPECS) == (reply.strip(), [], None)


def test_qwen3_coder_values_are_typed_by_the_schema():
    fmt = FORMATS["qwen3_coder"]

    def one(params: str) -> dict:
        calls, error = fmt.parse(f"<tool_call>\n<function=f>\n{params}</function>\n</tool_call>", [SCHEMA_F])
        assert error is None
        return calls[0]["arguments"]

    p = "<parameter={}>\n{}\n</parameter>\n".format
    assert one(p("s", "12") + p("i", "12") + p("n", "1.5") + p("b", "True")) == {
        "s": "12",
        "i": 12,
        "n": 1.5,
        "b": True,
    }
    assert one(p("s", "null") + p("i", "null") + p("o", "[1, {}]")) == {"s": "null", "i": None, "o": [1, {}]}
    assert one(p("i", "twelve") + p("b", "yes")) == {"i": "twelve", "b": "yes"}  # the schema check names them
    assert one(p("untyped", "7") + p("untyped2", "not json")) == {"untyped": 7, "untyped2": "not json"}
    # the Qwen3-Coder template writes booleans and None with `| string`: True, False, None
    assert one(p("b", "False") + p("i", "None") + p("untyped", "True")) == {"b": False, "i": None, "untyped": True}


SCHEMA_F = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {
                "s": {"type": "string"},
                "i": {"type": "integer"},
                "n": {"type": "number"},
                "b": {"type": "boolean"},
                "o": {"type": "array"},
            },
        },
    },
}


def test_names_a_format_cannot_write_are_refused(tiny_tokenizer):
    bad = [{"type": "function", "function": {"name": "run-tests", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(ValueError, match=r"tool_format='pythonic': the pythonic format cannot write these tools: "):
        Renderer(tiny_tokenizer, bad, tool_format="pythonic")
    with pytest.raises(ValueError, match="'run-tests' is not a Python identifier"):
        FORMATS["pythonic"].write([("run-tests", {})])
    odd = [{"type": "function", "function": {"name": "a>b", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(ValueError, match="cannot be written inside <function=...>"):
        Renderer(tiny_tokenizer, odd, tool_format="qwen3_coder")
    assert Renderer(tiny_tokenizer, bad, tool_format="hermes").tool_format == "hermes"


# ---- templates of each family's published shape -----------------------------------------------
# Each renders tools=, tool_calls and tool results itself, as the family's template does.
QWEN25 = r"""
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- endif %}
{%- if tools %}{{- '<|im_start|>system\n' }}{%- if sys is defined %}{{- sys + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for t in tools %}{{- '\n' + (t | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif sys is defined %}{{- '<|im_start|>system\n' + sys + '<|im_end|>\n' }}{%- endif %}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant' }}{%- if m.content %}{{- '\n' + m.content }}{%- endif %}
{%- for c in m.tool_calls %}{{- '\n<tool_call>\n{"name": "' + c.function.name + '", "arguments": ' + (c.function.arguments | tojson) + '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
# Qwen3-Coder: the tools as XML in the system turn; its closing reminder is the module's
# QWEN3_CODER_TAIL (raw template text here), the rest is written out.
QWEN3_CODER = (
    r"""
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- endif %}
{%- if tools %}{{- '<|im_start|>system\n' }}{%- if sys is defined %}{{- sys }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
{{- '\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for t in tools %}{%- set fn = t.function %}{{- '\n<function>\n<name>' + fn.name + '</name>' }}
{%- if fn.description is defined %}{{- '\n<description>' + (fn.description | trim) + '</description>' }}{%- endif %}{{- '\n<parameters>' }}
{%- for pname, spec in fn.parameters.properties | items %}{{- '\n<parameter>\n<name>' + pname + '</name>' }}
{%- if spec.type is defined %}{{- '\n<type>' + (spec.type | string) + '</type>' }}{%- endif %}{{- '\n</parameter>' }}{%- endfor %}
{%- for k, v in fn.parameters | items if k not in ['type', 'properties'] %}{{- '\n<' + k + '>' + (v | tojson) + '</' + k + '>' }}{%- endfor %}
{{- '\n</parameters>\n</function>' }}{%- endfor %}
{{- '\n</tools>' }}"""
    + QWEN3_CODER_TAIL
    + r"""{{- '<|im_end|>\n' }}
{%- elif sys is defined %}{{- '<|im_start|>system\n' + sys + '<|im_end|>\n' }}{%- endif %}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant' }}{%- if m.content %}{{- '\n' + (m.content | trim) + '\n' }}{%- endif %}
{%- for c in m.tool_calls %}{{- '\n<tool_call>\n<function=' + c.function.name + '>\n' }}
{%- for k, v in c.function.arguments | items %}{{- '<parameter=' + k + '>\n' + (v | tojson if v is mapping or (v is sequence and v is not string) else v | string) + '\n</parameter>\n' }}{%- endfor %}
{{- '</function>\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user\n' }}{%- endif %}{{- '<tool_response>\n' + m.content + '\n</tool_response>\n' }}{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
)
# Llama 3.1 with the tools in the system turn (tools_in_user_message=false); the published
# template takes one call per turn, vLLM's llama3_json parser reads several joined by '; '.
_LLAMA_HEAD = r"""
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content | trim %}{%- else %}{%- set sys = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
"""
_LLAMA_TAIL = r"""
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}CALLS{{- '<|eot_id|>' }}
{%- elif m.role in ['tool', 'ipython'] %}{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}
{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content | trim) + '<|eot_id|>' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""
LLAMA31 = (
    _LLAMA_HEAD
    + r"""{%- if tools %}{{- 'You have access to the following functions. To call a function, please respond with JSON for a function call. Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n' }}
{%- for t in tools %}{{- (t | tojson(indent=4)) + '\n\n' }}{%- endfor %}{%- endif %}{{- sys + '<|eot_id|>' }}"""
    + _LLAMA_TAIL.replace(
        "CALLS",
        r"""{%- for c in m.tool_calls %}{{- '{"name": "' + c.function.name + '", "parameters": ' + (c.function.arguments | tojson) + '}' }}{%- if not loop.last %}{{- '; ' }}{%- endif %}{%- endfor %}""",
    )
)
# Llama 3.2 pythonic (vLLM's example template), values written with tojson.
LLAMA32_PYTHONIC = (
    _LLAMA_HEAD
    + r"""{%- if tools %}{{- 'You have access to the following functions. To call functions, please respond with a python list of the calls. Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)] Do not use variables.\n\n' }}
{%- for t in tools %}{{- (t | tojson(indent=4)) + '\n\n' }}{%- endfor %}{%- endif %}{{- sys + '<|eot_id|>' }}"""
    + _LLAMA_TAIL.replace(
        "CALLS",
        r"""{{- '[' }}{%- for c in m.tool_calls %}{{- c.function.name + '(' }}{%- for k, v in c.function.arguments | items %}{{- k + '=' + (v | tojson) }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ')' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']' }}""",
    )
)
# Mistral 7B Instruct v0.3 (tool-call ids left out: the harness's messages carry none).
MISTRAL = r"""
{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- endif %}
{{- '<s>' }}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'user' %}{%- if tools and m == users[-1] %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' }}{%- if sys is defined and m == users[-1] %}{{- sys + '\n\n' }}{%- endif %}{{- m.content + '[/INST]' }}
{%- elif m.role == 'assistant' and m.tool_calls %}{{- '[TOOL_CALLS] [' }}{%- for c in m.tool_calls %}{{- c.function | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']</s>' }}
{%- elif m.role == 'assistant' %}{{- ' ' + m.content + '</s>' }}
{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS] {"content": ' + (m.content | tojson) + '}[/TOOL_RESULTS]' }}{%- endif %}
{%- endfor %}
"""
CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
FAMILIES = {  # format → (template, end-of-turn token)
    "hermes": (QWEN25, "<|im_end|>"),
    "qwen3_coder": (QWEN3_CODER, "<|im_end|>"),
    "llama3_json": (LLAMA31, "<|eot_id|>"),
    "mistral": (MISTRAL, "</s>"),
    "pythonic": (LLAMA32_PYTHONIC, "<|eot_id|>"),
}
SPECIAL = ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>", "<s>", "</s>"]
SPECIAL += ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
SPECIAL += ["[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


@pytest.fixture(scope="module")
def family_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with the families' control tokens added (as each family's vocabulary has them)."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    return tok


def _with_template(tok, template: str):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


OPENING = [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "Fix find_max."}]


def _episode_stream(r: Renderer, turns: list[list[tuple[str, dict]]]) -> tuple[list[int], list[dict]]:
    """Play ``turns`` (each: the calls the policy samples) as the harness does: prompt ids, then per
    turn the sampled ids (the format's text + end-of-turn) and the observation ids of its results."""
    history, stream = list(OPENING), r.prompt_ids(OPENING)
    for k, calls in enumerate(turns):
        sampled = r.encode(r.format_calls(calls)) + [r.eot_id]
        turn = r.parse(sampled, "stop")
        assert (turn.parse_error, turn.tool_calls) == (None, [{"name": n, "arguments": a} for n, a in calls])
        results = [{"role": "tool", "content": f"result {k}.{i}"} for i in range(len(calls))]
        stream += sampled + r.observation_ids(history, turn.message, results)
        history += [turn.message, *results]
    return stream, history


TURNS = [
    [("replace_line", {"line": 2, "code": '    best = xs[0]  # "first"'})],
    [("run_tests", {}), ("replace_line", {"line": 3, "code": "x = {'a': [1]}\nreturn x"})],
]


@pytest.mark.parametrize("name", NAMES)
def test_a_family_template_is_used_natively_and_its_calls_are_read(name, family_tokenizer):
    template, eot = FAMILIES[name]
    r = Renderer(_with_template(family_tokenizer, template), TOOLS, end_of_turn=eot)
    assert (r.tool_format, r.call_format) == ("native", name)
    assert Renderer(r.tokenizer, TOOLS, end_of_turn=eot, tool_format="native").call_format == name
    stream, history = _episode_stream(r, TURNS)
    # the episode's tokens are the template's own rendering of the whole conversation
    assert stream == r.encode(r.render_text(history, add_generation_prompt=True))
    assert r.render_text(history, True) == r.tokenizer.apply_chat_template(
        history, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    no_call = r.parse(r.encode("I am not sure.") + [r.eot_id], "stop")
    assert no_call.parse_error == f"no tool call; answer with {FORMATS[name].hint}"


def test_a_template_whose_calls_no_format_reads_keeps_hermes(family_tokenizer):
    tok = _with_template(family_tokenizer, QWEN25.replace('\'\\n<tool_call>\\n{"name": "\'', "'\\nCALL \"'"))
    assert "CALL" in tok.chat_template
    assert (Renderer(tok, TOOLS).tool_format, Renderer(tok, TOOLS).call_format) == ("native", "hermes")


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder"])
def test_declared_on_chatml_is_the_family_template_text(name, family_tokenizer):
    """Written into the messages of a plain ChatML template, the Qwen formats give exactly the
    text the Qwen2.5 / Qwen3-Coder templates render for the same conversation."""
    family = _with_template(family_tokenizer, FAMILIES[name][0])
    plain = _with_template(family_tokenizer, CHATML)
    _, history = _episode_stream(Renderer(family, TOOLS), TURNS)
    declared = Renderer(plain, TOOLS, tool_format=name)
    assert declared.tool_format == name
    for gen in (True, False):
        assert declared.render_text(history, gen) == Renderer(family, TOOLS).render_text(history, gen)
    stream, history2 = _episode_stream(declared, TURNS)
    assert history2 == history and stream == declared.encode(declared.render_text(history, True))


@pytest.mark.parametrize("name", NAMES)
def test_each_format_declared_on_a_plain_template(name, family_tokenizer):
    r = Renderer(_with_template(family_tokenizer, CHATML), TOOLS, tool_format=name)
    assert (r.tool_format, r.call_format) == (name, name)
    fmt = FORMATS[name]
    prompt = r.render_text(OPENING, True)
    assert prompt.startswith("<|im_start|>system\nYou fix code.\n\n" + fmt.tools_text(TOOLS) + "<|im_end|>\n")
    stream, history = _episode_stream(r, TURNS)
    assert stream == r.encode(r.render_text(history, True))
    text = r.tokenizer.decode(stream)
    rendered = r.tokenizer.apply_chat_template(declare(fmt, history, TOOLS), tokenize=False, add_generation_prompt=True)
    assert text == rendered
    for calls in TURNS:
        assert "<|im_start|>assistant\n" + fmt.write(calls) + "<|im_end|>" in text
    results = fmt.result_messages(["result 1.0", "result 1.1"])
    assert "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in results) in text
    assert [m["role"] for m in results] == (["ipython"] * 2 if name in ("llama3_json", "pythonic") else ["user"])


def test_declared_system_text_of_the_llama_and_mistral_families():
    llama = FORMATS["llama3_json"].tools_text(TOOLS[:1])
    assert llama == LLAMA_TOOLS_HEAD + json.dumps(TOOLS[0], indent=4)
    assert llama.startswith(
        "You have access to the following functions. To call a function, please respond with JSON for a function call."
        ' Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    )
    assert FORMATS["mistral"].tools_text(TOOLS[:1]) == (
        '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "run_tests", "description": '
        '"Run the visible tests.", "parameters": {"type": "object", "properties": {}}}}][/AVAILABLE_TOOLS]'
    )
    assert FORMATS["mistral"].result_messages(['2 "passed"', "ok"]) == [
        {
            "role": "user",
            "content": '[TOOL_RESULTS] {"content": "2 \\"passed\\""}[/TOOL_RESULTS][TOOL_RESULTS] {"content": "ok"}[/TOOL_RESULTS]',
        }
    ]


def test_a_format_the_template_cannot_show_is_refused_with_what_to_use(family_tokenizer):
    tok = _with_template(family_tokenizer, MISTRAL)
    with pytest.raises(ValueError) as e:
        Renderer(tok, TOOLS, end_of_turn="</s>", tool_format="mistral")
    msg = str(e.value)
    assert msg.startswith("tool_format='mistral' was asked for, and the Mistral tool format cannot stand in: ")
    assert "the generation prompt adds no assistant header" in msg
    assert msg.endswith("This template renders tools= itself (its calls read as mistral): use tool_format='native'")


# ---- the default is what it was ----------------------------------------------------------------
_OLD_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _old_parse(text: str, answers: bool):
    """The renderer's reading before the registry (a regular expression, then json.loads), verbatim
    in behaviour: (content, calls, error) of a reply that stopped by itself."""
    calls, errors = [], []
    for block in _OLD_RE.findall(text):
        try:
            obj = json.loads(block.strip())
        except json.JSONDecodeError as e:
            errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append('tool call must be an object with a string "name"')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                errors.append("tool call arguments are not a JSON object")
                continue
        if not isinstance(args, dict):
            errors.append("tool call arguments must be a JSON object")
            continue
        calls.append({"name": obj["name"], "arguments": args})
    content = _OLD_RE.sub("", text).strip()
    if errors:
        return text, [], errors[0]
    if not calls and not answers:
        return text, [], 'no tool call; answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    return content, calls, None


OLD_REPLIES = [
    '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>',
    'I will test.\n<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>\nthen finish',
    '<tool_call>{"name": "replace_line", "arguments": "{\\"line\\": 2, \\"code\\": \\"x\\"}"}</tool_call>'
    '<tool_call>{"name": "finish"}</tool_call>',
    '<tool_call>\n{"name": "run_tests", "arguments": {\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call><tool_call>{"name": 3}</tool_call>',
    '<tool_call>{"name": "a"} trailing</tool_call>',
    '<tool_call> <tool_call>{"name": "a"}</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}',  # never closed: text
    "hello",
    "",
    '{"name": "run_tests", "arguments": {}}',
    '</tool_call><tool_call>{"name": "a"}</tool_call></tool_call>',
]


@pytest.mark.parametrize("reply", OLD_REPLIES)
@pytest.mark.parametrize("answers", [False, True])
def test_auto_reads_the_tiny_models_replies_exactly_as_before(renderer, reply, answers):
    assert (renderer.tool_format, renderer.call_format) == ("native", "hermes")
    turn = renderer.parse(renderer.encode(reply) + [renderer.eot_id], "stop", answers=answers)
    content, calls, error = _old_parse(reply, answers)
    assert (turn.message["content"], turn.tool_calls, turn.parse_error) == (content, calls, error)


def test_a_closing_tag_inside_a_string_no_longer_cuts_the_call(renderer):
    reply = (
        '<tool_call>\n{"name": "replace_line", "arguments": {"line": 1, "code": "s = \'</tool_call>\'"}}\n</tool_call>'
    )
    assert _old_parse(reply, False)[2].startswith("tool call is not valid JSON (Unterminated string")
    turn = renderer.parse(renderer.encode(reply) + [renderer.eot_id], "stop")
    assert turn.parse_error is None
    assert turn.tool_calls == [{"name": "replace_line", "arguments": {"line": 1, "code": "s = '</tool_call>'"}}]


# ---- writers of demonstrations ---------------------------------------------------------------------
def test_scripted_turns_are_written_in_the_renderers_format(family_tokenizer, renderer):
    from consequence.distill.teacher import turn_text

    step = [{"answer": "Checking."}, ("run_tests", {}), {"name": "finish", "arguments": {}}]
    r = Renderer(_with_template(family_tokenizer, CHATML), TOOLS, tool_format="mistral")
    assert turn_text(step, r) == 'Checking.\n[TOOL_CALLS] [{"name": "run_tests", "arguments": {}}, ' + (
        '{"name": "finish", "arguments": {}}]'
    )
    assert turn_text(step, renderer) == turn_text(step)  # the tiny model: Hermes, one call per line
    assert turn_text(step) == "Checking.\n" + renderer.format_call("run_tests", {}) + "\n" + renderer.format_call(
        "finish", {}
    )


def test_the_manifest_records_the_format(tmp_path, family_tokenizer):
    from consequence.config import TrainConfig
    from consequence.envs.registry import env_of
    from consequence.report.manifest import build_manifest

    cfg = TrainConfig(env="calculator", run_dir=str(tmp_path / "run"), tool_format="llama3_json")
    r = Renderer(_with_template(family_tokenizer, CHATML), env_of(cfg).tools, tool_format=cfg.tool_format)
    m = build_manifest(
        cfg,
        tmp_path,
        env_of(cfg),
        chat_template="",
        isolation={},
        tool_format=r.tool_format,
        tool_call_format=r.call_format,
    )
    assert m["config"]["tool_format"] == "llama3_json" and m["boxes"]["rollout"]["tool_format"] == "llama3_json"
    assert (m["harness"]["tool_format"], m["harness"]["tool_call_format"]) == ("llama3_json", "llama3_json")


def test_a_tool_format_for_an_environment_without_tools_is_refused():
    """Break-test: --tool-format pythonic on a tool-less environment ran and recorded a format
    nothing used. It is refused before any model work (loop.train.preflight)."""
    from types import SimpleNamespace

    from consequence.config import TrainConfig
    from consequence.loop.train import preflight

    cfg = TrainConfig(tool_format="pythonic")
    with pytest.raises(ValueError, match="--tool-format pythonic: the environment .* offers the policy no tools"):
        preflight(cfg, None, None, SimpleNamespace(tools=[]), None)
