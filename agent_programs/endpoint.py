"""The gateway's HTTP side: its server and each request's handling: the episode's key, the body, the
answer or the stream. What a call does is gateway.py's (Gateway.pin, chat, completion).

It listens on TCP, not on a Unix socket in a private directory as our vLLM server does
(vllm_server.private_socket): an agent gets a base URL, and OpenAI clients in any language take
http://host:port only. So any process on the machine can connect, keyless; what a connection may
cost rank 0 is bounded (Limits), so that none keeps the agents' calls from being served:
- A connection holds no thread while it sends a request's head. The door (one thread, a selector)
  reads the heads of every waiting connection, new or kept alive between calls, a byte at a time if
  it comes so: a request's head must be in within head_timeout of its first byte (a connection may
  wait idle_timeout to begin one), or the connection is closed. A client that drips a byte a second
  holds a socket for seconds, and never a thread. A connection is read as it arrives; past
  max_waiting connections at the door that never carried a live episode's key, the oldest of them
  is closed: a new one is always read, and keyless arrivals never close an agent's connection kept
  alive between its calls.
- A request whose head is in is handled on a thread: from max_calls threads when it names a live
  episode (its key in the base URL or in Authorization: Bearer), from max_guests when it does not
  (a 401, /v1/models: answered from the head alone, no body read). Past its pool it is answered 503
  and closed: keyless clients cannot take the threads of the episodes' calls.
- A call's body must be in within body_timeout of its head (else 408 and closed); after the answer,
  a connection kept alive goes back to the door, holding no thread between calls.
- While a call samples, its connection is watched: a client that closes it (its timeout) has its
  generation aborted at vLLM, so its retry, which waits for the episode's lock, does not wait out
  tokens nobody reads. /end (the program's run is over) aborts the episode's call in flight and
  takes no lock (Gateway.end): a program that returned in time is scored.
"""

import collections
import contextlib
import dataclasses
import http.client
import http.server
import io
import json
import re
import select
import selectors
import socket
import threading
import time

from agent_programs.trace import Refusal

