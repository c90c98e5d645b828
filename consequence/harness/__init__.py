"""The harness: tool specs and call validation, the tool-call formats of model families, and the
renderer that owns messages → tokens and tokens → tool calls (docs/design.md §3)."""

from consequence.exports import lazy

__all__ = [
    "ParsedTurn",
    "Renderer",
    "ToolFormat",
    "check_tool_specs",
    "declare",
    "get_format",
    "replay_conversation",
    "validate_call",
]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "Renderer": "renderer",
        "ParsedTurn": "renderer",
        "replay_conversation": "renderer",
        "ToolFormat": "tool_formats",
        "declare": "tool_formats",
        "get_format": "tool_formats",
        "check_tool_specs": "tools",
        "validate_call": "tools",
    },
)
