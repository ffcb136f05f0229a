"""Colocation: the vLLM server we launch on the training GPUs, asleep while the policy trains.

    colocated(cfg, cuda)                       whether it shares the training devices
    check_launch(cfg, cuda)                    where our server may go, refused before any model loads
    check_compute_modes(answer, visible, gpus) no colocated server on a GPU in EXCLUSIVE_PROCESS mode
    fraction(cfg, *plan, gpus, gpu)            the share of each GPU the memory plan leaves it
    flags(cfg, fraction)                       its command line's part: sleep mode, that share, its layout

Colocated (vllm_colocate; by default on GPUs without vllm_server_urls; untested on GPUs here: it
needs a GPU build of vLLM): rank 0 launches one server over this node's GPUs, the trainers' own,
with --enable-sleep-mode and the GPU fraction the memory plan leaves it (flags). Each step
the generator puts it to sleep before training (POST /sleep?level=1: weights to host memory, KV
cache freed), then wakes its weights (POST /wake_up?tags=weights), syncs, and wakes its KV cache
(?tags=kv_cache) before evaluation and the next generation: the weights are woken before the sync
so that the sync's are the ones it serves (the sync check compares every step). Level 1, not 2: a
step without samples syncs nothing, and must still find the weights it left. single_gpu_mode is
the one-GPU case, at vllm_gpu_memory_utilization. On a CPU the same calls run (vLLM's CPU build
logs that it cannot sleep and does nothing), which is how the order is tested here.

The generator (infra/generator.py) drives it: sleep before the update, the two-tag wake around the
weight sync, each asked by rank 0 and told to every rank.
"""

import os

import torch

from infra import memory


def colocated(cfg, cuda: bool) -> bool:
    """Whether the server we launch shares the training devices, asleep while the policy trains:
    vllm_colocate, or by default on GPUs without vllm_server_urls (single_gpu_mode: on one GPU)."""
    if cfg.vllm_colocate is not None:
        return cfg.vllm_colocate
    return cfg.single_gpu_mode or (cuda and not cfg.vllm_server_urls)


def check_launch(cfg, cuda: bool):
    """Refuse, before any model loads, a GPU run whose server has nowhere to go (vllm_colocate=False and
    no vllm_server_urls), and a colocated one that cannot sleep while the policy trains."""
    if cuda and not cfg.vllm_server_urls and not colocated(cfg, cuda):
        raise ValueError("vllm_colocate=False on GPUs without vllm_server_urls leaves our vLLM server no GPU; "
                         "give the servers GPUs of their own with bash scripts/launch_8gpu.sh (or pass "
                         "vllm_server_urls of servers you run), or leave vllm_colocate unset to share the training "
                         "GPUs")
    if colocated(cfg, cuda) and (cfg.async_steps or cfg.weight_sync_transport == "nccl"):
        raise ValueError("our vLLM server shares the training GPUs (no vllm_server_urls) and sleeps while the policy "
                         "trains: set async_steps=0 and weight_sync_transport='filesystem', or give the servers GPUs "
                         "of their own with bash scripts/launch_8gpu.sh")
    gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if cuda and colocated(cfg, cuda) and int(os.environ.get("WORLD_SIZE", 1)) != gpus:
        raise ValueError("several nodes would share one colocated server on the first node's GPUs; give the servers "
                         "GPUs of their own (bash scripts/launch_multinode.sh) and pass vllm_server_urls")
    if cuda and colocated(cfg, cuda) and gpus % cfg.vllm_tensor_parallel_size:
        raise ValueError(f"vllm_tensor_parallel_size={cfg.vllm_tensor_parallel_size} does not divide this node's "
                         f"{gpus} GPUs; pick a divisor of {gpus}")
    if cuda and colocated(cfg, cuda) and torch.cuda.is_available():  # this node's GPUs, not a test's cuda=True
        check_compute_modes(query_compute_modes(), os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)


