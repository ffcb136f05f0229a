"""scripts/launch_8gpu.sh starts the vLLM servers train.py would launch: scripts/serve.py's command
line is the one launch_server runs (on a GPU too, faked here), and the script's servers get the
trainer's own flags. The GPU-only parts (the servers themselves) are not run on this machine."""

import os
import shlex
import subprocess
import sys

import pytest
import torch

from lora import sync as lora_sync
import serve
from infra import vllm_server
from config import Config
from infra.cli import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--num_unique_prompts_rollout", "48", "--max_tokens_per_micro_batch", "16384", "--response_length", "1024",
         "--max_prompt_length", "1024"]


class Started(Exception):
    pass


@pytest.mark.parametrize("lora_rank,max_lora_rank", [(1, "1"), (300, "320")])
def test_the_server_cli_runs_what_launch_server_runs(monkeypatch, tmp_path, lora_rank, max_lora_rank):
    """On a GPU (faked), for LoRA ranks where the script's own copy of the flags said 8 and 512:
    `scripts/serve.py --serve` execs the command and environment of launch_server with LoRA's flags
    (as generator.py launches it). Before: the script built its own command, and there was no server
    command line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    flags = [*FLAGS, "--lora_rank", str(lora_rank), "--vllm_port", "8001"]
    seen = {}

    def popen(cmd, env, **kw):
        seen["launch_server"] = (cmd, env)
        raise Started

    def execve(path, cmd, env):
        seen["cli"] = (cmd, env)
        raise Started

    monkeypatch.setattr(vllm_server, "death_signal_prefix", lambda: [])  # serve.py execs the server: no parent
    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    monkeypatch.setattr(serve.os, "execve", execve)
    cfg = parse_args(Config, flags)
    with pytest.raises(Started):
        vllm_server.launch_server("serving/m", cfg, str(tmp_path / "log"), port=8001,
                                  extra_args=lora_sync.server_flags(cfg))
    with pytest.raises(Started):
        serve.main(["--serve", "serving/m", *flags])
    assert seen["cli"] == seen["launch_server"]
    with pytest.raises(Started):  # as train.py launches it: on a Unix socket, in a directory of its own
        vllm_server.launch_server("serving/m", cfg, str(tmp_path / "log"), extra_args=lora_sync.server_flags(cfg))
    own = seen["launch_server"][0]
    uds = own[own.index("--uds") + 1]
    assert "--port" not in own and own[:own.index("--uds")] == seen["cli"][0][:own.index("--uds")]
    assert not os.path.exists(os.path.dirname(uds))  # removed when the server did not start
    cmd = seen["cli"][0]
    assert cmd[cmd.index("--max-lora-rank") + 1] == max_lora_rank and cmd[cmd.index("--port") + 1] == "8001"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and "--hf-overrides" in cmd
    assert seen["cli"][1]["VLLM_SERVER_DEV_MODE"] == "1"


def test_a_bad_flag_stops_the_server_cli_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(["--serve", "serving/m", "--lora_rnak", "4"])
    assert e.value.code == 2 and "did you mean 'lora_rank'" in capsys.readouterr().err


@pytest.mark.subprocess
def test_launch_8gpu_gives_its_servers_the_trainers_flags():
    """DRY_RUN=1 prints what the script would start: each server line is server_command of the
    flags on the trainer's line, on that server's port, and the script names no server flag of
    its own. Before: the script had no dry run, and its own copy of the server's flags."""
    env = dict(os.environ, PYTHON=sys.executable, DRY_RUN="1", LORA_RANK="300", VLLM_GPUS="0 1", PORT="8100", SERVING="serving/m")
    out = subprocess.run(["bash", "scripts/launch_8gpu.sh", "--seed", "7"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    servers = [shlex.split(line) for line in lines if line.startswith("CUDA_VISIBLE_DEVICES=")]
    trainer = shlex.split(next(line for line in lines if "train.py" in line))
    flags = trainer[trainer.index("--vllm_server_urls") + 2:]
    assert trainer[trainer.index("--vllm_server_urls") + 1] == "http://127.0.0.1:8100,http://127.0.0.1:8101"
    assert "--seed" in flags and "--lora_rank" in flags
    for gpu, words in enumerate(servers):
        cfg = parse_args(Config, [*flags, "--vllm_port", str(8100 + gpu)])
        cmd, added = vllm_server.server_command("serving/m", cfg, cfg.vllm_port, extra_args=lora_sync.server_flags(cfg))
        assigned = dict(w.split("=", 1) for w in words[:words.index(cmd[0])])
        assert assigned == {"CUDA_VISIBLE_DEVICES": str(gpu), **added}
        assert words[words.index(cmd[0]):] == cmd and "--max-lora-rank" in cmd
    script = open(os.path.join(ROOT, "scripts", "launch_8gpu.sh")).read()
    assert "vllm.entrypoints" not in script and "--max-lora-rank" not in script


def test_a_port_in_use_is_refused_before_the_server_starts(tmp_path):
    """A server already listening on the port asked for (tests, benchmarks) would answer in place
    of one that never started (a run then asked it for a model it does not serve: HTTP 404).
    Before: the server was started anyway (here the quick tier's guard refuses the process
    instead). train.py's own server takes no port (tests/test_two_runs.py)."""
    import socket

    from infra.faults import VLLMError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(VLLMError, match=f"port {port} is taken .*--vllm_port"):
            vllm_server.launch_server("serving/m", parse_args(Config, []), str(tmp_path / "log"), port=port)


def test_vllm_engine_sockets_go_into_the_servers_private_directory(monkeypatch, tmp_path):
    """vLLM's ZMQ ipc sockets between its API server and engine go where VLLM_RPC_BASE_PATH says (the shared
    temporary directory by default): into the 0700 directory of the server's own socket, which other users
    cannot enter and which goes with the server (or with the next run, after a SIGKILL). Before: in /tmp."""
    seen = {}

    def popen(cmd, env, **kw):
        seen.update(cmd=cmd, env=env)
        raise Started

    monkeypatch.setattr(vllm_server, "death_signal_prefix", lambda: [])  # its probe would run the fake Popen
    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    with pytest.raises(Started):
        vllm_server.launch_server("serving/m", parse_args(Config, []), str(tmp_path / "log"))
    uds = seen["cmd"][seen["cmd"].index("--uds") + 1]
    assert seen["env"]["VLLM_RPC_BASE_PATH"] == os.path.dirname(uds)
