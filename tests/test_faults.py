"""Runs that survive: SIGKILL and resume, a kill during a checkpoint write, SIGTERM, NaNs,
a vLLM server that dies, a rank that dies. Real runs of train.py on 1 and 2 gloo ranks
with a real vLLM CPU server."""

import os
import signal
import subprocess
import time

import pytest
import torch

from infra import vllm_server
from helpers import command, flags, full, metrics, run, serve, stable, start, wait_for_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """A server "the user runs": the trainer pushes its weights into it at start."""
    _, client = serve(tiny_model_dir, str(tmp_path_factory.mktemp("server")), 8051)
    yield client
    vllm_server.stop_server(client.proc)


def server_pid(served):
    """The API server started on the model dir `served`: its pid is its process group's id."""
    found = subprocess.run(["pgrep", "-f", f"model {served} --host"], capture_output=True, text=True).stdout.split()
    return int(found[0])


def group_alive(pgid):
    return subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True).returncode == 0


@pytest.mark.slow
def test_sigkill_then_resume_equals_the_uninterrupted_run(server, tiny_model_dir, tmp_path):
    url = server.urls[0]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    out = run(command("train.py", 2) + flags(tiny_model_dir, whole, 8, "--checkpoint_state_freq", "4", url=url))
    assert out.returncode == 0, out.stderr[-3000:]
    # every rank SIGKILLs itself in step 6, after its update and before the EMA, the sync, the checkpoint and
    # the log: step 5 is logged, checkpoint 4 complete, 8 not begun (a kill from outside once step 5 was
    # logged could land after step 8's checkpoint under load: a tiny step takes a second)
    out = run(command("tests/fault_worker.py", 2) + ["kill_after_update=6"] +
              flags(tiny_model_dir, cut, 8, "--checkpoint_state_freq", "4", url=url))
    assert "SIGKILL" in out.stderr and [r["step"] for r in metrics(cut)] == [1, 2, 3, 4, 5], out.stderr[-2000:]
    assert os.listdir(cut / "ckpt") == ["step_00000004"]
    out = run(command("train.py", 2) + flags(tiny_model_dir, cut, 8, "--checkpoint_state_freq", "4", url=url))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout and "step_00000004 (step 4)" in out.stdout, out.stdout[-2000:]
    a, b = metrics(whole), metrics(cut)
    assert [r["step"] for r in b] == list(range(1, 9))  # the killed run's step 5 was rewritten
    assert stable(a) == stable(b)  # every metric of every step, exactly (CPU, fixed threads)
    wa, wb = full(whole / "ckpt" / "step_00000008"), full(cut / "ckpt" / "step_00000008")
    for part in ("policy", "ref"):
        assert wa[part].keys() == wb[part].keys()
        assert all(torch.equal(wa[part][k], wb[part][k]) for k in wa[part]), part  # bit-identical
    assert not all(torch.equal(wa["ref"][k], wa["policy"][k]) for k in wa["ref"])  # the reference is its own


@pytest.mark.slow
def test_kill_while_writing_a_checkpoint_resumes_from_the_previous_one(server, tiny_model_dir, tmp_path):
    url = server.urls[0]
    args = flags(tiny_model_dir, tmp_path, 6, "--checkpoint_state_freq", "2", url=url)
    out = run(command("tests/fault_worker.py", 2, 29642) + ["kill_in_checkpoint=4"] + args)
    assert out.returncode != 0
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000002", "step_00000004.partial"]
    out = run(command("train.py", 2, 29642) + args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step_00000002 (step 2)" in out.stdout, out.stdout[-2000:]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000002", "step_00000004", "step_00000006"]
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, 7))


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_then_exits(server, tiny_model_dir, tmp_path):
    args = flags(tiny_model_dir, tmp_path, 1000, "--checkpoint_state_freq", "500", url=server.urls[0])
    proc = start(command("train.py", 2, 29643) + args)
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0
    last = metrics(tmp_path)[-1]["step"]
    assert os.listdir(tmp_path / "ckpt") == [f"step_{last:08d}"], text[-2000:]
    assert f"SIGTERM: stopped after step {last}" in text


@pytest.mark.slow
def test_non_finite_loss_skips_the_step_then_stops_the_run(server, tiny_model_dir, tmp_path):
    args = flags(tiny_model_dir, tmp_path, 10, "--checkpoint_state_freq", "100", url=server.urls[0])
    out = run(command("tests/fault_worker.py", 1) + ["nan_loss=2,4,5,6"] + args)
    assert out.returncode != 0
    assert "3 steps in a row had a non-finite loss or gradient norm" in out.stderr, out.stderr[-2000:]
    rows = {r["step"]: r for r in metrics(tmp_path)}
    assert [rows[s]["skipped_updates"] for s in (1, 2, 3, 4, 5)] == [0, 1, 0, 1, 1]
    assert 6 not in rows  # the run stopped at step 6 ...
    assert rows[3]["vllm_logp_diff_max"] < 1e-4  # ... and step 2's NaN never reached the weights
    assert not any(v != v for v in rows[3].values() if isinstance(v, float))


