"""The tool specs (OpenAI function format) the renderer, harness and serve tests share.

A module of its own, not conftest: `from conftest import` resolves to whichever conftest.py
pytest imported first (tests/ or tests/distill/), so it broke with the collection order."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the visible tests.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "replace_line",
            "description": "Replace one line.",
            "parameters": {
                "type": "object",
                "properties": {"line": {"type": "integer"}, "code": {"type": "string"}},
                "required": ["line", "code"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "End the episode.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
