"""The agent gateway (agent_programs/gateway.py) against a scripted client: what an OpenAI-client agent gets,
and the episode's Sample recorded as exactly the tokens vLLM saw and sampled, with the real chat
templates of Qwen2.5, Qwen3 and Llama-3.1."""

import concurrent.futures
import contextlib
import http.client
import http.server
import itertools
import json
import re
import socket
import threading
import time
import urllib.request

import openai
import pytest

from agent_programs import endpoint, gateway
import packing
from envs.chat import ChatTokens
from config import Config
from helpers import family_tokenizer, ScriptedClient

# importing vLLM (its tool parsers) runs `file` on the interpreter (py-cpuinfo): outside the quick tier
vllm_import = pytest.mark.subprocess

TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
FIRST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


class Recording(ScriptedClient):
    """ScriptedClient that keeps each submit's arguments and answer."""

    def submit(self, prompt_ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(), request_id=None):
        future = super().submit(prompt_ids, n, max_tokens, temperature, top_p, seed, stop)
        self.calls = getattr(self, "calls", []) + [dict(
            prompt=list(prompt_ids), n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
            out=future.result()[0])]
        return future


@pytest.fixture
def make():
    """make(family, script, parser=False, serve=None, **cfg) -> (gateway, tokenizer, openai client, key), the
    gateway built with serve's keywords; shut down after."""
    made = []

    def build(family, script, parser=False, serve=None, **kw):
        tok = family_tokenizer(family)
        cfg = Config(agent="tests/agent.py:run", **{"max_turns": 4, "max_prompt_length": 1024,
                                                    "response_length": 1024, **kw})
        if parser:
            from envs import tool_calls
            parser = tool_calls.Parser("hermes", tok, None)
        g = gateway.Gateway(tok, cfg, parser=parser or None, **(serve or {}))
        made.append(g)
        g.client = Recording(tok, script, tok.convert_tokens_to_ids(tok.eos_token))
        url, key = g.open("k1", 1.0, lambda t: 100 + t)
        return g, tok, openai.OpenAI(base_url=url, api_key=key, max_retries=0), key
    yield build
    for g in made:  # serve_forever notices in up to 0.5 s: not waited for
        threading.Thread(target=g.shutdown, daemon=True).start()


