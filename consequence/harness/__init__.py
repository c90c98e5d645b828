"""The harness: tool specs and call validation, and the renderer that owns messages → tokens and
tokens → tool calls (docs/design.md §3)."""

from consequence.exports import lazy

__all__ = ["ParsedTurn", "Renderer", "check_tool_specs", "replay_conversation", "validate_call"]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "Renderer": "renderer",
        "ParsedTurn": "renderer",
        "replay_conversation": "renderer",
        "check_tool_specs": "tools",
        "validate_call": "tools",
    },
)
