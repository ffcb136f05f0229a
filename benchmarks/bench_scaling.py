"""How the training step's cost grows with world size and model size. Generation is
excluded: the step trains on fixed synthetic rollouts, no vLLM server is involved.

    .venv/bin/python benchmarks/bench_scaling.py                                   # tiny, 24m, 0.5b x 1, 2 ranks
    .venv/bin/python benchmarks/bench_scaling.py --models tiny,24m --steps 5
    python benchmarks/bench_scaling.py --models 0.5b,1.5b --worlds 1 --max_tokens 16384   # one GPU: adds MFU

The step is update.train_on_batch followed by EMAReference.update(), exactly as
train.py runs them: old logprobs (one no-grad forward, needed since the batch is cut
into --num_mini_batches optimizer steps), reference logprobs (one no-grad forward,
--beta > 0), then per mini-batch forward + loss + backward, gradient clipping and AdamW,
then the EMA update. The rollouts are --prompts x --samples sequences of a ~10-token
prompt (like the copy task's) and exactly --new_tokens completion tokens, random ids.
Models are make_tiny_model.SHAPES with random weights (tiny 0.3 M, 24m, Qwen2.5-0.5B's
and -1.5B's shapes), sharded by train.load_model (FSDP2).

Each (model, world size) cell is one torchrun job; on a CPU the cores are split evenly
between the ranks (OMP_NUM_THREADS = cores // world, or --threads_per_rank), so a row
compares the same machine used by 1 process or by 2. Step time is the slowest rank's,
median (and best) over --steps timed steps after --warmup. The profile columns are
measured separately in the same job: one no-grad logprob pass over the whole batch (the
step runs two: old and reference) and one EMA update; --profile N prints the top N
operators of one step under torch.profiler.

On CUDA the model runs in bf16 (MixedPrecisionPolicy, fp32 master weights and
reductions) and MFU is printed: model FLOPs per step / step time / --peak_tflops. The peak
(torch.cuda.max_memory_allocated) is printed beside the memory plan at the step's largest
micro-batch (memory.at_tokens, less the CUDA context the allocator does not see);
--memory_fraction F holds the process to that share of its GPU (a step that does not fit fails).
Model FLOPs count every matrix product the step asks for, once: a forward pass costs
2 x (non-embedding parameters) x (prompt + completion tokens) + 2 x vocab x hidden x
(completion tokens, the only positions the LM head is applied to), a backward twice
that; the step runs (no-grad passes + 3 x mini-batch passes) forwards' worth.
Recomputation (the chunked LM head is recomputed in backward) and attention's
score/value products (under 1% at these lengths) are not counted: this is MFU, not
hardware utilisation.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
from episodes import Sample  # noqa: E402


def synthetic_rollouts(n_prompts, n_samples, new_tokens, vocab, seed=0):
    """Fixed rollouts: the same on every rank and in every world size."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hi = min(vocab, 64)  # ids of the character tokenizer; any id < vocab would do
    samples = []
    for _ in range(n_prompts):
        prompt = torch.randint(3, hi, (int(torch.randint(8, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n_samples):
            samples.append(Sample(prompt_ids=prompt, token_ids=torch.randint(3, hi, (new_tokens,), generator=g).tolist(),
                                logprobs=(-4 * torch.rand(new_tokens, generator=g)).tolist(),
                                adv=torch.randn(1, generator=g).item()))
    return samples


def worker(args):
    """One (model, world size) cell, under torchrun. Rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    from infra import memory
    import train
    import update
    from config import Config
    from packing import batch_plan
    from reference import EMAReference

    cfg = Config(model_name_or_path=args.model_dir, num_unique_prompts_rollout=args.prompts,
                 num_samples_per_prompt_rollout=args.samples, response_length=args.new_tokens,
                 max_tokens_per_micro_batch=args.max_tokens, num_mini_batches=args.num_mini_batches,
                 beta=args.beta, ref_policy_update_freq=1, learning_rate=1e-6,
                 vllm_logp_tolerance=1e9)  # random vLLM logprobs: no sync to check
    rank, world, device, mesh = train.setup_distributed(cfg)
    batch_plan(cfg, world)
    trainer_plan = gpu_plan(cfg, args.model_dir, world, device, args.memory_fraction)
    torch.manual_seed(0)
    policy = train.load_model(cfg, device, mesh)
    ref = EMAReference(train.load_model(cfg, device, mesh), policy, cfg.alpha)
    state = update.TrainState(policy, ref, *train.make_optimizer(cfg, policy, 10 ** 6, device))
    samples = synthetic_rollouts(args.prompts, args.samples, args.new_tokens, policy.config.vocab_size)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def timed(fn, n):
        out = []
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t0)
        t = torch.tensor(out, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is done when the slowest rank is
        return t.tolist()

    tokens = [0]  # the largest micro-batch a step ran: the plan's step figure

    def step():
        m = update.train_on_batch(cfg, state, samples, rank, world, device)
        tokens[0] = max(tokens[0], m["micro_batch_tokens"])
        ref.update()

    from dataclasses import replace

    from packing import micro_batches
    batches = [b for mbs, _, _ in micro_batches(samples, replace(cfg, num_mini_batches=1), world, rank) for b in mbs]

    @torch.no_grad()
    def logprob_pass():  # what the old or the reference logprobs cost
        for b in batches:
            policy.sequence_logprobs(b["input_ids"].to(device), b["mask"].to(device), cfg.temperature,
                                     position_ids=b["position_ids"].to(device))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed(step, args.warmup)
    steps = timed(step, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None
    # the plan at that micro-batch, less what the allocator does not see (the CUDA context)
    planned = (memory.at_tokens(trainer_plan, tokens[0]) - trainer_plan["runtime"]) / 2 ** 30 if trainer_plan else None
    timed(logprob_pass, 1)
    fwd = timed(logprob_pass, max(1, min(3, args.steps)))
    ema = timed(ref.update, max(1, min(3, args.steps)))

    if args.profile:  # one more step under the profiler; rank 0 prints its top operators
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            step()
            sync()
        if rank == 0:
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(f"profile of one step, {args.name}, world {world}, top operators by {key}:")
            print(prof.key_averages().table(sort_by=key, row_limit=args.profile), flush=True)

    cfg_hf = policy.config
    params = sum(p.numel() for p in policy.parameters())
    emb = cfg_hf.vocab_size * cfg_hf.hidden_size
    body = params - emb * (1 if cfg_hf.tie_word_embeddings else 2)
    t_all = sum(len(s.prompt_ids) + len(s.token_ids) for s in samples)
    t_comp = sum(len(s.token_ids) for s in samples)
    fwd_flops = 2 * body * t_all + 2 * emb * t_comp
    passes = (1 if cfg.num_mini_batches > 1 else 0) + (1 if cfg.beta > 0 else 0) + 3 * cfg.num_epochs
    if rank == 0:
        print(json.dumps(dict(model=args.name, world=world, params=params, threads=torch.get_num_threads(),
                              device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              step_median=statistics.median(steps), step_best=min(steps), steps=len(steps),
                              logprob_pass=statistics.median(fwd), ema=statistics.median(ema),
                              tokens=t_all, completion_tokens=t_comp, step_flops=fwd_flops * passes,
                              forward_passes=passes, peak_gib=peak, plan_gib=planned)), flush=True)
    dist.destroy_process_group()


def gpu_plan(cfg, model_dir, world, device, fraction):
    """On a GPU: a rank's memory plan (memory.trainer_plan), and with --memory_fraction this process
    held to that share of its GPU (torch.cuda.set_per_process_memory_fraction: a step that does not
    fit fails). None on a CPU."""
    if device.type != "cuda":
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from infra import memory

    mc = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(mc)
    if fraction:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    return memory.trainer_plan(cfg, mc, meta, world, cuda=True)


def run_cell(args, name, model_dir, world, port):
    env = dict(os.environ)
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // world)
    env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(port),
           os.path.abspath(__file__), "--_worker", model_dir, "--_name", name]
    for k in ("steps", "warmup", "prompts", "samples", "new_tokens", "max_tokens", "num_mini_batches", "beta",
              "profile"):
        cmd += [f"--{k}", str(getattr(args, k))]
    cmd += ["--memory_fraction", str(args.memory_fraction)] if args.memory_fraction else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if args.profile:
        print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("{")), flush=True)
    if proc.returncode or not lines:
        print(f"[{name} x {world}] FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
        return None
    row = json.loads(lines[-1])
    print(f"[{name} x {world}] step {row['step_median']:.3f}s median ({row['steps']} steps), "
          f"job {time.perf_counter() - t0:.0f}s", flush=True)
    return row


def main():
    import make_tiny_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,24m,0.5b", help=f"comma separated, from {', '.join(make_tiny_model.SHAPES)}")
    p.add_argument("--worlds", default="1,2", help="comma separated world sizes (ranks of one torchrun job)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per cell")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--big_steps", type=int, default=None, help="timed steps for 0.5b and 1.5b (default --steps)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--max_tokens", type=int, default=4096, help="max_tokens_per_micro_batch (packed)")
    p.add_argument("--num_mini_batches", type=int, default=2, help="> 1 makes the step compute old logprobs")
    p.add_argument("--beta", type=float, default=0.1, help="> 0 makes the step compute reference logprobs")
    p.add_argument("--profile", type=int, default=0, help="print this many top operators of one profiled step")
    p.add_argument("--threads_per_rank", type=int, default=None, help="CPU: default cores // world size")
    p.add_argument("--peak_tflops", type=float, default=989.0,
                   help="CUDA: dense bf16 peak for MFU (989 = H100 SXM datasheet, without sparsity)")
    p.add_argument("--memory_fraction", type=float, default=None,
                   help="CUDA: torch.cuda.set_per_process_memory_fraction for the trainer (e.g. what a colocated server leaves)")
    p.add_argument("--port", type=int, default=29670, help="torchrun master port; each cell takes the next")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_name", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._worker:
        args.model_dir, args.name = args._worker, args._name
        return worker(args)
    names, worlds = args.models.split(","), [int(w) for w in args.worlds.split(",")]
    if unknown := [m for m in names if m not in make_tiny_model.SHAPES]:
        p.error(f"unknown model(s) {unknown}; choose from {list(make_tiny_model.SHAPES)}")
    print(f"training step on synthetic rollouts ({args.prompts} prompts x {args.samples} samples x "
          f"{args.new_tokens} new tokens), generation EXCLUDED; {os.cpu_count()} cores; "
          f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}", flush=True)
    rows, port = [], args.port
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"bench_scaling_{name}_") as model_dir:
            make_tiny_model.build_model(**make_tiny_model.SHAPES[name]).save_pretrained(model_dir)
            cell_args = argparse.Namespace(**vars(args))
            if name in ("0.5b", "1.5b") and args.big_steps:
                cell_args.steps = args.big_steps
            for world in worlds:
                rows.append(run_cell(cell_args, name, model_dir, world, port))
                port += 1
    rows = [r for r in rows if r]
    cuda = any(r["device"] != "cpu" for r in rows)
    print(f"\n| model | params | ranks | threads/rank | step s median | step s best | steps | x 1-rank step "
          f"| no-grad logprob pass s | EMA update s |" +
          (" peak GiB | plan GiB | peak / plan | TFLOP/step | MFU |" if cuda else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|---|" if cuda else ""))
    one = {r["model"]: r["step_median"] for r in rows if r["world"] == 1}
    for r in rows:
        rel = f"{r['step_median'] / one[r['model']]:.2f}" if r["model"] in one else "-"
        line = (f"| {r['model']} | {r['params'] / 1e6:.1f} M | {r['world']} | {r['threads']} | {r['step_median']:.3f} "
                f"| {r['step_best']:.3f} | {r['steps']} | {rel} | {r['logprob_pass']:.3f} | {r['ema']:.4f} |")
        if cuda:
            mfu = r["step_flops"] / r["step_median"] / (args.peak_tflops * 1e12 * r["world"])
            line += (f" {r['peak_gib']:.2f} | {r['plan_gib']:.2f} | {r['peak_gib'] / r['plan_gib']:.2f} "
                     f"| {r['step_flops'] / 1e12:.2f} | {100 * mfu:.1f}% |")
        print(line)
    if rows:
        r = rows[0]
        print(f"\n{r['tokens']} tokens a step ({r['completion_tokens']} completion); {r['forward_passes']} forward "
              f"passes' worth of FLOPs per step; device {r['device']}" +
              (f"; MFU against {args.peak_tflops:.0f} TFLOP/s per GPU" if cuda else ""))


if __name__ == "__main__":
    main()
