"""The calculator agent written with pydantic-ai (pydantic-ai-slim[openai], 2.x): an Agent, a
@agent.tool_plain, and its OpenAIChatModel pointed at the gateway by an OpenAIProvider(base_url=...).
Nothing in it knows the trainer; it trains as it is:

    .venv/bin/python train.py --agent examples/pydantic_ai_agent.py:solve --tool_call_parser hermes ...

pydantic-ai is not in this project's venv and this example was not run here (docs/data.md says how
to install it beside the trainer). Its limits are the policy's: UsageLimitExceeded (still calling
tools at request_limit) is agent_policy_failures, scored and trained on (infra/faults.py,
POLICY_EXCEPTIONS), so solve does not catch it. A tool that raises ModelRetry tells the policy its
arguments were wrong and lets it try again, within the agent's retries.
"""

import os
import sys

from pydantic_ai import Agent, ModelRetry
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calculator_agent import SYSTEM, calculate, question  # noqa: E402 - the plain agent's prompt and calculator


async def solve(row, base_url, api_key):
    model = OpenAIChatModel("policy", provider=OpenAIProvider(base_url=base_url, api_key=api_key))
    agent = Agent(model, instructions=SYSTEM.replace("calculate", "calculator"), retries=2)

    @agent.tool_plain
    def calculator(expression: str) -> str:
        """The value of an arithmetic expression: numbers, + - * / and parentheses, e.g. "214 + 659"."""
        answer = calculate(expression)
        if answer.startswith("error"):
            raise ModelRetry(answer)  # the policy's arguments: told to it, and it tries again
        return answer

    await agent.run(question(row), usage_limits=UsageLimits(request_limit=3))
    return None  # the run's reward scores the final answer
