"""An OpenAI-compatible endpoint whose every call is recorded token-exactly (docs/agents.md).

``protocol`` (the wire shapes: requests checked, messages normalised, responses and
errors), ``sessions`` (the recorder: one trajectory per session, the prefix rule),
``batcher`` (concurrent requests sampled in one ``generate`` call), ``app`` (the FastAPI
application and the uvicorn server) and ``runner`` (the agent-runner of ``consequence
train --agent``).
"""
