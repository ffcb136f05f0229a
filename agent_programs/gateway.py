"""The agent gateway: an OpenAI-compatible endpoint in front of the vLLM server(s), through which
an agent that is a program (runner.py) calls the policy, and which records exactly what it sampled.

    gateway = Gateway(tokenizer, cfg)               # 127.0.0.1, a free port
    base_url, key = gateway.open(k, temperature, seeds)   # one per episode
    ... the agent: openai.OpenAI(base_url=base_url, api_key=key).chat.completions.create(...)
    trace = gateway.close(key)                      # trace.sample: the episode's tokens, as sampled

Routes: POST /v1/chat/completions (messages, tools, tool calls in the model's format read by
vLLM's parser: --tool_call_parser; reasoning by --reasoning_parser; stream=True answered as one
chunk), POST /v1/completions (a text or token-id prompt), GET /v1/models. The episode is named by
its base URL (http://host:port/e/KEY/v1) or by its API key (Authorization: Bearer KEY); any model
name is served by the policy. Every answer carries OpenAI's usage (a stream's with
stream_options.include_usage). The trainer's sampling settings are pinned: an agent's temperature,
top_p, seed or penalties are overridden, and what would make the policy sample from another
distribution (tool_choice="required", a response_format, ...: UNHONOURED) is not honoured; both are
counted as agent_overrides and said once. n > 1, best_of, echo and suffix are refused (docs/data.md).

What a call records, and when it continues the episode's sample: trace.py.

The HTTP side (connections, keys, bodies, answers and streams) is endpoint.py.
"""

import collections
import json
import threading
import uuid

from agent_programs.endpoint import Limits, Server
from agent_programs.trace import Refusal, Trace, plain
from envs.chat import ChatTokens
from infra.faults import VLLMError

TOOL_LISTS = 16  # distinct tool lists whose ChatTokens are kept, the least recently used dropped
PINNED = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty")  # sampling an agent may ask for and the trainer sets
# What an agent may ask that would make the policy sample from another distribution than the trainer's
# (constrained decoding, forced calls, biased logits) or that the gateway does not return, with the values
# that ask nothing: the policy samples as it is, and the call is counted with the pinned ones (agent_overrides)
UNHONOURED = {"tool_choice": ("auto",), "response_format": ({"type": "text"},), "logit_bias": ({},),
              "logprobs": (False,), "top_logprobs": (0,), "parallel_tool_calls": (True,), "guided_json": (),
              "guided_regex": (), "guided_choice": (), "structured_outputs": ()}


def as_json(value):
    """Arguments as OpenAI sends them: a JSON string (one the parser could not read stays as it was)."""
    return value if isinstance(value, str) else json.dumps(value)


def usage(prompt, completion):
    """OpenAI's usage of one call (what LangChain, LiteLLM and smolagents read)."""
    return dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def stops(body):
    """The request's stop strings (vLLM takes at most 4; a fifth is its error, the agent's to see)."""
    stop = body.get("stop") or ()
    return [stop] if isinstance(stop, str) else list(stop)