@vllm_import
@pytest.mark.parametrize("family", ["qwen2.5-instruct", "qwen3", "llama-3.1-instruct"])
def test_an_agent_loop_is_recorded_as_the_tokens_sampled(make, family):
    """Three calls (a hermes tool call, its answer, a follow-up question): the sample is the first
    prompt, then each request's prompt extension (mask 0) and each sampled turn (mask 1), token for
    token; the template's rendering of the conversation differs from what vLLM saw."""
    call = CALL.replace('{"expression": "2 + 3"}', '{"expression":"2 + 3"}') if family.startswith("llama") else CALL
    turn0 = ("<think>\nreasoning\n</think>\n\n" if family == "qwen3" else "") + "Let me compute.\n" + call
    g, tok, client, key = make(family, [turn0, "\\boxed{5}", "Yes."], parser=True)
    messages = list(FIRST)
    reply = client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content == turn0[:turn0.index("<tool_call>")]  # the text before the call, kept
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("calculate", '{"expression": "2 + 3"}')]  # OpenAI's JSON string (llama's sampled compact JSON re-serialised)
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}]
    reply = client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("\\boxed{5}", "stop")
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    assert client.chat.completions.create(model="any", messages=messages, tools=TOOLS).choices[0].message.content \
        == "Yes."
    s, calls = g.close(key).sample, g.client.calls
    prompts, sampled = [c["prompt"] for c in calls], [c["out"]["token_ids"] for c in calls]
    assert len(calls) == 3 and s.prompt_ids == prompts[0] == ChatTokens(tok, TOOLS).prompt_ids(FIRST)
    for t in (1, 2):  # each request continues the last: its prompt and the tokens it sampled, as they were
        assert prompts[t][:len(prompts[t - 1]) + len(sampled[t - 1])] == prompts[t - 1] + sampled[t - 1]
    assert s.token_ids == prompts[2][len(prompts[0]):] + sampled[2]
    mask, logprobs = [], []
    for t, ids in enumerate(sampled):
        extension = prompts[t][len(prompts[t - 1]) + len(sampled[t - 1]):] if t else []
        mask += [0] * len(extension) + [1] * len(ids)
        logprobs += [0.0] * len(extension) + [-0.1 * (j + 1) for j in range(len(ids))]
        if t:  # the new messages as the template writes them after the turn's end-of-sequence token
            upto = tok.apply_chat_template(messages[:2 * t + 2], tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
            assert upto.endswith(tok.decode(sampled[t - 1][-1:] + extension))
    assert s.mask == mask and s.logprobs == pytest.approx(logprobs) and s.restarts == () and s.versions == (0, 0, 0)
    # why exactness matters: the template renders the same conversation otherwise than it was sampled
    seen = tok.decode(prompts[2])
    rendered = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert rendered != seen and turn0 in seen
    if family == "qwen3":  # reasoning of turns before the last user message dropped
        assert "<think>\nreasoning\n</think>" in seen and "reasoning" not in rendered
    if family.startswith("llama"):  # arguments re-serialised (and the call rewritten in Llama's own format)
        assert '{"expression":"2 + 3"}' in seen and '{"expression":"2 + 3"}' not in rendered


def test_a_conversation_that_does_not_extend_starts_a_new_sequence(make):
    """History rewritten: the new prompt is rendered whole (mask 0) where positions restart."""
    g, tok, client, key = make("qwen2.5-instruct", ["Four."])  # the fake answers a fresh prompt as turn 0
    client.chat.completions.create(model="any", messages=FIRST)
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 3?"}]
    assert client.chat.completions.create(model="any", messages=other).choices[0].message.content == "Four."
    s, calls = g.close(key).sample, g.client.calls
    first, restart = calls[0]["out"]["token_ids"], ChatTokens(tok).prompt_ids(other)
    assert calls[1]["prompt"] == restart  # vLLM saw the new conversation alone
    second = calls[1]["out"]["token_ids"]
    assert s.prompt_ids == calls[0]["prompt"] and s.token_ids == first + restart + second
    assert s.restarts == (len(first),) and s.mask == [1] * len(first) + [0] * len(restart) + [1] * len(second)
    positions = packing.collate([s])["position_ids"][0].tolist()
    assert positions == list(range(len(s.prompt_ids) + len(first))) + list(range(len(restart) + len(second)))


@pytest.mark.parametrize("budget", [dict(max_turns=1), dict(response_length=12)])
def test_a_call_past_the_budget_is_answered_length_unsampled(make, budget):
    """Past max_turns or response_length: finish_reason "length", no text, nothing sampled or recorded."""
    g, tok, client, key = make("qwen2.5-instruct", ["\\boxed{5}", "more"], **budget)
    messages = FIRST + [{"role": "assistant", "content": "\\boxed{5}"}, {"role": "user", "content": "Again."}]
    assert client.chat.completions.create(model="any", messages=FIRST).choices[0].finish_reason == "stop"
    reply = client.chat.completions.create(model="any", messages=messages)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("", "length")
    trace = g.close(key)
    first = g.client.calls[0]["out"]["token_ids"]
    assert len(g.client.requests) == 1 and trace.cut and trace.calls == 1
    assert trace.sample.token_ids == first and trace.sample.mask == [1] * len(first)


def test_sampling_is_pinned_and_n_refused(make):
    """The agent's temperature, top_p and seed are overridden (counted); n=2 is an HTTP 400."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."])
    g.traces[key].temperature = 0.9
    client.chat.completions.create(model="any", messages=FIRST, temperature=0.2, top_p=0.5, seed=7)
    (call,) = g.client.calls
    assert (call["temperature"], call["top_p"], call["seed"], call["n"]) == (0.9, g.cfg.top_p, 100, 1)
    assert g.traces[key].overrides == 1
    with pytest.raises(openai.BadRequestError, match="n > 1 is not served"):
        client.chat.completions.create(model="any", messages=FIRST, n=2)
    assert len(g.client.calls) == 1 and g.close(key).failure is None


def test_every_answer_carries_its_usage(make):
    """OpenAI's usage (LangChain, LiteLLM and smolagents read it): the tokens vLLM was given and sampled,
    on a chat call, a text completion and a call past the budget; a stream says it in a last chunk
    when stream_options asks (before: no usage anywhere, and smolagents failed on every call)."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five.", "Six.", "Seven."], max_turns=3)
    reply = client.chat.completions.create(model="any", messages=FIRST)
    first = g.client.calls[0]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(first["prompt"]),
                                                                          len(first["out"]["token_ids"]))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="any", messages=FIRST + [
        {"role": "assistant", "content": "Five."}, {"role": "user", "content": "And?"}], stream=True,
        stream_options={"include_usage": True}))
    second = g.client.calls[1]
    assert [c.usage for c in chunks[:-1]] == [None, None] and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        len(second["prompt"]), len(second["out"]["token_ids"]))
    text = client.completions.create(model="any", prompt="What is 3 + 4?")  # a new sequence
    assert text.usage.completion_tokens == len(g.client.calls[2]["out"]["token_ids"])
    past = client.completions.create(model="any", prompt="Again?")  # max_turns=3 spent: nothing sampled
    assert past.choices[0].finish_reason == "length" and past.usage.completion_tokens == 0


