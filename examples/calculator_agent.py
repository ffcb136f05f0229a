"""A plain OpenAI-client agent with one function tool, a calculator. It knows nothing of the
trainer: an OpenAI base URL and key, the row's question, and its own loop.

    .venv/bin/python train.py --agent examples/calculator_agent.py:solve --tool_call_parser hermes ...
    (bash scripts/demo.sh --agent)

The system message shows the call format with one worked example, since SmolLM2's chat template
does not render tools. The agent returns None: the run's reward scores its final answer.
"""

import ast
import json
import operator

import openai

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg}
TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "The value of an arithmetic expression.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "numbers, + - * / and parentheses, e.g. \"214 + 659\""}}}}}]


def call(expression):
    return '<tool_call>\n{"name": "calculate", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'


SYSTEM = ("You can use a calculator tool. To compute an expression, call it like this:\n" + call("12 * 7")
          + "\nand its value will be shown to you. Give the final answer as \\boxed{number}.")


def value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        out = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in OPS:
        out = OPS[type(node.op)](value(node.left), value(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        out = OPS[type(node.op)](value(node.operand))
    else:
        raise ValueError("only numbers, + - * / and parentheses")
    # bounded as envs/calculator.py bounds it: a 400-digit integer does not convert to float, 1e308 * 10
    # is inf, and products of huge integers take seconds
    if not abs(out) <= 1e15:
        raise OverflowError("number too large")
    return out


def calculate(expression):
    """The expression's value, or "error: ..." for one the policy got wrong: an answer it sees, as a
    tool's, never an exception, which would end the run and leave the episode unscored."""
    try:
        result = value(ast.parse(str(expression).replace("x", "*"), mode="eval").body)
        return str(int(result)) if float(result).is_integer() else f"{result:.10g}"
    except (SyntaxError, ValueError, TypeError, ArithmeticError) as e:  # ArithmeticError: / 0, overflow
        return f"error: {e}"
    except RecursionError:  # "-" * 5000 + "1": nested past the parser's (or value's) recursion limit
        return "error: the expression is nested too deeply"


def question(row):
    """The row's question: its prompt, or its prompt's last message."""
    return row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]


def solve(row, base_url, api_key, turns=3):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 214 + 659?"},
                {"role": "assistant", "content": call("214 + 659")}, {"role": "tool", "content": "873"},
                {"role": "assistant", "content": "\\boxed{873}"}, {"role": "user", "content": question(row)}]
    for _ in range(turns):
        reply = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
        if not reply.message.tool_calls:
            break
        for c in reply.message.tool_calls:
            try:
                expression = json.loads(c.function.arguments).get("expression")
            except (ValueError, AttributeError):
                expression = None
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": calculate(expression) if expression else "error: no expression"})
    return None
