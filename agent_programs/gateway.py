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

It listens on TCP, not on a Unix socket in a private directory as our vLLM server does
(vllm_server.private_socket): an agent gets a base URL, and OpenAI clients in any language take
http://host:port only. So any process on the machine can connect, keyless: a connection that sends
nothing for idle_timeout seconds is closed, and past max_connections open at once a new one is
answered 503 and closed (each open connection holds a thread of rank 0). Calls need the episode's key.
"""

import collections
import contextlib
import http.server
import json
import select
import socket
import threading
import time
import uuid

from agent_programs.trace import Refusal, Trace, plain
from envs.chat import ChatTokens
from faults import VLLMError

IDLE_TIMEOUT = 60.0  # seconds a connection may send nothing (between calls, or within one) before it is closed
MAX_CONNECTIONS = 256  # open at once: each holds a thread of rank 0 (an agent's client keeps a few per episode)
MAX_BODY = 64 << 20  # bytes of one request (a conversation of max_prompt_length + response_length fits many times)
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

    def __init__(self, tokenizer, cfg, parser=None, reasoning=None, host="127.0.0.1", idle_timeout=IDLE_TIMEOUT,
                 max_connections=MAX_CONNECTIONS):
        self.tokenizer, self.cfg, self.parser, self.reasoning = tokenizer, cfg, parser, reasoning
        self.client, self.traces, self.chats, self.said = None, {}, collections.OrderedDict(), set()
        self.lock = threading.Lock()
        self.server = Server((host, 0), self, idle_timeout, max_connections)
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
        nothing to its episode, and a later call is answered with an error. close collects the traces."""
        traces = [self.traces[str(key)] for key in keys]
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
        trace.in_flight = uuid.uuid4().hex  # its name at vLLM, for close's abort
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


