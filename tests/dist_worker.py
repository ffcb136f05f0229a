"""Run by the distributed tests, under torchrun (2 or 4 gloo ranks) or as one plain process.

    python tests/dist_worker.py train MODEL_DIR OUT [LOSS_FN KL_ESTIMATOR] [key=value ...]  # 3 GRPO steps + EMA
    python tests/dist_worker.py ema MODEL_DIR OUT [key=value ...]   # K EMA updates, collectives counted
    python tests/dist_worker.py ess MODEL_DIR OUT     # ESS of fixed ratios split over the ranks
    python tests/dist_worker.py grads MODEL_DIR OUT [key=value ...]  # loss and full gradients of one micro-batch
    python tests/dist_worker.py filtered MODEL_DIR OUT [...] groups=0,2  # one batch of which only these groups survived
    python tests/dist_worker.py attention MODEL_DIR OUT sequence_parallel_size=2  # ulysses_attention against packed_sdpa
    python tests/dist_worker.py parts MODEL_DIR OUT [key=value ...]  # the weight sync's parts, and a write failing midway

key=value pairs override Config fields (fsdp_shard_size=2, activation_checkpointing=true, ...).
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

import dataclasses

from lora import adapters
import train
import update
from infra.cli import convert
from config import Config
from packing import micro_batches
from reference import local, make_reference
from episodes import Sample
from infra.weight_sync import full_state_dict

mode, model_dir, out = sys.argv[1:4]
positional = [a for a in sys.argv[4:] if "=" not in a]
types = {f.name: f.type for f in dataclasses.fields(Config)}
pairs = [a.split("=", 1) for a in sys.argv[4:] if "=" in a]
kept_groups = [int(g) for k, v in pairs if k == "groups" for g in v.split(",")]
overrides = {k: convert(k, v, eval(types[k]) if isinstance(types[k], str) else types[k]) for k, v in pairs
             if k != "groups"}
loss_fn, kl_estimator = (positional + ["dapo", "k3"][len(positional):])
cfg = Config(**{**dict(model_name_or_path=model_dir, num_unique_prompts_rollout=4, num_samples_per_prompt_rollout=4,
                      max_prompt_length=6, response_length=12, max_tokens_per_micro_batch=24, beta=0.1, kl_estimator=kl_estimator, learning_rate=1e-3,
                      alpha=0.3, num_mini_batches=2, ref_policy_update_freq=1, loss_fn=loss_fn,
                      kl_topk=4 if kl_estimator == "topk" else 0,
                      vllm_logp_tolerance=1e9),  # fixed_rollouts' vLLM logprobs are random: no sync to check
                 **overrides})
rank, world_size, device, mesh = train.setup_distributed(cfg)
torch.manual_seed(0)
attn, convert = train.model_doors(cfg)  # sequence parallelism's groups and attention, LoRA's adapters
policy = train.load_model(cfg, device, mesh, attn=attn, convert=convert)
ref = make_reference(cfg, policy, lambda: train.load_model(cfg, device, mesh, reference=True, attn=attn))  # LoRA: an adapter
mesh_info = dict(shape=tuple(mesh.shape), placements=[str(p) for p in next(policy.parameters()).placements],
                 shard_device=str(local(next(policy.parameters())).device))


def states():
    """Full state dicts: (policy, the part the EMA moves, the reference). With LoRA the two adapters,
    the reference's under the trained one's names."""
    whole = full_state_dict(policy)
    if not cfg.lora_rank:
        return whole, whole, full_state_dict(ref.model)
    adapter = {a: {k.replace(f".{a}.", f".{adapters.ADAPTER}."): v for k, v in whole.items() if adapters.is_adapter(k, a)}
               for a in (adapters.ADAPTER, adapters.REFERENCE)}
    return whole, adapter[adapters.ADAPTER], adapter[adapters.REFERENCE]


def fixed_rollouts(step):
    """The same uneven batch on every rank and in every world size: 4 groups of 4 samples, each
    group's samples after one prompt (shared in the forward unless shared_prefix=false)."""
    g = torch.Generator().manual_seed(step)
    samples = []
    for i in range(16):
        p, c = torch.randint(2, 7, (1,), generator=g).item(), torch.randint(1, 13, (1,), generator=g).item()
        prompt = torch.randint(3, 64, (p,), generator=g).tolist()
        samples.append(Sample(prompt_ids=prompt if i % 4 == 0 else samples[-1].prompt_ids,
                              token_ids=torch.randint(3, 64, (c,), generator=g).tolist(),
                              logprobs=(-4 * torch.rand(c, generator=g)).tolist(), mask=tool_turn(c),
                              adv=torch.randn(1, generator=g).item()))
        s = samples[-1]
        s.logprobs = [lp if m else 0.0 for lp, m in zip(s.logprobs, s.mask)]
    return samples


