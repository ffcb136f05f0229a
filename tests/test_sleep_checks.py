"""Every sleep, wake and prefix-cache reset of a colocated server is checked (VLLMClient.sleep, wake_up,
reset_prefix_cache), against a local HTTP server that answers vLLM 0.32's routes as a GPU server does
(vllm/entrypoints/serve/dev/sleep and dev/cache, read in its source): /sleep pauses scheduling and
puts the weights and the KV cache to sleep; /wake_up?tags=T wakes T and answers "awake" only once
nothing sleeps (scheduling resumes then); /is_sleeping is true while anything sleeps or scheduling is
paused; /reset_prefix_cache answers {"success": bool}. On a CPU the real server answers the same
states (tests/test_colocate.py); a GPU server's memory is what a CPU cannot show."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from infra.faults import VLLMError
from infra.vllm_client import VLLMClient


class Engine:
    """vLLM 0.32's sleep state (EngineCore.sleep / wake_up / is_sleeping, Executor.sleeping_tags), with the
    faults a test sets: a sleep that does nothing, a wake that does nothing, a restart (awake again),
    resets refused (success false) so many times, a route that answers HTTP 500."""

    def __init__(self):
        self.tags, self.paused, self.calls = set(), False, []
        self.lost_sleep = self.lost_wake = False
        self.refused_resets, self.broken_route = 0, None

    def answer(self, route, tags):
        if route == "/sleep":
            if not self.lost_sleep:
                self.paused, self.tags = True, {"weights", "kv_cache"}
            return {"status": "sleeping", "level": 1}
        if route == "/wake_up":
            if self.tags and set(tags) <= self.tags and not self.lost_wake:  # else vLLM logs a warning, wakes nothing
                self.tags -= set(tags)
            self.paused = self.paused and bool(self.tags)  # scheduling resumes once everything is awake
            return {"status": "sleeping" if self.tags else "awake", "tags": tags}
        if route == "/is_sleeping":
            return {"is_sleeping": self.paused or bool(self.tags)}
        if route == "/reset_prefix_cache":
            self.refused_resets -= 1
            return {"success": self.refused_resets < 0}
        raise KeyError(route)


@pytest.fixture
def server():
    """(url, engine): one GPU-like server's routes over HTTP."""
    engine = Engine()

    class Handler(BaseHTTPRequestHandler):
        def reply(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            url = urlparse(self.path)
            engine.calls.append(self.path)
            try:
                body, status = engine.answer(url.path, parse_qs(url.query).get("tags", [])), 200
            except KeyError:
                body, status = {"detail": "Not Found"}, 404
            if url.path == engine.broken_route:
                body, status = {"error": "CUDA out of memory"}, 500
            self.send_response(status)
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        do_GET = do_POST = reply

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{http.server_address[1]}", engine
    http.shutdown()


def client(*urls):
    return VLLMClient(list(urls), model="m", timeout=10.0, max_retries=0)


def test_a_step_sleeps_wakes_its_weights_then_its_kv_cache_each_checked(server):
    url, engine = server
    c = client(url)
    c.sleep()
    c.wake_up("weights")
    c.reset_prefix_cache()
    c.wake_up("kv_cache")
    assert engine.calls == ["/sleep?level=1", "/is_sleeping", "/wake_up?tags=weights", "/is_sleeping",
                            "/reset_prefix_cache", "/wake_up?tags=kv_cache", "/is_sleeping"]
    assert not engine.tags and not engine.paused


def test_a_sleep_that_does_not_take_is_one_line(server):
    url, engine = server
    engine.lost_sleep = True
    with pytest.raises(VLLMError, match=rf"^vLLM server {url} is awake after /sleep\?level=1 .*: it did not sleep"):
        client(url).sleep()


def test_a_wake_that_does_not_take_is_one_line_not_the_next_sync_check(server):
    url, engine = server
    c = client(url)
    c.sleep()
    c.wake_up("weights")
    engine.lost_wake = True
    with pytest.raises(VLLMError, match=r"is still asleep after /wake_up\?tags=kv_cache .*'status': 'sleeping'.*"
                                        r"/is_sleeping True\): a wake did not take") as e:
        c.wake_up("kv_cache")
    assert "\n" not in str(e.value)


def test_a_lost_weights_wake_shows_at_the_kv_cache_wake(server):
    """The routes say only "asleep or not": a weights wake that did not take leaves the server asleep (its KV
    cache too), which is what it should say then; the KV cache's wake then leaves the weights asleep."""
    url, engine = server
    c = client(url)
    c.sleep()
    engine.lost_wake = True
    c.wake_up("weights")
    engine.lost_wake = False
    with pytest.raises(VLLMError, match=r"still asleep after /wake_up\?tags=kv_cache"):
        c.wake_up("kv_cache")
    assert engine.tags == {"weights"}


def test_a_server_awake_before_its_wake_was_not_asleep(server):
    """A server restarted between the sleep and the wake (awake, fresh) answers "awake" to the weights' wake."""
    url, engine = server
    with pytest.raises(VLLMError, match=r"is awake after /wake_up\?tags=weights .*: it was not asleep"):
        client(url).wake_up("weights")


def test_an_http_error_of_a_wake_is_a_vllm_error(server):
    url, engine = server
    c = client(url)
    c.sleep()
    engine.broken_route = "/wake_up"
    with pytest.raises(VLLMError, match=r"failed /wake_up after 1 attempt\(s\): HTTP 500.*CUDA out of memory"):
        c.wake_up("weights")


def test_a_refused_reset_is_asked_again_then_is_one_line(server):
    """vLLM refuses a reset while running requests hold blocks ("callers may retry"): asked again up to
    vllm_max_retries times (1 here, after 1 s), then VLLMError."""
    url, engine = server
    engine.refused_resets = 1
    patient = VLLMClient([url], model="m", timeout=10.0, max_retries=1)
    patient.reset_prefix_cache()
    assert engine.calls == ["/reset_prefix_cache"] * 2
    engine.refused_resets = 5
    with pytest.raises(VLLMError, match=rf"^vLLM server {url} did not reset its prefix cache after 2 attempt"):
        patient.reset_prefix_cache()
    assert engine.refused_resets == 3


def test_every_server_is_asked_and_the_one_that_did_not_sleep_is_named(server):
    """Several servers (vllm_server_urls): each sleeps and is asked; the error names the one that did not."""
    url, engine = server
    other = Engine()
    other.lost_sleep = True

    class Second(BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps(other.answer(urlparse(self.path).path, [])).encode())

        do_GET = do_POST

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Second)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    second = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        with pytest.raises(VLLMError, match=rf"^vLLM server {second} is awake after /sleep"):
            client(url, second).sleep()
        assert engine.tags == {"weights", "kv_cache"}  # the first slept, and was asked
    finally:
        http.shutdown()
