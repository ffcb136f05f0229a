"""Benchmark generation on the vLLM CPU server that train.py launches, against the bounds of
this machine measured in the same invocation: the compute bound (2 x parameters x tokens at
the fp32 matmul rate timed here) and the memory bound (every decode step reads the weights
once, at the memory-copy rate timed here).

    .venv/bin/python benchmarks/bench_generation.py                                # SmolLM2, every setting
    .venv/bin/python benchmarks/bench_generation.py --settings one_core,all_cores --repeats 3

The request is the demo's: 4 prompts x 8 samples, 64-token prompts, 128 new tokens with
ignore_eos (so every run generates 4096 tokens), T 0.7, sent as the trainer sends it (one
request per prompt, concurrently). Each setting launches its own server through
vllm_server.launch_server with the environment and arguments below, runs one warm-up request and
--repeats timed ones, and stops it. Port --port.
"""

import os

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
from infra import vllm_client  # noqa: E402
from infra import vllm_server  # noqa: E402
from infra import weight_sync  # noqa: E402
from config import Config  # noqa: E402

CORES = len(os.sched_getaffinity(0))
ALL = ",".join(map(str, sorted(os.sched_getaffinity(0))))


def iomp():
    """libiomp5.so from the intel-openmp wheel, if installed; else None."""
    path = os.path.join(sys.prefix, "lib", "libiomp5.so")
    return path if os.path.exists(path) else None


def tcmalloc():
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib"):
        path = os.path.join(d, "libtcmalloc_minimal.so.4")
        if os.path.exists(path):
            return path
    return None