def tool_turn(c):
    """A multi-turn episode's mask when it has room: policy, 2 environment tokens, policy."""
    return [1] * c if c < 4 else [1] * (c // 2) + [0, 0] + [1] * (c - c // 2 - 2)


if mode == "train":
    state = update.TrainState(policy, ref, *train.make_optimizer(cfg, policy, 10, device))
    losses = []
    for step in range(3):
        m = update.train_on_batch(cfg, state, fixed_rollouts(step), rank, world_size, device)
        ref.update()
        losses.append([m["loss"], m["kl"], m["clip_frac"], m["grad_norm"], m.get("ess", 1.0), m["grad_norm_max"],
                       m["trained_tokens"]])
    policy_sd, _, ref_sd = states()
    rows = [b["input_ids"].numel() for step in range(3) for r in range(world_size)
            for mbs, _, _ in micro_batches(fixed_rollouts(step), cfg, world_size, r) for b in mbs]
    if rank == 0:
        torch.save(dict(losses=losses, policy=policy_sd, ref=ref_sd, mesh=mesh_info, row_tokens=rows), out)
elif mode == "filtered":
    state = update.TrainState(policy, ref, *train.make_optimizer(cfg, policy, 10, device))
    n = cfg.num_samples_per_prompt_rollout
    batch = fixed_rollouts(0)
    kept = [s for g in kept_groups for s in batch[g * n:(g + 1) * n]]
    m = update.train_on_batch(cfg, state, kept, rank, world_size, device)
    policy_sd = full_state_dict(policy)
    if rank == 0:
        torch.save(dict(m=m, policy=policy_sd, scheduler_steps=state.scheduler.last_epoch), out)
elif mode == "ema":
    # clone: in a world of one the "gathered" tensors may be the live parameters themselves
    _, pol0, ref0 = [{k: v.clone() for k, v in sd.items()} for sd in states()]
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_into_tensor",
                                                        "reduce_scatter_tensor", "broadcast", "send", "recv")}
    for name, fn in originals.items():
        setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
    with torch.no_grad(), CommDebugMode() as comm:
        for p in ref.policy_params:  # make policy and reference differ
            local(p).add_(0.1)
        for k in range(3):
            for p in ref.policy_params:  # the policy moves: pol_k = 1.1 * pol_{k-1} + 0.01
                local(p).mul_(1.1).add_(0.01)
            ref.update()
    for name, fn in originals.items():
        setattr(dist, name, fn)
    ref_k = states()[2]
    if rank == 0:
        torch.save(dict(ref0=ref0, pol0=pol0, ref_k=ref_k, calls=calls, comm=comm.get_total_counts(), mesh=mesh_info),
                   out)
elif mode == "grads":
    from loss import grpo_loss
    from packing import collate

    b = {k: v.to(device) for k, v in collate(fixed_rollouts(0)[:4]).items()}
    saved = []  # bytes autograd keeps for backward outside checkpointed regions (which keep their own)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel() * t.element_size()), t)[1],
                                                  lambda t: t):
        logp, _, _, _ = policy.sequence_logprobs(b["input_ids"], b["mask"], 1.0, position_ids=b["position_ids"])
    loss, _ = grpo_loss(logp, b["vllm_logp"], b["adv"], b["seq_ids"], float(logp.numel()),
                        dataclasses.replace(cfg, loss_fn="cispo"))
    loss.backward()
    names = [n.replace("_checkpoint_wrapped_module.", "") for n, _ in policy.named_parameters()]
    grads = {n: p.grad.full_tensor() for n, p in zip(names, policy.parameters())}
    if rank == 0:
        torch.save(dict(loss=loss.item(), grads=grads, saved_bytes=sum(saved), mesh=mesh_info), out)
