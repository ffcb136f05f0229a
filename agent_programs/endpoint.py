"""The gateway's HTTP side: its server (a thread per connection, at most max_connections open at once)
and each request's handling: the episode's key, the body, the answer or the stream. What a call does
is gateway.py's (Gateway.pin, chat, completion).

It listens on TCP, not on a Unix socket in a private directory as our vLLM server does
(vllm_server.private_socket): an agent gets a base URL, and OpenAI clients in any language take
http://host:port only. So any process on the machine can connect, keyless: a connection that sends
nothing for idle_timeout seconds is closed, and past max_connections open at once a new one is
answered 503 and closed (each open connection holds a thread of rank 0). Calls need the episode's key.
"""

import contextlib
import http.server
import json
import select
import socket
import threading
import time

from agent_programs.trace import Refusal

IDLE_TIMEOUT = 60.0  # seconds a connection may send nothing (between calls, or within one) before it is closed
MAX_CONNECTIONS = 256  # open at once: each holds a thread of rank 0 (an agent's client keeps a few per episode)
MAX_BODY = 64 << 20  # bytes of one request (a conversation of max_prompt_length + response_length fits many times)


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

