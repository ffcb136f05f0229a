"""Benchmark the EMA reference update ref <- lerp(ref, policy, alpha) against the per-parameter
loop other trainers use and against plain memory-bound kernels over the same bytes.

    .venv/bin/python benchmarks/bench_ema.py                               # one process (a world of one)
    .venv/bin/torchrun --nproc_per_node 2 benchmarks/bench_ema.py          # 2 CPU ranks, half the shards each
    .venv/bin/python benchmarks/bench_ema.py --repeats 5 --warmup 1        # quicker
    python benchmarks/bench_ema.py                                         # on a CUDA machine: the GPU's shards

The model has Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14/2 heads, intermediate 4864,
vocab 151936, tied embeddings) with random weights: 494 M fp32 parameters, ~2 GB a copy.
Rank 0 saves it once to a temporary directory and every rank loads it twice (policy and
reference) with train.load_model, so the shards are exactly the trainer's FSDP2 shards.
Each rank briefly holds full models before sharding: ~4 GB a rank at peak, then 2 GB of
shards plus 3 flat buffers of its shard size (~10 GB in all for one or two ranks).

Rows, each over this rank's shard bytes B (fp32):
  foreach lerp   reference.EMAReference.update(): one torch._foreach_lerp_ over local shards
  param loop     r.mul_(1 - alpha).add_(p, alpha=alpha) per parameter (TRL's sync callback,
                 open-instruct), on the same local shards: the loop itself, no gather
  param lerp_    r.lerp_(p, alpha) per parameter: one plain kernel per shard, no foreach
  flat lerp      torch.lerp on one flat tensor of B bytes (the kernel without the foreach)
  triad          STREAM triad a = b + alpha * c on one flat tensor: read two, write one
  triad in place b += alpha * c: the same, but written where it was read, like the EMA;
                 a store to a third buffer costs the CPU a read for ownership first (4 x B
                 on the bus, not 3), so in-place kernels can beat the triad by up to 4/3
  copy           a.copy_(b), for reference
GB/s counts 3 x B per update (read ref, read policy, write ref; 2 x B for copy), summed over
ranks, over the slowest rank's time; the loop really moves 5 x B (mul_ reads and writes
ref, add_ reads both and writes ref), which is why it is slower. GB = 1e9 bytes.
On CUDA the shards and buffers live on the GPU, each timing is bracketed by
torch.cuda.synchronize(), and the copy row is the device-to-device copy bandwidth the
last line compares the update with. The methods run interleaved, one of each per round, so load from other jobs on a shared
machine hits them alike; best-of is the number to compare, the median shows the noise.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]  # make_tiny_model, and train / config without PYTHONPATH
import make_tiny_model  # noqa: E402
import train  # noqa: E402
from config import Config  # noqa: E402
from reference import EMAReference, local  # noqa: E402

QWEN_05B = dict(vocab_size=151936, hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864,
                tie_word_embeddings=True)
TARGET = 0.9  # EMAReference.update() should reach this fraction of the triad's bandwidth


def load_pair(rank, device, mesh):
    """Policy and reference, sharded by train.load_model from one random model saved by rank 0."""
    tmp = tempfile.TemporaryDirectory(prefix="bench_ema_") if rank == 0 else None
    if rank == 0:  # the built model is dropped right after saving: only the shards stay in memory
        make_tiny_model.build_model(**QWEN_05B).save_pretrained(tmp.name)
    path = [tmp.name if tmp else None]
    dist.broadcast_object_list(path, src=0)
    cfg = Config(model_name_or_path=path[0])
    policy = train.load_model(cfg, device, mesh)
    ref = train.load_model(cfg, device, mesh, reference=True)
    dist.barrier()  # every rank has read the files before rank 0 deletes them
    if tmp:
        tmp.cleanup()
    return policy, ref


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=10, help="timed rounds (one of each method per round)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--alpha", type=float, default=0.6, help="EMA weight on the policy (open-instruct's default)")
    args = p.parse_args()
    rank, world, device, mesh = train.setup_distributed(Config())
    say = print if rank == 0 else (lambda *a, **k: None)
    t_load = time.perf_counter()
    policy, ref = load_pair(rank, device, mesh)
    ema, alpha = EMAReference(ref, policy, args.alpha), args.alpha
    n = sum(local(r).numel() for r in ref.parameters())  # this rank's shard elements, fp32
    shards = [None] * world
    dist.all_gather_object(shards, n)
    total = sum(p.numel() for p in ref.parameters())
    say(f"{total / 1e6:.1f} M parameters ({4 * total / 1e9:.2f} GB a copy), world {world}, "
        f"torch threads per rank {torch.get_num_threads()}, loaded in {time.perf_counter() - t_load:.0f} s")
    for r, k in enumerate(shards):
        say(f"  rank {r}: {k / 1e6:.1f} M elements, {4 * k / 1e9:.3f} GB of shards per model")

    # Collectives during one update, counted on the dispatcher: the update must be local.
    with CommDebugMode() as comm:
        ema.update()
    collectives = torch.tensor(comm.get_total_counts(), device=device)
    dist.all_reduce(collectives)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def param_lerp():
        for r, q in zip(ref.parameters(), policy.parameters()):
            local(r).lerp_(local(q), alpha)

    def param_loop():
        for r, q in zip(ref.parameters(), policy.parameters()):
            local(r).mul_(1 - alpha).add_(local(q), alpha=alpha)

    # Flat buffers of the same size, filled so their pages are touched before timing.
    a, b, c = torch.zeros(n, device=device), torch.ones(n, device=device), torch.full((n,), 2.0, device=device)
    methods = {  # name: (function, bytes moved per element / 4 bytes)
        "foreach lerp (EMAReference)": (ema.update, 3),
        "param loop (mul_/add_)": (param_loop, 3),
        "param lerp_ (one kernel each)": (param_lerp, 3),
        "flat lerp": (lambda: torch.lerp(b, c, alpha, out=a), 3),
        "triad (add)": (lambda: torch.add(b, c, alpha=alpha, out=a), 3),
        "triad in place (add_)": (lambda: b.add_(c, alpha=alpha), 3),
        "copy": (lambda: a.copy_(b), 2),
    }
    times = {name: [] for name in methods}
    for i in range(args.warmup + args.repeats):
        for name, (fn, _) in methods.items():
            dist.barrier()  # ranks start together: they share the memory bus, as in training
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                fn()
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    del a, b, c

    rows = {}
    for name, (_, passes) in methods.items():
        t = torch.tensor(times[name], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # an update is done when the slowest rank is
        best, med = t.min().item(), statistics.median(t.tolist())
        gb = passes * 4 * sum(shards) / 1e9
        rows[name] = (best, med, gb / best, gb / med)
    tb, tm = rows["triad (add)"][2:]
    say("\n| method | s/update best | s/update median | GB/s best | GB/s median | x triad best | x triad median |")
    say("|---|---|---|---|---|---|---|")
    for name, (best, med, bw_best, bw_med) in rows.items():
        say(f"| {name} | {best:.3f} | {med:.3f} | {bw_best:.1f} | {bw_med:.1f} | {bw_best / tb:.2f} | {bw_med / tm:.2f} |")
    ratio = rows["foreach lerp (EMAReference)"][2] / tb
    ratio_in_place = rows["foreach lerp (EMAReference)"][2] / rows["triad in place (add_)"][2]
    ratio_copy = rows["foreach lerp (EMAReference)"][2] / rows["copy"][2]
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads a rank"
    say(f"\ndevice: {where}; foreach lerp at {ratio_copy:.2f} x the copy bandwidth ({rows['copy'][2]:.0f} GB/s, "
        f"bytes read + written)")
    if device.type == "cuda":  # where an update's time goes: kernels on the device, or launching them
        from torch.profiler import ProfilerActivity, profile
        ema.update()
        sync()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ema.update()
            sync()
        wall = time.perf_counter() - t0
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.device_time for e in kernels) / 1e6  # microseconds -> seconds
        say(f"one profiled update: {len(kernels)} kernels, {1e3 * busy:.2f} ms on the device "
            f"({3 * 4 * shards[rank] / busy / 1e9:.0f} GB/s while busy), {1e3 * wall:.2f} ms wall under the profiler")
    say(f"collectives during EMAReference.update(): {collectives.item()} (must be 0)")
    say(f"target foreach lerp >= {TARGET} x triad bandwidth (best-of): {'met' if ratio >= TARGET else 'NOT met'} "
        f"({ratio:.2f}; {ratio_in_place:.2f} x the in-place triad); world {world}, torch.get_num_threads() = {torch.get_num_threads()} per rank, "
        f"{args.repeats} rounds after {args.warmup} warm-up")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
