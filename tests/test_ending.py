"""A job that cannot go on ends on every rank within seconds, in one line: train.py on 2 gloo ranks under
a real torchrun, with a real vLLM CPU server that does not start, a restart that fails, and a teacher
whose server dies mid-run (infra/ranks.py carries rank 0's failure to the rank that waits for it)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import EAGER, ENV, ROOT, free_port, metrics

pytestmark = pytest.mark.slow


def launch(tmp_path, *args):
    """train.py on 2 ranks; each rank's output in its own file (--redirects 3) for ranks_said."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--redirects", "3", "--log_dir", str(tmp_path / "logs"), os.path.join(ROOT, "train.py"),
           "--output_dir", str(tmp_path / "out"), "--eval_freq", "0", *EAGER, *args]
    return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def ranks_said(tmp_path, rank):
    found = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "logs") for f in files
             if os.path.basename(d) == str(rank) and f in ("stdout.log", "stderr.log")]
    return "".join(open(p).read() for p in found)


def ended(proc, timeout):
    """(exit status, seconds) of the job; the test fails if it did not end within `timeout`."""
    start = time.monotonic()
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end within {timeout} s")
    return proc.returncode, time.monotonic() - start


def one_line(tmp_path, says):
    """Rank 0 said one `error:` line (containing `says`) and no traceback; rank 1 said nothing of it."""
    r0, r1 = ranks_said(tmp_path, 0), ranks_said(tmp_path, 1)
    errors = [line for line in r0.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], r0[-3000:]
    assert "Traceback" not in r0 and "Traceback" not in r1, (r0 + r1)[-3000:]
    assert "error" not in r1.lower(), r1[-2000:]


def alive(pid):
    """Whether process `pid` still runs (a zombie has ended: nobody may have reaped it yet)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for_step(proc, tmp_path, step, timeout=600):
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in metrics(tmp_path)):
        assert proc.poll() is None and time.monotonic() < deadline, ranks_said(tmp_path, 0)[-3000:]
        time.sleep(0.2)


def test_a_server_that_does_not_start_ends_every_rank_in_one_line(tiny_model_dir, tmp_path):
    """The first failure a GPU node is likeliest to meet: rank 1 waited in a broadcast until backend_timeout
    (30 min) while rank 0 had printed its error."""
    rc, _ = ended(launch(tmp_path, "--model_name_or_path", tiny_model_dir, "--vllm_startup_timeout", "3"), 240)
    assert rc != 0
    one_line(tmp_path, "did not answer within vllm_startup_timeout=3s")


def test_a_restart_that_fails_ends_every_rank_in_one_line(tiny_model_dir, tmp_path):
    """Our server dies mid-run and its serving copy is gone: the restart cannot start a server. Rank 1 waits
    in the weight sync's gathers meanwhile; it must end with rank 0, and the last trained step is kept."""
    proc = launch(tmp_path, "--model_name_or_path", tiny_model_dir, "--num_training_steps", "1000",
                  "--checkpoint_state_dir", str(tmp_path / "ckpt"), "--checkpoint_state_freq", "500")
    wait_for_step(proc, tmp_path, 2)
    served = str(tmp_path / "out" / "vllm_model")
    pid = int(subprocess.run(["pgrep", "-f", f"model {served} --host"], capture_output=True, text=True).stdout.split()[0])
    subprocess.run(["rm", "-rf", served], check=True)
    os.killpg(pid, signal.SIGKILL)  # the server and its engine
    rc, _ = ended(proc, 240)
    assert rc != 0
    one_line(tmp_path, "exited with code")
    assert "restart 1 of 3" in ranks_said(tmp_path, 0)
    last = max(r["step"] for r in metrics(tmp_path))
    assert os.listdir(tmp_path / "ckpt") == [f"step_{last:08d}"]


def test_a_teachers_server_that_dies_ends_every_rank_in_one_line(tiny_model_dir, tmp_path):
    """Rank 0 asks the teacher for its scores of each batch while rank 1 waits; the teacher's server
    killed mid-run ends both, in one line."""
    proc = launch(tmp_path, "--model_name_or_path", tiny_model_dir, "--num_training_steps", "1000",
                  "--teacher_model_name_or_path", tiny_model_dir, "--beta", "1.0", "--kl_estimator", "advantage",
                  "--reward_advantage", "false", "--vllm_max_retries", "1")
    wait_for_step(proc, tmp_path, 1)
    pid = int(subprocess.run(["pgrep", "-f", f"model {tiny_model_dir} --host"], capture_output=True,
                             text=True).stdout.split()[0])
    os.killpg(pid, signal.SIGKILL)
    rc, _ = ended(proc, 240)
    assert rc != 0
    one_line(tmp_path, "the teacher's server")


def test_a_launcher_killed_outright_stops_its_ranks_and_our_server(tiny_model_dir, tmp_path):
    """torchrun SIGKILLed (its ranks, each in a session of its own, were left running and holding their
    devices): each rank's watch sees its launcher gone and stops as on a SIGTERM, the last trained step
    checkpointed, and the server we launched goes with rank 0."""
    proc = launch(tmp_path, "--model_name_or_path", tiny_model_dir, "--num_training_steps", "1000",
                  "--checkpoint_state_dir", str(tmp_path / "ckpt"), "--checkpoint_state_freq", "500")
    wait_for_step(proc, tmp_path, 2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    served = str(tmp_path / "out" / "vllm_model")
    server = subprocess.run(["pgrep", "-f", f"model {served} --host"], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2 and server
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 90
    running = lambda pids: [p for p in pids if alive(p)]  # noqa: E731
    while (running(workers) or running(server)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not running(workers), "a rank outlived its launcher"
    assert not running(server), "our server outlived the job"
    last = max(r["step"] for r in metrics(tmp_path))
    assert os.listdir(tmp_path / "ckpt") == [f"step_{last:08d}"]
    assert f"SIGTERM: stopped after step {last}" in ranks_said(tmp_path, 0)
