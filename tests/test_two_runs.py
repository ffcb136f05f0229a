"""Runs that share a machine: each launches its own vLLM server on a private Unix socket, never
takes another's server for its own, and no other user's process reaches its routes; a second run
into a busy output_dir is refused."""

import fcntl
import http.server
import json
import os
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import time
import types

import pytest

from infra import vllm_client
from infra import vllm_server
from config import Config
from infra.tracking import claim_output_dir
from helpers import EAGER, ENV, ROOT, generate, serve

MODEL = "output/demo/vllm_model"


class Foreign(http.server.BaseHTTPRequestHandler):
    """Another run's server, as the trainer that took it for its own saw it: /health answers, any
    other route names a model we do not serve. Records what it was asked."""
    asked = []

    def do_GET(self):
        self.asked.append(self.path)
        if self.path == "/health":
            self.answer(200, b"")
        elif self.path == "/v1/models":
            self.answer(200, json.dumps({"data": [{"id": "their/vllm_model"}]}).encode())
        else:
            self.answer(404, b'{"message": "The model does not exist"}')

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.asked.append(self.path)
        self.answer(404, json.dumps({"message": f"The model `{MODEL}` does not exist."}).encode())

    def answer(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet; on a Unix socket there is no client address to print
        pass


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_foreign_server_on_the_port_is_refused_before_any_request():
    """A server that took the port after our check answers /health; before, launch_server then
    returned its URL and the run died on its first request (HTTP 404: the model does not exist)."""
    Foreign.asked = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    alive = types.SimpleNamespace(poll=lambda: None)
    try:
        with pytest.raises(vllm_client.VLLMError, match=r"serves \['their/vllm_model'\], not output/demo"):
            vllm_server.is_ours(f"http://127.0.0.1:{httpd.server_address[1]}", MODEL, alive)
        assert Foreign.asked == ["/v1/models"]
    finally:
        httpd.shutdown()


def test_the_client_speaks_http_over_a_unix_socket(tmp_path):
    """GET, POST, an error status (no retry on 4xx) and a missing socket, as over TCP."""
    Foreign.asked = []
    path = str(tmp_path / "api.sock")
    httpd = UnixServer(path, Foreign)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = vllm_client.VLLMClient([f"unix:{path}"], timeout=5, max_retries=2)
        assert client.model == "their/vllm_model"
        with pytest.raises(vllm_client.VLLMError, match=r"failed /v1/completions after 1 attempt\(s\): HTTP 404"):
            client.post(client.urls[0], "/v1/completions", {"prompt": [1]})
        assert Foreign.asked == ["/v1/models", "/v1/completions"]
    finally:
        httpd.shutdown()
        httpd.server_close()
    gone = vllm_client.VLLMClient([f"unix:{tmp_path}/none.sock"], "m", timeout=1, max_retries=0)
    with pytest.raises(vllm_client.VLLMError, match="none.sock failed /sleep after 1 attempt.*FileNotFoundError"):
        gone.sleep()


class Keyed(Foreign):
    """A server you run with VLLM_API_KEY=secret: vLLM then wants the key on its /v1 routes."""

    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer secret":
            return self.answer(401, b'{"error": "Unauthorized"}')
        super().do_GET()


def test_a_server_you_run_may_want_a_key():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Keyed)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        assert vllm_client.VLLMClient([url], api_key="secret").model == "their/vllm_model"
        with pytest.raises(vllm_client.VLLMError, match="/v1/models: Unauthorized .*export VLLM_API_KEY"):
            vllm_client.VLLMClient([url])
    finally:
        httpd.shutdown()


def test_a_second_run_into_a_busy_output_dir_is_refused_naming_the_first(tmp_path):
    with open(tmp_path / "run.lock", "w") as other:  # another run's lock (flock: per open file)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other.write("4242\n")
        other.flush()
        with pytest.raises(ValueError, match=r"output_dir=.* is in use by another run \(pid 4242\); give this run "
                                             "another --output_dir"):
            claim_output_dir(str(tmp_path))
    claim_output_dir(str(tmp_path))  # free once that run ends
    claim_output_dir(str(tmp_path))  # and ours to take again
    assert open(tmp_path / "run.lock").read() == f"{os.getpid()}\n"


# --- a real server, launched while a foreign one takes the port a fixed default would have given it


