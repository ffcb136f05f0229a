"""Run by the distributed tests, under torchrun (2 gloo ranks) or as one plain process.

    python tests/dist_worker.py train MODEL_DIR OUT [LOSS_FN KL_ESTIMATOR]  # 3 GRPO steps on fixed rollouts + EMA
    python tests/dist_worker.py ema MODEL_DIR OUT     # K EMA updates, collectives counted
    python tests/dist_worker.py ess MODEL_DIR OUT     # ESS of fixed ratios split over the ranks
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

import train
from config import Config
from reference import EMAReference, local
from weight_sync import full_state_dict

mode, model_dir, out = sys.argv[1:4]
loss_fn, kl_estimator = (sys.argv[4:6] + ["dapo", "k3"][len(sys.argv[4:6]):])
cfg = Config(model_name_or_path=model_dir, num_unique_prompts_rollout=4, num_samples_per_prompt_rollout=4,
             per_device_train_batch_size=2, beta=0.1, kl_estimator=kl_estimator, learning_rate=1e-3, alpha=0.3,
             num_mini_batches=2, ref_policy_update_freq=1, loss_fn=loss_fn, kl_topk=4 if kl_estimator == "topk" else 0)
rank, world_size, device, mesh = train.setup_distributed(cfg)
torch.manual_seed(0)
policy = train.load_model(cfg, device, mesh)
ref = EMAReference(train.load_model(cfg, device, mesh), policy, cfg.alpha)


def fixed_rollouts(step):
    """The same uneven batch on every rank and in every world size."""
    g = torch.Generator().manual_seed(step)
    samples = []
    for _ in range(16):
        p, c = torch.randint(2, 7, (1,), generator=g).item(), torch.randint(1, 13, (1,), generator=g).item()
        samples.append(dict(prompt_ids=torch.randint(3, 64, (p,), generator=g).tolist(),
                            token_ids=torch.randint(3, 64, (c,), generator=g).tolist(),
                            logprobs=(-4 * torch.rand(c, generator=g)).tolist(),
                            adv=torch.randn(1, generator=g).item()))
    return samples


if mode == "train":
    optimizer, scheduler = train.make_optimizer(cfg, policy, 10, device)
    losses = []
    for step in range(3):
        m = train.train_on_rollouts(cfg, policy, ref.model, optimizer, scheduler, fixed_rollouts(step), rank,
                                    world_size, device, pad_id=0)
        ref.update()
        losses.append([m["loss"], m["kl"], m["clip_frac"], m["grad_norm"], m.get("ess", 1.0)])
    policy_sd, ref_sd = full_state_dict(policy), full_state_dict(ref.model)
    if rank == 0:
        torch.save(dict(losses=losses, policy=policy_sd, ref=ref_sd), out)
elif mode == "ema":
    # clone: in a world of one the "gathered" tensors may be the live parameters themselves
    ref0, pol0 = [{k: v.clone() for k, v in full_state_dict(m).items()} for m in (ref.model, policy)]
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_into_tensor",
                                                        "reduce_scatter_tensor", "broadcast", "send", "recv")}
    for name, fn in originals.items():
        setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
    with torch.no_grad(), CommDebugMode() as comm:
        for p in policy.parameters():  # make policy and reference differ
            local(p).add_(0.1)
        for k in range(3):
            for p in policy.parameters():  # the policy moves: pol_k = 1.1 * pol_{k-1} + 0.01
                local(p).mul_(1.1).add_(0.01)
            ref.update()
    for name, fn in originals.items():
        setattr(dist, name, fn)
    ref_k = full_state_dict(ref.model)
    if rank == 0:
        torch.save(dict(ref0=ref0, pol0=pol0, ref_k=ref_k, calls=calls, comm=comm.get_total_counts()), out)
elif mode == "ess":
    from loss import ess

    rho = torch.exp(torch.randn(1001, generator=torch.Generator().manual_seed(0)))  # odd: the ranks hold unequal parts
    if rank == 0:
        torch.save(dict(ess=ess(rho[rank::world_size])), out)
    else:
        ess(rho[rank::world_size])
dist.destroy_process_group()