class Gateway:
    """The endpoint, served on threads in the trainer's rank 0 while episodes play."""

    def __init__(self, tokenizer, cfg, parser=None, reasoning=None, host="127.0.0.1", limits=Limits()):
        self.tokenizer, self.cfg, self.parser, self.reasoning = tokenizer, cfg, parser, reasoning
        self.client, self.traces, self.chats, self.said = None, {}, collections.OrderedDict(), set()
        self.lock = threading.Lock()
        self.server = Server((host, 0), self, limits)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="gateway")
        self.thread.start()

    def open(self, key, temperature, seeds):
        """Register episode `key`; seeds(t) seeds its call t (None: unseeded). Returns its base URL and API key."""
        self.traces[str(key)] = Trace(temperature, seeds)
        return f"{self.url}/e/{key}/v1", str(key)

    def end(self, keys):
        """The episodes' programs are over (their runs returned, timed out or crashed): a call of theirs
        in flight (a killed program's, or a thread's it left behind) is aborted at vLLM, all in one
        request, so that the step does not wait out its tokens (agent_timeout bounds the step); it adds
        nothing to its episode, and a later call is answered with an error. close collects the traces
        (an episode closed already has nothing left to end: a program's /end may come after)."""
        traces = [self.traces[str(key)] for key in keys if str(key) in self.traces]
        for trace in traces:
            trace.closed = True
        if self.client and (flying := [t.in_flight for t in traces if t.in_flight]):
            self.client.abort(flying)

    def close(self, key):
        """The episode's trace, final (end first, or here: a call still in flight is aborted again each
        second, as it may not have reached vLLM when end asked)."""
        self.end([key])
        trace = self.traces.pop(str(key))
        while not trace.lock.acquire(timeout=1.0):
            if trace.in_flight:
                self.client.abort([trace.in_flight])
        trace.lock.release()
        return trace

    def shutdown(self):
        self.server.shutdown()
        self.server.server_close()

    def chat_tokens(self, tools):
        """The ChatTokens of one tool list (a template renders tools into the prompt), kept for the
        TOOL_LISTS lists used last: an agent that sends ever-new lists must not grow rank 0's memory."""
        name = json.dumps(tools, sort_keys=True)
        if name in self.chats:
            self.chats.move_to_end(name)
            return self.chats[name]
        try:
            chat = self.chats[name] = ChatTokens(self.tokenizer, tools or None)
        except ValueError as e:
            raise Refusal(400, str(e), fatal=True) from None
        if len(self.chats) > TOOL_LISTS:
            self.chats.popitem(last=False)
        return chat

    def pin(self, trace, body):
        """Refuse what cannot be served (n > 1, best_of, echo, suffix); count (agent_overrides) and say once
        what is overridden: the sampling settings the trainer sets (PINNED) and what would change what the
        policy samples or is not returned (UNHONOURED: tool_choice="required", a response_format, ...)."""
        if body.get("n", 1) != 1 or body.get("best_of", 1) not in (None, 1):
            raise Refusal(400, "n > 1 is not served: a group's samples are separate episodes (num_samples_per_prompt_"
                          "rollout); ask for one completion per call")
        if body.get("echo") or body.get("suffix"):
            raise Refusal(400, "echo and suffix are not served: ask for the completion alone")
        if not isinstance(body.get("stream_options") or {}, dict):
            raise Refusal(400, "stream_options must be an object, such as {\"include_usage\": true}")
        asked = [k for k in PINNED if body.get(k) is not None and body[k] != {"temperature": trace.temperature,
                                                                              "top_p": self.cfg.top_p}.get(k)]
        asked += [k for k, fine in UNHONOURED.items() if body.get(k) is not None and body[k] not in fine]
        if asked:
            trace.overrides += 1
            if tuple(asked) not in self.said:
                self.said.add(tuple(asked))
                print(f"gateway: the agent asked for {', '.join(f'{k}={body[k]}' for k in asked)}; not honoured: the "
                      f"policy samples as it is, at the trainer's temperature={trace.temperature}, top_p="
                      f"{self.cfg.top_p}, seeded per episode (counted in agent_overrides)")

    def chat(self, trace, body):
        """One /v1/chat/completions call: (the assistant message, finish_reason, usage)."""
        tools = body.get("tools") or []
        if tools and self.parser is None:
            raise Refusal(400, "the agent sends tools, and the trainer reads no tool calls: set --tool_call_parser "
                          "(hermes for Qwen and SmolLM2's demo, llama3_json for Llama-3.1, ...)", fatal=True)
        messages = [plain(m) for m in body.get("messages") or []]
        if not messages:
            raise Refusal(400, "messages is empty")
        name = json.dumps(tools, sort_keys=True)  # tools the template shows: a change is a new prompt
        extends = trace.continues(messages, name)
        with self.lock:  # one tokenizer for every thread
            chat = self.chat_tokens(tools)
            between = chat.ids(messages[len(trace.convo):], trace.eos) if extends else chat.prompt_ids(messages)
        ids, finish, usage = self.sample(trace, between, extends, body, stops(body))
        if ids is None:
            return {"role": "assistant", "content": ""}, finish, usage
        text, trace.tools = trace.text, name
        with self.lock:
            reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
            reply = self.parser.message(content, trace.calls - 1) if self.parser and tools else \
                {"role": "assistant", "content": content}
        trace.tool_calls += bool(reply.get("tool_calls"))
        trace.convo, trace.messages, trace.completion = messages + [reply], messages + [reply], text
        if reply.get("tool_calls") and finish == "stop":
            finish = "tool_calls"
        out = dict(reply, reasoning_content=reasoning) if reasoning is not None else dict(reply)
        if reply.get("tool_calls"):  # OpenAI's form: arguments as a JSON string
            out["tool_calls"] = [dict(c, function=dict(c["function"], arguments=as_json(c["function"]["arguments"])))
                                 for c in reply["tool_calls"]]
        return out, finish, usage

    def completion(self, trace, body):
        """One /v1/completions call: (the text, finish_reason, usage). A prompt (text or token ids) that
        starts with the sample so far continues it, its new tokens as given (mask 0); a text's
        new part is tokenized on its own."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        so_far = trace.current() if trace.sample else None
        if isinstance(prompt, str):
            with self.lock:
                text = self.tokenizer.decode(so_far) if so_far else None
                extends = text is not None and len(prompt) > len(text) and prompt.startswith(text)
                between = self.tokenizer(prompt[len(text):] if extends else prompt,
                                         add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            extends = so_far is not None and len(prompt) > len(so_far) and prompt[:len(so_far)] == so_far
            between = prompt[len(so_far):] if extends else prompt
        else:
            raise Refusal(400, "prompt must be one text or one list of token ids")
        ids, finish, usage = self.sample(trace, between, extends, body, stops(body))
        if ids is None:
            return "", finish, usage
        trace.completion, trace.messages = trace.text, []  # the reward reads this call's text
        return trace.text, finish, usage

    def sample(self, trace, between, extends, body, stop):
        """Append `between` (mask 0) to the trace's sample, continuing it or starting a sequence,
        and sample the next turn after it; (the sampled ids, finish_reason, usage), or (None, "length",
        usage) when the episode's token or turn budget is spent. usage is OpenAI's: the tokens vLLM was
        given (the sequence so far, as it continues) and sampled."""
        cfg, s = self.cfg, trace.sample
        if s is None and len(between) > cfg.max_prompt_length:
            raise Refusal(400, f"the agent's first prompt is {len(between)} tokens, over max_prompt_length="
                          f"{cfg.max_prompt_length}; raise it (the micro-batch budget follows)", fatal=True)
        left = cfg.response_length - (len(s.token_ids) + len(between) if s else 0)
        prompt = trace.current() + between if extends else between  # a restarted sequence sees itself only
        if left <= 0 or trace.calls >= cfg.episode_turns:
            trace.cut = True
            return None, "length", usage(len(prompt), 0)
        asked = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), left)
        if not isinstance(asked, int) or asked < 1:
            raise Refusal(400, f"max_tokens={asked!r} must be a whole number of at least 1")
        trace.in_flight = uuid.uuid4().hex  # its name at vLLM, for end's abort
        if trace.closed:  # ended as it got here: end saw no call in flight to abort, so it is not sent
            trace.in_flight = None
            raise Refusal(409, "the episode has ended")
        try:
            out = self.client.submit(prompt, 1, min(left, asked), trace.temperature, cfg.top_p,
                                     trace.seeds(trace.calls), stop, request_id=trace.in_flight).result()[0]
        except VLLMError as e:  # an abort is no error (vLLM answers it, finish_reason "abort"): this is the server's
            if " HTTP 4" in str(e):  # the server refused this request (the agent's stop strings, say)
                raise Refusal(400, f"the vLLM server refused the request: {e}") from None
            return self.failed(trace, e)
        finally:
            trace.in_flight = None
        if trace.closed:  # aborted, or answered after its program ended: not the episode's
            raise Refusal(409, "the episode has ended")
        try:
            return (*trace.record(between, extends, out, stop, self.tokenizer, cfg.response_length),
                    usage(len(prompt), len(out["token_ids"])))
        except ValueError as e:  # Trace.record's check, before it records anything: not one logprob per token
            return self.failed(trace, VLLMError(str(e)))

    def failed(self, trace, error):
        """A server that fails (ours, not the agent's nor the policy's): the episode is unscored, and
        the rollout stops on trace.server_error, a server of ours restarted (runner.Agents.play raises it)."""
        trace.server_error = error
        raise Refusal(502, f"the vLLM server: {error}", fatal=True) from None
