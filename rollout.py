"""Everything between the trainer and vLLM: the server, generation, weight sync, the check.

The server is a real vLLM OpenAI-compatible server spoken to over HTTP. Without
`vllm_server_urls` we launch one as a subprocess (`python -m vllm.entrypoints.openai.
api_server`; the `vllm` console script of the CPU build is broken) and stop it, and only
it, when training ends. With URLs, requests are spread over the servers the user runs
(started with VLLM_SERVER_DEV_MODE=1 for the weight routes).

Tied embeddings: the CPU server's `reload_weights` does not refresh a tied LM head
("ParallelLMHead: Failed to load weights"), so the server always gets an untied copy:
config.json says tie_word_embeddings=false and every weight file carries lm_head.weight
equal to the input embedding. It costs the server one vocab x hidden matrix.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch


class VLLMError(RuntimeError):
    """A server that cannot be reached, answers with an error, or dies."""


def log_tail(path, n=20):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


# --- the server we launch


def launch_server(model_dir, cfg, log_path, port=None):
    """Start a vLLM server on `model_dir` and return (process, url) once /health answers.
    A server that exits or stays unhealthy past vllm_startup_timeout is stopped and the
    tail of its log is quoted in the error."""
    port = port or cfg.vllm_port
    max_len = cfg.vllm_max_model_len or cfg.max_prompt_length + cfg.response_length
    # "auto" means the trainer's compute dtype. vLLM's own "auto" turns float32 into
    # bfloat16 on CPU, which puts a 1e-3 gap between trainer and server logprobs.
    dtype = cfg.vllm_dtype if cfg.vllm_dtype != "auto" else "bfloat16" if torch.cuda.is_available() else "float32"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_len),
           "--seed", str(cfg.seed), "--logprobs-mode", "processed_logprobs", "--disable-log-stats",
           "--gpu-memory-utilization", str(cfg.vllm_gpu_memory_utilization)]
    if cfg.weight_sync_transport == "nccl":
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(cfg.vllm_kv_cache_space_gb))
    env.setdefault("OMP_NUM_THREADS", "1")
    log = open(log_path, "w")
    # A new session: the server and its engine processes form one group we can stop together.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + cfg.vllm_startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VLLMError(f"vLLM server on {model_dir} exited with code {proc.returncode} while starting; "
                            f"log {log_path}:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    stop_server(proc)
    raise VLLMError(f"vLLM server on {model_dir} not healthy after {cfg.vllm_startup_timeout:.0f}s "
                    f"(vllm_startup_timeout); log {log_path}:\n{log_tail(log_path)}")


def stop_server(proc, timeout=30):
    """Stop a server we launched and its engine processes (its process group), nothing else."""
    if proc is None or proc.poll() is not None:
        return
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


# --- the client


class VLLMClient:
    """HTTP client over one or more servers: bounded retries with backoff, concurrent
    requests spread round-robin, errors that name the server and quote what it said."""

    def __init__(self, urls, model=None, timeout=120.0, max_retries=3, proc=None, log_path=None):
        self.urls, self.timeout, self.max_retries = list(urls), timeout, max_retries
        self.proc, self.log_path = proc, log_path  # set when we launched the (single) server
        self.model = model or self.get(self.urls[0], "/v1/models")["data"][0]["id"]  # the name it serves

    def get(self, url, route):
        try:
            with urllib.request.urlopen(url + route, timeout=self.timeout) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise VLLMError(f"vLLM server {url} did not answer {route}: {getattr(e, 'reason', e)}") from None

    def post(self, url, route, payload=None, params=""):
        data = json.dumps(payload or {}).encode()
        last = None
        for attempt in range(self.max_retries + 1):
            if self.proc is not None and self.proc.poll() is not None:
                raise VLLMError(f"vLLM server {url} died (exit code {self.proc.returncode}); "
                                f"log {self.log_path}:\n{log_tail(self.log_path)}")
            req = urllib.request.Request(url + route + params, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    body = r.read()
                    return json.loads(body) if body else {}
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"
                if e.code < 500:
                    break  # the request is wrong; retrying will not help
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt < self.max_retries:
                time.sleep(min(2.0 ** attempt, 30.0) * (0.5 + random.random()))
        raise VLLMError(f"vLLM server {url} failed {route} after {attempt + 1} attempt(s): {last}")

    def map(self, route, payloads):
        """POST every payload concurrently, spread over the servers; results in order."""
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(payloads)))) as pool:
            futures = [pool.submit(self.post, self.urls[i % len(self.urls)], route, p) for i, p in enumerate(payloads)]
            return [f.result() for f in futures]

    def broadcast(self, route, payload=None, params=""):
        return [self.post(url, route, payload, params) for url in self.urls]

    def generate(self, prompt_ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None):
        """n completions of each token-id prompt. Returns one list per prompt of dicts with
        token_ids, logprobs (of the sampled tokens, under the sampling temperature),
        finish_reason ("stop" or "length") and text."""
        payloads = [dict(model=self.model, prompt=ids, n=n, max_tokens=max_tokens, temperature=temperature,
                         top_p=top_p, logprobs=0, return_token_ids=True,
                         seed=None if seed is None else seed + i)
                    for i, ids in enumerate(prompt_ids)]
        out = []
        for resp in self.map("/v1/completions", payloads):
            choices = sorted(resp["choices"], key=lambda c: c["index"])
            out.append([dict(token_ids=c["token_ids"], logprobs=c["logprobs"]["token_logprobs"],
                             finish_reason=c["finish_reason"], text=c["text"]) for c in choices])
        return out

    def score(self, sequences):
        """The server's logprob of every token of each sequence after the first
        (prompt_logprobs): one list of len(seq) - 1 floats per sequence."""
        payloads = [dict(model=self.model, prompt=seq, max_tokens=1, temperature=1.0, prompt_logprobs=0)
                    for seq in sequences]
        out = []
        for seq, resp in zip(sequences, self.map("/v1/completions", payloads)):
            plp = resp["choices"][0]["prompt_logprobs"][1:]
            out.append([entry[str(tok)]["logprob"] for tok, entry in zip(seq[1:], plp)])
        return out

    def reload_weights(self, weights_dir):
        self.broadcast("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}})
        self.broadcast("/reset_prefix_cache")

    def pause(self):
        self.broadcast("/pause", params="?mode=keep")

    def resume(self):
        self.broadcast("/resume")


# --- weight sync


def full_state_dict(model):
    """The full, unsharded state dict, on CPU, on rank 0 (empty on other ranks).
    Every rank must call it: it gathers FSDP2/DTensor shards with collectives. In a world
    of one the tensors may alias the live parameters: copy them to keep a snapshot."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def untie(state_dict):
    """The serving copy of a state dict: lm_head.weight present (equal to the embedding for a
    tied model) and no tensor stored twice."""
    sd = {k: v.contiguous() for k, v in state_dict.items()}
    if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    elif "lm_head.weight" in sd and sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr():
        sd["lm_head.weight"] = sd["lm_head.weight"].clone()
    return sd


