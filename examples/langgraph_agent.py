r"""The calculator agent written with LangGraph: the prebuilt ReAct graph (create_react_agent), a
LangChain @tool, and ChatOpenAI pointed at a base URL. Nothing in it knows the trainer; it trains
as it is:

    .venv/bin/python scripts/prepare_smollm2.py    # models/smollm2-135m-instruct, once
    .venv/bin/python train.py --agent examples/langgraph_agent.py:solve --tool_call_parser hermes \
        --model_name_or_path models/smollm2-135m-instruct --dataset calc --math_digits 2 \
        --max_prompt_length 384 --response_length 512 --num_unique_prompts_rollout 2 \
        --num_samples_per_prompt_rollout 2 --num_training_steps 2 --filter_zero_std_samples false \
        --output_dir output/langgraph

What the model is given, as the plain agent gives it (examples/calculator_agent.py): a system message
with the call format, since SmolLM2's chat template does not render tools, one worked exchange (a
question, the call as text, the tool's answer, the boxed answer) and the row's question. LangGraph
sends the history as OpenAI messages (the assistant's tool calls, each tool's result), so every
call extends the previous one: one sequence per episode, nothing re-rendered. The graph runs at
most three model calls (recursion_limit); the run's reward scores its final answer, and a tool call
whose arguments are not an object (LangChain cannot build the message) scores 0.
"""

import os
import sys

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from pydantic import ValidationError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calculator_agent import SYSTEM, calculate, call, question  # noqa: E402 - the plain agent's prompt and calculator


@tool("calculate")  # the name the system message and the worked exchange call
def calculator(expression: str) -> str:
    """The value of an arithmetic expression.

    Args:
        expression: numbers, + - * / and parentheses, e.g. "214 + 659"
    """
    return calculate(expression)


def solve(row, base_url, api_key):
    llm = ChatOpenAI(model="smollm2", base_url=base_url, api_key=api_key, max_retries=0, temperature=0.7,
                     max_tokens=128)
    agent = create_react_agent(llm, [calculator], prompt=SYSTEM)
    shown = [("user", "What is 214 + 659?"), AIMessage(call("214 + 659")), ToolMessage("873", tool_call_id="0"),
             AIMessage("\\boxed{873}"), ("user", question(row))]
    try:  # model, tools, model, tools, model: five graph steps, three model calls at most (a third
        # call that still calls a tool ends the graph: the reward scores that call as it was sampled)
        agent.invoke({"messages": shown}, {"recursion_limit": 5})
    except ValidationError:  # the policy's tool call has arguments that are not an object: its mistake
        return 0.0
    return None