# name -> (environment of the server, extra server arguments). None in the environment: unset.
# WORKER: the model in a worker process of its own (vLLM's multiprocessing executor), as vLLM starts a
# CPU server by default; ENGINE: in the engine's process (its one-process executor). With
# VLLM_ENABLE_V1_MULTIPROCESSING=1 vLLM's CPU platform replaces "--distributed-executor-backend uni" by
# the multiprocessing executor (vllm/platforms/cpu.py), so the model runs in its engine's process only
# with that variable at 0.
WORKER, ENGINE = dict(VLLM_ENABLE_V1_MULTIPROCESSING="1"), dict(VLLM_ENABLE_V1_MULTIPROCESSING="0")
BOUND = dict(OMP_NUM_THREADS=str(CORES), VLLM_CPU_OMP_THREADS_BIND=ALL, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
SETTINGS = {
    # vLLM's automatic binding: on x86 it reserves one core for the scheduler process, so on 2
    # cores the model runs on one.
    "one_core": (dict(WORKER, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=None, VLLM_CPU_NUM_OF_RESERVED_CPU=None,
                      LD_PRELOAD=None), []),
    "all_cores": (dict(WORKER, **BOUND, LD_PRELOAD=None), []),
    "all_cores_iomp": (dict(WORKER, **BOUND, LD_PRELOAD="IOMP"), []),
    "all_cores_iomp_tcmalloc": (dict(WORKER, **BOUND, LD_PRELOAD="TCMALLOC:IOMP"), []),
    # the engine's wait on the worker polled by vLLM's compiled spin loop instead of sched_yield
    "all_cores_iomp_spinloop": (dict(WORKER, **BOUND, LD_PRELOAD="IOMP", VLLM_USE_SPINLOOP_EXT="1"), []),
    # the model in the engine's process: no worker process to start, no shared-memory queue whose
    # reader spins (sched_yield) while the worker computes
    "engine_process": (dict(ENGINE, **BOUND, LD_PRELOAD=None), ["--distributed-executor-backend", "uni"]),
    "engine_process_iomp_bound": (dict(ENGINE, OMP_NUM_THREADS=str(CORES), LD_PRELOAD="IOMP", VLLM_CPU_OMP_THREADS_BIND=None,
                                       KMP_BLOCKTIME="5", KMP_TPAUSE="0",
                                       KMP_AFFINITY=f"granularity=fine,explicit,proclist=[{ALL}]"),
                                  ["--distributed-executor-backend", "uni"]),
    # what train.py launches (vllm_server.cpu_placement: all cores, the model in the engine's process)
    "trainer": (None, None),
    # the same with the model in a worker process, as train.py launched it before 2026-11-29
    "trainer_worker_process": (WORKER, []),
}


def matmul_gflops(threads, n=2048, tries=5):
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(timed(lambda: a @ b) for _ in range(tries))
    return 2 * n ** 3 / best / 1e9


def copy_gbps(nbytes=512 * 2 ** 20, tries=5):
    """Bytes read per second by dst.copy_(src) (each byte read once and written once)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best = min(timed(lambda: dst.copy_(src)) for _ in range(tries))
    return nbytes / best / 1e9


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_seconds(pid):
    """CPU seconds (user + system) so far of the server and each of its processes, by name:
    the API server, the engine core (the scheduler; the model too with ENGINE) and, with WORKER,
    the worker that runs the model."""
    import psutil

    out = {}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            name = "api_server" if p.pid == pid else p.name()
            t = p.cpu_times()
            out[name] = out.get(name, 0.0) + t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def resolve(env):
    libs = {"IOMP": iomp(), "TCMALLOC": tcmalloc()}
    out = {}
    for k, v in env.items():
        if k == "LD_PRELOAD" and v is not None:
            parts = [libs[p] for p in v.split(":")]
            if None in parts:
                return None  # a library this machine does not have
            v = ":".join(parts)
        out[k] = v
    return out


def run_setting(name, cfg, served, payloads, repeats, log_dir):
    env, args = SETTINGS[name]
    if env is not None:
        env = resolve(env)
        if env is None:
            return dict(setting=name, skipped="preload library not installed")
    started = time.perf_counter()
    proc, url = vllm_server.launch_server(served, cfg, os.path.join(log_dir, f"{name}.log"), env=env,
                                      extra_args=args or ())
    start_s = time.perf_counter() - started
    try:
        client = vllm_client.VLLMClient([url], served, timeout=600)
        client.map("/v1/completions", payloads)  # warm-up
        times, cpu = [], {}
        for _ in range(repeats):
            before = cpu_seconds(proc.pid)
            t = time.perf_counter()
            outs = client.map("/v1/completions", payloads)
            times.append(time.perf_counter() - t)
            cpu = {k: v - before.get(k, 0.0) for k, v in cpu_seconds(proc.pid).items()}
            tokens = sum(len(c["token_ids"]) for o in outs for c in o["choices"])
        return dict(setting=name, start_s=start_s, seconds=times, tokens=tokens, cpu_seconds=cpu)
    finally:
        vllm_server.stop_server(proc)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--repeats", type=int, default=2, choices=range(1, 100), metavar="N")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt_tokens", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--port", type=int, default=8031)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    params = sum(t.numel() for t in model.parameters())
    work = tempfile.mkdtemp(prefix="bench_generation_")
    served = os.path.join(work, "served")
    weight_sync.write_serving_dir(model.state_dict(), model.config, tok, served)
    served_bytes = sum(os.path.getsize(os.path.join(served, f)) for f in os.listdir(served) if f.endswith(".safetensors"))
    del model

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(min(100, tok.vocab_size // 2), tok.vocab_size, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.prompts)]
    cfg = Config(model_name_or_path=args.model, max_prompt_length=args.prompt_tokens, response_length=args.new_tokens,
                 vllm_port=args.port)
    payloads = [dict(model=served, prompt=ids, n=args.samples, max_tokens=args.new_tokens, temperature=0.7,
                     top_p=1.0, **vllm_client.NEUTRAL_SAMPLING, logprobs=0, return_token_ids=True, ignore_eos=True, seed=1 + i * args.samples)
                for i, ids in enumerate(prompts)]

    # the bounds, measured before any server runs
    gflops = matmul_gflops(CORES)
    gbps = copy_gbps()
    torch.set_num_threads(1)
    n_seq = args.prompts * args.samples
    flop = 2 * params * n_seq * (args.prompt_tokens + args.new_tokens)
    compute_s = flop / (gflops * 1e9)
    memory_s = args.new_tokens * served_bytes / (gbps * 1e9)  # one read of the weights per decode step
    print(f"{cpu_name()}, {CORES} cores; fp32 matmul {gflops:.0f} GFLOP/s ({CORES} threads), "
          f"memory copy {gbps:.1f} GB/s read")
    print(f"request: {n_seq} sequences x ({args.prompt_tokens} prompt + {args.new_tokens} new) tokens, "
          f"{params / 1e6:.1f} M parameters: {flop / 1e12:.2f} TFLOP -> compute bound {compute_s:.1f} s; "
          f"{args.new_tokens} decode steps x {served_bytes / 1e6:.0f} MB of weights -> memory bound {memory_s:.1f} s",
          flush=True)

    rows = []
    for name in args.settings.split(","):
        r = run_setting(name, cfg, served, payloads, args.repeats, work)
        rows.append(r)
        if "skipped" in r:
            print(f"{name:26s} skipped: {r['skipped']}", flush=True)
            continue
        best = min(r["seconds"])
        print(f"{name:26s} ready in {r['start_s']:.1f} s; " + ", ".join(f"{s:.1f} s" for s in r["seconds"]) +
              f"  -> {r['tokens'] / best:.0f} tokens/s, {compute_s / best:.2f} of the compute bound; CPU s in the "
              "last: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["cpu_seconds"].items())), flush=True)
    print(json.dumps(dict(cpu=cpu_name(), gflops=gflops, copy_gbps=gbps, compute_bound_s=compute_s,
                          memory_bound_s=memory_s, rows=rows)))


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
        flags = next(l for l in out.splitlines() if l.startswith("Flags"))
        avx = sorted({f for f in flags.split() if f.startswith("avx")})
        return f"{name} ({' '.join(avx) or 'no AVX'})"
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
