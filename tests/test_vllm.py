"""Rollouts against a real vLLM CPU server: generation, weight sync, failures."""

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from infra import vllm_client
from infra import vllm_server
from infra import weight_sync
from config import Config
from helpers import VLLM_CFG, generate, logprob_diff, prompt_logprobs, serve, trainer_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def untied(tiny_model_dir, tmp_path_factory):
    model, client = serve(tiny_model_dir, str(tmp_path_factory.mktemp("untied")), 8021)
    yield model, client
    vllm_server.stop_server(client.proc)


@pytest.fixture(scope="module")
def tied(tied_model_dir, tmp_path_factory):
    model, client = serve(tied_model_dir, str(tmp_path_factory.mktemp("tied")), 8022)
    yield model, client
    vllm_server.stop_server(client.proc)


SEQS = [[7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 5, 6], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


@pytest.mark.slow
def test_generate_shape_ids_and_seed(untied):
    _, client = untied
    prompts = [[7, 8, 9], [20, 21], [30, 31, 32, 33]]
    out = generate(client, prompts, n=4, max_tokens=12, temperature=1.0, seed=5)
    assert len(out) == 3 and all(len(group) == 4 for group in out)
    for group in out:
        for s in group:
            assert 1 <= len(s["token_ids"]) <= 12 and all(0 <= t < 64 for t in s["token_ids"])
            assert len(s["logprobs"]) == len(s["token_ids"]) and all(lp <= 0 for lp in s["logprobs"])
            assert s["finish_reason"] in ("stop", "length")
            assert (s["finish_reason"] == "stop") == (s["token_ids"][-1] == 2)  # eos
        assert len({tuple(s["token_ids"]) for s in group}) > 1  # n samples differ
    assert generate(client, prompts, n=4, max_tokens=12, seed=5) == out
    assert generate(client, prompts, n=4, max_tokens=12, seed=6) != out


@pytest.mark.slow
def test_samples_of_neighbouring_prompts_do_not_share_streams(untied):
    """The server seeds sample j of a request with seed s as s + j (a request with n=1 and
    seed s + j draws it again). Two requests for the same prompt in one call must then not
    repeat each other's samples, as they did with seeds s and s + 1."""
    _, client = untied
    prompt = [7, 8, 9]
    group = generate(client, [prompt], n=4, max_tokens=12, seed=40)[0]
    for j in (1, 3):
        assert generate(client, [prompt], n=1, max_tokens=12, seed=40 + j)[0][0]["token_ids"] == group[j]["token_ids"]
    first, second = generate(client, [prompt, prompt], n=4, max_tokens=12, seed=40)
    assert [s["token_ids"] for s in first] == [s["token_ids"] for s in group]
    assert [s["token_ids"] for s in second[:3]] != [s["token_ids"] for s in first[1:]]


@pytest.mark.slow
def test_a_turn_that_extends_an_episode_reuses_its_whole_cached_blocks(untied):
    """A later turn of an episode sends the episode so far: the prefix cache serves its whole
    32-token blocks (vllm_server.server_command), where the CPU default of 128 served none of
    these 56 tokens and prefilled the whole episode again."""
    _, client = untied
    episode = [5 + i % 50 for i in range(40)]
    usage = []
    for prompt in (episode, episode + [9] * 16):
        payload = dict(model=client.model, prompt=prompt, max_tokens=1, temperature=0.0)
        usage.append(client.post(client.urls[0], "/v1/completions", payload)["usage"])
    assert [u["prompt_tokens"] for u in usage] == [40, 56]
    assert (usage[1].get("prompt_tokens_details") or {}).get("cached_tokens") == 32


@pytest.mark.slow
def test_sampling_logprobs_match_trainer(untied):
    model, client = untied
    s = generate(client, [[7, 8, 9]], n=2, max_tokens=10, temperature=0.7, seed=1)[0][0]
    seq = [7, 8, 9] + s["token_ids"]
    trainer = trainer_logprobs(model, [seq], temperature=0.7)[0][2:]
    assert max(abs(a - b) for a, b in zip(trainer, s["logprobs"])) < 1e-4  # vLLM reports tempered logprobs


def perturb_sync_check(model, client, tmp, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
    before = logprob_diff(trainer_logprobs(model, SEQS), prompt_logprobs(client, SEQS))
    sync = weight_sync.FilesystemSync(client, 0, tmp)
    sync.sync(model)
    sync.close()
    after = logprob_diff(trainer_logprobs(model, SEQS), prompt_logprobs(client, SEQS))
    return before, after


@pytest.mark.slow
@pytest.mark.parametrize("which", ["untied", "tied"])
def test_sync_of_perturbed_weights_matches_transformers(which, request, tmp_path):
    model, client = request.getfixturevalue(which)
    for seed in (0, 1):  # twice: the second sync must replace the first
        before, after = perturb_sync_check(model, client, str(tmp_path), seed)
        assert before[1] > 1e-3, "the perturbation did not change the logprobs; the test would prove nothing"
        assert after[1] < 1e-4, f"{which}: server disagrees with transformers after sync: {after}"
    if which == "tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_each_completion_carries_the_version_of_the_weights_that_sampled_it(untied, tmp_path):
    """Generation running while the weights change (async_steps): requests in flight finish on
    the old weights, requests made during the update wait for the new ones, and each label
    is exact: its sampling logprobs are those of the model of its version."""
    model, client = untied
    prompts = [[7 + i, 8, 9] for i in range(8)]
    old = {k: v.clone() for k, v in model.state_dict().items()}
    new_model = AutoModelForCausalLM.from_pretrained(client.model, dtype=torch.float32)
    new_model.load_state_dict(old)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(3)) * p.abs().mean())
    v0, out = client.version, {}
    before = threading.Thread(target=lambda: out.update(before=generate(client, prompts, n=4, max_tokens=16, seed=1)))
    before.start()
    while not client._in_flight:
        time.sleep(0.001)

    def update():
        sync = weight_sync.FilesystemSync(client, 0, str(tmp_path))  # takes the gate itself
        sync.sync(new_model)
        sync.close()

    updater = threading.Thread(target=update)
    updater.start()
    while not client._updating:
        time.sleep(0.001)
    out["during"] = generate(client, prompts, n=4, max_tokens=16, seed=2)  # waits for the update
    before.join()
    updater.join()
    assert client.version == v0 + 1
    assert {s["version"] for g in out["during"] for s in g} == {v0 + 1}
    assert v0 in {s["version"] for g in out["before"] for s in g}
    models = {v0: model, v0 + 1: new_model}
    samples = [(p, s) for name in ("before", "during") for p, g in zip(prompts, out[name]) for s in g]
    for p, s in samples:  # each label is the truth: the logprobs are those of that version's model
        lp = trainer_logprobs(models[s["version"]], [p + s["token_ids"]])[0][len(p) - 1:]
        other = trainer_logprobs(models[2 * v0 + 1 - s["version"]], [p + s["token_ids"]])[0][len(p) - 1:]
        assert max(abs(a - b) for a, b in zip(lp, s["logprobs"])) < 1e-4
        assert max(abs(a - b) for a, b in zip(other, s["logprobs"])) > 1e-3  # the versions are told apart
    model.load_state_dict(new_model.state_dict())  # the module's model and server agree again


