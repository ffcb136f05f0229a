"""The vLLM side of a rollout: the server we launch and the HTTP client that talks to it.

The server is a real vLLM OpenAI-compatible server spoken to over HTTP. Without
`vllm_server_urls` we launch one as a subprocess (`python -m vllm.entrypoints.openai.
api_server`; the `vllm` console script of the CPU build is broken) and stop it, and only
it, when training ends. With URLs, requests are spread over the servers the user runs
(started with VLLM_SERVER_DEV_MODE=1 for the weight routes).

Pushing the trainer's weights into the server is weight_sync.py.

single_gpu_mode (untested here: it needs a GPU build of vLLM): the server we launch shares
the trainer's GPU, started with --enable-sleep-mode and the vllm_gpu_memory_utilization
fraction. train.py puts it to sleep before training (POST /sleep?level=1: weights to CPU
memory, KV cache freed) and wakes it (POST /wake_up) before the weight sync and the next
generation. Level 1, not 2: a step without samples syncs nothing, and must still find
the weights it left.
"""

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch


class VLLMError(RuntimeError):
    """A server that cannot be reached, answers with an error, or dies."""


# What every request pins besides temperature and top_p. A server started without
# --generation-config vllm fills each sampling parameter a request leaves out from the model's
# generation_config.json (Qwen2.5-Instruct: top_k=20, repetition_penalty=1.05), and then samples
# from another distribution than the trainer's softmax: a biased ratio, silently. top_k=-1 is
# "off" in every vLLM (0.32 prefers 0 and quietly accepts -1; older versions refuse 0).
NEUTRAL_SAMPLING = dict(top_k=-1, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)


def log_tail(path, n=20):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


# --- the server we launch


def die_with_parent():
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # SIGTERM: it then stops its engine too
    except (OSError, AttributeError):
        pass  # not Linux: stop_server and the finally in train.py still stop it on a clean exit


def server_dtype(cfg):
    """The server's dtype: vllm_dtype, where "auto" means the trainer's compute dtype. vLLM's own
    "auto" turns float32 into bfloat16 on CPU, which puts a 1e-3 gap between trainer and server logprobs."""
    return cfg.vllm_dtype if cfg.vllm_dtype != "auto" else "bfloat16" if torch.cuda.is_available() else "float32"


def launch_server(model_dir, cfg, log_path, port=None, env=None, extra_args=()):
    """Start a vLLM server on `model_dir` and return (process, url) once /health answers.
    A server that exits or stays unhealthy past vllm_startup_timeout is stopped and the
    tail of its log is quoted in the error. `env` and `extra_args` (benchmarks) are laid over
    the environment and the arguments below; None in `env` unsets a variable."""
    port = port or cfg.vllm_port
    max_len = cfg.vllm_max_model_len or cfg.max_prompt_length + cfg.response_length
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", server_dtype(cfg), "--max-model-len", str(max_len),
           "--seed", str(cfg.seed), "--logprobs-mode", "processed_logprobs", "--disable-log-stats",
           "--generation-config", "vllm",  # vLLM's neutral defaults, not the model's (NEUTRAL_SAMPLING)
           "--gpu-memory-utilization", str(cfg.vllm_gpu_memory_utilization)]
    if not torch.cuda.is_available():
        # The CPU build crashes ("CPU Generator does not use offset") when a seeded request's
        # prompt is prefilled in chunks, i.e. when a step's prompt tokens pass the batch budget
        # (2048 on CPU): 4 prompts x 8 samples of 120 tokens did. Whole prompts only.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(2048, max_len))]
    else:  # the LM head in float32, as the trainer computes it (vLLM's head_dtype docs: required for RL)
        cmd += ["--hf-overrides", json.dumps({"head_dtype": "float32"})]
    if cfg.weight_sync_transport == "nccl":
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if cfg.single_gpu_mode:
        if not torch.cuda.is_available():
            raise VLLMError("single_gpu_mode=True needs a GPU (vLLM's sleep mode frees GPU memory); "
                            "set single_gpu_mode=False on CPU")
        cmd += ["--enable-sleep-mode"]
    cmd += list(extra_args)
    server_env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(cfg.vllm_kv_cache_space_gb))
    if not torch.cuda.is_available():
        server_env.update(cpu_placement(cfg, server_env))
    for k, v in (env or {}).items():
        server_env.pop(k, None) if v is None else server_env.__setitem__(k, v)
    log = open(log_path, "w")
    # A new session: the server and its engine processes form one group we can stop together.
    # It also dies with the trainer if the trainer is killed (SIGKILL, OOM) and cannot stop it.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env, start_new_session=True,
                            preexec_fn=die_with_parent)
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


