"""The policy's failures inside an agent program are the policy's (faults.POLICY_EXCEPTIONS): an
agent_programs.PolicyFailed, and the frameworks' own limits, raised by the real packages where they
are installed (the Agents SDK's max_turns, LangGraph's recursion_limit), are scored and trained on,
counted as agent_policy_failures; their groups stay in the batch. pydantic-ai and AutoGen are checked
by class where installed, skipped where not."""

import math

import pytest

from agent_programs import PolicyFailed
from config import Config
from helpers import ScriptedClient, family_tokenizer
from infra import faults
from infra.worker_pool import RewardPool
from rollout import sample_groups


def test_policy_failed_is_found_by_module_and_class_name():
    class Mine(PolicyFailed):
        pass

    assert faults.policy_failed(PolicyFailed("x")) and faults.policy_failed(Mine("x"))  # a subclass too
    assert not faults.policy_failed(RuntimeError("x")) and not faults.policy_failed(KeyboardInterrupt())
    assert not faults.policy_failed(type("MaxTurnsExceeded", (Exception,), {})("x"))  # the name alone: not it
    assert PolicyFailed("x").reward is None and PolicyFailed("x", reward=0.5).reward == 0.5


@pytest.mark.parametrize("module,name", [("agents.exceptions", "MaxTurnsExceeded"),
                                         ("langgraph.errors", "GraphRecursionError"),
                                         ("pydantic_ai.exceptions", "UsageLimitExceeded")])
def test_each_frameworks_limit_is_the_real_class(module, name):
    """The table names each framework's class where that framework defines it (skipped where it is
    not installed: pydantic-ai is not, in this venv)."""
    cls = getattr(pytest.importorskip(module), name)
    assert cls.__module__ == module and (module, name) in faults.POLICY_EXCEPTIONS
    assert faults.policy_failed(cls.__new__(cls))


def test_langgraphs_recursion_limit_is_the_policys():
    """LangGraph raises GraphRecursionError when a graph runs past recursion_limit steps: a loop that
    never ends (a model that never stops calling tools) meets it."""
    from typing import TypedDict

    from langgraph.graph import START, StateGraph

    class State(TypedDict):
        n: int

    graph = StateGraph(State)
    graph.add_node("model", lambda s: {"n": s["n"] + 1})
    graph.add_edge(START, "model")
    graph.add_edge("model", "model")
    with pytest.raises(Exception) as raised:
        graph.compile().invoke({"n": 0}, {"recursion_limit": 3})
    assert type(raised.value).__name__ == "GraphRecursionError" and faults.policy_failed(raised.value)


def test_smolagents_returns_an_answer_at_max_steps():
    """smolagents raises nothing at max_steps: it asks the model for a final answer and returns it
    (MultiStepAgent._handle_max_steps_reached), recording AgentMaxStepsError in its memory. That
    answer is scored as any other: nothing to map."""
    import inspect

    from smolagents.agents import MultiStepAgent

    source = inspect.getsource(MultiStepAgent._handle_max_steps_reached)
    assert "provide_final_answer" in source and "return final_answer.content" in source and "raise" not in source


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'

PROGRAMS = '''
import openai
from agent_programs import PolicyFailed


def said_so(row, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    raise PolicyFailed("no answer in sight", reward=0.25)


async def agents_sdk(row, base_url, api_key):
    """Two turns allowed; the model calls the tool at every one: the SDK raises MaxTurnsExceeded."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """The value of an arithmetic expression."""
        return "5"

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(name="calculator", instructions="Use the calculator.", tools=[calculator],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    await Runner.run(agent, row["prompt"], max_turns=2)


def langgraph(row, base_url, api_key):
    """A graph whose model node loops back to itself: it runs until LangGraph's recursion_limit."""
    from typing import TypedDict
    from langgraph.graph import START, StateGraph

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)

    class State(TypedDict):
        messages: list

    def model(state):
        reply = client.chat.completions.create(model="policy", messages=state["messages"]).choices[0].message
        return {"messages": state["messages"] + [{"role": "assistant", "content": reply.content},
                                                 {"role": "user", "content": "go on"}]}

    graph = StateGraph(State)
    graph.add_node("model", model)
    graph.add_edge(START, "model")
    graph.add_edge("model", "model")
    graph.compile().invoke({"messages": [{"role": "user", "content": row["prompt"]}]}, {"recursion_limit": 3})
'''


