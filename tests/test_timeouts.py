"""weight_sync_timeout: the reload request and the NCCL transfer give up with an error
that names the field, against a local HTTP server that answers too late (no vLLM); and an
answer cut short, as from a server that dies mid-reply, is retried or is a VLLMError."""

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from config import Config
from infra.faults import VLLMError
from infra.vllm_client import VLLMClient
from infra.weight_sync import FilesystemSync, make_weight_sync
from nccl_sync import within


@pytest.fixture
def slow_server():
    """POST /collective_rpc answers after 60 s, every other route at once."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path.startswith("/collective_rpc"):
                time.sleep(60)
            try:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{}")
            except OSError:  # the client gave up first
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_reload_request_times_out_with_weight_sync_timeout(slow_server, tmp_path):
    client = VLLMClient([slow_server], model="m", timeout=120.0, max_retries=0)
    client.post(slow_server, "/reset_prefix_cache")  # the request timeout (120 s) is not what bounds the reload
    cfg = Config(weight_sync_timeout=0.5, output_dir=str(tmp_path), weight_sync_dir=str(tmp_path / "shared"))
    sync = make_weight_sync(cfg, client, 0, torch.device("cpu"))
    assert isinstance(sync, FilesystemSync) and sync.timeout == 0.5 and sync.dir.startswith(str(tmp_path / "shared"))
    t0 = time.monotonic()
    with pytest.raises(VLLMError, match=r"weight_sync_timeout=0.5s; raise it"):
        sync.sync(torch.nn.Linear(2, 2))  # without a process group: a world of one
    assert time.monotonic() - t0 < 30  # gave up after 0.5 s (plus a loaded machine), not after the server's 60 s
    assert os.path.exists(os.path.join(sync.dir, "model.safetensors.index.json"))  # written where the servers were told to look
    sync.close()


def test_within_gives_up_passes_errors_and_values():
    finished = threading.Event()
    with pytest.raises(TimeoutError, match=r"the NCCL weight transfer did not finish within weight_sync_timeout=0.2s"):
        within(0.2, lambda: (time.sleep(30), finished.set()), "the NCCL weight transfer")
    assert not finished.is_set()  # it gave up on the call, not waited for it (no wall-clock bound to flake)
    with pytest.raises(ZeroDivisionError):
        within(5, lambda: 1 / 0, "x")
    assert within(5, lambda: 42, "x") == 42


def test_an_answer_cut_short_is_retried_then_a_vllm_error():
    """The server promises 100 bytes, sends 9 and closes (a server killed mid-reply: what the
    restart of a launched server needs to see as a VLLMError, not an http.client error)."""
    answers = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            whole = len(answers) % 2 == 1  # every second answer arrives whole
            answers.append(whole)  # before the body: the client may return before this thread runs again
            body = b'{"ok": 1}'
            self.send_header("Content-Length", str(len(body) if whole else 100))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert VLLMClient([url], model="m", max_retries=1).post(url, "/v1/completions") == {"ok": 1}
        assert answers == [False, True]
        with pytest.raises(VLLMError, match=r"failed /v1/completions after 1 attempt\(s\): IncompleteRead"):
            VLLMClient([url], model="m", max_retries=0).post(url, "/v1/completions")
    finally:
        server.shutdown()
