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


def validate_call(call: dict[str, Any], specs: dict[str, dict]) -> str | None:
    """Check one parsed call against the specs.

    Returns:
        ``None`` when valid, else an error message meant for the model (an observation).
    """
    name = call.get("name")
    if name not in specs:
        return f"unknown tool {name!r}; available: {', '.join(specs)}"
    schema = dict(specs[name])
    schema.setdefault("additionalProperties", False)
    try:
        jsonschema.validate(call.get("arguments", {}), schema)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "arguments"
        return f"bad arguments for {name}: {where}: {e.message}"
    return None
