"""Parallelism: the process group, the device mesh and the FSDP2-sharded model.

    python train.py                                                # a world of one (gloo on CPU)
    torchrun --nproc_per_node 8 train.py --vllm_server_urls URL    # shard over 8 ranks (FSDP); on GPUs without
                                                                   # the URLs our server shares the 8 (vllm_colocate)
    torchrun --nnodes 4 --nproc_per_node 8 ... train.py --fsdp_shard_size 8   # shard in each node,
                                                                   # replicate across the 4 (HSDP)
    torchrun --nproc_per_node 8 train.py --sequence_parallel_size 2 ...  # 4 groups of 2 ranks split each row

open-instruct's GRPO distributed knobs (DeepSpeed terms) and what they are here:

| open-instruct                          | here                                                    |
|----------------------------------------|---------------------------------------------------------|
| deepspeed_stage 3                      | always: fully_shard per decoder layer, then the root    |
| stage 2 (weights whole during a step)  | reshard_after_forward=False                             |
| deepspeed_zpg (partition group size)   | fsdp_shard_size: a 2-D mesh (replicate, shard) = HSDP   |
| deepspeed_offload_param / _optimizer   | offload_params (CPUOffloadPolicy moves both together)   |
| gradient_checkpointing                 | activation_checkpointing (each decoder layer)           |
| sequence_parallel_size                 | sequence_parallel_size: Ulysses (sequence_parallel.py)  |
| num_learners_per_node                  | torchrun --nproc_per_node                               |
| single_gpu_mode                        | single_gpu_mode (vLLM sleep mode, vllm_server.py)       |
| backend_timeout                        | backend_timeout (the process group)                     |

load_model takes what the loop hands it: the attention (sequence parallelism registers its own) and a
converter that changes the model before the sharding (LoRA injects its adapters there: each adapter is
then sharded with its layer, and the reference is an adapter of the policy's own module).

The reference gets the policy's mesh and placements, so its shards sit beside the
policy's (the EMA update stays local); it never runs backward, so it is never
checkpointed and always reshards after forward.
"""

import gc
import os
import socket
import types
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)

from infra import ranks
from infra.policy import check_architecture, sequence_logprobs


def mesh_shape(cfg, world_size: int) -> tuple:
    """(replicas, shard size) of the device mesh; refuse sizes the world does not fit."""
    if cfg.single_gpu_mode and world_size != 1:
        raise ValueError(f"single_gpu_mode=True runs one trainer process beside the server, got {world_size} "
                         "ranks; run `python train.py` without torchrun or set single_gpu_mode=False")
    shard = cfg.fsdp_shard_size or world_size
    if shard > world_size or world_size % shard:
        raise ValueError(f"fsdp_shard_size={cfg.fsdp_shard_size} does not divide the world of {world_size} "
                         f"ranks into equal groups; pick a divisor of {world_size} (ranks per node is usual) "
                         "or 0 to shard over all ranks")
    if world_size % cfg.sequence_parallel_size:
        raise ValueError(f"sequence_parallel_size={cfg.sequence_parallel_size} does not divide the world of "
                         f"{world_size} ranks into sequence-parallel groups; pick a divisor of {world_size}")
    return world_size // shard, shard