@pytest.mark.slow
def test_a_sync_that_did_not_take_stops_the_run_before_the_step_trains(server, tiny_model_dir, tmp_path):
    """The server answers the reload after step 3 but keeps step 2's weights. Step 4's check finds
    it before step 4's update: the run stops, and its checkpoint is step 3's, equal to that of a
    run whose syncs all took (the bad step trained nothing)."""
    url, good, lost = server.urls[0], tmp_path / "good", tmp_path / "lost"
    out = run(command("train.py", 1) + flags(tiny_model_dir, good, 6, "--checkpoint_state_freq", "3", url=url))
    assert out.returncode == 0, out.stderr[-3000:]
    out = run(command("tests/fault_worker.py", 1) + ["lost_sync=3"] +
              flags(tiny_model_dir, lost, 6, "--checkpoint_state_freq", "100", url=url))
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if "SyncError: " in line]
    assert len(errors) == 1 and "before this step's update: the last weight sync did not take" in errors[0], \
        out.stderr[-3000:]
    assert stable(metrics(lost)) == stable(metrics(good)[:3])  # step 4 is not logged: it did not train
    assert os.listdir(lost / "ckpt") == ["step_00000003"]
    a, b = full(good / "ckpt" / "step_00000003"), full(lost / "ckpt" / "step_00000003")
    for part in ("policy", "ref", "optimizer"):
        flat_a, flat_b = flatten(a[part]), flatten(b[part])
        assert flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), part
    sa, sb = (torch.load(run_dir / "ckpt" / "step_00000003" / "trainer_state.pt", weights_only=False)
              for run_dir in (good, lost))
    assert (sa["scheduler"], sa["sampler_position"]) == (sb["scheduler"], sb["sampler_position"])


def flatten(tree, prefix=""):
    """The tensors of a nested state dict, by dotted path."""
    if torch.is_tensor(tree):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    return {k: v for key, sub in items for k, v in flatten(sub, f"{prefix}.{key}").items()}


@pytest.mark.slow
def test_a_server_we_launched_is_restarted_when_it_dies(tiny_model_dir, tmp_path):
    args = flags(tiny_model_dir, tmp_path, 6, "--checkpoint_state_freq", "100")
    proc = start(command("train.py", 1) + args)
    wait_for_step(proc, tmp_path, 2)
    served = str(tmp_path / "out" / "vllm_model")
    first = server_pid(served)
    os.kill(first, signal.SIGKILL)  # the API server; its engine lives on, orphaned, until we stop its group
    text = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, text[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["vllm_restarts"] == 1 and rows[0]["vllm_restarts"] == 0
    assert all(r["vllm_logp_diff_max"] < 1e-4 for r in rows)  # the restarted server has the current weights
    assert "the vLLM server died; restart 1 of 3" in text
    assert not group_alive(first), "the dead server's engine was left running"


@pytest.mark.slow
def test_a_rank_that_dies_takes_the_job_and_our_server_down(tiny_model_dir, tmp_path):
    args = flags(tiny_model_dir, tmp_path, 1000, "--checkpoint_state_freq", "500")
    proc = start(command("train.py", 2, 29644) + args)
    wait_for_step(proc, tmp_path, 2)
    group = server_pid(str(tmp_path / "out" / "vllm_model"))
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    rank1 = [p for p in workers if "LOCAL_RANK=1" in open(f"/proc/{p}/environ").read().split("\0")]
    os.kill(int(rank1[0]), signal.SIGKILL)
    t = time.monotonic()
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert time.monotonic() - t < 120, "the surviving rank hung in a collective"
    deadline = time.monotonic() + 60
    while group_alive(group) and time.monotonic() < deadline:
        time.sleep(1)
    assert not group_alive(group), "the server or its engine outlived the job"


@pytest.mark.slow
def test_a_server_the_user_runs_is_reported_when_it_dies(server, tiny_model_dir, tmp_path):
    """Last in this file: it kills the module's server."""
    url = server.urls[0]
    proc = start(command("train.py", 1) + flags(tiny_model_dir, tmp_path, 1000, "--checkpoint_state_freq", "500",
                                                "--vllm_max_retries", "1", url=url))
    wait_for_step(proc, tmp_path, 2)
    vllm_server.stop_server(server.proc)
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0
    assert f"vLLM server {url} failed" in text, text[-2000:]
    last = metrics(tmp_path)[-1]["step"]
    # What was trained is kept, and logged: the failure may hit a step's generation (the previous
    # step is the last trained) or its weight sync, after its training.
    assert os.listdir(tmp_path / "ckpt") == [f"step_{last:08d}"]
