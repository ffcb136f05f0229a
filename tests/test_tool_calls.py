"""Native tool calls (envs/tool_calls.py): tools written as Python functions, rendered by real chat
templates (tests/data/templates), called in the model's own format and read by vLLM's parsers
(hermes for Qwen2.5, llama3_json for Llama-3.1); episodes whose appended tokens are the
template's rendering of the final conversation, tool calls included; bad calls answered and
counted."""

import pytest

from config import Config
from envs.environment import Environment
from envs.tool_calls import Parser, answer_calls, schemas
from helpers import documented, family_tokenizer, ScriptedClient, with_prompts

# importing vLLM (its tool parsers) runs `file` on the interpreter (py-cpuinfo): outside the quick tier
vllm_import = pytest.mark.subprocess

ENV = documented("Ledger")  # docs/data.md's example, as written


def call(name, arguments):
    """A call as Qwen2.5's template writes one (and the model was trained to)."""
    import json

    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + '}\n</tool_call>'


def ledger_episodes(tmp_path, script, workers=0, family="qwen2.5-instruct", **kw):
    tok = family_tokenizer(family)
    (tmp_path / "ledger.py").write_text(ENV)
    cfg = Config(environment=f"{tmp_path}/ledger.py:Ledger", tool_call_parser="hermes", tool_workers=workers,
                 tool_timeout=20.0, max_prompt_length=2500, response_length=1500, max_turns=6,
                 num_samples_per_prompt_rollout=2, **kw)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    try:
        rows = with_prompts(env, tok, [dict(prompt="put 2 and 3 on the ledger", answer="5")])
        client = ScriptedClient(tok, script, eos_id=tok.convert_tokens_to_ids("<|im_end|>"))
        episodes, stats = env.play(client, rows, 2, 0, cfg.temperature)
    finally:
        env.close()
    return tok, env, rows[0], episodes, stats


def test_a_function_is_a_schema_the_template_renders():
    """transformers' get_json_schema of a function (hints, docstring Args) is what Qwen2.5's template
    lists in its system turn; a dict is taken as a schema; a function without Args is refused."""
    import types

    tok = family_tokenizer("qwen2.5-instruct")
    ledger = types.SimpleNamespace()
    exec(ENV, ledger.__dict__)
    tools = schemas(ledger.Ledger().tools + [{"name": "ping", "parameters": {"type": "object", "properties": {}}}])
    assert tools[0]["function"]["name"] == "add" and tools[0]["function"]["parameters"]["required"] == ["amount"]
    assert tools[0]["function"]["parameters"]["properties"]["note"] == {"type": "string", "description": "what it is for"}
    assert tools[2] == {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "add", "description": "Put an amount on the ledger."' in text

    def bare(x: int):
        return x

    with pytest.raises(ValueError, match="'bare' has no JSON schema"):
        schemas([bare])


@vllm_import
@pytest.mark.parametrize("family,parser,text,content", [
    ("qwen2.5-instruct", "hermes", 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"amount": 2}}\n</tool_call>\n'
                                   '<tool_call>\n{"name": "total", "arguments": {}}\n</tool_call>', "Adding.\n"),
    ("llama-3.1-instruct", "llama3_json", '<|python_tag|>{"name": "add", "parameters": {"amount": 2}}; '
                                          '{"name": "total", "parameters": {}}', ""),
])
def test_vllms_parsers_read_sampled_calls(family, parser, text, content):
    """Each family's own format, as sampled, read into the OpenAI form with ids that depend on the
    turn and the call's place only; a call the parser cannot read is named as such."""
    p = Parser(parser, family_tokenizer(family), None)
    message = p.message(text, turn=1)
    assert message == {"role": "assistant", "content": content, "tool_calls": [
        {"id": "c00010000", "type": "function", "function": {"name": "add", "arguments": {"amount": 2}}},
        {"id": "c00010001", "type": "function", "function": {"name": "total", "arguments": {}}}]}
    assert p.unread(message) is None
    plain = p.message("it is 5", turn=2)
    assert plain == {"role": "assistant", "content": "it is 5"} and p.unread(plain) is None
    broken = p.message(p.marker + '{"name": "add", "arguments": {"amount": 2', turn=3)
    assert "tool_calls" not in broken and p.unread(broken) == f"the tool call does not parse in the {parser} format"


@vllm_import
def test_a_parser_that_does_not_exist_or_fit_is_refused_in_one_line():
    with pytest.raises(ValueError, match="'herpes' is not one of vLLM's tool parsers; pick one of .*hermes"):
        Parser("herpes", family_tokenizer("qwen2.5-instruct"), None)
    with pytest.raises(ValueError, match="does not fit the tokenizer of 'qwen2.5-instruct'"):
        Parser("llama3_json", family_tokenizer("qwen2.5-instruct"), None)  # no <|python_tag|> token