def setup_distributed(cfg):
    """gloo on CPU, nccl on CUDA; under torchrun or as a plain process (a world of one).
    Returns rank, world size, device and the data-parallel mesh: 1-D (shard) or, with
    fsdp_shard_size, 2-D (replicate, shard)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and (cfg.offload_params or cfg.offload_ref_policy):
        backend = "cuda:nccl,cpu:gloo"  # offloaded gradients are CPU tensors: their norm is reduced over gloo
    dist.init_process_group(backend, timeout=timedelta(minutes=cfg.backend_timeout))
    ranks.start()  # the CPU group the waits for rank 0 use, SIGTERM, the watch (infra/ranks.py)
    replicas, shard = mesh_shape(cfg, dist.get_world_size())
    # Consecutive ranks share a shard group: with torchrun they are the GPUs of one node,
    # so the all-gathers stay on the fast links and only the gradient all-reduce crosses nodes.
    mesh = init_device_mesh(device.type, (shard,), mesh_dim_names=("shard",)) if replicas == 1 else \
        init_device_mesh(device.type, (replicas, shard), mesh_dim_names=("replicate", "shard"))
    return dist.get_rank(), dist.get_world_size(), device, mesh


def close_distributed():
    """Leave the process group so that a finished run exits 0 on every rank. Call it once the
    run's models are out of scope (after main() returns, or after `del model`).

    destroy_process_group() only unregisters the group: FSDP2's modules and the device mesh
    keep it alive, and its C++ side would otherwise be freed, if at all, while the
    interpreter exits. A gloo worker thread can still be letting go of a finished
    collective then: wait() returns on the main thread before the worker drops the work,
    and a loaded machine delays the worker. Dropping a tensor that Python had dropped first
    needs the GIL, which a finalizing interpreter answers by ending the thread, and ending a
    C++ thread that way aborts the process ("terminate called without an active
    exception", SIGABRT). So: every rank finishes its collectives (the barrier: no rank
    leaves while a peer is inside one), the meshes let go of their groups, and the group
    is freed here, on the main thread, which joins the gloo threads while the interpreter
    is whole."""
    if not dist.is_initialized():
        return
    ranks.barrier()
    ranks.close()
    dist.destroy_process_group()
    # DTensor's caches keep device meshes alive past the run, and a mesh holds its groups.
    # (type(), not isinstance: DeviceMesh's metaclass reads each object's __class__, and the deprecated
    # torch.distributed.reduce_op answers that with a FutureWarning printed after the run's last line)
    for obj in gc.get_objects():
        if issubclass(type(obj), DeviceMesh) and hasattr(obj, "_pg_registry"):  # older torch keeps no groups on it
            obj._pg_registry.clear()
    gc.collect()  # FSDP2 modules sit in reference cycles: free them, and the group with them


def load_model(cfg, device, mesh, reference=False, attn=None, convert=None):
    """The HF model, sharded with FSDP2 on `mesh`: each decoder layer, then the root.
    reference=True builds the EMA reference: same sharding, no activation checkpointing,
    offloaded with offload_ref_policy instead of offload_params. attn: the attention implementation
    (cfg.attn_implementation when None); convert(model): a change before the wrappers and the sharding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, dtype=torch.float32,
                                                 attn_implementation=attn or cfg.attn_implementation)
    check_architecture(model)
    if convert is not None:
        convert(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    offload = cfg.offload_ref_policy if reference else cfg.offload_params
    # Offloaded shards live in CPU memory and are copied to the GPU for each gather
    # (pinned memory makes that copy asynchronous; there is none to pin without CUDA).
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    # The reference runs forward only, under no_grad, where nothing would reshard it later:
    # kept gathered it would no longer match its sharded policy twin, which the EMA needs.
    reshard = True if reference else cfg.reshard_after_forward
    layers = model.model.layers
    for i in range(len(layers)):
        if cfg.activation_checkpointing and not reference:
            # Inside the FSDP unit, so the recompute in backward finds the layer's weights
            # gathered by FSDP's pre-backward hook. Parameter names gain a
            # `_checkpoint_wrapped_module.` part; state dicts drop it again.
            layers[i] = checkpoint_wrapper(layers[i])
        fully_shard(layers[i], mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    # reshard_after_forward set on the root too: FSDP2's default keeps the root's parameters
    # (embeddings, LM head) gathered after forward, which the reference cannot afford (above).
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    model.sequence_logprobs = types.MethodType(sequence_logprobs, model)
    register_fsdp_forward_method(model, "sequence_logprobs")
    return model
