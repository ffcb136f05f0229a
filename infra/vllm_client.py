"""The HTTP client of vLLM: generation requests spread over the servers, retries,
weight versions (a completion never mixes two), and the routes the weight sync and
a colocated server's sleep use. The servers are ours (vllm_server.py: a URL unix:PATH, HTTP over its private
Unix socket) or the user's (vllm_server_urls, http(s)://host:port, started with
VLLM_SERVER_DEV_MODE=1 for the weight routes; the key in VLLM_API_KEY, if set, is sent to them).

Pushing the trainer's weights into the server is weight_sync.py.
"""

import contextlib
import http.client
import io
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from infra.faults import VLLMError


# What every request pins besides temperature and top_p. A server started without
# --generation-config vllm fills each sampling parameter a request leaves out from the model's
# generation_config.json (Qwen2.5-Instruct: top_k=20, repetition_penalty=1.05), and then samples
# from another distribution than the trainer's softmax: a biased ratio, silently. top_k=-1 is
# "off" in every vLLM (0.32 prefers 0 and quietly accepts -1; older versions refuse 0).
NEUTRAL_SAMPLING = dict(top_k=-1, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)


KEY_HINT = " (the server wants an API key: export VLLM_API_KEY=its key before train.py)"


def log_tail(path, n=20):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket: the server we launch listens on one, in a directory only our user
    may enter, so no other user's process can reach any of its routes (vllm_server.launch_server)."""

    def __init__(self, socket_path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def fetch(url, route, data=None, headers=None, timeout=120.0):
    """The body of GET (data None) or POST url + route, as urllib.request.urlopen reads it, errors
    included (urllib.error.HTTPError for a status >= 400, OSError when unreachable). `url` is
    http(s)://host:port, or unix:PATH for the socket of a server we launched."""
    if not url.startswith("unix:"):
        with urllib.request.urlopen(urllib.request.Request(url + route, data, headers or {}), timeout=timeout) as r:
            return r.read()
    conn = UnixHTTPConnection(url[len("unix:"):], timeout)
    try:
        conn.request("GET" if data is None else "POST", route, body=data, headers=headers or {})
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    if r.status >= 400:
        raise urllib.error.HTTPError(url + route, r.status, r.reason, r.headers, io.BytesIO(body))
    return body


def check_servers(urls, timeout, vllm_version=None):
    """Servers the user runs (vllm_server_urls), asked for /health before anything starts, and for
    /version (vLLM's route, open without a key) when `vllm_version` is the one they must run: ValueError
    with one line naming the fix for one that does not answer or runs another vLLM."""
    for url in urls:
        try:
            urllib.request.urlopen(url + "/health", timeout=timeout).close()
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(f"vllm_server_urls: {url} does not answer /health ({getattr(e, 'reason', e)}); "
                             "start the server first or fix the URL") from None
        if vllm_version is None:
            continue
        try:
            with urllib.request.urlopen(url + "/version", timeout=timeout) as r:
                served = str(json.loads(r.read())["version"])
            said = f"the server at {url} runs vLLM {served}"
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as e:
            why = f"HTTP {e.code}" if isinstance(e, urllib.error.HTTPError) else getattr(e, "reason", e)
            served, said = None, f"the server at {url} does not say its vLLM version (GET /version: {why})"
        check_version(served, vllm_version, said)


def check_version(found, pinned, said):
    """ValueError, one line opening with `said`, unless `found` (a vLLM version; None: none known) is
    `pinned`; a build label (0.32.0+cu130) counts as its release."""
    if found is None or found.split("+")[0] != pinned:
        raise ValueError(f"{said}, not vLLM {pinned}, the one this trainer runs (pyproject.toml's gpu and cpu extras "
                         "pin it): install that, or set --vllm_any_version true to run another at your own risk")


class VLLMClient:
    """HTTP client over one or more servers: bounded retries with backoff, concurrent
    requests spread round-robin, errors that name the server and quote what it said."""

    def __init__(self, urls, model=None, timeout=120.0, max_retries=3, proc=None, log_path=None, stop_token_ids=(),
                 api_key=None):
        self.urls, self.timeout, self.max_retries = list(urls), timeout, max_retries
        # vLLM's --api-key (or its VLLM_API_KEY) guards only routes under /v1 (its AuthenticationMiddleware's
        # GUARDED_PREFIX): sent on every request, it opens those; the dev routes need none
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        # the model's end-of-sequence ids beyond the tokenizer's (generation_config.json's eos_token_id
        # list): a server launched with --generation-config vllm, or on a copy without that file, would
        # not stop on them
        self.stop_token_ids = list(stop_token_ids)
        self.proc, self.log_path = proc, log_path  # set when we launched the (single) server
        self.model = model or self.get(self.urls[0], "/v1/models")["data"][0]["id"]  # the name it serves
        self.version = 0  # weight updates the servers have taken (see updating)
        self._cond, self._in_flight, self._updating = threading.Condition(), 0, False
        self._requests, self._sent = None, 0  # submit's threads (made on first use), requests sent

    @contextlib.contextmanager
    def generating(self):
        """Around one generation request: waits out a weight update; yields the weight version
        the request runs on."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._in_flight += 1
            version = self.version
        try:
            yield version
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def updating(self):
        """Around a weight update: new generation requests wait and requests in flight finish
        on the old weights, so each completion comes from exactly one weight version. With
        generation running ahead (async_steps), this is the only time it stops."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)  # one update at a time
            self._updating = True
            self._cond.wait_for(lambda: self._in_flight == 0)
        done = False
        try:
            yield
            done = True
        finally:
            with self._cond:
                self.version += done
                self._updating = False
                self._cond.notify_all()

    def get(self, url, route):
        try:
            return json.loads(fetch(url, route, headers=self.headers, timeout=self.timeout))
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            hint = KEY_HINT if getattr(e, "code", None) == 401 else ""
            raise VLLMError(f"vLLM server {url} did not answer {route}: {getattr(e, 'reason', e)}{hint}") from None

    def post(self, url, route, payload=None, params="", timeout=None):
        """POST with retries; `timeout` (seconds per attempt) defaults to vllm_request_timeout."""
        timeout = timeout or self.timeout
        data = json.dumps(payload or {}).encode()
        last = None
        for attempt in range(self.max_retries + 1):
            if self.proc is not None and self.proc.poll() is not None:
                raise VLLMError(f"vLLM server {url} died (exit code {self.proc.returncode}); "
                                f"log {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                body = fetch(url, route + params, data, self.headers, timeout)
                try:
                    return json.loads(body) if body else {}
                except ValueError:  # the LoRA routes answer in plain text
                    return body.decode(errors="replace")
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"
                last += KEY_HINT if e.code == 401 else ""
                if e.code < 500:
                    break  # the request is wrong; retrying will not help
            except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException) as e:
                # HTTPException: an answer cut short (IncompleteRead), as when the server dies mid-reply
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt < self.max_retries:
                time.sleep(min(2.0 ** attempt, 30.0) * (0.5 + random.random()))
        raise VLLMError(f"vLLM server {url} failed {route} after {attempt + 1} attempt(s): {last}")

    def map(self, route, payloads, fn=None):
        """POST every payload concurrently, spread over the servers; results in order. A failed request lets
        the others end first; a stop (infra/ranks.py's Stop) waits for none of them."""
        pool = ThreadPoolExecutor(max_workers=min(64, max(1, len(payloads))))
        try:
            futures = [pool.submit(fn or self.post, self.urls[i % len(self.urls)], route, p)
                       for i, p in enumerate(payloads)]
            return [f.result() for f in futures]
        except BaseException as e:
            pool.shutdown(wait=isinstance(e, Exception), cancel_futures=True)
            raise
        finally:
            pool.shutdown(wait=False)

    def versioned_post(self, url, route, payload):
        """A generation request on the weights of one version: the model it names (a LoRA adapter's
        name changes at each sync) is read once no update is under way."""
        with self.generating() as version:
            return self.post(url, route, dict(payload, model=self.model)), version

    def broadcast(self, route, payload=None, params="", timeout=None):
        return [self.post(url, route, payload, params, timeout) for url in self.urls]

    def submit(self, prompt_ids, n, max_tokens, temperature, top_p, seed=None, stop=(), server=None, request_id=None):
        """n completions of the token-id prompt, requested now: a Future of a list of dicts with
        token_ids, logprobs (of the sampled tokens, under the sampling temperature), finish_reason
        ("stop" or "length"), eos (it ended on an end-of-sequence token, the last of token_ids),
        text and version (of the weights that sampled it). A stop string ends a completion and stays
        in it. vLLM seeds sample j with seed + j. Requests go round-robin over the servers (or to
        `server` mod their number). request_id names the request for abort."""
        extra = dict(stop=list(stop), include_stop_str_in_output=True) if stop else {}
        if request_id:
            extra["request_id"] = request_id
        payload = dict(prompt=prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                       **NEUTRAL_SAMPLING, stop_token_ids=self.stop_token_ids, logprobs=0, return_token_ids=True,
                       seed=seed, **extra)
        with self._cond:
            if self._requests is None:  # threads that wait on HTTP; requests beyond them queue
                self._requests = ThreadPoolExecutor(max_workers=64, thread_name_prefix="vllm-request")
            self._sent += 1
            url = self.urls[(self._sent if server is None else server) % len(self.urls)]
        return self._requests.submit(self.completions, url, payload)

    def completions(self, url, payload):
        resp, version = self.versioned_post(url, "/v1/completions", payload)
        choices = sorted(resp["choices"], key=lambda c: c["index"])
        # stop_reason: None for the model's EOS, the token id for stop_token_ids (a string for a stop string)
        return [dict(token_ids=c["token_ids"], logprobs=c["logprobs"]["token_logprobs"],
                     finish_reason=c["finish_reason"], text=c["text"], version=version,
                     eos=c["finish_reason"] == "stop" and not isinstance(c.get("stop_reason"), str))
                for c in choices]

    def abort(self, request_ids):
        """Abort requests in flight (submit's request_id) on every server: they end at once, with what they
        sampled so far (finish_reason "abort"). Returns whether every server took it: a server without
        /abort_requests (one you run without VLLM_SERVER_DEV_MODE=1) lets them run to their end. No ids
        asks nothing (vLLM 0.32's /abort_requests takes an empty list as every request on the server)."""
        if not request_ids:
            return True
        ids = [f"cmpl-{r}-0" for r in request_ids]  # vLLM's id of a completions request's one prompt
        data = json.dumps({"request_ids": ids}).encode()
        try:
            for url in self.urls:
                fetch(url, "/abort_requests", data, self.headers, self.timeout)
            return True
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return False

    def reload_weights(self, weights_dir, timeout=None):
        """Each server reloads the safetensors in weights_dir; `timeout` is weight_sync_timeout."""
        try:
            self.broadcast("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
                           timeout=timeout)
        except VLLMError as e:
            raise VLLMError(f"weight sync: {e}\n(each attempt may take weight_sync_timeout="
                            f"{timeout or self.timeout:g}s; raise it if the server is only slow to reload)") from None
        self.reset_prefix_cache()

    def reset_prefix_cache(self):
        """Each server drops its cached prefixes (computed by the weights before an update). vLLM answers
        {"success": false} while running requests hold blocks: asked again with backoff, then VLLMError."""
        for url in self.urls:
            for attempt in range(self.max_retries + 1):
                answer = self.post(url, "/reset_prefix_cache")
                if not isinstance(answer, dict) or answer.get("success", True):  # older vLLMs answer nothing
                    break
                time.sleep(min(2.0 ** attempt, 30.0))
            else:
                raise VLLMError(f"vLLM server {url} did not reset its prefix cache after {attempt + 1} attempt(s) "
                                "({'success': false}: requests still hold its blocks); the next batch would reuse "
                                "prefixes of the old weights")

    def sleep(self):
        """A colocated server frees the GPUs for training (level 1: weights to host memory, KV cache dropped),
        checked on each server (/is_sleeping)."""
        for url in self.urls:
            self.check_sleeping(url, "/sleep?level=1", self.post(url, "/sleep", params="?level=1"), True)

    def wake_up(self, tags):
        """Wake the part `tags` names: "weights" or "kv_cache" (vLLM's sleep-mode tags), checked on each server:
        after the weights it still sleeps (its KV cache does), after the KV cache it is awake."""
        for url in self.urls:
            route = f"/wake_up?tags={tags}"
            self.check_sleeping(url, route, self.post(url, "/wake_up", params=f"?tags={tags}"), tags != "kv_cache")

    def check_sleeping(self, url, route, answer, expected):
        """VLLMError in one line unless the server at `url` says, after `route` (whose answer was `answer`), that
        it sleeps (`expected` True) or is awake. vLLM's /is_sleeping is true while any part of the engine sleeps
        or its scheduling is paused (a /sleep pauses it; the wake of the last part resumes it); its /sleep and
        /wake_up answer {"status": "sleeping" | "awake", ...}."""
        said = answer.get("status") if isinstance(answer, dict) else None
        state = self.get(url, "/is_sleeping").get("is_sleeping")
        if state is expected and said in (None, "sleeping" if expected else "awake"):
            return
        if route.startswith("/sleep"):
            why = "it did not sleep, and would hold its GPU memory while the policy trains (--enable-sleep-mode?)"
        elif expected:
            why = "it was not asleep before this wake (restarted, or woken by another client)"
        else:
            why = "a wake did not take (of the weights or the KV cache), and the server would not generate"
        raise VLLMError(f"vLLM server {url} is {'awake' if expected else 'still asleep'} after {route} (it answered "
                        f"{answer!r}, /is_sleeping {state!r}): {why}")

    def pause(self):
        self.broadcast("/pause", params="?mode=keep")

    def resume(self):
        self.broadcast("/resume")
