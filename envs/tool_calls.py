"""Native tool calls: tools as Python functions or JSON schemas, rendered by the chat template,
called in the model's own format and read by one of vLLM's tool parsers.

    class Shop:                                 # --environment shop.py:Shop --tool_call_parser hermes
        def __init__(self):
            self.cart = []
            self.tools = [self.add_to_cart]     # bound methods: state per episode

        def add_to_cart(self, item: str, count: int) -> str:
            '''Put items in the cart.

            Args:
                item: what to buy
                count: how many
            '''
            self.cart += [item] * count
            return f"{len(self.cart)} items in the cart"

A function's schema is transformers' get_json_schema of it (its type hints, and its docstring's
description and Args); a dict is taken as a schema as it is. The chat template renders them
(apply_chat_template(tools=...)). The policy's turn is read by the parser `--tool_call_parser`
names (the names of `vllm serve --tool-call-parser`: hermes for Qwen2.5 and Qwen3, llama3_json
for Llama-3.1, mistral, ...) into the OpenAI form of an assistant message:

    {"role": "assistant", "content": text before the calls,
     "tool_calls": [{"id": "c00010000", "type": "function", "function": {"name": ..., "arguments": {...}}}]}

and an environment without a step method of its own answers it with `answer_calls`: each call
runs with its parsed arguments and its result comes back as {"role": "tool", "name": ...,
"tool_call_id": ..., "content": ...}; a turn without calls ends the episode. A call that names no
tool, has arguments its function does not take or of other types than its schema's, or raises
raises (ToolError or any exception: its input came from the policy, as TRL answers a tool's
exception) is answered with an error message and counted (tool_bad_calls), as is a turn that opens
a call the parser cannot read (the parser's start marker, as <tool_call>, with no call parsed). A
tool that raises Unavailable could not run at all: its episode is unscored (faults.py).
"""

import inspect
import json
import logging


class ToolError(Exception):
    """Raised by an environment for the policy's mistake (a call that does not parse, names no
    tool, or has bad arguments): its text is told to the policy as a tool message and counted as
    tool_bad_calls. Any other exception of a step is the environment's own failure (tool_errors:
    the episode is unscored; faults.py)."""


class Unavailable(Exception):
    """Raised by an environment or a tool function when the tool could not run for a reason that is
    not the policy's (a sandbox that cannot start, a service that is down): the episode ends unscored
    and is counted as tool_unavailable (faults.py), never told to the policy."""


class Starved(Unavailable):
    """Raised by a tool whose call ran out of time because the machine kept it from a CPU (a sandboxed
    cell that waited on the run queue for more than half its wall clock: sandbox.Result.ours): ours,
    the episode unscored, counted as tool_starved (faults.py), never told to the policy."""


def schemas(tools):
    """The JSON schemas of an environment's tools, for the chat template and the parser: a function
    through transformers' get_json_schema, a dict as it is (a bare function schema is wrapped as
    {"type": "function", "function": ...}). ValueError naming the tool that has no schema."""
    from transformers.utils import get_json_schema

    out = []
    for tool in tools:
        if isinstance(tool, dict):
            out.append(tool if "function" in tool else {"type": "function", "function": tool})
            continue
        try:
            out.append(get_json_schema(tool))
        except Exception as e:  # noqa: BLE001 - transformers raises its own types for a docstring it cannot read
            raise ValueError(f"tool {getattr(tool, '__name__', tool)!r} has no JSON schema ({type(e).__name__}: {e}); "
                             "give it type hints and a docstring with an Args section, or pass a schema dict") from None
    return out


def functions(tools):
    """The callable tools by name."""
    return {tool.__name__: tool for tool in tools if callable(tool)}


def vllm_parser(flag, kind, name, tokenizer):
    """One of vLLM's parsers of a kind ("tool", "reasoning") by its name, made for the tokenizer; a
    ValueError in one line naming the fix."""
    try:
        if kind == "tool":
            from vllm.tool_parsers import ToolParserManager as manager
        else:
            from vllm.reasoning import ReasoningParserManager as manager
    except ImportError as e:
        raise ValueError(f"{flag}={name!r} needs vLLM's {kind} parsers ({e}); install vllm") from None
    try:
        cls = manager.get_tool_parser(name) if kind == "tool" else manager.get_reasoning_parser(name)
    except KeyError:
        raise ValueError(f"{flag}={name!r} is not one of vLLM's {kind} parsers; pick one of "
                         f"{', '.join(sorted(manager.list_registered()))}") from None
    logging.getLogger(cls.__module__).setLevel(logging.CRITICAL)  # a call it cannot read is counted here
    try:
        return cls(tokenizer)
    except Exception as e:  # noqa: BLE001 - a parser checks the vocabulary its own way
        raise ValueError(f"{flag}={name!r} does not fit the tokenizer of {tokenizer.name_or_path!r} "
                         f"({type(e).__name__}: {e}); pick the parser of the model's family") from None