def write_weights(state_dict, out_dir, dtype=None):
    """Write the serving copy as one safetensors file; atomically replaces the last one."""
    from safetensors.torch import save_file

    sd = untie(state_dict)
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, ".model.safetensors.tmp")
    save_file(sd, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    return sum(v.numel() * v.element_size() for v in sd.values())


def write_serving_dir(state_dict, hf_config, tokenizer, out_dir):
    """A model directory the server can start from: untied config, tokenizer, weights."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = hf_config.to_dict()
    cfg["tie_word_embeddings"] = False
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tokenizer.save_pretrained(out_dir)
    write_weights(state_dict, out_dir)


def sync_dir_for(output_dir):
    """Where synced weights go: memory-backed /dev/shm when there is one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else output_dir
    return tempfile.mkdtemp(prefix="weight_sync_", dir=base)


def sync_weights_filesystem(model, client, sync_dir, rank):
    """Gather on every rank, then rank 0 writes safetensors and asks each server to reload.
    Returns the bytes written (rank 0) or 0."""
    import torch.distributed as dist

    sd = full_state_dict(model)
    nbytes = 0
    if rank == 0:
        nbytes = write_weights(sd, sync_dir)
        client.reload_weights(sync_dir)
    if dist.is_initialized():
        dist.barrier()
    return nbytes


class NCCLWeightSync:
    """GPU servers: vLLM's native weight-transfer API over NCCL (server launched with
    --weight-transfer-config '{"backend": "nccl"}'). Untested on the CPU machines this
    project is developed on. Every rank gathers every full_tensor() first; only then
    does rank 0 broadcast: interleaving the FSDP gathers with the NCCL broadcast lets
    rank 0 wait in the broadcast while the others wait in a gather (deadlock).
    Supports one server with one worker (tensor parallel size 1)."""

    def __init__(self, client, rank, master_address, master_port, device):
        self.client, self.rank, self.device, self.engine = client, rank, device, None
        self.master_address, self.master_port = master_address, master_port  # this trainer's rendezvous

    # the four calls vLLM's trainer engine makes on its client (VLLMWeightSyncClient)
    def init_weight_transfer_engine(self, init_info):
        self.client.broadcast("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        self.client.broadcast("/start_weight_update")

    def update_weights(self, update_info):
        self.client.broadcast("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.client.broadcast("/finish_weight_update", {"weight_version": weight_version})

    def sync(self, model):
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                   NCCLTrainerWeightTransferEngine)

        full = {}
        for name, t in model.state_dict().items():  # every rank, every gather, before any send
            full[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
        if self.rank != 0:
            return 0
        full = {k: v.to(self.device) for k, v in untie(full).items()}

        class Gathered(WeightSource):
            def metadata(self):
                return [ParamMeta(k, v.dtype, tuple(v.shape)) for k, v in full.items()]

            def __iter__(self):
                return iter(full.items())

        if self.engine is None:
            info = NCCLTrainerInitInfo(master_address=self.master_address, master_port=self.master_port,
                                       world_size=2, rank=0)
            self.engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=self, source=Gathered())
        self.engine.source = Gathered()
        self.client.pause()
        try:
            self.engine.send_weights()
        finally:
            self.client.resume()
        self.client.broadcast("/reset_prefix_cache")
        return sum(v.numel() * v.element_size() for v in full.values())


def remove_sync_dir(sync_dir):
    shutil.rmtree(sync_dir, ignore_errors=True)


# --- the check


@torch.no_grad()
def trainer_logprobs(model, sequences, temperature=1.0):
    """Per-token logprobs of each sequence under `model` (same layout as VLLMClient.score)."""
    out = []
    for seq in sequences:
        ids = torch.tensor([seq], device=next(model.parameters()).device)
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu().tolist())
    return out


def logprob_diff(trainer_lp, server_lp):
    """(mean, max) of |trainer - server| over all tokens."""
    diffs = torch.tensor([abs(a - b) for t, s in zip(trainer_lp, server_lp) for a, b in zip(t, s)])
    return diffs.mean().item(), diffs.max().item()
