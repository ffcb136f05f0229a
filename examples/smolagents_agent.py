r"""The calculator agent written with smolagents: a ToolCallingAgent, a @tool, and its
OpenAIServerModel pointed at a base URL. Nothing in it knows the trainer; it trains as it is:

    .venv/bin/python scripts/prepare_smollm2.py    # models/smollm2-135m-instruct, once
    .venv/bin/python train.py --agent examples/smolagents_agent.py:solve --tool_call_parser hermes \
        --model_name_or_path models/smollm2-135m-instruct --dataset calc --math_digits 2 \
        --max_prompt_length 1536 --response_length 4096 --max_tokens_per_micro_batch 5632 \
        --num_unique_prompts_rollout 1 --num_samples_per_prompt_rollout 2 --num_training_steps 2 \
        --filter_zero_std_samples false --output_dir output/smolagents

What the model is given: smolagents' own system prompt (976 tokens of SmolLM2's tokenizer, with the
tools and worked examples in its JSON format) and the row's question. Its tool calls arrive either
as the hermes parser reads them or as a JSON blob in the text, which smolagents parses itself. After
a tool call smolagents writes the history in its own words (the call again as the text "Calling
tools: ...", its result as a user message), and its last call at max_steps is a new conversation:
such a call does not extend the previous one and starts a new sequence in the episode, its prompt
rendered whole and counted in `response_length` (docs/data.md: "Agents that are programs").

The reward is the program's: 1.0 when smolagents' final answer is the row's answer. smolagents
sends tool_choice="required", which the trainer counts and does not honour (the policy samples as
it is). Its logging is off: sixteen episodes a step would print their every step.
"""

import os
import sys

from smolagents import LogLevel, OpenAIServerModel, ToolCallingAgent, tool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calculator_agent import calculate, question  # noqa: E402 - the plain agent's calculator


@tool
def calculator(expression: str) -> str:
    """The value of an arithmetic expression.

    Args:
        expression: numbers, + - * / and parentheses, e.g. "214 + 659"
    """
    return calculate(expression)


# At max_steps smolagents asks the model for a final answer and returns an exception of that call as
# text beginning so (MultiStepAgent.provide_final_answer); an exception of any other call raises
SWALLOWED = "Error in generating final LLM output"


def same_number(answer, gold):
    try:
        return float(str(answer).replace(",", "").strip()) == float(str(gold).replace(",", ""))
    except ValueError:
        return False


def solve(row, base_url, api_key):
    model = OpenAIServerModel(model_id="smollm2", api_base=base_url, api_key=api_key,
                              client_kwargs={"max_retries": 0}, temperature=0.7, max_tokens=128)
    agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=2, verbosity_level=LogLevel.OFF)
    answer = agent.run(question(row))
    text = answer[0].get("text", "") if isinstance(answer, list) and answer else answer  # that text comes in parts
    if isinstance(text, str) and text.startswith(SWALLOWED):  # a failed call, not the policy's answer
        raise RuntimeError(text)
    return 1.0 if same_number(text, row["answer"]) else 0.0