class Server(http.server.ThreadingHTTPServer):
    """The gateway's HTTP server: a thread per connection, at most max_connections open at once."""
    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's 5): a burst of connects past it waits 1 s, 3 s, ...

    def __init__(self, address, gateway, idle_timeout, max_connections):
        super().__init__(address, Handler)
        self.gateway, self.idle_timeout = gateway, idle_timeout
        self.slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):  # full: refused here, on the accepting thread, without a wait
            data = json.dumps({"error": {"message": "the gateway has too many connections open"}}).encode()
            with contextlib.suppress(OSError):
                request.setblocking(False)  # a few bytes into an empty socket buffer
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            return self.shutdown_request(request)
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class Handler(http.server.BaseHTTPRequestHandler):
    """One HTTP request to the gateway (self.server.gateway)."""
    protocol_version = "HTTP/1.1"

    def setup(self):
        self.timeout = self.server.idle_timeout  # on the socket (StreamRequestHandler): a silent client is closed
        super().setup()

    def log_message(self, *args):  # quiet: the trainer's log is its metrics
        pass

    def do_GET(self):
        route = self.path.split("/v1", 1)[-1]
        if route != "/models":
            return self.reply(404, {"error": {"message": f"no route {self.path}"}})
        self.reply(200, {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "trainer"}]})

    def do_POST(self):
        key = self.path.split("/e/", 1)[1].split("/", 1)[0] if self.path.startswith("/e/") else \
            self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        route, trace = self.path.split("/v1", 1)[-1], self.server.gateway.traces.get(key)
        if trace is None:  # its body is never read (a caller without a key costs us no memory): the
            self.close_connection = True  # connection closes, so what is left unread is never read as a request
            return self.reply(401, {"error": {"message": "no episode has this key: use the base URL and API key "
                                                         "the episode was given"}})
        data = self.body()
        if data is None:
            return
        try:
            body = json.loads(data or b"{}")
        except ValueError as e:
            return self.reply(400, {"error": {"message": f"the body is not JSON ({e})"}})
        if not isinstance(body, dict):
            return self.reply(400, {"error": {"message": "the body must be a JSON object"}})
        with trace.lock:  # one call of an episode at a time, its answer written before the next
            if route == "/end":  # the program's run is over (runner.Program): later calls add nothing
                trace.closed = True
                return self.reply(200, {})
            saved = trace.save()
            status, payload = self.respond(trace, route, body, key)
            if self.gone():
                return trace.load(saved)
            try:
                self.stream(payload, (body.get("stream_options") or {}).get("include_usage")) \
                    if status == 200 and body.get("stream") else self.reply(status, payload)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the agent gave up on this call
                trace.load(saved)  # (its client's timeout) and never saw it: as if it was never made

    def body(self):
        """The request's body, or None when it cannot be read (the error answered, the connection closed):
        chunked, over MAX_BODY bytes, or a client that went silent for idle_timeout seconds within it."""
        size = self.headers.get("Content-Length", "0")
        if self.headers.get("Transfer-Encoding") or not (size.isdigit() and int(size) <= MAX_BODY):
            self.close_connection = True  # its body stays unread: nothing after it on the connection can be read
            self.reply(413, {"error": {"message": f"the gateway reads a body of a Content-Length of at most "
                                                  f"{MAX_BODY} bytes, not a chunked one"}})
            return None
        try:
            return self.rfile.read(int(size))
        except OSError:  # TimeoutError among them
            self.close_connection = True
            return None

    def gone(self):
        """Whether the agent closed the connection while its call was sampled (its client timed out)."""
        if not select.select([self.connection], [], [], 0)[0]:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def respond(self, trace, route, body, key):
        """(HTTP status, the JSON answer) of one call."""
        gateway = self.server.gateway
        try:
            if trace.closed:
                raise Refusal(409, "the episode has ended")
            gateway.pin(trace, body)
            if route == "/chat/completions":
                message, finish, used = gateway.chat(trace, body)
                choice, kind = dict(index=0, message=message, finish_reason=finish, logprobs=None), "chat.completion"
            elif route == "/completions":
                text, finish, used = gateway.completion(trace, body)
                choice, kind = dict(index=0, text=text, finish_reason=finish, logprobs=None), "text_completion"
            else:
                raise Refusal(404, f"no route {self.path}")
        except Refusal as e:
            if e.fatal and trace.failure is None:
                trace.failure = f"the gateway: {e}"
            return e.status, {"error": {"message": str(e), "type": "invalid_request_error"}}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return 400, {"error": {"message": f"a malformed request ({type(e).__name__}: {e})"}}
        except Exception as e:  # noqa: BLE001 - ours, not the agent's: its episode is not trained on
            trace.failure = trace.failure or f"the gateway failed: {type(e).__name__}: {e}"
            return 500, {"error": {"message": trace.failure}}
        return 200, dict(id=f"{kind}-{key}-{trace.calls}", object=kind, created=int(time.time()),
                         model=body.get("model") or "policy", choices=[choice], usage=used)

    def reply(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def stream(self, done, include_usage=False):
        """The whole answer as one server-sent chunk, then its finish_reason, with include_usage (the
        request's stream_options) a last chunk of no choices and the call's usage, then [DONE]."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        choice, kind = done["choices"][0], done["object"] + ".chunk"
        if "message" in choice:
            delta = dict(choice["message"])
            if delta.get("tool_calls"):
                delta["tool_calls"] = [dict(c, index=j) for j, c in enumerate(delta["tool_calls"])]
            first = dict(index=0, delta=delta, finish_reason=None)
            last = dict(index=0, delta={}, finish_reason=choice["finish_reason"])
        else:
            first, last = dict(choice, finish_reason=None), dict(choice, text="")
        chunks = [dict(done, object=kind, choices=[c], usage=None) for c in (first, last)]
        chunks += [dict(done, object=kind, choices=[])] if include_usage else []
        for chunk in chunks if include_usage else [{k: v for k, v in c.items() if k != "usage"} for c in chunks]:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True