MAX_BODY = 64 << 20  # bytes of one request (a conversation of max_prompt_length + response_length fits many times)
MAX_HEAD = 32 << 10  # bytes of a request line and headers (an OpenAI client sends under 1 KiB)
HEAD_END = re.compile(rb"\r?\n\r?\n")  # the blank line that ends a head (bare LF, as http.server's parser takes it)
TICK = 0.25  # seconds between the door's checks of its deadlines: each is kept to within this
WATCH = 0.25  # seconds between checks that a sampling call's client is still there


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a connection may cost rank 0, and for how long (the module's docstring)."""
    idle_timeout: float = 60.0  # seconds a connection may wait at the door, no request begun (a tool runs meanwhile)
    head_timeout: float = 10.0  # seconds from a request's first byte to its head's end: a client writes a head at once
    body_timeout: float = 60.0  # seconds from the head's end to the body's: MAX_BODY at 1 MiB/s (a call: ~100 KiB)
    max_calls: int = 256  # live episodes' requests handled at once, a thread of rank 0 each (an agent opens a few)
    max_guests: int = 16  # keyless requests answered at once: each is answered from its head, at once, and ends
    max_waiting: int = 512  # connections at the door (a socket, MAX_HEAD bytes at most each); past it the oldest closes


def episode_key(path, headers):
    """The episode a request names: in its base URL (/e/KEY/v1/...), else as its API key (Authorization: Bearer)."""
    if path.startswith("/e/"):
        return path[len("/e/"):].split("/", 1)[0]
    return headers.get("Authorization", "").removeprefix("Bearer ").strip()


def head_key(head):
    """episode_key of a request from its raw head (the door's: which pool its thread comes from)."""
    line, _, rest = head.partition(b"\n")
    words = line.split()
    try:
        headers = http.client.parse_headers(io.BytesIO(rest))  # http.server's own parser of the headers
    except http.client.HTTPException:  # too many or too long: the handler answers that, as a guest
        return None
    return episode_key(words[1].decode("latin-1") if len(words) == 3 else "", headers)


def refuse(conn, status, reason, message):
    """Answer a connection that gets no thread, from the thread that has it, without a wait, and close it."""
    data = json.dumps({"error": {"message": message}}).encode()
    with contextlib.suppress(OSError):
        conn.setblocking(False)  # a few bytes into an empty socket buffer
        conn.sendall(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (status, reason.encode(), len(data), data))
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
    conn.close()


@dataclasses.dataclass
class Waiting:
    """A connection at the door: what it sent of its next request's head, and when it is closed if that is not in."""
    conn: socket.socket
    addr: tuple
    head: bytearray
    deadline: float
    keyed: bool = False  # it carried a live episode's request: an agent's, never closed for a newcomer


class Door:
    """The connections that hold no thread: each waits here, on one thread for all (a selector), for
    the head of its next request, and is handed to Server.dispatch once it is in."""

    def __init__(self, server):
        self.server, self.limits = server, server.limits
        self.selector, self.arrivals, self.waiting = selectors.DefaultSelector(), collections.deque(), {}
        self.closed = False
        self.wake, self.bell = socket.socketpair()  # admit rings the bell from any thread; the selector wakes
        for s in (self.wake, self.bell):
            s.setblocking(False)
        self.selector.register(self.wake, selectors.EVENT_READ)
        self.checked = time.monotonic()
        self.thread = threading.Thread(target=self.run, daemon=True, name="gateway-door")
        self.thread.start()

    def admit(self, conn, addr, head=b"", keyed=False):
        """A new connection, or one kept alive after its answer (head: what it sent past that request; keyed:
        that request named a live episode)."""
        if self.closed:
            return self.server.shutdown_request(conn)
        self.arrivals.append((conn, addr, head, keyed))
        with contextlib.suppress(OSError):  # a full bell has rung already
            self.bell.send(b"\0")

    def close(self):
        self.closed = True
        with contextlib.suppress(OSError):
            self.bell.send(b"\0")

    def run(self):
        while not self.closed:
            for key, _ in self.selector.select(TICK):
                if key.fileobj is self.wake:
                    self.take()
                elif self.waiting.get(key.fileobj) is key.data:  # not closed since (take's max_waiting)
                    self.read(key.data)
            if time.monotonic() - self.checked >= TICK:
                self.expire()
        self.take()  # closed: what came last is closed with the rest
        for w in list(self.waiting.values()):
            self.drop(w)
        self.selector.close()
        self.wake.close()
        self.bell.close()

    def take(self):
        """The arrivals: each waits for its head (idle_timeout to begin it), read at once for what it sent
        already; past max_waiting unkeyed ones at the door, the oldest of those is closed."""
        with contextlib.suppress(OSError):
            while self.wake.recv(4096):
                pass
        while self.arrivals:
            conn, addr, head, keyed = self.arrivals.popleft()
            if self.closed:
                self.server.shutdown_request(conn)
                continue
            unkeyed = [w for w in self.waiting.values() if not w.keyed]  # dicts keep their order: first came first
            if not keyed and len(unkeyed) >= self.limits.max_waiting:
                self.drop(unkeyed[0])
            w = Waiting(conn, addr, bytearray(), time.monotonic() + self.limits.idle_timeout, keyed)
            conn.setblocking(False)
            self.selector.register(conn, selectors.EVENT_READ, w)
            self.waiting[conn] = w
            if head:  # the start of its next request came with the last one
                self.got(w, head)
            elif not keyed:  # an agent's new connection: its head is usually in already, read before a flood's
                self.read(w)

    def read(self, w):
        try:
            data = w.conn.recv(MAX_HEAD)
        except BlockingIOError:
            return
        except OSError:  # reset
            data = b""
        if not data:  # the client closed it
            return self.drop(w)
        self.got(w, data)

    def got(self, w, data):
        """Bytes of a request's head: its first starts head_timeout; a whole head goes to its thread. Only the
        new bytes are searched for the head's end (and the 3 before them): a head sent a byte at a time costs
        the door linear time, not quadratic."""
        if not w.head:
            w.deadline = time.monotonic() + self.limits.head_timeout
        start = max(len(w.head) - 3, 0)
        w.head += data
        if HEAD_END.search(w.head, start):
            self.forget(w)
            self.server.dispatch(w)
        elif len(w.head) > MAX_HEAD:
            self.forget(w)
            refuse(w.conn, 431, "Request Header Fields Too Large", f"the gateway reads a head of at most {MAX_HEAD} "
                   "bytes")

    def expire(self):
        """Close what did not send its head (or begin one) in time."""
        self.checked = now = time.monotonic()
        for w in [w for w in self.waiting.values() if w.deadline <= now]:
            self.drop(w)

    def forget(self, w):
        self.selector.unregister(w.conn)
        del self.waiting[w.conn]

    def drop(self, w):
        self.forget(w)
        self.server.shutdown_request(w.conn)


class Server(http.server.HTTPServer):
    """The gateway's HTTP server: connections accepted on serve_forever's thread and sent to the door,
    each request whose head is in handled on a thread of its pool (Limits)."""
    request_queue_size = 128  # the listen backlog (socketserver's 5): a burst of connects past it waits 1 s, 3 s, ...

    def __init__(self, address, gateway, limits):
        super().__init__(address, Handler)
        self.gateway, self.limits = gateway, limits
        self.calls = threading.BoundedSemaphore(limits.max_calls)  # threads of live episodes' requests
        self.guests = threading.BoundedSemaphore(limits.max_guests)  # threads of keyless ones
        self.door = Door(self)

    def process_request(self, request, client_address):
        self.door.admit(request, client_address)  # no thread until its head is in

    def dispatch(self, w):
        """A request whose head is in (the door's thread): a thread of its own, from its pool, else a 503."""
        keyed = head_key(w.head) in self.gateway.traces
        slots = self.calls if keyed else self.guests
        if not slots.acquire(blocking=False):  # full: refused on the door's thread, without a wait
            return refuse(w.conn, 503, "Service Unavailable", "the gateway is serving too many calls" if keyed else
                          "the gateway is answering too many requests without an episode's key")
        try:
            threading.Thread(target=self.serve, args=(w, slots), daemon=True, name="gateway-call").start()
        except RuntimeError:  # no thread to be had: the door must go on for every other connection
            slots.release()
            refuse(w.conn, 503, "Service Unavailable", "the gateway has no thread to serve this request")

    def serve(self, w, slots):
        """One request, on its thread; a connection kept alive then goes back to the door for its next."""
        handler = None
        try:
            handler = Handler(w.conn, w.addr, self, w.head)
        except Exception:  # noqa: BLE001 - socketserver's own: printed, and the connection closed
            self.handle_error(w.conn, w.addr)
        finally:
            slots.release()
        if handler is not None and not handler.close_connection:  # an agent's, when it named a live episode
            self.door.admit(w.conn, w.addr, handler.leftover, w.keyed or slots is self.calls)
        else:
            self.shutdown_request(w.conn)

    def server_close(self):
        super().server_close()
        self.door.close()


class Handler(http.server.BaseHTTPRequestHandler):
    """One HTTP request to the gateway (self.server.gateway), its head read by the door."""
    protocol_version = "HTTP/1.1"

    def __init__(self, conn, addr, server, head):
        self.head, self.began, self.leftover = head, time.monotonic(), b""  # began: the head's end, for body_timeout
        super().__init__(conn, addr, server)

    def setup(self):
        self.timeout = self.server.limits.idle_timeout  # on the socket: an answer's write to a client that reads none
        super().setup()
        self.rfile.close()  # the request is read from what the door read, its body's rest from the socket (body)
        self.rfile = io.BytesIO(self.head)

    def handle(self):
        self.close_connection = True
        self.handle_one_request()
        self.leftover = self.rfile.read()  # what the client sent past this request: the next one's start

    def log_message(self, *args):  # quiet: the trainer's log is its metrics
        pass

    def do_GET(self):
        route = self.path.split("/v1", 1)[-1]
        if route != "/models":
            return self.reply(404, {"error": {"message": f"no route {self.path}"}})
        self.reply(200, {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "trainer"}]})

    def do_POST(self):
        gateway, key = self.server.gateway, episode_key(self.path, self.headers)
        route, trace = self.path.split("/v1", 1)[-1], gateway.traces.get(key)
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
        if route == "/end":  # the program's run is over (runner.Program): later calls add nothing; its call in
            gateway.end([key])  # flight (a thread's it left) is aborted now, not waited for behind the episode's lock
            return self.reply(200, {})
        with trace.lock, self.watched(trace):  # one call of an episode at a time, its answer written before the next
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
        chunked, over MAX_BODY bytes, not in within body_timeout of the head, or cut off."""
        size = self.headers.get("Content-Length", "0")
        if self.headers.get("Transfer-Encoding") or not (size.isascii() and size.isdigit() and int(size) <= MAX_BODY):
            self.close_connection = True  # its body stays unread: nothing after it on the connection can be read
            self.reply(413, {"error": {"message": f"the gateway reads a body of a Content-Length of at most "
                                                  f"{MAX_BODY} bytes, not a chunked one"}})
            return None
        try:
            return self.received(int(size))
        except TimeoutError:
            self.close_connection = True
            self.reply(408, {"error": {"message": f"the body did not arrive within {self.server.limits.body_timeout:g}"
                                                  " s of the request's head"}})
        except OSError:  # cut off
            self.close_connection = True
        return None

    def received(self, size):
        """`size` bytes of body: what the door read past the head, then the socket's, each read waiting only
        what is left of body_timeout (TimeoutError past it): a client that drips cannot outlast it."""
        data, deadline = bytearray(self.rfile.read(size)), self.began + self.server.limits.body_timeout
        try:
            while len(data) < size:
                self.connection.settimeout(max(deadline - time.monotonic(), 1e-3))
                # never past the body: what follows is the next request's, for the door to read
                chunk = self.connection.recv(min(size - len(data), 1 << 20))
                if not chunk:
                    raise ConnectionResetError("the client closed the connection within the body")
                data += chunk
        finally:
            self.connection.settimeout(self.timeout)
        return bytes(data)

    @contextlib.contextmanager
    def watched(self, trace):
        """While the call runs: once its client has closed the connection (its timeout), the episode's
        generation in flight is aborted at vLLM, again each WATCH seconds (an abort that came before the
        request reached vLLM is lost), so that a retry waiting for the episode's lock is served promptly."""
        done = threading.Event()

        def watch():
            while not done.wait(WATCH):
                if (flying := trace.in_flight) and self.gone():
                    self.server.gateway.client.abort([flying])
        watcher = threading.Thread(target=watch, daemon=True, name="gateway-watch")
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()  # before the episode's lock goes: it never sees, nor aborts, the next call's request

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

