"""A tool-using agent written against the `openai` package only (no import of consequence).

Train it:  consequence train --agent examples/openai_agent/agent.py:agent --env repair
Serve it:  consequence serve --port 8000, then  python examples/openai_agent/agent.py
"""

import asyncio

import openai


async def agent(client: openai.AsyncOpenAI, task) -> str | None:
    """Call the model, run the tools it asks for, until it answers without a tool call."""
    messages = list(task.messages)
    while not task.done:
        reply = await client.chat.completions.create(model=task.model, messages=messages, tools=task.tools)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the reply, sent back as it came
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            result = await task.call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


class _Demo:  # a task without an environment: every tool answers "ok"
    model, done, messages = "tiny-repair", False, [{"role": "user", "content": "Fix the bug, then call finish."}]
    tools = [{"type": "function", "function": {"name": "finish", "parameters": {"type": "object", "properties": {}}}}]

    async def call_tool(self, name, arguments):
        self.done = name == "finish"
        return "ok"


if __name__ == "__main__":
    demo = openai.AsyncOpenAI(base_url="http://127.0.0.1:8000/s/demo/v1", api_key="local")
    print(asyncio.run(agent(demo, _Demo())))
