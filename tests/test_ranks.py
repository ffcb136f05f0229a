"""Every rank together (infra/ranks.py), on 2 real gloo ranks under a real torchrun: the ranks that
wait for rank 0 wait on the CPU group, back in Python between polls; a failure on either rank, a
SIGTERM and a launcher that is gone end every rank within seconds. tests/ranks_worker.py is the job."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ENV, ROOT, free_port

pytestmark = pytest.mark.subprocess


def launch(case, tmp_path):
    """torchrun, 2 ranks, each rank's output in its own file (--redirects 3)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--redirects", "3", "--log_dir", str(tmp_path / "logs"), os.path.join(ROOT, "tests", "ranks_worker.py"),
           case, str(tmp_path)]
    return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def seen(tmp_path, rank):
    path = tmp_path / f"rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def rank_output(tmp_path, rank):
    """What rank `rank` wrote to stdout and stderr."""
    found = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "logs") for f in files
             if os.path.basename(d) == str(rank) and f in ("stdout.log", "stderr.log")]
    return "".join(open(p).read() for p in found)


def finished(proc, timeout):
    """The launcher's exit status and output; fails the test if it did not end within `timeout`."""
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end within {timeout} s:\n{proc.communicate()[0][-3000:]}")
    return proc.returncode, out


def alive(pids):
    return [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]


def test_ranks_wait_for_rank0_on_the_cpu_group_back_in_python(tmp_path):
    rc, out = finished(launch("wait", tmp_path), 120)
    assert rc == 0, out[-3000:]
    r0, r1 = seen(tmp_path, 0), seen(tmp_path, 1)
    assert r0["value"] == r1["value"] == {"answer": 42}
    assert r1["waited"] > 1.5  # it did wait for rank 0's call
    assert r1["collectives"] and all(on_cpu for _, on_cpu in r1["collectives"]), r1["collectives"]
    assert {name for name, _ in r1["collectives"]} == {"broadcast"}  # no object broadcast on the default group
    assert r1["tick"] is not None and r1["tick"] < 1.0, "a signal's handler waited for rank 0's call to end"


def test_rank0s_fault_is_raised_on_every_rank(tmp_path):
    rc, out = finished(launch("carried", tmp_path), 120)
    assert rc == 1
    assert seen(tmp_path, 0)["raised"] == seen(tmp_path, 1)["raised"] == "the server did not start"
    assert "error: the server did not start" in rank_output(tmp_path, 0)
    assert "error:" not in rank_output(tmp_path, 1) and "Traceback" not in rank_output(tmp_path, 1)


def test_anything_else_rank0_raises_ends_the_other_rank_quietly(tmp_path):
    rc, out = finished(launch("failed", tmp_path), 120)
    assert rc != 0
    assert "ZeroDivisionError" in rank_output(tmp_path, 0)
    assert rank_output(tmp_path, 1).strip() == "", rank_output(tmp_path, 1)


@pytest.mark.parametrize("case", ["abort", "stuck"])
def test_a_rank_that_fails_alone_ends_a_rank_inside_a_collective(tmp_path, case):
    """Rank 0 sits in a gloo all_reduce that rank 1 never joins. When rank 1 exits, gloo ends the collective
    with "connection closed by peer", which rank 0 knows for the echo of rank 1's failure; when rank 1
    lingers, nothing ends it in native code but rank 0's watch, STUCK seconds after it read rank 1's post."""
    start = time.monotonic()
    rc, out = finished(launch(case, tmp_path), 120)
    assert rc != 0
    assert "error" not in rank_output(tmp_path, 0).lower(), rank_output(tmp_path, 0)  # quiet: rank 1 says why
    if case == "abort":
        assert "rank 1 failed on its own" in rank_output(tmp_path, 1)
    assert time.monotonic() - start < 60, "rank 0 waited for the collective's timeout"


def test_a_wait_past_its_limit_is_one_line_and_ends_every_rank(tmp_path):
    """The waits have no deadline of backend_timeout's, only WAIT_LIMIT (24 h; 3 s here): rank 0 inside a
    20 s call, rank 1 past the limit says so in one line, and rank 0 ends with it, quietly, before its call is
    done."""
    rc, out = finished(launch("hang", tmp_path), 120)
    assert rc != 0
    lines = [x for x in rank_output(tmp_path, 1).splitlines() if x.strip()]
    assert lines == ["error: rank 1 waited 3 s for the other ranks, and one never came (a rank hung outside "
                     "any call with a timeout); see each rank's last lines"], lines
    assert rank_output(tmp_path, 0).strip() == "", rank_output(tmp_path, 0)


@pytest.mark.parametrize("how", ["sigterm", "launcher_killed"])
def test_a_stop_reaches_rank0s_call_and_every_rank(tmp_path, how):
    """Rank 0 is inside a 10-minute call (as in a generation), rank 1 waits for it. torchrun's SIGTERM, or
    the launcher killed outright (its ranks, in sessions of their own, are orphaned), stops both."""
    proc = launch("long", tmp_path)
    deadline = time.monotonic() + 120
    while not (seen(tmp_path, 0) and seen(tmp_path, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    time.sleep(1)  # both inside the wait
    proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    start = time.monotonic()
    while alive(workers) and time.monotonic() - start < 60:
        time.sleep(0.2)
    assert not alive(workers), f"ranks {alive(workers)} outlived the {how}"
    proc.communicate()
    assert time.monotonic() - start < 30
    assert seen(tmp_path, 0).get("stopped") and seen(tmp_path, 1).get("stopped"), "not both stopped at the call"