@pytest.mark.slow
def test_fsdp2_sharded_sync_on_two_ranks(untied, tiny_model_dir, tmp_path):
    """Two gloo ranks shard the model with FSDP2, perturb it identically, and sync;
    rank 0 then finds the server equal to the full model."""
    _, client = untied
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29601",
           os.path.join(ROOT, "tests", "dist_sync_worker.py"), tiny_model_dir, client.urls[0], client.model,
           str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SYNC OK" in out.stdout, out.stdout[-2000:]


def test_weight_files_go_to_a_private_directory(tmp_path):
    """Nobody else on the machine may replace the weights between the write and the reload."""
    sync = weight_sync.FilesystemSync(None, 0, str(tmp_path), base=str(tmp_path / "shared"))
    assert os.path.dirname(sync.dir) == str(tmp_path / "shared") and os.stat(sync.dir).st_mode & 0o777 == 0o700
    sync.close()
    assert not os.path.exists(sync.dir)


@pytest.mark.subprocess
def test_the_directories_of_a_killed_trainer_go_with_the_next_run(tmp_path, monkeypatch):
    """A trainer killed by SIGKILL cannot remove its server's socket directory (in TMPDIR) nor the weight
    sync's copy of the model (in /dev/shm); the next run's own removes them, and not those of a live
    owner. Before: each killed run left a copy of its model in /dev/shm."""
    import shutil
    import tempfile

    code = ("import time\nfrom infra import vllm_server, weight_sync\n"
            f"print(vllm_server.private_socket(), weight_sync.FilesystemSync(None, 0, {str(tmp_path / 'a')!r}).dir)\n"
            "print(flush=True)\ntime.sleep(600)\n")
    tmp = tempfile.mkdtemp(dir="/tmp")  # not tmp_path: vLLM's socket paths in the directory must fit in 107 bytes
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, TMPDIR=tmp), cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    uds, weights = proc.stdout.readline().split()
    # checked before the kill: another test's run may clean /dev/shm the moment the owner is dead
    assert os.path.isdir(os.path.dirname(uds)) and os.path.isdir(weights)
    proc.kill()
    proc.wait()
    monkeypatch.setattr(tempfile, "tempdir", tmp)  # the next run's temporary directory: the same
    syncs, sockets = [], []
    try:
        sockets.append(vllm_server.private_socket())
        syncs.append(weight_sync.FilesystemSync(None, 0, str(tmp_path / "b")))
        assert not os.path.exists(os.path.dirname(uds)) and not os.path.exists(weights)
        sockets.append(vllm_server.private_socket())
        syncs.append(weight_sync.FilesystemSync(None, 0, str(tmp_path / "c")))
        assert os.path.isdir(os.path.dirname(sockets[0])) and os.path.isdir(syncs[0].dir)  # their owner lives
    finally:
        shutil.rmtree(weights, ignore_errors=True)  # in /dev/shm: not left there when the test fails
        for sync in syncs:
            sync.close()
        shutil.rmtree(tmp)


