"""A finished 2-rank run exits 0 on every rank: the process group is torn down before the
interpreter exits (parallel.close_distributed). A server that does not come up ends the run in one line."""

import os
import re
import subprocess
import sys

import pytest
from helpers import train

pytestmark = pytest.mark.subprocess  # every test here starts processes (ranks, workers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_gloo_thread_busy_at_exit_does_not_abort_the_rank(tiny_model_dir):
    """tests/exit_worker.py makes the race at exit certain: FSDP2 trains a step, then rank 1's
    last collective completes a second after its main thread moved on, with a Python
    callback for the gloo worker thread to run, and the interpreter then takes 3 s to
    finalize. Ended with destroy_process_group() alone, that rank aborts ("terminate called
    without an active exception"); close_distributed() must leave it exiting 0, with every
    gloo thread joined before the interpreter exits."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        "29671", os.path.join(ROOT, "tests", "exit_worker.py"), tiny_model_dir, "close"],
                       env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "terminate called" not in out
    left = re.findall(r"rank (\d) threads after close: \[(.*?)\]", out)  # lazy: the two ranks may print on one line
    assert sorted(r for r, _ in left) == ["0", "1"], out[-4000:]
    for _, names in left:
        assert "gloo" not in names, names  # pt_gloo_runloop, gloo_tcp_loop: joined by close_distributed


def test_a_server_that_does_not_answer_in_time_ends_the_run_in_one_line(tiny_model_dir, tmp_path):
    """On a loaded machine the server may not come up within vllm_startup_timeout: one line names the limit,
    the log and the fix, and it is the last line. Before: a traceback of some 40 lines, ending in the log's tail;
    then a torch FutureWarning printed as the process group closed."""
    out_dir = tmp_path / "out"
    out = train(["--model_name_or_path", tiny_model_dir, "--output_dir", str(out_dir), "--eval_freq", "0",
                 "--vllm_startup_timeout", "1"], timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: the vLLM server did not answer within vllm_startup_timeout=1s; see its log "
                     f"{out_dir / 'vllm.log'} (raise --vllm_startup_timeout on a loaded machine)"], out.stderr[-3000:]
    assert out.stderr.splitlines()[-1] == lines[0], out.stderr[-3000:]
