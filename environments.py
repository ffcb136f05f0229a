"""Environments: episodes of several turns, written as plain Python and passed by flag.

    --environment my_env.py:shop      (or module:name; the built-in: environments:calculator)

The object named needs one method, and may have three attributes:

    step(row, messages) -> list of new messages, or [] to end the episode
        messages is the conversation so far, ending with the policy's last turn as
        {"role": "assistant", "content": text}; the answer is usually a tool's result,
        [{"role": "tool", "content": "873"}], or feedback as a user message.
    reset(row) -> the first messages (default: the row's prompt as one user message)
    stop: stop strings that end an assistant turn, kept in its text (e.g. ["</calc>"])
    tools: tool schemas for the chat template (apply_chat_template(tools=...)), if it takes them

Text in, messages out: the trainer owns tokenization. The reward (--reward_fn) scores the
episode: it sees the policy's final turn as the completion, and the whole conversation as
example["messages"].

step runs in worker processes (reward_pool.CallPool) under tool_timeout: one that hangs,
kills its process or raises becomes an "error: ..." tool message to the policy, is counted
(tool_timeouts, tool_crashes, tool_errors) and the episode goes on. A message longer than
tool_output_max_tokens is cut there. The worker is an ordinary process: it shares the
trainer's user, files and network. It stops a tool that hangs or crashes from stopping the
run; it does not contain code that means harm.

The environment's messages enter the episode as the chat template's rendering of just those
messages (ChatTokens), with loss mask 0. That is exact only for a template that renders a
conversation as an extension of its earlier turns, which start-up checks.
"""

import ast
import operator
import re

from reward_pool import CallPool
from rewards import load_object


