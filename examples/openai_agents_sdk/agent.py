"""A tool-using agent written with the OpenAI Agents SDK (`openai-agents`; no import of consequence).

Its default model is the Responses API (`POST /v1/responses`), which the endpoint records
token-exactly like chat completions (docs/agents.md §5).

Train it:  consequence train --agent examples/openai_agents_sdk/agent.py:agent --env repair
"""

from __future__ import annotations

import openai
from agents import Agent, FunctionTool, OpenAIProvider, RunConfig, Runner


def _tool(task, spec: dict) -> FunctionTool:
    """One of the task's tools (a chat-completions spec) as an Agents-SDK tool that the task runs."""
    fn = spec["function"]

    async def invoke(_context, arguments: str) -> str:
        return await task.call_tool(fn["name"], arguments)

    # strict_json_schema=False: the environment's schemas are sent as they are, not rewritten to strict form
    return FunctionTool(fn["name"], fn.get("description", ""), fn["parameters"], invoke, strict_json_schema=False)


async def agent(client: openai.AsyncOpenAI, task) -> str | None:
    """Run the SDK's own loop (call the model, run its tool calls, repeat) until a reply without a call."""
    sdk_agent = Agent(name="repair", tools=[_tool(task, spec) for spec in task.tools])
    config = RunConfig(model=task.model, model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    # the episode's budgets end it (a refused call raises, which the harness ignores once the episode is over)
    result = await Runner.run(sdk_agent, list(task.messages), run_config=config, max_turns=1000)
    return result.final_output
