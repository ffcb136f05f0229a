"""Benchmark per-token logprobs + entropy: policy.token_logprobs (chunked, recomputed in
backward) against the naive float32 full-vocabulary path, forward + backward.

    .venv/bin/python benchmarks/bench_logprobs.py                        # vocab 151,936, 2,048 tokens, hidden 896
    .venv/bin/python benchmarks/bench_logprobs.py --chunk_sizes 1024,256 --repeats 3
    python benchmarks/bench_logprobs.py                                  # on a CUDA machine: the same on the GPU

Both variants take the same inputs: hidden states (N, H) and an LM head (V, H), float32,
both requiring gradients (Qwen2.5-0.5B's hidden size and vocabulary), and N target ids.
Entropy is logged, never differentiated, in both
variants; the loss is sum(c * logp) with random weights c, so a gradient flows through
every position. The naive path is what a trainer without chunking does:

    logits = (hidden @ weight.T).float() / T             # (N, V), all at once
    logp = log_softmax(logits).gather(targets)           # (N,)
    entropy = -(softmax(logits) * log_softmax(logits)).sum(-1), without gradient

Peak memory, measured honestly on each device:
  CUDA  torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus what was
        allocated before the call (the inputs): the extra memory forward + backward needs,
        the two gradients (N x H and V x H) included.
  CPU   every variant runs in a fresh subprocess that allocates and touches its inputs,
        reads its resident-set high-water mark (ru_maxrss), runs forward + backward once,
        and reads it again: the difference is the extra memory the call touched. The glibc
        allocator returns large blocks to the OS at once (they are mmap'ed), so the peak is
        not hidden by reuse; page granularity makes it exact to about a MB.
Times: the variants run interleaved in this process, one of each per round, after one
warm-up each (the accuracy pass); best-of and median over --repeats rounds. Values and
gradients of every variant, the naive one included, are compared with the same function
evaluated in float64: float32 sums over 151,936 terms carry errors of about 1e-5 on an
entropy of 12, whichever way they are ordered, so the naive path is no exact reference.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # policy without PYTHONPATH
from infra.policy import token_logprobs  # noqa: E402

TARGET = 0.25  # the chunked peak should be at most this fraction of the naive one


def inputs(n, hidden, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=g)).to(device).requires_grad_()
    # scaled in place: a (V, H) temporary freed here would raise the CPU high-water mark before
    # the call by its size, and hide that much of every variant's peak
    w = torch.randn(vocab, hidden, generator=g).mul_(0.02).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g).to(device)
    coef = torch.rand(n, generator=g).to(device)
    return h, w, targets, coef


def naive(h, w, targets, temperature):
    logits = (h @ w.t()).float() / temperature  # (N, V) float32
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def chunked(chunk_size):
    def fn(h, w, targets, temperature):
        logp, entropy, _, _ = token_logprobs(h, w, targets, temperature, chunk_size=chunk_size)
        return logp, entropy
    return fn


def run(fn, h, w, targets, coef, temperature):
    """Forward + backward; returns (logp, entropy) detached. Gradients land in h.grad, w.grad."""
    h.grad = w.grad = None
    logp, entropy = fn(h, w, targets, temperature)
    (coef * logp).sum().backward()
    return logp.detach(), entropy.detach()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def variants(chunk_sizes):
    out = {"naive float32": naive}
    for c in chunk_sizes:
        out[f"token_logprobs chunk {c}"] = chunked(c)
    return out


def peak_bytes(name, args, device):
    """Extra peak memory of one forward + backward of variant `name` (see the docstring)."""
    if device.type == "cuda":
        h, w, targets, coef = inputs(args.tokens, args.hidden, args.vocab, device)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(variants(args.chunk_sizes)[name], h, w, targets, coef, args.temperature)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del h, w, targets, coef
        torch.cuda.empty_cache()
        return peak
    cmd = [sys.executable, os.path.abspath(__file__), "--_measure", name, "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--temperature", str(args.temperature),
           "--chunk_sizes", ",".join(map(str, args.chunk_sizes))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak"]


def measure_in_this_process(args):
    """The CPU subprocess: inputs touched, high-water mark before and after one call."""
    h, w, targets, coef = inputs(args.tokens, args.hidden, args.vocab, torch.device("cpu"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    run(variants(args.chunk_sizes)[args._measure], h, w, targets, coef, args.temperature)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak": (after - before) * 1024}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="positions N")
    p.add_argument("--hidden", type=int, default=896, help="hidden size H (Qwen2.5-0.5B)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary V (Qwen2.5)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk_sizes", default="1024,256,128", help="comma separated; 256 is token_logprobs' default")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, one of each variant per round")
    p.add_argument("--_measure", default=None, help=argparse.SUPPRESS)  # internal: the CPU subprocess
    args = p.parse_args()
    args.chunk_sizes = [int(c) for c in str(args.chunk_sizes).split(",") if c]
    torch.manual_seed(0)
    if args._measure:
        return measure_in_this_process(args)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    fns = variants(args.chunk_sizes)
    print(f"logprobs + entropy, forward + backward: N={args.tokens} tokens, H={args.hidden}, V={args.vocab}, "
          f"float32, on {where}; naive logits alone are {args.tokens * args.vocab * 4 / 1e9:.2f} GB", flush=True)

    # --- memory (fresh state per variant)
    peaks = {name: peak_bytes(name, args, device) for name in fns}

    # --- values and gradients against a float64 evaluation of the same function
    h, w, targets, coef = inputs(args.tokens, args.hidden, args.vocab, device)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = run(naive, h64, w64, targets, coef.double(), args.temperature) + (h64.grad, w64.grad)
    del h64, w64
    diffs, times = {}, {name: [] for name in fns}
    for name, fn in fns.items():
        logp, entropy = run(fn, h, w, targets, coef, args.temperature)
        got = (logp, entropy, h.grad, w.grad)
        # values: max absolute error; gradients: max absolute error over the largest exact entry
        diffs[name] = [(a.double() - b).abs().max().item() / (1 if i < 2 else b.abs().max().item())
                       for i, (a, b) in enumerate(zip(got, exact))]
        del got
    del exact

    # --- time, interleaved: one of each per round
    for _ in range(args.repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            run(fn, h, w, targets, coef, args.temperature)
            sync(device)
            times[name].append(time.perf_counter() - t0)

    naive_peak, naive_time = peaks["naive float32"], min(times["naive float32"])
    print("\n| variant | peak GB | x naive peak | s best | s median | x naive time (best) | logp err | "
          "entropy err | grad hidden rel err | grad weight rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in fns:
        d = diffs[name]
        print(f"| {name} | {peaks[name] / 1e9:.3f} | {peaks[name] / naive_peak:.3f} | {min(times[name]):.3f} | "
              f"{statistics.median(times[name]):.3f} | {min(times[name]) / naive_time:.2f} | {d[0]:.1e} | {d[1]:.1e} | "
              f"{d[2]:.1e} | {d[3]:.1e} |")
    print(f"\nerrors are against the same function in float64 (values: max absolute; gradients: max absolute over the "
          f"largest exact entry); GB = 1e9 bytes; {args.repeats} timed rounds after one warm-up")
    for name in fns:
        if name == "naive float32":
            continue
        ratio = peaks[name] / naive_peak
        ok = max(diffs[name][:2]) <= max(1e-5, max(diffs["naive float32"][:2]))
        print(f"{name}: peak <= {TARGET} x naive: {'met' if ratio <= TARGET else 'NOT met'} ({ratio:.3f}); values "
              f"within 1e-5 of float64 or no further than the naive path's: {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
