"""Benchmark the filesystem weight sync (weight_sync.write_weights + VLLMClient.reload_weights)
against model size, next to a plain memory copy of the same bytes, on a real vLLM CPU server.

    .venv/bin/python benchmarks/bench_sync.py                       # tiny (0.3 M) and Qwen2.5-0.5B shape
    .venv/bin/python benchmarks/bench_sync.py --models tiny,24m --repeats 5

Weights are random (make_tiny_model.SHAPES: tiny 0.3 M, 24m, 0.5b); the 0.5b model has Qwen2.5-0.5B's shape
(hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab 151936, tied embeddings) but
the 64-token character tokenizer, which is fine since every token id we send is < 64.
In float32 it is ~2 GB in the trainer and ~2.5 GB on the wire (the server gets an untied
lm_head); on 2 CPU cores its server takes a few minutes to start. Servers use ports
--port and --port + 1 and are stopped, and only they, when the script ends.
Times are the median over --repeats syncs after one warm-up; GB = 1e9 bytes.
"""

import os

# One thread here: the sync itself is single-threaded (safetensors write, and the server
# is launched with OMP_NUM_THREADS=1), so the copy baseline should be one core's memcpy too,
# and on a 2-core machine it leaves the other core to the server.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "tests")]  # make_tiny_model, helpers
import make_tiny_model  # noqa: E402
from infra import vllm_client  # noqa: E402
from infra import vllm_server  # noqa: E402
from infra import weight_sync  # noqa: E402
from config import Config  # noqa: E402
from helpers import logprob_diff, prompt_logprobs, trainer_logprobs  # noqa: E402

MODELS = {name: make_tiny_model.SHAPES[name] for name in ("tiny", "24m", "0.5b")}  # random weights
SEQS = [[7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 5, 6, 30, 31, 32, 33, 34]]  # token ids < 64


@torch.no_grad()
def perturb(model, seed):
    """Move every weight a little, so each sync carries new values the check can see."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g))


def max_diff(model, client):
    return logprob_diff(trainer_logprobs(model, SEQS), prompt_logprobs(client, SEQS))[1]


def copy_gbps(nbytes, tries=5):
    """Best-of-`tries` bandwidth of dst.copy_(src) for nbytes (bytes read once, written once)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)  # pages touched
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def bench(name, port, repeats, workdir):
    model = make_tiny_model.build_model(**MODELS[name]).eval()
    params = sum(p.numel() for p in model.parameters())  # a tied matrix counts once
    serving = os.path.join(workdir, name)  # on disk: the server only reads it at start
    weight_sync.write_serving_dir(weight_sync.full_state_dict(model), model.config, make_tiny_model.build_tokenizer(), serving)
    cfg = Config(max_prompt_length=32, response_length=16, vllm_startup_timeout=900)
    log = os.path.join(workdir, f"vllm_{name}.log")
    sync = weight_sync.FilesystemSync(None, 0, workdir)  # its directory: /dev/shm, as in training
    sync_dir = sync.dir
    t = time.perf_counter()
    proc, url = vllm_server.launch_server(serving, cfg, log, port=port)
    print(f"[{name}] {params / 1e6:.1f} M params, server up in {time.perf_counter() - t:.0f}s (log {log})", flush=True)
    try:
        # No retries: a retried reload would be timed as one; a generous timeout for 2.5 GB on one core.
        client = vllm_client.VLLMClient([url], serving, timeout=900, max_retries=0, proc=proc, log_path=log)
        writes, reloads = [], []
        for i in range(repeats + 1):  # i == 0 is the warm-up (first-touch page faults, first reload)
            perturb(model, seed=i)
            t0 = time.perf_counter()  # the sync's own path: parts of the serving copy, a file each
            nbytes = weight_sync.write_weights(weight_sync.serving_parts(model, 0), sync_dir)
            t1 = time.perf_counter()
            client.reload_weights(sync_dir)
            t2 = time.perf_counter()
            print(f"[{name}] {'warm-up' if i == 0 else f'rep {i}'}: write {t1 - t0:.3f}s  reload {t2 - t1:.3f}s",
                  flush=True)
            if i:
                writes.append(t1 - t0)
                reloads.append(t2 - t1)
        synced = max_diff(model, client)
        perturb(model, seed=repeats + 1)  # a change the server has not seen: the check must catch it
        stale = max_diff(model, client)
        print(f"[{name}] max |trainer - vLLM| logprob: {synced:.2e} after sync, {stale:.2e} unsynced", flush=True)
    finally:
        vllm_server.stop_server(proc)
        sync.close()
    del model, sd  # free the trainer copy before the baseline allocates 2 x nbytes
    write, reload = statistics.median(writes), statistics.median(reloads)
    total = statistics.median([w + r for w, r in zip(writes, reloads)])
    copy = copy_gbps(nbytes)
    return dict(model=name, params=params, bytes=nbytes, write=write, reload=reload, total=total,
                write_gbps=nbytes / write / 1e9, total_gbps=nbytes / total / 1e9, copy_gbps=copy,
                ratio=nbytes / total / 1e9 / copy, diff=synced)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,0.5b", help=f"comma separated, from {', '.join(MODELS)}")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per model, after one warm-up")
    p.add_argument("--port", type=int, default=8031, help="first server's port; the next model gets port + 1")
    args = p.parse_args()
    names = [m for m in args.models.split(",") if m]
    if unknown := [m for m in names if m not in MODELS]:
        p.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_sync_") as workdir:
        rows = []
        for i, name in enumerate(names):
            try:
                rows.append(bench(name, args.port + i, args.repeats, workdir))
            except vllm_client.VLLMError as e:  # one model's server failing should not lose the others' numbers
                print(f"[{name}] FAILED: {e}", flush=True)
    print(f"\nfilesystem weight sync, float32, median of {args.repeats}, {torch.get_num_threads()} trainer thread(s), "
          f"{time.perf_counter() - start:.0f}s in all\n")
    print("| model | params | bytes | write s | reload s | total s | write GB/s | total GB/s | copy GB/s "
          "| total / copy | max logprob diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:.1f} M | {r['bytes'] / 1e6:.1f} MB | {r['write']:.3f} "
              f"| {r['reload']:.3f} | {r['total']:.3f} | {r['write_gbps']:.2f} | {r['total_gbps']:.2f} "
              f"| {r['copy_gbps']:.2f} | {r['ratio']:.3f} | {r['diff']:.1e} |")


if __name__ == "__main__":
    main()
