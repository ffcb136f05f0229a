"""Peak activation memory per rank of one long sequence's forward + backward under sequence parallelism.

    python benchmarks/bench_sequence_parallel.py                        # 8,192 tokens, S = 1, 2 and 4 (4 CPU ranks)
    python benchmarks/bench_sequence_parallel.py --tokens 4096 --sizes 1,2

Builds the 24 M Qwen2 shape (make_tiny_model.SHAPES["24m"]: hidden 512, 8 layers, 8 heads,
2 KV heads, vocabulary 64) in code and, for each S, runs one torchrun job of S ranks with
sequence_parallel_size=S (S = 1: one plain process): FSDP2 shards the model over the S
ranks (train.load_model), every rank takes its piece of one packed row of --tokens tokens
(a 256-token prompt, the rest completion; sequence_parallel.piece), runs
policy.sequence_logprobs (the all-to-alls around attention), a CISPO loss over the step's
tokens and backward, as update.py does for one micro-batch. Memory is torch's MemTracker
(bytes of live tensors by category, the allocator's cache not counted): activations are
what the forward keeps for backward plus the backward's temporaries (its ACT and TMP at
the moment of the peak); the parameters and gradients, also divided by S under FSDP, are
shown apart. Each job first runs the sequence at half the length, so the script reports
how activations grow with the tokens a rank holds and how long a sequence one rank holds
in a given activation budget (--budget_gib) at each S, without running one that does
not fit.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
from episodes import Sample  # noqa: E402
PROMPT = 256


def one_step(policy, cfg, tokens, rank, size, device):
    """Forward and backward of this rank's piece of one sequence of `tokens` tokens; its loss."""
    import torch

    from loss import grpo_loss
    from packing import collate
    from sequence_parallel import piece

    g = torch.Generator().manual_seed(0)
    sample = Sample(prompt_ids=torch.randint(3, 64, (PROMPT,), generator=g).tolist(),
                  token_ids=torch.randint(3, 64, (tokens - PROMPT,), generator=g).tolist(),
                  logprobs=[-1.0] * (tokens - PROMPT), adv=1.0)
    b = collate([sample])
    b = piece(b, rank % size, size) if size > 1 else b
    extra = {k: b[k].to(device) for k in ("targets", "row_position_ids") if k in b}
    logp, _, _, _ = policy.sequence_logprobs(b["input_ids"].to(device), b["mask"].to(device), 1.0,
                                             position_ids=b["position_ids"].to(device), **extra)
    loss, _ = grpo_loss(logp, logp.detach() - 0.01, b["adv"].to(device), b["seq_ids"].to(device),
                        float(tokens - PROMPT), cfg)
    (loss * size).backward()
    return loss.detach()


def worker(args):
    """One S, under torchrun: rank 0 prints one JSON line with every rank's peaks."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    import train
    from config import Config

    cfg = Config(model_name_or_path=args._worker, loss_fn="cispo", sequence_parallel_size=args._size,
                 activation_checkpointing=args.activation_checkpointing)
    rank, world, device, mesh = train.setup_distributed(cfg)
    torch.manual_seed(0)
    attn, _ = train.model_doors(cfg)  # its rank groups and attention
    policy = train.load_model(cfg, device, mesh, attn=attn)
    rows = []
    for tokens in (args.tokens // 2, args.tokens):
        tracker = MemTracker()
        tracker.track_external(policy)
        dist.barrier()
        t0 = time.perf_counter()
        with tracker:
            loss = one_step(policy, cfg, tokens, rank, args._size, device)
        seconds = time.perf_counter() - t0
        peak = tracker.get_tracker_snapshot("peak")[device]  # the categories at the moment of the total's peak
        dist.all_reduce(loss)
        policy.zero_grad(set_to_none=True)
        rows.append(dict(tokens=tokens, seconds=seconds, loss=loss.item(), total=peak["Total"],
                         activations=peak.get("Activation", 0) + peak.get("Temp", 0),
                         weights=peak.get("Parameter", 0) + peak.get("Gradient", 0)))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print(json.dumps(dict(size=args._size, ranks=gathered)), flush=True)
    del policy
    train.close_distributed()


def run_size(args, model_dir, size, port):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_rank))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    me = [os.path.abspath(__file__), "--_worker", model_dir, "--_size", str(size), "--tokens", str(args.tokens)]
    me += ["--activation_checkpointing"] if args.activation_checkpointing else []
    cmd = [sys.executable, *me] if size == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(size), "--master_port", str(port), *me]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        sys.exit(f"S={size} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the sequence (256 of prompt, the rest completion)")
    p.add_argument("--sizes", default="1,2,4", help="comma separated sequence_parallel_size values (ranks of one job)")
    p.add_argument("--threads_per_rank", type=int, default=1)
    p.add_argument("--activation_checkpointing", action="store_true")
    p.add_argument("--budget_gib", type=float, default=1.0, help="activation memory of one rank, for the fits line")
    p.add_argument("--port", type=int, default=29780, help="torchrun master port; each S takes the next")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    p.add_argument("--_size", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._worker:
        return worker(args)

    import make_tiny_model

    model_dir = tempfile.mkdtemp(prefix="bench_sp_")
    make_tiny_model.build_model(**make_tiny_model.SHAPES["24m"], max_position_embeddings=4 * args.tokens) \
        .save_pretrained(model_dir)
    results = [run_size(args, model_dir, int(s), args.port + i) for i, s in enumerate(args.sizes.split(","))]
    mib = 2 ** 20
    print(f"24 M Qwen2 shape, one sequence of {args.tokens} tokens ({PROMPT} prompt), forward + backward, "
          f"activation_checkpointing={args.activation_checkpointing}, {args.threads_per_rank} thread(s) per rank, "
          "peak by MemTracker")
    print("| S | ranks | tokens per rank | activations per rank (MiB, max over ranks) | vs S=1 | params + grads per rank "
          "(MiB) | peak per rank (MiB) | seconds | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for r in results:
        long = [rank_rows[1] for rank_rows in r["ranks"]]
        act = max(x["activations"] for x in long)
        base = base or act
        print(f"| {r['size']} | {len(long)} | {args.tokens // r['size']} | {act / mib:.1f} | {act / base:.2f} | "
              f"{max(x['weights'] for x in long) / mib:.1f} | {max(x['total'] for x in long) / mib:.1f} | "
              f"{max(x['seconds'] for x in long):.1f} | {long[0]['loss']:.6f} |")
    for r in results:  # activations are linear in the tokens a rank holds (attention runs sequence by sequence, O(L))
        short, long = (max(x[i]["activations"] for x in r["ranks"]) for i in (0, 1))
        per_token = (long - short) / (args.tokens - args.tokens // 2)
        fits = int((args.budget_gib * 2 ** 30 - (long - per_token * args.tokens)) / per_token)
        print(f"S={r['size']}: {per_token / 1024:.1f} KiB of activations per token of the sequence on each rank "
              f"({args.tokens // 2} -> {args.tokens} tokens: {short / mib:.1f} -> {long / mib:.1f} MiB); "
              f"{args.budget_gib:g} GiB per rank holds a sequence of about {fits} tokens")


if __name__ == "__main__":
    main()
