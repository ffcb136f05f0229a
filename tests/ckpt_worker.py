"""Run by tests/test_checkpoint.py, as one process or under torchrun (2 gloo ranks).

    python tests/ckpt_worker.py save MODEL_DIR DIR    # 3 steps, a checkpoint after each; then load it into fresh objects
    python tests/ckpt_worker.py load MODEL_DIR DIR    # load DIR/ckpt (written by any world size) into fresh objects

Writes DIR/saved.pt (state after the last save) and DIR/loaded_<world size>.pt (state after
loading), both as full tensors, for the test to compare bit for bit.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from infra import checkpoint
import train
import update
from config import Config
from data import PromptSampler
from reference import EMAReference
from episodes import Sample
from infra.weight_sync import full_state_dict

mode, model_dir, out = sys.argv[1:4]
root = os.path.join(out, "ckpt")
cfg = Config(model_name_or_path=model_dir, num_unique_prompts_rollout=4, num_samples_per_prompt_rollout=4,
             max_prompt_length=8, response_length=16, max_tokens_per_micro_batch=24, beta=0.1, num_mini_batches=2, ref_policy_update_freq=1, alpha=0.3,
             lr_scheduler_type="cosine", warm_up_steps=2,
             vllm_logp_tolerance=1e9)  # made-up vLLM logprobs: no sync to check
rank, world_size, device, mesh = train.setup_distributed(cfg)


def rollouts(step):
    """16 sequences of uneven lengths with fixed advantages; those of 4 tokens or more are
    multi-turn (2 environment tokens in the middle, out of the loss)."""
    g = torch.Generator().manual_seed(100 + step)
    masks = [[1] * c if c < 4 else [1] * (c // 2) + [0, 0] + [1] * (c - c // 2 - 2) for c in (1 + i % 9 for i in range(16))]
    return [Sample(prompt_ids=[5 + i % 7, 9, 11], token_ids=torch.randint(3, 64, (len(m),), generator=g).tolist(),
                   logprobs=[-3.0 * x for x in m], mask=m, adv=i % 4 - 1.5) for i, m in enumerate(masks)]


def fresh():
    """The training state (policy, a bf16 reference so that the EMA keeps an fp32 master, optimizer,
    scheduler) and a sampler."""
    policy = train.load_model(cfg, device, mesh)
    ref = EMAReference(train.load_model(cfg, device, mesh).to(torch.bfloat16), policy, cfg.alpha)
    optimizer, scheduler = train.make_optimizer(cfg, policy, 20, device)
    return update.TrainState(policy, ref, optimizer, scheduler), PromptSampler(list(range(10)), cfg.seed)


def snapshot(state, sampler):
    policy, ref, optimizer, scheduler = state.policy, state.ref, state.optimizer, state.scheduler
    masters = checkpoint.sharded_state(state)["ref_master"]
    opt = get_optimizer_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return dict(policy=full_state_dict(policy), ref=full_state_dict(ref.model),
                master={k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in masters.items()},
                optimizer=opt, scheduler=scheduler.state_dict()["last_epoch"], lr=scheduler.get_last_lr(),
                position=sampler.position, rng=torch.rand(3))


if mode == "save":
    state, sampler = fresh()
    for step in (1, 2, 3):
        update.train_on_batch(cfg, state, rollouts(step), rank, world_size, device)
        state.ref.update()
        sampler.next_batch(3)
        checkpoint.save(root, step, state, sampler.position, cfg, keep_last=2)
    saved = snapshot(state, sampler)  # its rng draw is the first after the save
    if rank == 0:
        torch.save(saved, os.path.join(out, "saved.pt"))
        os.makedirs(os.path.join(root, "step_00000009.partial"))  # a run killed while writing
        os.makedirs(os.path.join(root, "step_00000010"))  # not a checkpoint: no .metadata
    dist.barrier()
state, sampler = fresh()
torch.manual_seed(1234)  # whatever the RNG was, loading restores it
found = checkpoint.latest(root)
trainer = checkpoint.load(found, state)
sampler.position = trainer["sampler_position"]
loaded = dict(snapshot(state, sampler), found=os.path.basename(found), step=trainer["step"],
              listing=sorted(os.listdir(root)))
if rank == 0:
    torch.save(loaded, os.path.join(out, f"loaded_{world_size}.pt"))
del state
train.close_distributed()