def test_unreachable_server_fails_with_name_and_reason():
    client = vllm_client.VLLMClient(["http://127.0.0.1:9"], "m", timeout=2, max_retries=2)
    t = time.monotonic()
    with pytest.raises(vllm_client.VLLMError, match=r"http://127.0.0.1:9 failed /v1/completions after 3 attempt\(s\)"):
        generate(client, [[1, 2]], n=2, max_tokens=4)
    assert time.monotonic() - t < 20


def test_request_timeout_is_bounded():
    """A server that accepts and never answers: the client gives up after its retries."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    conns = []
    threading.Thread(target=lambda: [conns.append(sock.accept()) for _ in range(8)], daemon=True).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    client = vllm_client.VLLMClient([url], "m", timeout=0.5, max_retries=1)
    t = time.monotonic()
    with pytest.raises(vllm_client.VLLMError, match="timed out"):
        prompt_logprobs(client, [[1, 2, 3]])
    assert time.monotonic() - t < 10
    sock.close()


@pytest.mark.slow
def test_server_that_cannot_start_quotes_its_log(tmp_path):
    bad = tmp_path / "not_a_model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    cfg = Config(vllm_startup_timeout=120)
    with pytest.raises(vllm_client.VLLMError, match="exited with code") as e:
        vllm_server.launch_server(str(bad), cfg, str(tmp_path / "log"), port=8023)
    assert "log " in str(e.value) and len(str(e.value).splitlines()) > 2


@pytest.mark.slow
def test_launched_server_computes_on_every_core(untied):
    """The model runs in the engine's process (no worker process) on as many torch threads as the
    process has cores; vLLM's automatic binding had given its worker one core of two."""
    _, client = untied
    with open(client.log_path) as f:
        log = f.read()
    n = len(os.sched_getaffinity(0))
    if n > 1:  # vLLM says so only of more than one thread
        assert re.search(rf"\(EngineCore pid=\d+\).*OMP_NUM_THREADS={n} is set; leaving Torch threads at {n}\b", log)
    assert "(Worker pid=" not in log and "VllmWorker" not in log