def play(tmp_path, tiny_model_dir, fn, script, spec=None, **kw):
    """One step of two prompts, both groups played by `fn`, scored by a reward that gives 1 to "ab"."""
    from transformers import AutoTokenizer

    from agent_programs.runner import Agents

    (tmp_path / "programs.py").write_text(PROGRAMS)
    # tool calls in Qwen2.5's format, read by the hermes parser, with Qwen2.5's tokenizer (tests/test_tool_calls.py)
    tok = family_tokenizer("qwen2.5-instruct") if kw.get("tool_call_parser") else AutoTokenizer.from_pretrained(
        tiny_model_dir)
    cfg = Config(agent=spec or f"{tmp_path}/programs.py:{fn}", agent_workers=2, agent_timeout=60.0, max_prompt_length=3584,
                 response_length=512, num_samples_per_prompt_rollout=2, num_unique_prompts_rollout=2,
                 unscored_stop=0.0, filter_zero_std_samples=False, **kw)
    agents = Agents(cfg, tok)
    agents.start()
    rows = []
    for prompt in ("a", "b"):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        rows.append(dict(prompt=prompt, answer="ab", prompt_text=text, prompt_ids=tok(text)["input_ids"]))
    pool = RewardPool(lambda p, c, e: 1.0 if c == "ab" else 0.0, workers=0, fallback=float("nan"))
    client = ScriptedClient(tok, script, tok.convert_tokens_to_ids("<|im_end|>"))
    try:
        return (*sample_groups(cfg, client, rows, 0, 1, pool, tok, agents), client)
    finally:
        agents.close()


@pytest.mark.subprocess
@pytest.mark.parametrize("fn,script,calls,reward", [
    ("said_so", ["ab"], 1, 0.25),  # PolicyFailed's reward, as if returned
    ("langgraph", ["ab", "cd", "ef", "gh"], 3, 0.0),  # the reward's verdict on the last turn, "ef"
    ("agents_sdk", [CALL, CALL, CALL], 2, 0.0),  # the last turn a tool call: no answer
])
def test_a_framework_limit_is_scored_and_trained(tmp_path, tiny_model_dir, fn, script, calls, reward):
    """Every episode ends on the policy's failure: none is unscored (unscored_stop=0 would stop the
    step otherwise), each is counted, scored and trained on."""
    kw = dict(tool_call_parser="hermes") if fn == "agents_sdk" else {}
    samples, m, client = play(tmp_path, tiny_model_dir, fn, script, **kw)
    assert m["agent_policy_failures"] == 4, {k: v for k, v in m.items() if "agent" in k or "tool" in k or k == "turns"}
    assert m["unscored_groups"] == 0 and m["unscored_episodes"] == 0, m
    assert {k: v for k, v in m.items() if k.startswith("agent_") and k != "agent_policy_failures" and v
            and k in faults.FAULTS} == {}, m
    assert m["turns"] == 4 * calls, m
    assert len(samples) == 4 and [s.reward for s in samples] == [reward] * 4
    assert all(not math.isnan(s.adv) and sum(s.mask) > 0 for s in samples)


EXAMPLES = {"pydantic_ai": "pydantic_ai_agent.py", "autogen_agentchat": "autogen_agent.py"}


@pytest.mark.parametrize("package", EXAMPLES)
def test_the_pydantic_ai_and_autogen_examples_call_the_gateway(package):
    """Each parses, and its solve(row, base_url, api_key) gives the gateway's base_url and api_key to
    the framework's client, as the other examples do. Not run here: neither package is installed."""
    import ast
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", EXAMPLES[package])
    tree = ast.parse(open(path).read())
    solve = next(f for f in tree.body if isinstance(f, ast.AsyncFunctionDef) and f.name == "solve")
    assert [a.arg for a in solve.args.args] == ["row", "base_url", "api_key"]
    given = {(k.arg, k.value.id) for n in ast.walk(solve) if isinstance(n, ast.Call) for k in n.keywords
             if isinstance(k.value, ast.Name)}
    assert {("base_url", "base_url"), ("api_key", "api_key")} <= given


@pytest.mark.subprocess
@pytest.mark.parametrize("package", EXAMPLES)
def test_the_pydantic_ai_and_autogen_examples_play_where_installed(tmp_path, tiny_model_dir, package):
    """Each example plays a step through the gateway: a tool call, then an answer, every episode scored."""
    pytest.importorskip(package)
    import os

    spec = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", EXAMPLES[package]) + ":solve"
    call = CALL.replace("2 + 3", "12 * 7")
    samples, m, _ = play(tmp_path, tiny_model_dir, None, [call, "ab", "ab"], spec=spec, tool_call_parser="hermes")
    assert m["unscored_groups"] == 0 and m["tool_calls"] >= 4 and len(samples) == 4, m
