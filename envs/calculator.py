"""The built-in environment: a calculator the policy calls with <calc> tags (`calculator`) or as
a native tool in the hermes format (`calculator_tool`, with --tool_call_parser hermes).

    --environment envs.calculator:calculator
    --environment envs.calculator:calculator_tool --tool_call_parser hermes
    --environment envs.calculator:calculator_plain   # the system message alone: no worked example

`calculator_plain` is the student of context distillation (scripts/demo.sh --distill-context): the
teacher sees the worked example that the student's prompt lacks (examples/calculator_example.json,
--teacher_context_file), which is worked_example's messages between the system message and the question.

Its doors: none; the trainer loads it by its spec like any environment. config.py's
--environment help and data.py's calc task (its dataset, scripts/demo.sh --tools) name it.
"""

import ast
import operator
import re

from envs.tool_calls import ToolError

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def arithmetic(node):
    """The value of an expression of numbers, + - * / // % and parentheses; ValueError otherwise."""
    if isinstance(node, ast.Expression):
        return arithmetic(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        a, b = arithmetic(node.left), arithmetic(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise ValueError("division by zero")
        value = OPS[type(node.op)](a, b)
        if abs(value) > 1e15:
            raise ValueError("number too large")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](arithmetic(node.operand))
    raise ValueError("only numbers, + - * / // % and parentheses")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression.

    Args:
        expression: numbers, + - * / // % and parentheses, for example "214 + 659"
    """
    try:
        value = arithmetic(ast.parse(expression.strip().replace("x", "*").replace("×", "*"), mode="eval"))
    except (SyntaxError, ValueError, TypeError) as e:  # the policy's expression: told, counted (tool_bad_calls)
        raise ToolError(e.msg if isinstance(e, SyntaxError) else e) from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:.10g}" if isinstance(value, float) else str(value)


def worked_example(system, call, row):
    """A calculator's first messages: how to call it, one worked example with the call written
    as `call` writes it, then the row's question."""
    prompt = row["prompt"]
    question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return [{"role": "system", "content": system}, {"role": "user", "content": "What is 214 + 659?"},
            {"role": "assistant", "content": call("214 + 659")}, {"role": "tool", "content": "873"},
            {"role": "assistant", "content": "\\boxed{873}"}, {"role": "user", "content": question}]


class Calculator:
    """The policy writes <calc>expression</calc>; the environment answers with its value as a
    tool message. A turn without a call ends the episode (its \\boxed{} answer is scored).
    The first messages describe the tool and show one worked example (none with example=False)."""

    stop = ["</calc>"]
    system = ("You can use a calculator. To compute an expression, write it between <calc> and </calc>, "
              "for example <calc>12 * 7</calc>, and its value will be shown to you. "
              "Give the final answer as \\boxed{number}.")

    def __init__(self, example=True):
        self.example = example

    def reset(self, row):
        messages = worked_example(self.system, lambda e: f"<calc>{e}</calc>", row)
        return messages if self.example else [messages[0], messages[-1]]

    def step(self, row, messages):
        call = re.search(r"<calc>(.*?)</calc>", messages[-1]["content"], re.S)
        return [{"role": "tool", "content": calculate(call.group(1))}] if call else []


def hermes_call(expression):
    return '<tool_call>\n{"name": "calculate", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'


class CalculatorTool:
    """The calculator as a native tool (--tool_call_parser hermes): the policy calls
    calculate(expression) in the hermes format, <tool_call>{"name": ..., "arguments": ...}</tool_call>,
    which Qwen2.5 and Qwen3 are trained on; the template lists the tool where it renders tools,
    and the system message shows the format for templates that do not (SmolLM2's)."""

    tools = [calculate]
    system = ("You can use a calculator tool. To compute an expression, call it like this:\n"
              + hermes_call("12 * 7") + "\nand its value will be shown to you. Give the final answer as \\boxed{number}.")

    def reset(self, row):
        return worked_example(self.system, hermes_call, row)


calculator, calculator_tool, calculator_plain = Calculator(), CalculatorTool(), Calculator(example=False)
