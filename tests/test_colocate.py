"""The colocated server (vllm_colocate; the default on GPUs without vllm_server_urls): each step the
server sleeps while the policy trains, then its weights wake, the sync loads the new ones, its KV
cache wakes, and it generates. vLLM's CPU build takes the sleep and wake calls and does nothing
with them, so what a CPU shows is the order, read from the real server's access log, that each sleep
and wake is checked (/is_sleeping: the CPU build's engine pauses and counts its parts asleep as a GPU
server does, tests/test_sleep_checks.py), and that a wake followed by generation without a sync is
caught by the sync check."""

import re

import pytest
import torch

from config import Config
from tests.helpers import command, flags, metrics, run
from update import sync_tolerance

ROUTES = {"/sleep?level=1": "sleep", "/wake_up?tags=weights": "wake weights", "/collective_rpc": "load",
          "/reset_prefix_cache": "reset", "/wake_up?tags=kv_cache": "wake kv cache", "/v1/completions": "generate",
          "/is_sleeping": "asleep?"}


def calls(log_path):
    """The server's answered requests in order, named by ROUTES, a run of completions as one "generate"."""
    seen = []
    for route, status in re.findall(r'"(?:POST|GET) (\S+) HTTP/1\.1" (\d+)', open(log_path).read()):
        assert status == "200", (route, status)
        name = ROUTES.get(route)
        if name and not (name == "generate" and seen and seen[-1] == "generate"):
            seen.append(name)
    return seen


@pytest.mark.slow
def test_each_step_sleeps_wakes_syncs_then_generates_and_a_lost_sync_stops_the_run(tiny_model_dir, tmp_path):
    """2 ranks (every sleep and wake is rank 0's call that every rank waits for). The reload after step 2
    is never sent (tests/fault_worker.py lost_sync): the server wakes and generates from step 1's
    weights, and step 3's sync check stops the run on both ranks before it trains."""
    out = run(command("tests/fault_worker.py", 2) + ["lost_sync=1"] +
              flags(tiny_model_dir, tmp_path, 5, "--vllm_colocate", "--checkpoint_state_freq", "100"))
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if "SyncError: " in line]
    assert errors and all("the last weight sync did not take" in e for e in errors), out.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path) if "loss" in r] == [1, 2], "steps 1 and 2 trained, not 3"
    seq = calls(tmp_path / "out" / "vllm.log")
    step = ["generate", "sleep", "asleep?", "wake weights", "asleep?", "load", "reset", "wake kv cache", "asleep?"]
    lost = ["generate", "sleep", "asleep?", "wake weights", "asleep?", "wake kv cache", "asleep?"]
    assert seq == step + lost + ["generate", "sleep", "asleep?"], seq  # step 3 slept, then stopped before its update
    assert "sleep mode is not supported on CPU" in open(tmp_path / "out" / "vllm.log").read()  # and yet it said asleep


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the colocated server on GPUs needs 2 GPUs and a GPU "
                    "build of vLLM; untested here")
def test_the_cards_command_trains_on_two_gpus_with_the_server_beside_it(tiny_model_dir, tmp_path):
    """`torchrun --nproc_per_node 2 train.py` with no server flags: our server on the same 2 GPUs, in
    sleep mode; every step's sync check passes."""
    out = run(command("train.py", 2) + flags(tiny_model_dir, tmp_path, 3, "--checkpoint_state_freq", "100"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in metrics(tmp_path) if "loss" in r]
    assert rows and all(r["vllm_logp_diff_mean"] < sync_tolerance(Config()) for r in rows)  # 0.07: bf16 on GPUs
    assert calls(tmp_path / "out" / "vllm.log").count("sleep") == 3