class Parser:
    """The policy's turn read by one of vLLM's tool parsers into an assistant message with
    tool_calls. Call ids are made from the turn and the call's place in it (the parsers' own are
    random), so a run repeats exactly."""

    def __init__(self, name, tokenizer, tool_schemas):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.parser = vllm_parser("tool_call_parser", "tool", name, tokenizer)
        cls = type(self.parser)
        self.name, self.request = name, ChatCompletionRequest(model="policy", messages=[], tools=tool_schemas or None)
        # the text that opens a call in this format: a turn holding it and no parsed call is a bad call
        self.marker = getattr(cls, "tool_call_start_token", None) or getattr(cls, "bot_token", None)

    def message(self, text, turn):
        """The assistant message of a sampled turn: its text, or the text before its calls and the calls."""
        found = self.parser.extract_tool_calls(text, self.request)
        if not found.tools_called:
            return {"role": "assistant", "content": text}
        calls = []
        for j, call in enumerate(found.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except (TypeError, ValueError):
                arguments = call.function.arguments  # not JSON: answered as a bad call (answer_calls)
            calls.append({"id": f"c{turn:04d}{j:04d}", "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        return {"role": "assistant", "content": found.content or "", "tool_calls": calls}

    def unread(self, message):
        """Why the policy's last turn is a bad call the parser could not read, or None."""
        if "tool_calls" in message or not self.marker or self.marker not in message["content"]:
            return None
        return f"the tool call does not parse in the {self.name} format"


class Reasoning:
    """The policy's turn split into its reasoning and the text after it, by the markers of one of
    vLLM's reasoning parsers (the names of `vllm serve --reasoning-parser`: qwen3, deepseek_r1, ...)."""

    def __init__(self, name, tokenizer, generation_prompt=""):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.parser = vllm_parser("reasoning_parser", "reasoning", name, tokenizer)
        self.request = ChatCompletionRequest(model="policy", messages=[])
        start, end = self.parser.reasoning_start_str, self.parser.reasoning_end_str
        # a generation prompt that opens the reasoning (DeepSeek-R1's, Qwen3-Thinking's end in <think>): a
        # turn starts inside it, with no start marker of its own
        self.opened = bool(start and end) and generation_prompt.rfind(start) > generation_prompt.rfind(end)

    def split(self, text):
        """(the reasoning or None, the text after it). With a parser that names its markers (<think>,
        </think>) the reasoning ends only at the end marker: vLLM 0.32's qwen3 parser also ends it at a
        <tool_call>, and a call the policy wrote while thinking, then decided against, would be made.
        A turn cut off while thinking is all reasoning; one with neither marker is all answer, unless
        the generation prompt opened the reasoning."""
        start, end = self.parser.reasoning_start_str, self.parser.reasoning_end_str
        if not (start and end):
            reasoning, content = self.parser.extract_reasoning(text, self.request)
            return reasoning, content or ""
        head, found, tail = text.partition(end)
        if found:
            return head.split(start, 1)[-1], tail
        if self.opened or start in text:  # cut off while thinking: all reasoning
            return text.split(start, 1)[-1], ""
        return None, text


TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict,
         "null": type(None)}  # JSON schema types as Python's


def wrong_type(schema, arguments):
    """Why arguments do not have the types of the tool's JSON schema, or None: a wrongly typed
    argument is the policy's bad call, not the tool's failure."""
    for name, value in arguments.items():
        prop = schema.get("parameters", {}).get("properties", {}).get(name, {})
        kinds = prop.get("type")
        kinds = ([kinds] if isinstance(kinds, str) else list(kinds or [])) + (["null"] if prop.get("nullable") else [])
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 3.0 is an integer to JSON Schema
        ok = [k for k in kinds if k in TYPES and isinstance(value, TYPES[k])
              and not (isinstance(value, bool) and k in ("integer", "number"))]  # True is an int to Python
        if kinds and all(k in TYPES for k in kinds) and not ok:
            return f"argument {name!r} must be {' or '.join(kinds)}, not {value!r:.40}"
    return None


def as_text(value):
    """A tool's result as a message's content: text as it is, anything else as JSON (or str)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def answer_calls(tools, message):
    """The tool messages that answer an assistant message's tool calls, one per call, in order, and
    whether any was a bad call; ([], False) when it makes none (the episode ends)."""
    by_name, replies, bad = functions(tools), [], False
    for call in message.get("tool_calls") or ():
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        fn = by_name.get(name)
        try:
            if fn is None:
                raise ToolError(f"no tool is named {name!r}; the tools are {', '.join(sorted(by_name))}")
            if not isinstance(arguments, dict):
                raise ToolError(f"the arguments of {name} are not a JSON object: {arguments!r:.80}")
            try:
                inspect.signature(fn).bind(**arguments)
            except TypeError as e:
                raise ToolError(f"{name}: {e}") from None
            if why := wrong_type(schemas([fn])[0]["function"], arguments):
                raise ToolError(f"{name}: {why}")
            content = as_text(fn(**arguments))
        except Unavailable:  # not the policy's doing: the episode ends unscored (envs/calls.py)
            raise
        except Exception as e:  # noqa: BLE001 - a tool's exception on the policy's arguments is told to it, as in TRL
            content, bad = f"error: {e}" if isinstance(e, ToolError) else f"error: {type(e).__name__}: {e}", True
        replies.append({"role": "tool", "name": name, "tool_call_id": call.get("id", ""), "content": content})
    return replies, bad