def test_what_would_change_the_policys_sampling_is_counted_and_said_once(make, capsys):
    """tool_choice="required" (smolagents sends it on every call), a response_format, logprobs: the
    policy samples as it is, and the call is counted in agent_overrides and said once (before: dropped
    without a word); echo and best_of are refused."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five.", "Six.", "Seven."])
    for _ in range(2):
        client.chat.completions.create(model="any", messages=FIRST, tool_choice="required")
    client.chat.completions.create(model="any", messages=FIRST, response_format={"type": "json_object"})
    client.chat.completions.create(model="any", messages=FIRST, tool_choice="auto")  # asks nothing
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("gateway:")]
    assert len(said) == 2 and "tool_choice=required; not honoured" in said[0] and "response_format" in said[1]
    assert g.traces[key].overrides == 3
    with pytest.raises(openai.BadRequestError, match="echo and suffix are not served"):
        client.completions.create(model="any", prompt="x", echo=True)
    with pytest.raises(openai.BadRequestError, match="stream_options must be an object"):
        client.chat.completions.create(model="any", messages=FIRST, stream=True, extra_body={"stream_options": True})
    with pytest.raises(openai.BadRequestError, match="n > 1 is not served"):
        client.completions.create(model="any", prompt="x", best_of=2)


def test_tools_without_a_parser_are_refused_and_the_episode_unscored(make):
    g, tok, client, key = make("qwen2.5-instruct", ["Five."])
    with pytest.raises(openai.BadRequestError, match="--tool_call_parser"):
        client.chat.completions.create(model="any", messages=FIRST, tools=TOOLS)
    trace = g.close(key)
    assert "--tool_call_parser" in trace.failure and trace.sample is None and not g.client.requests


def test_keys_routes_and_the_authorization_header(make):
    """An unknown key is a 401; /v1/models lists the policy; the key in the header on the plain URL works."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{g.url}/v1", api_key="nobody", max_retries=0).chat.completions.create(
            model="any", messages=FIRST)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{g.url}/e/nobody/v1", api_key=key, max_retries=0).chat.completions.create(
            model="any", messages=FIRST)
    assert [m.id for m in client.models.list()] == ["policy"]
    plain = openai.OpenAI(base_url=f"{g.url}/v1", api_key=key, max_retries=0)
    assert plain.chat.completions.create(model="any", messages=FIRST).choices[0].message.content == "Five."
    assert g.close(key).sample.prompt_ids == g.client.calls[0]["prompt"]


@pytest.mark.parametrize("tools", [False, pytest.param(True, marks=vllm_import)])
def test_streaming_answers_in_chunks_with_a_finish_reason(make, tools):
    g, tok, client, key = make("qwen2.5-instruct", ["Ok.\n" + CALL if tools else "Five."], parser=tools)
    chunks = list(client.chat.completions.create(model="any", messages=FIRST, stream=True,
                                                 **({"tools": TOOLS} if tools else {})))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == ("Ok.\n" if tools else "Five.")
    assert [c.choices[0].finish_reason for c in chunks][-1] == ("tool_calls" if tools else "stop")
    calls = [(c.function.name, c.function.arguments) for d in deltas for c in d.tool_calls or ()]
    assert calls == ([("calculate", '{"expression": "2 + 3"}')] if tools else [])
    assert g.close(key).sample.token_ids == g.client.calls[0]["out"]["token_ids"]


