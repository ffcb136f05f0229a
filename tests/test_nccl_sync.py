"""The NCCL weight transport. Its NCCL calls (the rendezvous with the server, the broadcast)
need a CUDA GPU and the GPU build of vLLM, which the machines this project is developed on do
not have: the GPU test below skips there and has never run here. What runs everywhere is the
rest: its two halves of the pinned vLLM's contract, checked by vLLM's own classes (the
WeightSource its trainer engine replays, the client whose HTTP calls must be those of vLLM's own
HTTP client), and on 2 gloo ranks against servers faked at the HTTP boundary, the gather (every
rank, tensor by tensor, cast to the server's dtype on rank 0) and the failures (an HTTP error, a
rendezvous that never finishes), which every rank must hear of as a VLLMError."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from vllm.distributed.weight_transfer.base import ParamMeta, VLLMWeightSyncClient, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

from infra import vllm_client
from infra import vllm_server
from infra import weight_sync
import nccl_sync
import train
from config import Config
from helpers import logprob_diff, prompt_logprobs, trainer_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_server(fail):
    """A vLLM server's weight routes, failing one: `fail` maps a route to "error" (HTTP 500) or
    "hang" (never answers). Other routes answer {}. Returns (server, url)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            how = fail.get(self.path.split("?")[0])
            if how == "hang":
                time.sleep(30)
                return
            body = b'{"error": "the weight transfer engine is not initialised"}' if how == "error" else b"{}"
            self.send_response(500 if how == "error" else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_the_gathered_weights_are_a_weight_source_of_the_pinned_vllm():
    """What NCCLTrainerWeightTransferEngine reads: metadata() sizes the server's receive buffers, and
    its sender checks every pass against it (_checked_iter: the same names, dtypes and shapes, in
    order), a fresh pass each round; iter_groups (vLLM's default) batches it per layer."""
    full = {"model.embed_tokens.weight": torch.arange(12.0).reshape(3, 4).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.ones(2, 4, dtype=torch.bfloat16),
            "model.layers.0.input_layernorm.weight": torch.ones(4, dtype=torch.bfloat16),
            "model.layers.1.mlp.up_proj.weight": torch.zeros(2, 4, dtype=torch.bfloat16),
            "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
            "lm_head.weight": torch.ones(3, 4, dtype=torch.bfloat16)}
    source = nccl_sync.gathered_source(full, torch.device("cpu"))
    assert isinstance(source, WeightSource)
    meta = source.metadata()
    assert meta == [ParamMeta("model.embed_tokens.weight", torch.bfloat16, (3, 4)),
                    ParamMeta("model.layers.0.mlp.up_proj.weight", torch.bfloat16, (2, 4)),
                    ParamMeta("model.layers.0.input_layernorm.weight", torch.bfloat16, (4,)),
                    ParamMeta("model.layers.1.mlp.up_proj.weight", torch.bfloat16, (2, 4)),
                    ParamMeta("model.norm.weight", torch.bfloat16, (4,)),
                    ParamMeta("lm_head.weight", torch.bfloat16, (3, 4))]
    for _ in range(2):  # two rounds: each pass starts afresh
        sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
        assert [k for k, _ in sent] == list(full) and all(torch.equal(v, full[k]) for k, v in sent)
    assert [names for names, _ in source.iter_groups()] == [
        ["model.embed_tokens.weight"], ["model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"],
        ["model.layers.1.mlp.up_proj.weight"], ["model.norm.weight", "lm_head.weight"]]


def recording_server():
    """Answers 200 {} to every POST and records (route, JSON body; {} for none). Returns (server, url, seen)."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append((self.path, json.loads(body) if body else {}))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", seen


def test_the_sync_is_a_weight_sync_client_of_the_pinned_vllm():
    """NCCLSync is the client vLLM's trainer engine drives (its VLLMWeightSyncClient protocol), and its
    four calls reach a server as those of vLLM's own HTTPVLLMWeightSyncClient do: the same routes, the
    same JSON."""
    server, url, seen = recording_server()
    try:
        sync = nccl_sync.NCCLSync(vllm_client.VLLMClient([url], "m", timeout=5, max_retries=0), 0, "127.0.0.1",
                                  29655, torch.device("cpu"), timeout=5.0)
        assert isinstance(sync, VLLMWeightSyncClient)
        init_info = {"master_address": "10.0.0.1", "master_port": 29655, "rank_offset": 1, "world_size": 2,
                     "packed": True}
        update_info = {"names": ["lm_head.weight"], "dtype_names": ["bfloat16"], "shapes": [[3, 4]]}
        for client in (HTTPVLLMWeightSyncClient(url, timeout=5), sync):
            client.init_weight_transfer_engine(init_info)
            client.start_weight_update()
            client.update_weights(update_info)
            client.finish_weight_update()
        calls = [("/init_weight_transfer_engine", {"init_info": init_info}), ("/start_weight_update", {}),
                 ("/update_weights", {"update_info": update_info}), ("/finish_weight_update", {})]
        assert seen == calls + calls, seen
    finally:
        server.shutdown()


@pytest.mark.subprocess
def test_nccl_sync_failures_reach_every_rank_as_vllm_errors(tiny_model_dir):
    """Rank 0 alone talks to the server; before, the other rank returned as if the sync had
    worked, and a timeout stayed a TimeoutError (no checkpoint of the last finished step)."""
    refused, refused_url = fake_server({"/pause": "error"})
    stuck, stuck_url = fake_server({"/init_weight_transfer_engine": "hang"})
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29656",
           os.path.join(ROOT, "tests", "nccl_fault_worker.py"), tiny_model_dir, refused_url, stuck_url]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    refused.shutdown(), stuck.shutdown()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("RANK ")]
    assert sorted(line for line in lines if "GATHER" in line) == ["RANK 0 GATHER OK", "RANK 1 GATHER OK"], lines
    errors = {r: [re.sub(r"after [\d.]+s", "after Ts", line) for line in lines
                  if line.startswith(f"RANK {r} ") and "GATHER" not in line] for r in (0, 1)}
    assert errors[0] == [e.replace("RANK 1", "RANK 0") for e in errors[1]], lines  # the same errors on both ranks
    assert len(errors[0]) == 2 and all("VLLMError after Ts" in e for e in errors[0]), lines
    assert any(f"{refused_url} failed /pause after 2 attempt(s): HTTP 500" in e for e in errors[0]), lines
    assert any("VLLMError after Ts: weight sync: the NCCL rendezvous with the vLLM server did not finish within "
               "weight_sync_timeout=3s" in e for e in errors[0]), lines
    seconds = [float(s) for s in re.findall(r"VLLMError after ([\d.]+)s", "\n".join(lines))]
    assert max(seconds) < 20, lines  # bounded by weight_sync_timeout, not by the hung request


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="needs a CUDA GPU and the GPU build of vLLM")
def test_nccl_sync_of_perturbed_weights(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = Config(weight_sync_transport="nccl", max_prompt_length=48, response_length=16, vllm_dtype="float32",
                 vllm_gpu_memory_utilization=0.3, output_dir=str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda()
    served = str(tmp_path / "serving")
    weight_sync.write_serving_dir(weight_sync.full_state_dict(model), model.config,
                                  AutoTokenizer.from_pretrained(tiny_model_dir), served)
    proc, url = vllm_server.launch_server(served, cfg, str(tmp_path / "vllm.log"), port=8071)
    try:
        client = vllm_client.VLLMClient([url], served, proc=proc, log_path=str(tmp_path / "vllm.log"))
        sync = train.make_sync(cfg)(client, 0, torch.device("cuda"))
        seqs = [[7, 8, 9, 10, 11, 12], [20, 21, 22, 23]]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
        before = logprob_diff(trainer_logprobs(model, seqs), prompt_logprobs(client, seqs))
        sync.sync(model)
        after = logprob_diff(trainer_logprobs(model, seqs), prompt_logprobs(client, seqs))
        assert before[1] > 1e-3 and after[1] < 1e-4, (before, after)
        sync.close()
    finally:
        vllm_server.stop_server(proc)