def test_bad_calls_are_answered_one_message_each():
    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: one
            b: two
        """
        return a + b

    calls = [{"id": "x", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
             {"id": "y", "function": {"name": "mul", "arguments": {}}},
             {"id": "z", "function": {"name": "add", "arguments": {"a": 1}}},
             {"id": "w", "function": {"name": "add", "arguments": "a=1"}}]
    replies, bad = answer_calls([add], {"role": "assistant", "content": "", "tool_calls": calls})
    assert bad and [(m["tool_call_id"], m["name"]) for m in replies] == [("x", "add"), ("y", "mul"), ("z", "add"),
                                                                        ("w", "add")]
    assert [m["content"] for m in replies] == ["3", "error: no tool is named 'mul'; the tools are add",
                                               "error: add: missing a required argument: 'b'",
                                               "error: the arguments of add are not a JSON object: 'a=1'"]
    assert answer_calls([add], {"role": "assistant", "content": "5"}) == ([], False)


@vllm_import
@pytest.mark.parametrize("workers,family", [(0, "qwen2.5-instruct"), (2, "qwen2.5-instruct"), (0, "qwen3")])
def test_an_episode_with_native_calls_is_the_templates_rendering(tmp_path, workers, family):
    """A per-episode Ledger whose tools are its methods, hermes on Qwen2.5's and Qwen3's real
    templates (Qwen3's turns reason in <think> first): the episode's tokens (sampled calls, the
    tools' answers as the template renders tool messages) equal the template's rendering of the
    final conversation with its tool_calls; each episode keeps its own ledger; a call to no tool, a
    bad argument and an unreadable call are answered with errors and counted as bad calls."""
    think = (lambda text: f"<think>\nturn {text[:3]}\n</think>\n\n{text}") if family == "qwen3" else (lambda text: text)
    script = [think(call("add", {"amount": 2}) + "\n" + call("add", {"amount": 3})),
              think(call("subtract", {"amount": 1})),
              think(call("add", {"amount": -4})),
              think('<tool_call>\n{"name": "total", "arguments": {}'),
              think(call("total", {})),
              think("The sum is 5.")]
    tok, env, row, episodes, stats = ledger_episodes(tmp_path, script, workers, family)
    for e in episodes:
        assert e.turns == 6 and e.tool_calls == 5 and not e.cut
        rendered = tok.apply_chat_template(e.messages, tools=env.tools, tokenize=False)
        assert tok.decode(e.ids) + "\n" == rendered
        tools = [m for m in e.messages if m["role"] == "tool"]
        assert [m.get("name") for m in tools] == ["add", "add", "subtract", "add", None, "total"]
        assert [m.get("tool_call_id") for m in tools[:2]] == ["c00000000", "c00000001"]
        assert [m["content"] for m in tools] == [
            "1 entries", "2 entries", "error: no tool is named 'subtract'; the tools are add, total",
            "error: amount must be positive", "error: the tool call does not parse in the hermes format",
            '{"entries": [2, 3], "sum": 5}']  # this episode's ledger only
        assert e.messages[-1] == {"role": "assistant", "content": script[-1]} and e.env_reward == 1.0
    assert [what for what, _ in stats["tool_failures"]] == ["tool_bad_calls"] * 6


@vllm_import
def test_the_native_calculator_answers_hermes_calls_on_a_chatml_template():
    """envs.calculator:calculator_tool on a template that renders no tools (ChatML, as SmolLM2's): its
    system message shows the hermes format, a call is answered with its value, a bad expression
    with an error (a bad call), and \\boxed{} ends the episode."""
    tok = family_tokenizer("smollm2-instruct")
    cfg = Config(environment="envs.calculator:calculator_tool", tool_call_parser="hermes", tool_workers=0,
                 max_prompt_length=800, response_length=400, max_turns=4, num_samples_per_prompt_rollout=2)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    rows = with_prompts(env, tok, [dict(prompt="What is 12 * 7 + 5?", answer="89")])
    assert '<tool_call>\n{"name": "calculate", "arguments": {"expression": "214 + 659"}}\n</tool_call>' in \
        rows[0]["prompt_text"]
    script = [call("calculate", {"expression": "12 * 7"}), call("calculate", {"expression": "84 +* 5"}),
              call("calculate", {"expression": "84 + 5"}), "\\boxed{89}"]
    episodes, stats = env.play(ScriptedClient(tok, script, eos_id=tok.eos_token_id), rows, 2, 0, cfg.temperature)
    for e in episodes:
        assert [m["content"] for m in e.messages if m["role"] == "tool"][-3:] == ["84", "error: invalid syntax", "89"]
        assert e.turns == 4 and e.tool_calls == 3 and e.completion == "\\boxed{89}"
    assert [what for what, _ in stats["tool_failures"]] == ["tool_bad_calls"] * 2


def test_a_wrongly_typed_argument_is_the_policys_bad_call():
    """calculate(expression=12) used to reach the tool and fail inside it (the environment's failure,
    tool_errors); the schema says string: it is the policy's bad call."""
    from envs.calculator import calculate

    calls = [{"id": "x", "function": {"name": "calculate", "arguments": {"expression": 12}}},
             {"id": "y", "function": {"name": "calculate", "arguments": {"expression": "2 + 3"}}}]
    replies, bad = answer_calls([calculate], {"role": "assistant", "content": "", "tool_calls": calls})
    assert bad and [m["content"] for m in replies] == [
        "error: calculate: argument 'expression' must be string, not 12", "5"]

    def scale(x: float, times: int, loud: bool = False) -> str:
        """Scale.

        Args:
            x: a number
            times: how often
            loud: shout
        """
        return str(x * times)

    def answered(**arguments):
        call = [{"id": "z", "function": {"name": "scale", "arguments": arguments}}]
        return answer_calls([scale], {"role": "assistant", "content": "", "tool_calls": call})[0][0]["content"]
    assert answered(x=2, times=3) == "6" and answered(x=1.5, times=2) == "3.0"
    assert answered(x=2, times=1.5).startswith("error: scale: argument 'times' must be integer")
    assert answered(x=2, times=True).startswith("error: scale: argument 'times' must be integer")  # bool is no int


def qwen3_thinking():
    """Qwen3's tokenizer as the tests make it, with <think> and </think>, which the real one has."""
    tok = family_tokenizer("qwen3")
    tok.add_tokens(["<think>", "</think>"])
    return tok


@vllm_import
def test_a_call_written_while_thinking_is_not_made():
    """Qwen3 and hermes: a <tool_call> inside <think> (the model deciding against it) used to be made;
    a reasoning span that only mentions the marker was a bad call. With --reasoning_parser qwen3 only
    the text after </think> is read (vLLM 0.32's own qwen3 parser would end the reasoning at the
    <tool_call>: the markers decide here)."""
    tok = qwen3_thinking()
    think = "<think>\nI could write " + call("calculate", {"expression": "2+3"}) + " but I know it.\n</think>\n\n"
    cfg = Config(environment="envs.calculator:calculator_tool", tool_call_parser="hermes", reasoning_parser="qwen3")
    env = Environment(cfg.environment, tok, cfg)
    message = env.message(think + "It is \\boxed{5}.", 0)
    assert "tool_calls" not in message and message["content"] == "\n\nIt is \\boxed{5}."
    assert message["reasoning_content"].startswith("\nI could write <tool_call>")
    mention = env.message("<think>The format is <tool_call> with JSON.</think>\n\nIt is 5.", 1)
    assert env.parser.unread(mention) is None  # a mention while thinking is no bad call
    made = env.message(think + call("calculate", {"expression": "7*6"}), 2)
    assert [c["function"]["arguments"] for c in made["tool_calls"]] == [{"expression": "7*6"}]
    plain = Environment(cfg.environment, tok, Config(environment=cfg.environment, tool_call_parser="hermes"))
    assert "tool_calls" in plain.message(think + "It is \\boxed{5}.", 0)  # the defect, without the parser
    with pytest.raises(ValueError, match="reasoning_parser='nope' is not one of vLLM's reasoning parsers"):
        Environment(cfg.environment, tok, Config(environment=cfg.environment, tool_call_parser="hermes",
                                                 reasoning_parser="nope"))


def test_optional_and_integral_arguments_are_no_bad_calls():
    from typing import Optional

    def find(query: str, limit: Optional[int] = None) -> str:
        """Find.

        Args:
            query: what
            limit: how many
        """
        return f"{query}:{limit}"

    def answered(**arguments):
        call = [{"id": "z", "function": {"name": "find", "arguments": arguments}}]
        return answer_calls([find], {"role": "assistant", "content": "", "tool_calls": call})[0][0]["content"]
    assert answered(query="a", limit=None) == "a:None" and answered(query="a", limit=3.0) == "a:3.0"
    assert answered(query="a", limit="3").startswith("error: find: argument 'limit' must be integer or null")


@vllm_import
def test_a_turn_begun_inside_an_opened_reasoning_is_reasoning():
    """A template whose generation prompt opens <think> (DeepSeek-R1's, Qwen3-Thinking's): a turn that
    stopped before </think>, with no <think> of its own, is reasoning, and its call is not made."""
    tok = qwen3_thinking()
    tok.chat_template = tok.chat_template.replace("{{- '<|im_start|>assistant\\n' }}",
                                                  "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    cfg = Config(environment="envs.calculator:calculator_tool", tool_call_parser="hermes", reasoning_parser="qwen3")
    env = Environment(cfg.environment, tok, cfg)
    assert env.reasoning.opened
    message = env.message("I could " + call("calculate", {"expression": "1+1"}), 0)
    assert "tool_calls" not in message and message["content"] == ""
    assert "tool_calls" in env.message("done thinking</think>\n\n" + call("calculate", {"expression": "1+1"}), 1)