def test_a_token_completion_that_extends_the_sample_continues_it(make):
    """/v1/completions with token ids that start with the sample so far: the new ids go in with mask 0."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five.", "Sure."])
    client.chat.completions.create(model="any", messages=FIRST)
    first = g.client.calls[0]["out"]["token_ids"]
    new = tok("\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    prompt = g.client.calls[0]["prompt"] + first + new
    reply = client.completions.create(model="any", prompt=prompt)
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == ("Sure.", "stop")
    s, second = g.close(key).sample, g.client.calls[1]["out"]["token_ids"]
    assert g.client.calls[1]["prompt"] == prompt and s.restarts == ()
    assert s.token_ids == first + new + second and s.mask == [1] * len(first) + [0] * len(new) + [1] * len(second)


def test_a_call_after_a_restart_sees_its_own_sequence_only(make):
    """A sub-agent's conversation (a restart), then a call extending it: vLLM gets that sequence
    and its new messages, nothing of the first conversation."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five.", "Done."])
    client.chat.completions.create(model="any", messages=FIRST)
    other = [{"role": "user", "content": "Sub-task?"}]
    reply = client.chat.completions.create(model="any", messages=other).choices[0].message  # turn 0 again: "Five."
    client.chat.completions.create(model="any", messages=other + [reply.model_dump(exclude_none=True),
                                                                  {"role": "user", "content": "And?"}])
    s, calls = g.close(key).sample, g.client.calls
    restart = ChatTokens(tok).prompt_ids(other)
    assert calls[2]["prompt"][:len(restart)] == restart and calls[2]["prompt"][:len(calls[0]["prompt"])] != \
        calls[0]["prompt"]
    assert s.restarts == (len(calls[0]["out"]["token_ids"]),) and calls[2]["prompt"] == s.token_ids[s.restarts[0]:][
        :len(calls[2]["prompt"])]


def test_a_completion_is_the_answer_the_reward_reads(make):
    g, tok, client, key = make("qwen2.5-instruct", ["\\boxed{5}"])
    assert client.completions.create(model="any", prompt="2 + 3 = ").choices[0].text == "\\boxed{5}"
    trace = g.close(key)
    assert trace.completion == "\\boxed{5}" and trace.messages == []


def test_a_stop_string_is_sampled_and_left_out_of_the_text(make):
    """As OpenAI answers: the text ends before the stop string; the sample keeps its tokens."""
    g, tok, client, key = make("qwen2.5-instruct", ["Thought: add\nAction: calc"])
    reply = client.chat.completions.create(model="any", messages=FIRST, stop=["Action: calc"]).choices[0]
    assert reply.message.content == "Thought: add\n"
    with pytest.raises(openai.BadRequestError, match="max_tokens=0"):
        client.chat.completions.create(model="any", messages=FIRST, max_tokens=0)
    assert tok.decode(g.close(key).sample.token_ids) == "Thought: add\nAction: calc"


class Failing(Recording):
    def __init__(self, tokenizer, message):
        super().__init__(tokenizer, ["x"])
        self.message = message

    def submit(self, *args, **kwargs):
        from infra import vllm_client

        raise vllm_client.VLLMError(self.message)


@pytest.mark.parametrize("message,status", [("failed /v1/completions after 1 attempt(s): HTTP 400: too_long", 400),
                                            ("failed /v1/completions after 4 attempt(s): URLError: refused", 502)])
def test_a_request_the_server_refuses_is_the_agents_a_server_that_fails_is_ours(make, message, status):
    """A 4xx from vLLM is the agent's to see (a 400, the episode goes on); a server that fails
    leaves the episode unscored and its error for the rollout to raise (agent_programs: the server
    of ours is restarted)."""
    g, tok, client, key = make("qwen2.5-instruct", ["x"])
    g.client = Failing(tok, message)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="any", messages=FIRST)
    trace = g.close(key)
    assert e.value.status_code == status
    assert (trace.failure is None and trace.server_error is None) if status == 400 else \
        ("URLError" in trace.failure and "URLError" in str(trace.server_error))


