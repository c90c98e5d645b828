"""Tool specs (JSON schema, OpenAI function-calling shape) and call validation."""

from __future__ import annotations

from typing import Any

import jsonschema


def check_tool_specs(tools: list[dict]) -> dict[str, dict]:
    """Validate tool specs and index them by name.

    Each spec is ``{"type": "function", "function": {"name", "description", "parameters"}}``
    where ``parameters`` is a JSON schema of type object.

    Raises:
        ValueError: a spec is malformed or its parameters are not a valid JSON schema.
    """
    by_name: dict[str, dict] = {}
    for i, spec in enumerate(tools):
        fn = spec.get("function") if isinstance(spec, dict) else None
        if spec.get("type") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise ValueError(
                f"tool spec #{i} must look like "
                '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        try:
            jsonschema.Draft202012Validator.check_schema(params)
        except jsonschema.SchemaError as e:
            raise ValueError(f"tool {fn['name']!r}: parameters are not a valid JSON schema: {e.message}") from e
        if params.get("type") != "object":  # arguments arrive as one JSON object
            raise ValueError(
                f"tool {fn['name']!r}: parameters must be a JSON schema of type 'object', "
                f"got type {params.get('type')!r}"
            )
        by_name[fn["name"]] = params
    return by_name


# Why the harness refused a parsed tool call before running it (``ModelCall.invalid_calls``).
UNKNOWN_TOOL = "unknown_tool"  # the call names no declared tool
BAD_ARGUMENTS = "bad_arguments"  # its arguments do not match the tool's JSON schema
INVALID_CALL_KINDS: tuple[str, ...] = (UNKNOWN_TOOL, BAD_ARGUMENTS)


def call_problem(call: dict[str, Any], specs: dict[str, dict]) -> tuple[str, str] | None:
    """Check one parsed call against the specs, saying what kind of problem it has.

    Returns:
        ``None`` when valid, else ``(kind, message)``: ``kind`` is :data:`UNKNOWN_TOOL` or
        :data:`BAD_ARGUMENTS` (recorded in ``ModelCall.invalid_calls``), ``message`` the
        error meant for the model (an observation).
    """
    name = call.get("name")
    if name not in specs:
        return UNKNOWN_TOOL, f"unknown tool {name!r}; available: {', '.join(specs)}"
    schema = dict(specs[name])
    schema.setdefault("additionalProperties", False)
    try:
        jsonschema.validate(call.get("arguments", {}), schema)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "arguments"
        return BAD_ARGUMENTS, f"bad arguments for {name}: {where}: {e.message}"
    return None


def validate_call(call: dict[str, Any], specs: dict[str, dict]) -> str | None:
    """Check one parsed call against the specs.

    Returns:
        ``None`` when valid, else an error message meant for the model (an observation);
        :func:`call_problem` also says which kind of problem.
    """
    problem = call_problem(call, specs)
    return None if problem is None else problem[1]