def query_compute_modes():
    """This node's GPUs as nvidia-smi lists them, one "index, uuid, compute mode" line each; None where
    nvidia-smi is not there or fails (the check is then skipped: torch does not expose the compute mode).
    GPU-only, untested here."""
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,compute_mode", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def check_compute_modes(answer, visible, gpus):
    """Refuse a colocated server on GPUs in EXCLUSIVE_PROCESS compute mode: such a GPU takes one CUDA
    context, the trainer rank's, and vLLM's engine would fail to start on it. `answer` is
    query_compute_modes()'s, `visible` CUDA_VISIBLE_DEVICES (indices or UUIDs; None: all), and the job
    uses the first `gpus` visible GPUs (rank i on cuda:i; nvidia-smi's indices follow the PCI bus, CUDA's
    too on a node of identical GPUs). A UUID's prefix names a GPU as it does for CUDA."""
    if not answer:
        return
    rows = [[field.strip() for field in line.split(",")] for line in answer.strip().splitlines()]
    ids = [v.strip() for v in visible.split(",")] if visible is not None else [row[0] for row in rows]
    used = [row for i in ids[:gpus] for row in rows if i == row[0] or (i.startswith("GPU-") and row[1].startswith(i))]
    exclusive = [row for row in used if row[2].lower().startswith("exclusive")]
    if exclusive:
        which = ",".join(row[0] for row in exclusive)
        raise ValueError(f"GPU {which} is in {exclusive[0][2]} compute mode, which admits one process: the colocated "
                         f"vLLM server cannot start beside the trainer; set it to Default (nvidia-smi -i {which} -c "
                         "DEFAULT, as root), or give the servers GPUs of their own with bash scripts/launch_8gpu.sh")


def flags(cfg, fraction):
    """The flags of a server on the training GPUs (vllm_colocate): sleep mode, the GPU fraction the memory
    plan leaves it (single_gpu_mode: vllm_gpu_memory_utilization), and its layout over this node's GPUs:
    replicas of vllm_tensor_parallel_size GPUs each. None on a CPU, where there is nothing to free."""
    if not torch.cuda.is_available():
        return []
    gpus, tp = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), cfg.vllm_tensor_parallel_size  # check_launch: tp | gpus
    return ["--enable-sleep-mode", "--gpu-memory-utilization", f"{fraction:.3f}", "--tensor-parallel-size", str(tp),
            "--data-parallel-size", str(gpus // tp)]


def fraction(cfg, trainer, server, headroom, host, gpus, gpu_bytes):
    """The share of each GPU a colocated server gets (train.py's memory plan, unpacked: `host` is not the
    GPU's): what a trainer rank holds between steps (its shards, AdamW state, reference and runtime; the
    server sleeps while the activations come and go) and the plan's headroom (vLLM's CUDA context, NCCL's
    buffers, the sync's cached tensors: memory.headroom_plan) leave of the GPU, at most
    vllm_gpu_memory_utilization (single_gpu_mode takes that as it is). vLLM 0.32 wants that share free
    when it starts (its request_memory). Refused in one line when it cannot hold its part of the weights
    and KV cache, 1.2 times: its profile's activations and CUDA graphs come out of the same share."""
    if cfg.single_gpu_mode:
        return cfg.vllm_gpu_memory_utilization
    held = sum(trainer[k] for k in ("parameters", "optimizer", "reference", "runtime"))
    spare = sum(headroom.values())
    share = min(cfg.vllm_gpu_memory_utilization, (gpu_bytes - held - spare) / gpu_bytes)
    need = server["weights"] / cfg.vllm_tensor_parallel_size + server["kv_cache"] / gpus
    if share * gpu_bytes < 1.2 * need:
        raise ValueError(f"memory plan: a trainer rank holds {held / memory.GB:.1f} GB of a "
                         f"{gpu_bytes / memory.GB:.1f} GB GPU between steps and {spare / memory.GB:.1f} GB stay free "
                         "beside it (vLLM's context, NCCL, the sync's cache), leaving the colocated vLLM server less "
                         f"than 1.2 x its {need / memory.GB:.1f} GB; {memory.knob(cfg, trainer, server)}, or give the "
                         "servers GPUs of their own (scripts/launch_8gpu.sh)")
    return share