@pytest.fixture(scope="module")
def raced(tiny_model_dir, tmp_path_factory):
    """Our server launched as train.py launches it, while another process binds vllm_port half a
    second later: before vLLM did (it binds after its imports), as a run started seconds before ours."""
    Foreign.asked = []
    port = free_port()
    foreign = []

    def take_port():
        time.sleep(0.5)
        foreign.append(http.server.ThreadingHTTPServer(("127.0.0.1", port), Foreign))
        foreign[0].serve_forever()
    threading.Thread(target=take_port, daemon=True).start()
    cfg = Config(max_prompt_length=48, response_length=16, vllm_startup_timeout=400, vllm_request_timeout=60,
                 vllm_max_retries=1, vllm_port=port, vllm_enforce_eager=True)
    _, client = serve(tiny_model_dir, str(tmp_path_factory.mktemp("raced")), None, cfg)
    yield client
    vllm_server.stop_server(client.proc)
    foreign[0].shutdown()


@pytest.mark.slow
def test_a_run_never_samples_from_a_server_that_took_its_port(raced):
    out = generate(raced, [[7, 8, 9]], n=2, max_tokens=4, seed=1)
    assert len(out[0]) == 2 and Foreign.asked == []
    assert raced.urls[0].startswith("unix:") and os.stat(os.path.dirname(raced.urls[0][5:])).st_mode & 0o777 == 0o700


PROBE = """
import http.client, socket, sys
url = sys.argv[1]
for route in ("/collective_rpc", "/v1/load_lora_adapter"):
    conn = http.client.HTTPConnection("localhost", timeout=30)
    if url.startswith("unix:"):
        conn.sock = socket.socket(socket.AF_UNIX)
        try:
            conn.sock.connect(url[5:])
        except OSError as e:
            print(route, type(e).__name__)
            continue
    else:
        conn = http.client.HTTPConnection(url[len("http://"):], timeout=30)
    conn.request("POST", route, body="{}", headers={"Content-Type": "application/json"})
    print(route, conn.getresponse().status)
"""


def as_nobody(url):
    """PROBE run as uid/gid 65534, on a Python that user may execute."""
    for python in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        cmd = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--", python or "python3"]
        if subprocess.run(cmd + ["-c", "pass"], capture_output=True).returncode == 0:
            return subprocess.run(cmd + ["-c", PROBE, url], capture_output=True, text=True, timeout=120)
    pytest.skip("no Python that uid 65534 may run")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="switching users needs root and setpriv")
def test_another_user_cannot_reach_the_weight_or_lora_routes(raced):
    """Before: the server listened on 127.0.0.1 with no key, and any local user could reload its
    weights from any path (/collective_rpc) or load an adapter (/v1/load_lora_adapter). Root (this
    test's own user) still reaches them: the probe is sound; root is not kept out of anything."""
    out = as_nobody(raced.urls[0])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["/collective_rpc", "PermissionError", "/v1/load_lora_adapter", "PermissionError"]
    own = subprocess.run([sys.executable, "-c", PROBE, raced.urls[0]], capture_output=True, text=True, timeout=120)
    assert own.stdout.split()[:2] == ["/collective_rpc", "400"], own.stderr[-2000:]  # "Missing 'method'"


@pytest.mark.slow
def test_two_runs_started_seconds_apart_both_finish(tiny_model_dir, tmp_path):
    """Every setting at its default but the output_dir and the steps (the default model is this
    tiny one). Before: both servers wanted port 8011; the second run sampled from the first's
    server or found its port taken. A third run into the first's output_dir is refused in one line."""
    def start(name):
        args = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / name),
                "--num_training_steps", "2", *EAGER]
        return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], env=ENV, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = start("a")
    time.sleep(3)
    second = start("b")
    lock = tmp_path / "a" / "run.lock"
    deadline = time.monotonic() + 300
    while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.5)
    third = start("a")
    outs = [p.communicate(timeout=1500)[0] for p in (first, second, third)]
    assert first.returncode == 0, outs[0][-3000:]
    assert second.returncode == 0, outs[1][-3000:]
    assert third.returncode != 0 and f"is in use by another run (pid {first.pid})" in outs[2], outs[2][-3000:]
    for name in ("a", "b"):
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
