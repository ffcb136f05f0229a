"""Peak memory of one training micro-batch without and with activation checkpointing.

    python benchmarks/bench_memory.py                          # the 24 M Qwen2 shape, 4 sequences of 256 tokens
    python benchmarks/bench_memory.py --batch 8 --seq-len 1024

Builds a random model in code (hidden 512, 8 layers, 8 heads, 2 KV heads, MLP 1536,
vocabulary 64: 24.2 M parameters), shards it with parallel.load_model in a world of one
(FSDP2; gloo on CPU, nccl on a GPU) and runs the training path of train.py on one
micro-batch: policy.sequence_logprobs (chunked, checkpointed LM head), a CISPO loss,
backward. Once with activation_checkpointing=False, once with True, in one process.
Peak: torch.cuda.max_memory_allocated on a GPU; on CPU, torch's MemTracker (bytes of the
tensors alive at the peak: parameters, gradients, activations, temporaries; the
allocator's cache is not counted, there is none to count on CPU).
"""

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]


def step(model, batch, device):
    """One micro-batch of training: forward, loss, backward."""
    from config import Config
    from loss import grpo_loss

    ids, attn, mask = (batch[k].to(device) for k in ("input_ids", "attention_mask", "mask"))
    logp, _, _, _ = model.sequence_logprobs(ids, mask, 1.0, attention_mask=attn)
    old_logp = logp.detach() - 0.01
    seq_ids = mask.nonzero()[:, 0]  # the row of each completion token
    loss, _ = grpo_loss(logp, old_logp, torch.ones_like(logp), seq_ids, float(logp.numel()), Config(loss_fn="cispo"))
    loss.backward()
    return loss.item()


def peak_bytes(cfg, batch, device, mesh):
    """(peak bytes, seconds, loss) of one micro-batch on a freshly sharded model."""
    from infra.parallel import load_model

    model = load_model(cfg, device, mesh)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = step(model, batch, device)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), time.perf_counter() - t0, loss
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    t0 = time.perf_counter()
    with tracker:
        loss = step(model, batch, device)
    seconds = time.perf_counter() - t0
    return tracker.get_tracker_snapshot("peak")[device]["Total"], seconds, loss


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4, help="sequences in the micro-batch")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence; the second half is the completion")
    args = p.parse_args()

    import make_tiny_model
    from config import Config
    from infra.parallel import setup_distributed

    model_dir = tempfile.mkdtemp(prefix="bench_memory_")
    model = make_tiny_model.build_model(hidden_size=512, layers=8, heads=8, kv_heads=2, intermediate_size=1536)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    del model
    _, _, device, mesh = setup_distributed(Config(model_name_or_path=model_dir))
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(args.batch, args.seq_len - 1, dtype=torch.bool)
    mask[:, args.seq_len // 2:] = True
    batch = dict(input_ids=torch.randint(3, 64, (args.batch, args.seq_len), generator=g),
                 attention_mask=torch.ones(args.batch, args.seq_len, dtype=torch.long), mask=mask)
    results = {}
    for ac in (False, True):
        torch.manual_seed(0)
        cfg = Config(model_name_or_path=model_dir, activation_checkpointing=ac)
        results[ac] = peak_bytes(cfg, batch, device, mesh)
    print(f"model: Qwen2 shape, {n_params / 1e6:.1f} M parameters; micro-batch {args.batch} x {args.seq_len} tokens; "
          f"device {device}, peak by {'max_memory_allocated' if device.type == 'cuda' else 'MemTracker'}")
    for ac, (peak, seconds, loss) in results.items():
        print(f"activation_checkpointing={ac!s:5}: peak {peak / 2**20:8.1f} MiB, step {seconds:6.2f} s, loss {loss:.6f}")
    (p0, t0, _), (p1, t1, _) = results[False], results[True]
    print(f"ratio with / without: peak {p1 / p0:.3f}, time {t1 / t0:.2f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