def cpu_placement(cfg, environ):
    """OpenMP threads and core binding of a CPU server we launch (BENCHMARKS.md,
    "Generation on the CPU": scripts/bench_generation.py measures each choice).

    vLLM's automatic binding keeps one core per worker free for its scheduler process, so on a
    2-core machine the model runs on one. In the synchronous loop the training ranks only wait
    while the server generates, so the server takes every core the process may use, and none is
    reserved; with async_steps > 0 they compute at the same time and the server gets the last
    half of the cores (vllm_cpu_threads overrides both). The binding variables are defaults: a
    VLLM_CPU_OMP_THREADS_BIND or VLLM_CPU_NUM_OF_RESERVED_CPU already set is kept."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    n = min(len(cores), cfg.vllm_cpu_threads or (len(cores) if cfg.async_steps == 0 else max(1, len(cores) // 2)))
    bound = cores[-n:]
    return dict(OMP_NUM_THREADS=str(n),  # not the trainer's: demo.sh gives each training rank one thread
                VLLM_CPU_OMP_THREADS_BIND=environ.get("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, bound))),
                VLLM_CPU_NUM_OF_RESERVED_CPU=environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"))


def stop_server(proc, timeout=30):
    """Stop a server we launched and its engine processes (its process group), nothing else.
    The group is stopped even when the server itself is already dead: its engine may not be."""
    if proc is None:
        return
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
        time.sleep(0.5)  # the engine stops after the server
        os.killpg(proc.pid, signal.SIGKILL)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


# --- the client


class VLLMClient:
    """HTTP client over one or more servers: bounded retries with backoff, concurrent
    requests spread round-robin, errors that name the server and quote what it said."""

    def __init__(self, urls, model=None, timeout=120.0, max_retries=3, proc=None, log_path=None, stop_token_ids=()):
        self.urls, self.timeout, self.max_retries = list(urls), timeout, max_retries
        # the model's end-of-sequence ids beyond the tokenizer's (generation_config.json's eos_token_id
        # list): a server launched with --generation-config vllm, or on a copy without that file, would
        # not stop on them
        self.stop_token_ids = list(stop_token_ids)
        self.proc, self.log_path = proc, log_path  # set when we launched the (single) server
        self.model = model or self.get(self.urls[0], "/v1/models")["data"][0]["id"]  # the name it serves
        self.version = 0  # weight updates the servers have taken (see updating)
        self._cond, self._in_flight, self._updating = threading.Condition(), 0, False

    @contextlib.contextmanager
    def generating(self):
        """Around one generation request: waits out a weight update; yields the weight version
        the request runs on."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._in_flight += 1
            version = self.version
        try:
            yield version
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def updating(self):
        """Around a weight update: new generation requests wait and requests in flight finish
        on the old weights, so each completion comes from exactly one weight version. With
        generation running ahead (async_steps), this is the only time it stops."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)  # one update at a time
            self._updating = True
            self._cond.wait_for(lambda: self._in_flight == 0)
        done = False
        try:
            yield
            done = True
        finally:
            with self._cond:
                self.version += done
                self._updating = False
                self._cond.notify_all()

    def get(self, url, route):
        try:
            with urllib.request.urlopen(url + route, timeout=self.timeout) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise VLLMError(f"vLLM server {url} did not answer {route}: {getattr(e, 'reason', e)}") from None

    def post(self, url, route, payload=None, params="", timeout=None):
        """POST with retries; `timeout` (seconds per attempt) defaults to vllm_request_timeout."""
        timeout = timeout or self.timeout
        data = json.dumps(payload or {}).encode()
        last = None
        for attempt in range(self.max_retries + 1):
            if self.proc is not None and self.proc.poll() is not None:
                raise VLLMError(f"vLLM server {url} died (exit code {self.proc.returncode}); "
                                f"log {self.log_path}:\n{log_tail(self.log_path)}")
            req = urllib.request.Request(url + route + params, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
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

    def map(self, route, payloads, fn=None):
        """POST every payload concurrently, spread over the servers; results in order."""
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(payloads)))) as pool:
            futures = [pool.submit(fn or self.post, self.urls[i % len(self.urls)], route, p)
                       for i, p in enumerate(payloads)]
            return [f.result() for f in futures]

    def versioned_post(self, url, route, payload):
        with self.generating() as version:
            return self.post(url, route, payload), version

    def broadcast(self, route, payload=None, params="", timeout=None):
        return [self.post(url, route, payload, params, timeout) for url in self.urls]

    def generate(self, prompt_ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None):
        """n completions of each token-id prompt. Returns one list per prompt of dicts with
        token_ids, logprobs (of the sampled tokens, under the sampling temperature),
        finish_reason ("stop" or "length"), eos (it ended on an end-of-sequence token, the last of
        token_ids), text and version (of the weights that sampled it).
        Prompt i's request gets seed + i * n, so no two samples of the call share a stream."""
        payloads = [dict(model=self.model, prompt=ids, n=n, max_tokens=max_tokens, temperature=temperature,
                         top_p=top_p, **NEUTRAL_SAMPLING, stop_token_ids=self.stop_token_ids, logprobs=0,
                         return_token_ids=True,
                         seed=None if seed is None else seed + i * n)  # vLLM seeds sample j with seed + j
                    for i, ids in enumerate(prompt_ids)]
        out = []
        for resp, version in self.map("/v1/completions", payloads, self.versioned_post):
            choices = sorted(resp["choices"], key=lambda c: c["index"])
            # stop_reason: None for the model's EOS, the token id for stop_token_ids (a string for a stop string)
            out.append([dict(token_ids=c["token_ids"], logprobs=c["logprobs"]["token_logprobs"],
                             finish_reason=c["finish_reason"], text=c["text"], version=version,
                             eos=c["finish_reason"] == "stop" and not isinstance(c.get("stop_reason"), str))
                        for c in choices])
        return out

    def score(self, sequences):
        """The server's logprob of every token of each sequence after the first
        (prompt_logprobs): one list of len(seq) - 1 floats per sequence."""
        payloads = [dict(model=self.model, prompt=seq, max_tokens=1, temperature=1.0, top_p=1.0, **NEUTRAL_SAMPLING,
                         prompt_logprobs=0)
                    for seq in sequences]
        out = []
        for seq, resp in zip(sequences, self.map("/v1/completions", payloads)):
            plp = resp["choices"][0]["prompt_logprobs"][1:]
            out.append([entry[str(tok)]["logprob"] for tok, entry in zip(seq[1:], plp)])
        return out

    def reload_weights(self, weights_dir, timeout=None):
        """Each server reloads the safetensors in weights_dir; `timeout` is weight_sync_timeout."""
        try:
            self.broadcast("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
                           timeout=timeout)
        except VLLMError as e:
            raise VLLMError(f"weight sync: {e}\n(each attempt may take weight_sync_timeout="
                            f"{timeout or self.timeout:g}s; raise it if the server is only slow to reload)") from None
        self.broadcast("/reset_prefix_cache")

    def sleep(self):
        """single_gpu_mode: free the GPU for training (level 1: weights to CPU memory, KV cache dropped)."""
        self.broadcast("/sleep", params="?level=1")

    def wake_up(self):
        self.broadcast("/wake_up")

    def pause(self):
        self.broadcast("/pause", params="?mode=keep")

    def resume(self):
        self.broadcast("/resume")
