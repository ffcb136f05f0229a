"""The calculator agent written with the OpenAI Agents SDK (openai-agents): the SDK's own Runner
loop, a @function_tool, and its chat-completions model pointed at a base URL. Nothing in it knows
the trainer; it trains as it is:

    .venv/bin/python train.py --agent examples/agents_sdk_agent.py:solve --tool_call_parser hermes ...

Tracing is off: the SDK would send its traces to OpenAI's servers.
"""

import os
import sys

from agents import (Agent, ModelBehaviorError, ModelSettings, OpenAIChatCompletionsModel, Runner,
                    function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calculator_agent import SYSTEM, calculate, question  # noqa: E402 - the plain agent's prompt and calculator

set_tracing_disabled(True)


@function_tool
def calculator(expression: str) -> str:
    """The value of an arithmetic expression.

    Args:
        expression: numbers, + - * / and parentheses, e.g. "214 + 659"
    """
    return calculate(expression)


async def solve(row, base_url, api_key):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(name="calculator", instructions=SYSTEM.replace("calculate", "calculator"),
                  model=OpenAIChatCompletionsModel(model="smollm2", openai_client=client), tools=[calculator],
                  model_settings=ModelSettings(temperature=0.7))
    try:
        # still calling tools at the last turn, the SDK raises MaxTurnsExceeded: the policy's failure (infra/faults.py,
        # POLICY_EXCEPTIONS), scored as it stands and trained on
        await Runner.run(agent, question(row), max_turns=3)
    except ModelBehaviorError:  # the model called a tool that does not exist, or sent arguments that do not parse
        return 0.0
    finally:
        await client.close()
    return None  # the run's reward scores the final answer