def test_a_call_the_agent_gave_up_on_is_not_recorded(make):
    """The agent's client times out while the call samples: the answer nobody saw is taken back;
    its retry is the episode's first call."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."])
    fast, sampling, gave_up = g.client.submit, threading.Event(), threading.Event()

    def submit(*args, **kwargs):  # the call samples until its agent has gone
        sampling.set()
        gave_up.wait(30)
        return fast(*args, **kwargs)
    g.client.submit = submit
    impatient = socket.create_connection(g.server.server_address[:2], timeout=5)
    body = json.dumps({"model": "any", "messages": FIRST}).encode()
    impatient.sendall(f"POST /e/{key}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
                      .encode() + body)
    assert sampling.wait(30)
    impatient.close()  # its client's timeout: it never reads the answer
    time.sleep(0.5)  # (the gateway sees the connection closed when it answers)
    g.client.submit = fast
    gave_up.set()
    client.chat.completions.create(model="any", messages=FIRST)
    trace = g.close(key)
    assert trace.calls == 1 and trace.sample.restarts == () and len(g.client.calls) == 2
    assert trace.sample.token_ids == g.client.calls[1]["out"]["token_ids"]


def test_calls_after_the_run_ended_are_refused(make):
    """The program's run posts /end (agent_programs.Program): a thread it left behind adds nothing."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five.", "Late."])
    client.chat.completions.create(model="any", messages=FIRST)
    client.post("/end", body={}, cast_to=object)
    with pytest.raises(openai.APIStatusError, match="the episode has ended"):
        client.chat.completions.create(model="any", messages=FIRST)
    assert g.close(key).calls == 1 and len(g.client.calls) == 1


@vllm_import
def test_new_tools_are_a_new_prompt(make):
    """A call that adds tools the earlier prompt did not show starts a new sequence, rendered with them."""
    g, tok, client, key = make("qwen2.5-instruct", ["Plan.", "Five."], parser=True)
    reply = client.chat.completions.create(model="any", messages=FIRST).choices[0].message
    client.chat.completions.create(model="any", tools=TOOLS, messages=FIRST + [
        reply.model_dump(exclude_none=True), {"role": "user", "content": "Now use the tool."}])
    trace = g.close(key)
    assert trace.sample.restarts and "calculate" in tok.decode(g.client.calls[1]["prompt"])


def closed(sock, within):
    """Whether the gateway closes `sock` (its end of the connection) within `within` seconds."""
    sock.settimeout(max(within, 0.01))
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with a byte of ours unread
        return True
    except TimeoutError:
        return False


def served_again(client, within=10.0):
    """A call's answer once the gateway serves again: until the threads of the calls answered end, a
    call past max_calls is answered 503."""
    deadline = time.monotonic() + within
    while True:
        try:
            return client.chat.completions.create(model="any", messages=FIRST).choices[0].message.content
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_idle_connections_are_closed_and_a_call_is_served_beside_them(make):
    """Connections need no key: 50 that send nothing do not keep a call from being served, and the
    gateway closes each after idle_timeout seconds (each waited at the door: a socket, no thread)."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."], serve=dict(limits=endpoint.Limits(idle_timeout=1.0)))
    idle = [socket.create_connection(g.server.server_address[:2], timeout=5) for _ in range(50)]
    assert client.chat.completions.create(model="any", messages=FIRST).choices[0].message.content == "Five."
    started = time.monotonic()
    assert all(closed(s, 15.0) for s in idle) and time.monotonic() - started < 15.0
    for s in idle:
        s.close()


def test_connections_that_drip_their_heads_hold_no_thread_and_are_closed_at_the_deadline(make):
    """max_calls (256) connections without a key, each sending a byte of a request's head a second: an
    agent's call, on a connection of its own, is answered beside them, and each is closed head_timeout
    after its first byte. (Before: each held one of 256 threads, its socket's timeout renewed by every
    byte; the call was answered 503, its episode unscored.)"""
    limits = endpoint.Limits(head_timeout=2.0)
    g, tok, client, key = make("qwen2.5-instruct", ["Five."], serve=dict(limits=limits))
    drippers = [socket.create_connection(g.server.server_address[:2], timeout=5) for _ in range(limits.max_calls)]
    stop = threading.Event()

    def drip():
        for byte in itertools.cycle(b"POST /v1/chat/completions HTTP/1.1\r\n"):  # a head that never ends
            for s in drippers:
                with contextlib.suppress(OSError):  # closed by the gateway
                    s.send(bytes([byte]))
            if stop.wait(1.0):
                return
    threading.Thread(target=drip, daemon=True).start()
    started = time.monotonic()
    try:
        time.sleep(1.2)  # each has sent two bytes
        assert client.chat.completions.create(model="any", messages=FIRST).choices[0].message.content == "Five."
        assert all(closed(s, started + limits.head_timeout + 2.0 - time.monotonic()) for s in drippers)
    finally:
        stop.set()
        for s in drippers:
            s.close()


def test_past_max_waiting_the_oldest_connection_is_closed_and_a_call_is_served(make):
    """Connections that wait at the door are bounded (a socket each): past max_waiting the oldest is
    closed, so that an agent's new connection is always read."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."], serve=dict(limits=endpoint.Limits(max_waiting=8)))
    idle = [socket.create_connection(g.server.server_address[:2], timeout=5) for _ in range(8)]
    time.sleep(0.3)  # all at the door
    assert client.chat.completions.create(model="any", messages=FIRST).choices[0].message.content == "Five."
    assert closed(idle[0], 2.0) and not closed(idle[-1], 0.3)
    for s in idle:
        s.close()


