"""Padded against packed micro-batches: forward + backward of one mini-batch, one process.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_packing.py                  # 24m, 8 x 8 sequences
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_packing.py --max_tokens 2048 --reps 5

The mini-batch is --prompts x --samples synthetic rollouts: a prompt of 8 to 11 tokens (like
the copy task's) and completions of --min_new to --max_new tokens, uniformly spread (RL's
completions end anywhere between a few tokens and the response length). Each side runs
sequence_logprobs, a DAPO loss over the mini-batch's tokens and backward for every
micro-batch of the mini-batch:

- padded: rows of --micro_batch sequences in rollout order, right-padded to the longest,
  with a 2-D attention mask, transformers' sdpa (the trainer's layout before packing);
- packed: the trainer's layout (packing.py), one row of up to --max_tokens tokens per
  micro-batch, position_ids restarting per sequence, no attention mask, attention by
  --attn_implementation (packed_sdpa: a slice per sequence; sdpa: one mask over the row).

The model is make_tiny_model.SHAPES[--model] with random weights, float32, not sharded (the
step's compute without FSDP's collectives). The two sides alternate (A B B A ...) in one
process, so a busy machine slows both alike; the ratio is of medians over --reps.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
from episodes import Sample  # noqa: E402


def rollouts(n_prompts, n_samples, min_new, max_new, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n_prompts):
        prompt = torch.randint(3, 64, (int(torch.randint(8, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n_samples):
            c = int(torch.randint(min_new, max_new + 1, (1,), generator=g))
            samples.append(Sample(prompt_ids=prompt, token_ids=torch.randint(3, 64, (c,), generator=g).tolist(),
                                logprobs=(-4 * torch.rand(c, generator=g)).tolist(),
                                adv=torch.randn(1, generator=g).item()))
    return samples


def mini_batch(model, batches, key, attn, cfg, denom):
    """Forward, loss and backward of every micro-batch; key: position_ids or attention_mask."""
    from loss import grpo_loss
    from infra.policy import sequence_logprobs

    model.config._attn_implementation = attn
    for b in batches:
        logp, _, _, _ = sequence_logprobs(model, b["input_ids"], b["mask"], 1.0, **{key: b[key]})
        loss, _ = grpo_loss(logp, b["vllm_logp"], b["adv"], b["seq_ids"], denom, cfg)
        loss.backward()
    model.zero_grad(set_to_none=True)


def main(argv=None):
    import torch

    import make_tiny_model
    import packing
    from config import Config

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="24m", choices=list(make_tiny_model.SHAPES))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--min_new", type=int, default=8)
    p.add_argument("--max_new", type=int, default=256)
    p.add_argument("--micro_batch", type=int, default=8, help="padded: sequences per row batch")
    p.add_argument("--max_tokens", type=int, default=Config.max_tokens_per_micro_batch,
                   help="packed: max_tokens_per_micro_batch")
    p.add_argument("--attn_implementation", default=Config.attn_implementation, help="packed side's attention")
    p.add_argument("--reps", type=int, default=3, help="timed mini-batches per side, after one untimed each")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = make_tiny_model.build_model(**make_tiny_model.SHAPES[args.model])
    samples = rollouts(args.prompts, args.samples, args.min_new, args.max_new)
    cfg = Config(loss_fn="dapo", num_unique_prompts_rollout=args.prompts, num_samples_per_prompt_rollout=args.samples,
                 max_prompt_length=11, response_length=args.max_new, max_tokens_per_micro_batch=args.max_tokens)
    denom = float(sum(len(s.token_ids) for s in samples))
    padded = [packing.collate_padded(samples[i:i + args.micro_batch], pad_id=0)
              for i in range(0, len(samples), args.micro_batch)]
    packed = [b for mbs, _, _ in packing.micro_batches(samples, cfg, 1, 0) for b in mbs]
    sides = {"padded": (padded, "attention_mask", "sdpa"), "packed": (packed, "position_ids", args.attn_implementation)}
    times = {name: [] for name in sides}
    for rep in range(args.reps + 1):
        for name in (("padded", "packed") if rep % 2 == 0 else ("packed", "padded")):
            t0 = time.perf_counter()
            mini_batch(model, *sides[name], cfg, denom)
            if rep:  # the first of each side warms up
                times[name].append(time.perf_counter() - t0)
            print(f"rep {rep} {name}: {time.perf_counter() - t0:.2f}s", file=sys.stderr, flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps(dict(
        model=args.model, threads=torch.get_num_threads(), sequences=len(samples),
        tokens=sum(map(packing.length, samples)), completion_tokens=int(denom),
        padded_tokens=sum(b["input_ids"].numel() for b in padded), padded_micro_batches=len(padded),
        packed_micro_batches=len(packed), max_tokens=args.max_tokens, attn_implementation=args.attn_implementation,
        seconds=times,
        padded_s=med["padded"], packed_s=med["packed"], speedup=med["padded"] / med["packed"],
        load=os.getloadavg()), indent=1))


if __name__ == "__main__":
    main()
