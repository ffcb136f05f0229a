"""A stop inside a batch (infra/ranks.py's Stop, raised by SIGTERM's handler while rank 0 waits on a request)
waits for no other request: torchrun kills a rank 30 s after its SIGTERM, and a batch's generation takes
minutes. A failed request (an Exception) still lets the others end first, none left behind for a restarted
server. Threads and futures only: episodes.wait_all / settle, the environment's player, VLLMClient.map."""

import signal
import threading
from concurrent.futures import Future

import pytest

from episodes import wait_all
from infra.ranks import Stop
from infra.vllm_client import VLLMClient


def in_thread(fn):
    """fn() in a thread; what it raised, once it returned (None if it is still running after 20 s)."""
    raised = []

    def body():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            raised.append(e)
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(20)
    return None if t.is_alive() else raised


def test_a_stop_waits_for_no_other_request_and_cancels_those_not_sent():
    stopped, running, queued = Future(), Future(), Future()
    running.set_running_or_notify_cancel()  # sent: in a client thread, never answering
    stopped.set_exception(Stop())
    raised = in_thread(lambda: wait_all([stopped, running, queued], stopped))
    assert raised is not None, "wait_all waited for a request after a stop"
    assert isinstance(raised[0], Stop) and queued.cancelled() and not running.done()


def test_a_failed_request_lets_every_other_end_first():
    failed, slow = Future(), Future()
    slow.set_running_or_notify_cancel()
    failed.set_exception(ConnectionResetError("the server died"))
    seen = []
    threading.Timer(0.3, lambda: (seen.append("slow answered"), slow.set_result([]))).start()
    with pytest.raises(ConnectionResetError):
        wait_all([failed, slow], failed)
    assert seen == ["slow answered"] and slow.done()


def test_the_teachers_requests_end_as_a_batchs_do():
    """VLLMClient.map (the teacher's scores): a stop raised while the caller waits (SIGTERM's handler, here a
    timer's) returns while a request is still in flight; a failed request returns once the others ended."""
    release, answered = threading.Event(), []

    def post(url, route, payload):
        if payload == "fails":
            raise ConnectionResetError("the server died")
        release.wait(10)
        answered.append(payload)
        return payload

    client = VLLMClient.__new__(VLLMClient)
    client.urls = ["http://x"]

    def stop(*_):
        raise Stop()
    old = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Stop):
            client.map("/r", ["slow", "slow too"], post)
        assert answered == []  # both still in flight
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        release.set()
    release.clear()
    threading.Timer(0.3, release.set).start()
    with pytest.raises(ConnectionResetError):
        client.map("/r", ["slow", "fails"], post)
    assert answered[-1:] == ["slow"]
