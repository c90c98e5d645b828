"""An OpenAI-compatible endpoint whose every call is recorded token-exactly (docs/agents.md).

``protocol`` (the chat wire shapes: requests checked, messages normalised, responses and
errors), ``completions`` (``/v1/completions``), ``responses`` (``/v1/responses``, the
Responses API mapped onto the chat path), ``compat`` (the one table of every request
field's rule), ``sessions`` (the recorder: one trajectory per session, the prefix rule),
``batcher`` (concurrent requests sampled in one ``generate`` call), ``calls`` (one call from
body to response, off the event loop), ``streaming`` (token-by-token SSE), ``limits`` (the
body-size limit), ``metrics`` (``/metrics``), ``app`` (the FastAPI application and the
uvicorn server) and ``runner`` (the agent-runner of ``consequence train --agent``).
"""
