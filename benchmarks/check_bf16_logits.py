"""Logprob error of bf16 LM-head inputs against float64, at Qwen2.5-0.5B's shape.

    python benchmarks/check_bf16_logits.py                 # CPU
    python benchmarks/check_bf16_logits.py --device cuda   # a GPU

Compares token_logprobs (float32 logits from upcast bf16 hidden states and head) with a
bf16 product cast afterwards, both against float64 logprobs of the same bf16 values.
"""

import argparse

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # policy without PYTHONPATH
from infra.policy import token_logprobs  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--logit_std", type=float, default=4.5)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16).to(args.device)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * args.logit_std / args.hidden ** 0.5)
    weight = weight.to(torch.bfloat16).to(args.device)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(args.device)
    exact = torch.log_softmax(hidden.double() @ weight.double().t(), -1).gather(-1, targets[:, None])[:, 0]
    ours = token_logprobs(hidden, weight, targets)[0]
    bf16 = torch.log_softmax((hidden @ weight.t()).float(), -1).gather(-1, targets[:, None])[:, 0]
    for name, logp in (("float32 logits (token_logprobs)", ours), ("bf16 product, then float32", bf16)):
        err = (logp.double() - exact).abs()
        print(f"{name:34s} mean |logp error| {err.mean().item():.3g}  max {err.max().item():.3g}")


if __name__ == "__main__":
    main()