@pytest.mark.slow
def test_the_server_starts_from_vllms_launcher_and_says_the_pinned_version(untied):
    """The server as server_command starts it (vLLM's launchers.api_server.entry: one API server, not the
    deprecated openai.api_server) answers /version with the pinned release: check_servers lets it
    through, and refuses it in one line to a trainer pinned to another."""
    _, client = untied
    with open(f"/proc/{client.proc.pid}/cmdline") as f:
        assert f.read().split("\0")[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    with open(client.log_path) as f:
        assert "vllm.entrypoints.openai.api_server" not in f.read()  # its two DeprecationWarnings
    vllm_client.check_servers(client.urls, 10, vllm_server.VLLM_VERSION)
    with pytest.raises(ValueError, match=rf"^the server at {re.escape(client.urls[0])} runs vLLM "
                                         rf"{re.escape(vllm_server.VLLM_VERSION)}, not vLLM 0\.33\.0, .*vllm_any_version"):
        vllm_client.check_servers(client.urls, 10, "0.33.0")


@pytest.mark.slow
def test_an_eager_server_samples_what_the_compiled_one_does(untied, tiny_model_dir, tmp_path):
    """vllm_enforce_eager (every other server of the tests runs eager, helpers.EAGER): no torch.compile
    warm-up, and the same seeded samples as the compiled server, token for token, logprobs within 1e-4."""
    from dataclasses import replace

    model, eager = untied
    assert "--enforce-eager" in vllm_server.server_command("m", VLLM_CFG)[0]
    compiling = replace(VLLM_CFG, vllm_enforce_eager=False)
    assert "--enforce-eager" not in vllm_server.server_command("m", compiling)[0]
    _, compiled = serve(tiny_model_dir, str(tmp_path), 8029, compiling)
    try:
        for client in (eager, compiled):  # the module's earlier tests synced other weights into its server
            sync = weight_sync.FilesystemSync(client, 0, str(tmp_path / "sync"))
            sync.sync(model)
            sync.close()
        prompts = [[7, 8, 9], [20, 21], [30, 31, 32, 33]]
        for temperature, n in ((1.0, 4), (0.0, 1)):  # greedy takes n=1 (vLLM)
            a = generate(compiled, prompts, n=n, max_tokens=12, temperature=temperature, seed=11)
            b = generate(eager, prompts, n=n, max_tokens=12, temperature=temperature, seed=11)
            assert [[s["token_ids"] for s in g] for g in a] == [[s["token_ids"] for s in g] for g in b]
            gaps = [abs(x - y) for ga, gb in zip(a, b) for sa, sb in zip(ga, gb)
                    for x, y in zip(sa["logprobs"], sb["logprobs"])]
            assert max(gaps) < 1e-4
    finally:
        vllm_server.stop_server(compiled.proc)


@pytest.mark.slow
def test_killed_server_gives_clear_error(untied):  # last: it kills the module's server
    _, client = untied
    client.proc.kill()
    client.proc.wait()
    t = time.monotonic()
    with pytest.raises(vllm_client.VLLMError, match="died"):
        generate(client, [[7, 8]], n=2, max_tokens=4)
    assert time.monotonic() - t < 5


def test_cpu_server_takes_every_core_unless_generation_overlaps_training(monkeypatch):
    """Synchronous: every core, none reserved for vLLM's scheduler, the model in the engine's process;
    async: the last half, bound, in vLLM's worker process; vllm_cpu_threads overrides both; a binding
    the user exported is kept, and with it the worker process that applies it."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    place = lambda env={}, **kw: vllm_server.cpu_placement(Config(**kw), env)  # noqa: E731
    assert place() == dict(OMP_NUM_THREADS="4", VLLM_CPU_OMP_THREADS_BIND="0,1,2,3", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                           VLLM_ENABLE_V1_MULTIPROCESSING="0")  # the model in the engine's process
    async_cfg = dict(async_steps=1, use_vllm_logprobs=True)
    assert place(**async_cfg)["VLLM_CPU_OMP_THREADS_BIND"] == "2,3" and place(**async_cfg)["OMP_NUM_THREADS"] == "2"
    assert place(**async_cfg)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # vLLM's worker process, bound to 2 and 3
    assert place(vllm_cpu_threads=1)["VLLM_CPU_OMP_THREADS_BIND"] == "3"
    assert place(vllm_cpu_threads=9)["OMP_NUM_THREADS"] == "4"  # no more threads than cores
    # a binding the user exported is vLLM's worker process's to apply: the model stays in one
    user_bound = place({"VLLM_CPU_OMP_THREADS_BIND": "1-2"})
    assert user_bound["VLLM_CPU_OMP_THREADS_BIND"] == "1-2" and user_bound["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert place({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert place({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, **async_cfg)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert place(vllm_cpu_threads=1)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert place(vllm_cpu_threads=4)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # every core
    # (the memory plan's count of the server's processes: test_memory.py)