def test_a_body_that_does_not_arrive_in_time_is_answered_408_and_closed(make):
    """A call's body must be in within body_timeout of its head, however it trickles: one that sends a
    byte each 0.2 s is answered 408 and closed at the deadline (before: its socket's timeout was
    renewed by every byte, and it held its thread as long as it dripped)."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."], serve=dict(limits=endpoint.Limits(body_timeout=1.0)))
    conn = socket.create_connection(g.server.server_address[:2], timeout=5)
    conn.sendall(f"POST /e/{key}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode())
    started, answer = time.monotonic(), b""
    conn.settimeout(0.2)
    while not answer and time.monotonic() - started < 5.0:
        with contextlib.suppress(OSError):
            conn.send(b" ")
        with contextlib.suppress(TimeoutError):
            answer = conn.recv(1000)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 2.0
    conn.settimeout(1.0)
    while chunk := conn.recv(1000):  # the rest of the answer, then the end of the connection
        answer += chunk
    assert b"did not arrive within 1 s" in answer
    conn.close()
    assert g.close(key).calls == 0


def test_calls_past_max_calls_are_refused_at_once_and_keyless_ones_take_none(make):
    """Past max_calls requests of live episodes handled at once, a call is answered 503 and closed at
    once; a keyless request (GET /v1/models) is still answered, from its own pool; once the calls end,
    a call is served again."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."], serve=dict(limits=endpoint.Limits(max_calls=2)))
    release, sample = threading.Event(), g.client.submit
    g.client.submit = lambda *args, **kwargs: (release.wait(10), sample(*args, **kwargs))[1]
    other = openai.OpenAI(base_url=g.open("k2", 1.0, lambda t: t)[0], api_key="k2", max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(c.chat.completions.create, model="any", messages=FIRST) for c in (client, other)]
        deadline = time.monotonic() + 10
        while not all(g.traces[k].in_flight for k in ("k1", "k2")) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(openai.APIStatusError, match="too many") as e:
            client.chat.completions.create(model="any", messages=FIRST)
        assert e.value.status_code == 503
        keyless = openai.OpenAI(base_url=f"{g.url}/v1", api_key="nobody", max_retries=0)
        assert [m.id for m in keyless.models.list()] == ["policy"]
        release.set()
        assert [c.result(timeout=10).choices[0].message.content for c in calls] == ["Five.", "Five."]
    assert served_again(client) == "Five."  # once their threads end


def test_a_401_closes_its_connection_and_its_body_is_never_a_request(make):
    """An unknown key's 401 reads nothing of the request's body (a caller without a key makes rank 0
    hold no memory for it) and closes the connection: the body is never read as a request of its
    own, and the next request, on a new connection, is answered as itself. A body over MAX_BODY is
    a 413 and the connection is closed."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."])
    conn = http.client.HTTPConnection(*g.server.server_address[:2], timeout=5)
    hidden = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"  # a body that reads as a request of its own
    conn.request("POST", "/v1/chat/completions", hidden, {"Authorization": "Bearer nobody"})
    response = conn.getresponse()
    assert response.status == 401 and response.will_close
    response.read()  # http.client opens a new connection for the next request
    conn.request("POST", f"/e/{key}/v1/chat/completions", json.dumps(dict(model="any", messages=FIRST)),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["choices"][0]["message"]["content"] == "Five."
    conn.putrequest("POST", f"/e/{key}/v1/chat/completions")
    conn.putheader("Content-Length", str(endpoint.MAX_BODY + 1))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and response.will_close
    assert g.close(key).calls == 1


def test_a_server_failure_in_a_call_the_agent_gave_up_on_still_stops_the_step(make):
    """The agent's client timed out while the server failed: the call is taken back, the server's
    error is not (agent_programs.Agents.play raises it and the step stops)."""
    g, tok, client, key = make("qwen2.5-instruct", ["x"])
    failing = Failing(tok, "failed /v1/completions after 4 attempt(s): URLError: refused")
    g.client.submit = lambda *args, **kwargs: (time.sleep(1.5), failing.submit())
    impatient = openai.OpenAI(base_url=client.base_url, api_key=key, max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="any", messages=FIRST)
    trace = g.close(key)
    assert "URLError" in str(trace.server_error) and "URLError" in trace.failure and trace.sample is None


class Misaligned(Recording):
    """Answers one logprob short: a server whose answer does not hold together."""

    def submit(self, *args, **kwargs):
        future = super().submit(*args, **kwargs)
        future.result()[0]["logprobs"].pop()
        return future


def test_an_answer_without_one_logprob_per_token_is_the_servers_failure(make):
    """As episodes.Episode.add checks: the call fails (502), nothing is recorded, and the error is
    the server's, for the rollout to raise (not the policy's, nor the agent's)."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."])
    g.client = Misaligned(tok, ["Five."], tok.convert_tokens_to_ids(tok.eos_token))
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="any", messages=FIRST)
    trace = g.close(key)
    assert e.value.status_code == 502 and trace.sample is None
    assert "token ids and" in str(trace.server_error) and "logprobs for one turn" in trace.failure