elif mode == "attention":
    import types

    from infra.attention import packed_sdpa
    from sequence_parallel import GROUP, ulysses_attention

    size, sp_rank = dist.get_world_size(GROUP), dist.get_rank(GROUP)
    g = torch.Generator().manual_seed(0)
    position_ids = torch.tensor([list(range(5)) + list(range(11)) + list(range(4))])  # 3 sequences, L = 20
    L, lo, hi = 20, sp_rank * 20 // size, (sp_rank + 1) * 20 // size
    results = {}
    for kv_heads in (1, 2, 4):  # 4 query heads: KV heads repeated up to the group, split as they are, or one each
        q, k, v = (torch.randn(1, n, L, 8, generator=g, requires_grad=True) for n in (4, kv_heads, kv_heads))
        weight = torch.randn(1, L, 4, 8, generator=g)  # the loss: a fixed linear function of the output
        module = types.SimpleNamespace(training=False, num_key_value_groups=4 // kv_heads, layer_idx=0)
        whole, _ = packed_sdpa(module, q, k, v, None, position_ids=position_ids)  # (1, L, 4, 8), one process
        (whole * weight).sum().backward()
        expected = [whole.detach()] + [x.grad.clone() for x in (q, k, v)]
        pieces = [x.detach()[:, :, lo:hi].requires_grad_() for x in (q, k, v)]
        mine, _ = ulysses_attention(module, *pieces, None, position_ids=position_ids[:, lo:hi],
                                    row_position_ids=position_ids)  # (1, L/S, 4, 8)
        (mine * weight[:, lo:hi]).sum().backward()
        got = [mine.detach()] + [x.grad for x in pieces]
        gathered = []
        for t, dim in zip(got, (1, 2, 2, 2)):  # the pieces of all ranks, in order
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=GROUP)
            gathered.append(torch.cat(parts, dim))
        results[kv_heads] = dict(expected=expected, got=gathered)
    if rank == 0:
        torch.save(results, out)
elif mode == "parts":
    import os
    import types

    import safetensors.torch

    from infra import weight_sync
    from infra.faults import VLLMError

    budget = weight_sync.PART_BYTES = 200_000  # bytes: the tiny model in several parts
    whole = weight_sync.untie(full_state_dict(policy))
    parts = list(weight_sync.serving_parts(policy, rank))
    if rank == 0:  # an earlier layout's file, which transformers would read before the index
        os.makedirs(out + ".dir")
        safetensors.torch.save_file({"stale": torch.zeros(1)}, os.path.join(out + ".dir", "model.safetensors"))
    written = weight_sync.write_weights(iter(parts), out + ".dir") if rank == 0 else 0
    files = sorted(os.listdir(out + ".dir")) if rank == 0 else []
    calls, save_file = [], safetensors.torch.save_file

    def fails_second(*args, **kwargs):  # a full /dev/shm at the second file
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return save_file(*args, **kwargs)
    safetensors.torch.save_file = fails_second
    sync = weight_sync.FilesystemSync(types.SimpleNamespace(proc=None), rank, out + ".out")
    try:
        sync.sync(policy)
        error = None
    except VLLMError as e:
        error = str(e)
    sync.close()
    gather_error = None
    if world_size == 1:  # a gather that fails is the trainer's own error, not the servers' (VLLMError)
        safetensors.torch.save_file = save_file

        def breaks(*args, **kwargs):
            yield parts[0]
            raise RuntimeError("the gather broke")
        weight_sync.serving_parts = breaks
        sync = weight_sync.FilesystemSync(types.SimpleNamespace(proc=None), rank, out + ".out")
        try:
            sync.sync(policy)
        except Exception as e:  # noqa: BLE001
            gather_error = f"{type(e).__name__}: {e}"
        sync.close()
    torch.save(dict(whole=whole, parts=parts, written=written, files=files, error=error, budget=budget,
                    gather_error=gather_error,
                    read={k: v for f in files if f.endswith(".safetensors")
                          for k, v in safetensors.torch.load_file(os.path.join(out + ".dir", f)).items()}),
               out + (f".{rank}" if rank else ""))
elif mode == "ess":
    from update import ess

    rho = torch.exp(torch.randn(1001, generator=torch.Generator().manual_seed(0)))  # odd: the ranks hold unequal parts
    if rank == 0:
        torch.save(dict(ess=ess(rho[rank::world_size])), out)
    else:
        ess(rho[rank::world_size])
state = policy = ref = None  # the process group goes with the last FSDP module
train.close_distributed()
