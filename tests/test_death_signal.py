"""The server we launch dies with the trainer: vllm_server.death_signal_prefix (setpriv --pdeathsig) in
place of Popen's preexec_fn, which is unsafe in a process with threads. A parent with threads of its
own starts a child through the same prefix, in a session of its own as launch_server does, and is
SIGKILLed: the kernel sends the child SIGTERM."""

import os
import signal
import subprocess
import sys
import time

import pytest

from infra.vllm_server import death_signal_prefix

# The child: says it is ready once its handler is in, and writes the signal it gets (whole, by a rename).
CHILD = """import os, signal, sys, time
def got(signum, frame):
    with open(sys.argv[1] + ".part", "w") as f:
        f.write(signal.Signals(signum).name)
    os.replace(sys.argv[1] + ".part", sys.argv[1])  # whole: the test reads it as soon as it exists
    sys.exit(0)
signal.signal(signal.SIGTERM, got)
open(sys.argv[2], "w").close()
time.sleep(60)
"""

# The parent: a thread that keeps running (as rank 0's rollouts thread does), then the child started from
# the main thread with the prefix and start_new_session=True (launch_server's Popen), its pid printed.
PARENT = """import subprocess, sys, threading, time
from infra.vllm_server import death_signal_prefix
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen(death_signal_prefix() + [sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]],
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def wait_for(predicate, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def alive(pid):
    """Running: neither gone nor a zombie (pid 1 of a container may never reap an orphan)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.subprocess  # death_signal_prefix tries setpriv once
def test_a_child_started_through_the_prefix_gets_sigterm_when_its_parent_is_killed(tmp_path):
    prefix = death_signal_prefix()
    assert prefix in ([], ["setpriv", "--pdeathsig", "TERM", "--"])
    if not prefix:
        assert not os.path.exists("/usr/bin/setpriv"), "setpriv is installed but its --pdeathsig did not run"
        pytest.skip("no setpriv here (util-linux, essential in Debian and Ubuntu): the child outlives a SIGKILLed "
                    "parent, as death_signal_prefix says")
    got, ready = tmp_path / "signal", tmp_path / "ready"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(got), str(ready)], cwd=root,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=root))
    child = int(parent.stdout.readline())
    try:
        assert wait_for(ready.exists, 30), "the child did not start"
        assert os.getpgid(child) == child, "the child leads a session of its own, as launch_server's server"
        parent.kill()  # SIGKILL: no handler of the parent runs
        parent.wait()
        assert wait_for(got.exists, 10), "the child got no signal when its parent died"
        assert got.read_text() == "SIGTERM"
        assert wait_for(lambda: not alive(child), 10)
    finally:
        parent.kill()
        if alive(child):
            os.kill(child, signal.SIGKILL)