def test_the_tool_list_cache_is_bounded(make):
    """An agent sending ever-new tool lists keeps at most TOOL_LISTS ChatTokens on rank 0, the
    least recently used dropped."""
    g, tok, client, key = make("qwen2.5-instruct", ["x"])
    lists = [[dict(TOOLS[0], function=dict(TOOLS[0]["function"], name=f"tool{i}"))] for i in range(40)]
    for tools in lists:
        g.chat_tokens(tools)
    assert len(g.chats) == gateway.TOOL_LISTS < 40
    kept = g.chat_tokens(lists[-gateway.TOOL_LISTS])  # the oldest kept, used again: kept past one more list
    g.chat_tokens([])
    assert g.chat_tokens(lists[-gateway.TOOL_LISTS]) is kept and len(g.chats) == gateway.TOOL_LISTS


def test_an_abort_of_no_requests_asks_the_server_nothing():
    """VLLMClient.abort([]) sends no request: vLLM's /abort_requests takes an empty list as every
    request on the server (every episode's call in flight). The server here records what it is asked."""
    from infra import vllm_client

    asked = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            asked.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        client = vllm_client.VLLMClient([f"http://127.0.0.1:{server.server_address[1]}"], model="policy", timeout=5)
        assert client.abort([]) and asked == []
        assert client.abort(["a"]) and asked == [("/abort_requests", {"request_ids": ["cmpl-a-0"]})]
    finally:
        server.shutdown()
        server.server_close()


# --- against a vLLM server of the tiny model, paused where a generation must not end by itself
SERVED = Config(agent="tests/agent.py:run", max_turns=4, max_prompt_length=64, response_length=128,
                vllm_startup_timeout=400, vllm_request_timeout=60, vllm_max_retries=1, vllm_enforce_eager=True)
TINY = [{"role": "user", "content": "say something."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """A gateway in front of a vLLM server of the tiny model (on the server's private socket)."""
    from transformers import AutoTokenizer

    from infra import vllm_server
    from helpers import serve

    _, client = serve(tiny_model_dir, str(tmp_path_factory.mktemp("server")), None, SERVED)
    g = gateway.Gateway(AutoTokenizer.from_pretrained(tiny_model_dir), SERVED)
    g.client = client
    yield g
    g.shutdown()
    vllm_server.stop_server(client.proc)


@contextlib.contextmanager
def paused(client):
    """The server's engine paused (its requests wait, whatever their length, until resumed or aborted)."""
    client.pause()
    try:
        yield
    finally:
        client.resume()


@pytest.mark.slow
def test_end_aborts_the_call_in_flight_and_waits_for_no_lock(served):
    """/end (posted as runner.Program posts it, its run returned) beside a call that a thread of the
    program left in flight: the call is aborted at vLLM and /end answered at once, not after that
    call's generation (the engine paused here: it would never end); the episode keeps its first
    call and is scored. (Before: /end waited for the episode's lock, which that call held.)"""
    g = served
    url, key = g.open("end", 1.0, lambda t: 10 + t)
    agent = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)
    reply = agent.chat.completions.create(model="any", messages=TINY, max_tokens=4).choices[0].message
    trace = g.traces[key]
    with paused(g.client), concurrent.futures.ThreadPoolExecutor(1) as pool:
        left = pool.submit(agent.chat.completions.create, model="any", messages=TINY + [
            reply.model_dump(exclude_none=True), {"role": "user", "content": "more."}])
        deadline = time.monotonic() + 10
        while not trace.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        urllib.request.urlopen(urllib.request.Request(f"{url}/end", b"{}", method="POST"), timeout=5).close()
        took = time.monotonic() - started
        with pytest.raises(openai.APIStatusError, match="the episode has ended"):
            left.result(timeout=5)
    assert took < 2.0
    trace = g.close(key)
    assert trace.closed and trace.calls == 1 and trace.failure is None and trace.sample is not None


@pytest.mark.slow
def test_a_call_whose_client_left_is_aborted_at_vllm(served):
    """The agent's client times out while its call samples (the engine paused here: the generation
    would never end) and closes its connection: the gateway aborts the generation at vLLM, so the
    episode's lock is free while the engine is still paused; the call is taken back and the retry
    is the episode's first call. (Before: the retry waited out the abandoned generation.)"""
    g = served
    url, key = g.open("left", 1.0, lambda t: 20 + t)
    trace = g.traces[key]
    with paused(g.client):
        with pytest.raises(openai.APITimeoutError):
            openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=1.0).chat.completions.create(
                model="any", messages=TINY)
        free = trace.lock.acquire(timeout=3.0)  # the call ended, the engine paused: aborted
        if free:
            trace.lock.release()
    assert free
    reply = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30).chat.completions.create(
        model="any", messages=TINY, max_tokens=4)
    trace = g.close(key)
    assert trace.calls == 1 and trace.failure is None and len(trace.sample.token_ids) == reply.usage.completion_tokens


