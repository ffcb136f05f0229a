"""The calculator agent written with AutoGen AgentChat (autogen-agentchat, autogen-ext[openai], 0.7):
an AssistantAgent with a tool on an OpenAIChatCompletionClient pointed at the gateway. Nothing in it
knows the trainer; it trains as it is:

    .venv/bin/python train.py --agent examples/autogen_agent.py:solve --tool_call_parser hermes ...

AutoGen is not in this project's venv and this example was not run here: autogen-core pins
protobuf~=5.29 against the venv's (docs/data.md says how to install it beside the trainer). Two
settings it needs: model_info, since "policy" is no OpenAI model name AutoGen knows (it refuses an
unknown name without one), and reflect_on_tool_use=True, without which the run ends on the tool's
result and the policy never answers after it. AutoGen raises nothing at max_tool_iterations: the run
returns the tool's result, and the reward scores the conversation as it stands.
"""

import os
import sys

from autogen_agentchat.agents import AssistantAgent
from autogen_core.models import ModelFamily
from autogen_ext.models.openai import OpenAIChatCompletionClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calculator_agent import SYSTEM, calculate, question  # noqa: E402 - the plain agent's prompt and calculator

MODEL_INFO = dict(vision=False, function_calling=True, json_output=False, family=ModelFamily.UNKNOWN,
                  structured_output=False)


async def calculator(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / and parentheses, e.g. "214 + 659"."""
    return calculate(expression)


async def solve(row, base_url, api_key):
    client = OpenAIChatCompletionClient(model="policy", base_url=base_url, api_key=api_key, model_info=MODEL_INFO,
                                        max_retries=0)
    agent = AssistantAgent("calculator", model_client=client, tools=[calculator], reflect_on_tool_use=True,
                           system_message=SYSTEM.replace("calculate", "calculator"), max_tool_iterations=2)
    try:
        await agent.run(task=question(row))
    finally:
        await client.close()
    return None  # the run's reward scores the final answer
