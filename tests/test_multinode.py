"""scripts/launch_multinode.sh on one CPU machine as two nodes: two torchrun agents joined by the c10d
rendezvous (no --node_rank), one gloo rank each, against a vLLM server the user runs (scripts/serve.py
--serve on a port), the weights synced through a directory the server reads. What a cluster adds (NCCL
across nodes, a shared filesystem, InfiniBand) is not here: docs/running.md, "Several nodes"."""

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers import EAGER, ENV, ROOT, free_port, metrics

pytestmark = pytest.mark.slow  # a vLLM server and two agents

# the rollout's flags, the trainer's and the server's alike (the server's context is max_prompt_length +
# response_length); they win over the script's GPU-sized ones
RUN = ["--num_unique_prompts_rollout", "16", "--num_samples_per_prompt_rollout", "8", "--max_tokens_per_micro_batch",
       "4096", "--response_length", "8", "--max_prompt_length", "64", "--eval_freq", "0", "--seed", "5", *EAGER]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """The server a user runs on the untied serving copy (scripts/make_serving_copy.py), as
    scripts/launch_8gpu.sh starts it: scripts/serve.py becomes the server, so its pid is the server's."""
    tmp = tmp_path_factory.mktemp("server")
    serving, port = str(tmp / "serving"), free_port()
    copy = subprocess.run([sys.executable, "scripts/make_serving_copy.py", "--model", tiny_model_dir, "--out", serving],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert copy.returncode == 0, copy.stderr[-2000:]
    with open(tmp / "vllm.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "scripts/serve.py", "--serve", serving, *RUN, "--vllm_port", str(port)],
                                env=ENV, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while not healthy(url):
            assert proc.poll() is None, open(tmp / "vllm.log").read()[-3000:]
            assert time.monotonic() < deadline, "the server did not answer /health in 400 s"
            time.sleep(2)
        yield url, tmp / "vllm.log"
    finally:
        stop_group(proc.pid)
        proc.wait(timeout=60)


def healthy(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def stop_group(pgid):
    """SIGTERM a process group we started, then SIGKILL what is left of it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        time.sleep(3)


def reloads(log):
    """Weight reloads the server has logged (vLLM's inplace reload, one a sync)."""
    return open(log).read().count("Reloading and processing weights took")


def node(url, model, run_dir, port, *extra):
    """One node's agent: the script exec's torchrun, so the pid is the agent's; a session of its own."""
    env = dict(ENV, NNODES="2", GPUS_PER_NODE="1", NODE_ADDR="127.0.0.1", MASTER=f"127.0.0.1:{port}",
               RDZV_ID=f"test{port}", VLLM_URLS=url, MODEL=model, OUT=str(run_dir / "out"), PYTHON=sys.executable)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    args = [*RUN, "--weight_sync_dir", str(run_dir / "sync"), *extra]
    return subprocess.Popen(["bash", "scripts/launch_multinode.sh", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def stop(agents, ranks=()):
    """Stop the agents we started, and the ranks (pids) they started: a rank runs in a session of its own,
    so an orphan outlives its agent's group."""
    for a in agents:
        if a.poll() is None:
            stop_group(a.pid)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def ranks_of(agent):
    """{RANK: pid} of the ranks an agent started (its children with a RANK in their environment)."""
    found = {}
    for pid in subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split():
        try:
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(pid)
    return found


def test_two_nodes_train_two_steps_with_the_sync_check_holding(server, tiny_model_dir, tmp_path):
    """Both agents exit 0; rank 0 logs 2 steps of a world of 2; each step's sync check (trainer against
    vLLM logprobs on the tokens the synced weights sampled: step 2 checks the sync after step 1) holds
    to float32 rounding, far under vllm_logp_tolerance; the weights reached the server through
    weight_sync_dir: one reload at the start and one after each step, the directory left empty."""
    (url, log), port = server, free_port()
    before = reloads(log)
    agents = [node(url, tiny_model_dir, tmp_path, port, "--num_training_steps", "2")]
    time.sleep(2)  # the first agent hosts the rendezvous store; the second joins it
    agents.append(node(url, tiny_model_dir, tmp_path, port, "--num_training_steps", "2"))
    try:
        outs = [a.communicate(timeout=600)[0] for a in agents]
    finally:
        stop(agents, [pid for a in agents for pid in ranks_of(a).values()])
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-4000:]
    assert sum("world size 2" in out for out in outs) == 1, outs[0][-2000:]  # rank 0's run line, on one node
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(r.get("trained_tokens", 0) > 0 for r in rows), rows
    for r in rows:
        assert r["vllm_logp_diff_mean"] < 1e-5 and r["vllm_logp_diff_max"] < 1e-4, r
    assert reloads(log) - before == 3 and os.listdir(tmp_path / "sync") == []


def test_a_node_that_dies_ends_the_other_within_a_minute(server, tiny_model_dir, tmp_path):
    """SIGKILL the agent of the node that holds rank 1, in the middle of the run: the other node ends within
    a minute, with a non-zero exit and one `error:` line, or a clean stop (the orphaned rank sees its launcher
    gone and stops as on a SIGTERM; the other rank stops after the same step, infra/ranks.py). backend_timeout=1
    (minute) and the test's own limits keep a hang from holding the suite. Before a rank watched its launcher:
    both ranks alive a minute after the kill, the run gone on from step 2 to 153."""
    (url, _), port = server, free_port()
    long_run = ("--num_training_steps", "2000", "--backend_timeout", "1", "--weight_sync_timeout", "30")
    agents = [node(url, tiny_model_dir, tmp_path, port, *long_run)]
    time.sleep(2)
    agents.append(node(url, tiny_model_dir, tmp_path, port, *long_run))
    ranks = {}
    try:
        deadline = time.monotonic() + 600
        while not any(r["step"] >= 2 for r in metrics(tmp_path)):
            assert all(a.poll() is None for a in agents), agents[0].stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.5)
        ranks = {rank: (a, pid) for a in agents for rank, pid in ranks_of(a).items()}
        assert sorted(ranks) == [0, 1], ranks
        dying, survivor = ranks[1][0], ranks[0][0]
        os.kill(dying.pid, signal.SIGKILL)
        killed_at, step_then = time.monotonic(), metrics(tmp_path)[-1]["step"]
        try:
            out = survivor.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            alive = [rank for rank, (_, pid) in ranks.items() if os.path.exists(f"/proc/{pid}")]
            pytest.fail(f"the surviving node was still running {time.monotonic() - killed_at:.0f} s after the other's "
                        f"agent died: ranks alive {alive}, steps logged {step_then} -> {metrics(tmp_path)[-1]['step']}")
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert metrics(tmp_path)[-1]["step"] < 2000, "the run went on to its end"
        stopped = "SIGTERM: stopped after step" in out  # (tqdm's bar may share its line)
        assert survivor.returncode == 0 or stopped or len(errors) == 1, out[-4000:]
    finally:
        stop(agents, [pid for _, pid in ranks.values()])