def check_messages(value):
    """An environment's answer: a list of {"role": str, "content": str} ([] or None: the end)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise TypeError(f"step returned {value!r:.80}, not a list of {{'role': str, 'content': str}} messages")
    return [dict(role=m["role"], content=m["content"]) for m in value]


class ChatTokens:
    """The tokens an environment's messages add to an episode, from the chat template.

    Rendered against a fixed conversation (system, user, assistant A): the assistant turn's
    closing text (ChatML: "<|im_end|>\\n"), then the new messages up to the next generation prompt.
    A turn that ended on an end-of-sequence token already holds the start of the closing."""

    BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]

    def __init__(self, tokenizer, tools=None):
        self.tokenizer, self.tools = tokenizer, tools
        if not tokenizer.chat_template:
            raise ValueError(f"an environment's episodes are conversations, and the tokenizer of "
                             f"{tokenizer.name_or_path!r} has no chat template; use a chat model")
        first = [*self.BASE, {"role": "assistant", "content": "A1"}]
        second = [*first, {"role": "tool", "content": "T"}, {"role": "assistant", "content": "A2"}]
        try:
            opened, self.done = self.render(self.BASE, True), self.render(first)
            again, last = self.render(second[:-1], True), self.render(second)
        except Exception as e:  # noqa: BLE001 - a Jinja template may raise anything
            opened, self.done, again, last = "", "", "", f"{type(e).__name__}: {e}"
        self.close = self.done[len(opened + "A1"):]  # what the template puts after an assistant turn
        if not (self.done.startswith(opened + "A1") and again.startswith(self.done) and last == again + "A2" + self.close):
            raise ValueError(f"the chat template of {tokenizer.name_or_path!r} does not render a conversation with "
                             "tool messages as its earlier turns followed by the new ones, so an episode's tokens "
                             "cannot be appended turn by turn; use a model whose template does (ChatML's does)")

    def render(self, messages, generation_prompt=False):
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def ids(self, messages, eos_id=None):
        """Token ids of the environment's messages after an assistant turn (that ended on eos_id, or
        on a stop string or the token budget when None), through the next generation prompt."""
        close = self.close
        ended = self.tokenizer.decode([eos_id]) if eos_id is not None else ""
        if ended and close.startswith(ended):
            close = close[len(ended):]
        text = close + self.render([*self.BASE, {"role": "assistant", "content": "A1"}, *messages], True)[len(self.done):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


class Environment:
    """An --environment on the trainer's side: its first messages, stop strings and tools, its
    step in worker processes, and the tokens of its answers."""

    def __init__(self, spec, tokenizer, cfg):
        obj = load_object(spec, "environment", "environment")
        if isinstance(obj, type):
            raise ValueError(f"environment={spec!r} names a class; name an instance of it "
                             f"(a module-level `{obj.__name__.lower()} = {obj.__name__}()`)")
        if not callable(getattr(obj, "step", None)):
            raise ValueError(f"environment={spec!r} has no step(row, messages) method; see environments.py")
        self.obj, self.stop, self.tools = obj, list(getattr(obj, "stop", ())), getattr(obj, "tools", None)
        self.chat = ChatTokens(tokenizer, self.tools)
        self.spec, self.cfg, self.tokenizer, self.pool = spec, cfg, tokenizer, None

    def start(self):
        """Start the worker processes (rank 0, which plays the episodes)."""
        self.pool = CallPool((self.spec, "step"), self.cfg.tool_workers, self.cfg.tool_timeout, kind="tool",
                             check=check_messages, fallback=None)

    def reset(self, row):
        if callable(getattr(self.obj, "reset", None)):
            return check_messages(self.obj.reset(row))
        prompt = row["prompt"]
        return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]

    def truncate(self, message):
        ids = self.tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        if len(ids) <= self.cfg.tool_output_max_tokens:
            return message
        return dict(message, content=self.tokenizer.decode(ids[:self.cfg.tool_output_max_tokens]) + " [cut]")

    def answer(self, episodes):
        """The environment's answer to each episode's last turn, appended with mask 0. Returns the
        episodes still going and the kinds of the calls that failed."""
        for e in episodes:
            e.messages.append({"role": "assistant", "content": e.answer})
        replies, failures = self.pool.map([(e.row, e.messages) for e in episodes])
        for i, _, why in failures:
            replies[i] = [{"role": "tool", "content": f"error: {why}"}]
        going = []
        for e, reply in zip(episodes, replies):
            if not reply:
                e.done = True
                continue
            reply = [self.truncate(m) for m in reply]
            e.messages += reply
            e.tool_calls += 1
            ids = self.chat.ids(reply, e.sample.token_ids[-1] if e.eos else None)
            if len(ids) >= e.budget:  # no room left for another turn: cut at the token budget
                ids, e.done, e.cut = ids[:e.budget], True, True
            e.add(ids, None, sampled=False)
            if not e.done:
                going.append(e)
        return going, [what for _, what, _ in failures]

    def close(self):
        if self.pool:
            self.pool.close()


# --- the built-in environment: a calculator

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


class Calculator:
    """The policy writes <calc>expression</calc>; the environment answers with its value as a
    tool message. A turn without a call ends the episode (its \\boxed{} answer is scored).
    The first messages describe the tool and show one worked example."""

    stop = ["</calc>"]
    system = ("You can use a calculator. To compute an expression, write it between <calc> and </calc>, "
              "for example <calc>12 * 7</calc>, and its value will be shown to you. "
              "Give the final answer as \\boxed{number}.")
    example = [{"role": "user", "content": "What is 214 + 659?"}, {"role": "assistant", "content": "<calc>214 + 659</calc>"},
               {"role": "tool", "content": "873"}, {"role": "assistant", "content": "\\boxed{873}"}]

    def reset(self, row):
        prompt = row["prompt"]
        question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        return [{"role": "system", "content": self.system}, *self.example, {"role": "user", "content": question}]

    def step(self, row, messages):
        call = re.search(r"<calc>(.*?)</calc>", messages[-1]["content"], re.S)
        if call is None:
            return []
        try:
            value = arithmetic(ast.parse(call.group(1).strip().replace("x", "*").replace("×", "*"), mode="eval"))
        except (SyntaxError, ValueError, TypeError) as e:
            return [{"role": "tool", "content": f"error: {e.msg if isinstance(e, SyntaxError) else e}"}]
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return [{"role": "tool", "content": f"{value:.10g}" if isinstance(value, float) else str(value)}]


calculator = Calculator()