def raw_call(conn, key, content_length=None):
    """One chat call written by hand on `conn` (kept alive); (status, body) of its answer."""
    body = json.dumps({"model": "any", "messages": FIRST}).encode()
    conn.sendall(f"POST /e/{key}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {content_length or len(body)}\r\n\r\n".encode("latin-1") + body)  # HTTP's own
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += conn.recv(4096) or b"\r\n\r\n"
    head, _, rest = answer.partition(b"\r\n\r\n")
    size = int(re.search(rb"Content-Length: (\d+)", head).group(1)) if b"Content-Length" in head else 0
    while len(rest) < size:
        rest += conn.recv(4096)
    return int(head.split()[1]) if head.strip() else None, rest


def test_a_keyless_flood_never_closes_an_agents_connection_kept_alive(make):
    """Past max_waiting only connections that never carried a live episode's call are closed: an agent's
    connection waiting between its calls (its tool runs) is kept while keyless ones flood the door."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five.", "Six."], serve=dict(limits=endpoint.Limits(max_waiting=8)))
    agent = socket.create_connection(g.server.server_address[:2], timeout=5)
    assert raw_call(agent, key)[0] == 200
    flood = [socket.create_connection(g.server.server_address[:2], timeout=5) for _ in range(40)]
    time.sleep(0.5)  # all at the door, the agent's connection the oldest there
    assert raw_call(agent, key)[0] == 200
    assert sum(closed(s, 0.05) for s in flood) >= 30  # the flood closed its own
    for s in flood + [agent]:
        s.close()


def test_a_head_dripped_a_byte_at_a_time_is_searched_once(make, monkeypatch):
    """The door looks for a head's end in the bytes that came last (and the 3 before them), not in the whole
    head each time: a 4 KiB head sent byte by byte costs it about 4 KiB of searching, not 8 MiB."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."])
    searched, end = [], endpoint.HEAD_END

    class Counting:
        def search(self, head, pos=0):
            searched.append(len(head) - pos)
            return end.search(head, pos)
    monkeypatch.setattr(endpoint, "HEAD_END", Counting())
    mine, theirs = socket.socketpair()
    w = endpoint.Waiting(mine, ("127.0.0.1", 0), bytearray(), time.monotonic() + 10)
    for _ in range(4096):
        g.server.door.got(w, b"x")
    assert len(w.head) == 4096 and sum(searched) <= 4 * 4096, sum(searched)
    mine.close()
    theirs.close()


def test_a_content_length_of_other_digits_is_refused_in_an_answer(make):
    """"²".isdigit() is True and int("²") raises: such a Content-Length is answered 413, as any other
    that is not a decimal number (before: a traceback in the trainer's log and no answer)."""
    g, tok, client, key = make("qwen2.5-instruct", ["Five."])
    with socket.create_connection(g.server.server_address[:2], timeout=5) as conn:
        assert raw_call(conn, key, content_length="²")[0] == 413
