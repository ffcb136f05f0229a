"""GRPO on PyTorch FSDP2 with rollouts from a vLLM server and an EMA reference policy.

    python train.py --help                                   # every config field
    python scripts/make_tiny_model.py --out models/tiny      # a random 0.3 M model
    torchrun --nproc_per_node 2 train.py --dataset copy --output_dir output/demo

This version carries the foundation: config, tokenizer, prompts and rewards. It checks
the run's inputs and batch arithmetic, prints them, and stops before training (the
FSDP2 step loop is the next piece).
"""

import os
import sys

from config import Config, parse_args
from data import load_prompts


def load_tokenizer(cfg: Config):
    """The tokenizer of model_name_or_path, with a one-line error naming the fix."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path)
    except (OSError, ValueError) as e:
        where = "is not a local model directory" if not os.path.isdir(cfg.model_name_or_path) else "is unreadable"
        raise ValueError(f"model_name_or_path={cfg.model_name_or_path!r} {where} and could not be loaded "
                         f"({type(e).__name__}); build a tiny model with "
                         f"python scripts/make_tiny_model.py --out {cfg.model_name_or_path}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def main(cfg: Config):
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    plan = cfg.batch_plan(world_size)
    tokenizer = load_tokenizer(cfg)
    train_rows, eval_rows, skipped, reward_fn = load_prompts(cfg, tokenizer)
    if rank == 0:
        print(f"batch: {cfg.num_unique_prompts_rollout} prompts x {cfg.num_samples_per_prompt_rollout} samples = "
              f"{plan['sequences']} sequences -> {plan['mini_batches']} mini-batch(es) of {plan['per_mini_batch']} -> "
              f"{plan['per_rank']} per rank -> {plan['accumulation_steps']} micro-batch(es) of "
              f"{cfg.per_device_train_batch_size}; {plan['optimizer_steps']} optimizer step(s) per rollout")
        print(f"data: {len(train_rows)} train prompts, {len(eval_rows)} eval prompts from {cfg.dataset!r}, "
              f"skipped {skipped}; reward {reward_fn.__name__}; example: {train_rows[0]['prompt_text']!r}")
        print("stopping here: this version has the config, model, data and rewards but not yet the trainer.")


if __name__ == "__main__":
    try:
        cfg = parse_args()
        main(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
