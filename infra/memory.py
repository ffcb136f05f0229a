"""The run's memory plan: what a trainer rank and the vLLM server we launch will hold, from the
model's config, the mesh and the batch, before any weight loads. train.py prints it (the
`memory plan:` line), refuses a plan the machine cannot hold (one line naming the knob), sizes
the launched server's KV cache from it, and logs each step's plan at that step's largest
micro-batch (`memory_plan_gb`) beside the measured `peak_memory_gb` (BENCHMARKS.md, "Memory plan").

A trainer rank, FSDP2 over `shard` ranks, the parameters held in float32 (parallel.load_model):
- parameters: the rank's shard;
- gathered: the largest unit (the root's embeddings and LM head, or one decoder layer) whole in the
  compute dtype, twice (FSDP2 gathers the next unit while one computes), and its whole gradient
  before the reduce-scatter;
- gradients: the shard, or every trainable parameter whole when a step packs several
  micro-batches (update.py reduce-scatters once per optimizer step; until then FSDP2 holds them
  unsharded);
- optimizer: AdamW's two float32 moments of the trainable shard;
- reference: a second sharded model when the KL needs one (LoRA's reference is an adapter: none);
- activations: what the forward keeps for backward (activation_values: measured, below), in the
  compute dtype; with activation checkpointing each layer keeps its input and one layer
  at a time the rest;
- LM head: policy.token_logprobs' (policy.CHUNK, V) float32 logits and their gradient;
- weight sync: rank 0's part of the serving copy in host memory (weight_sync.serving_parts: at
  most weight_sync.PART_BYTES, or one larger tensor, and the next tensor), each step; with LoRA's merge the
  whole float32 state dict and its merged copy; on a GPU it is host memory, not the GPU's;
- runtime: on a CPU what the process holds before any weight loads (the libraries, the tokenizer,
  the prompts), read from /proc; on a GPU the CUDA context, about 0.5 GB beside the allocator.
The server we launch: its weights in its dtype, the KV cache of the run's own sequences (the
batch's sequences at max_prompt_length + response_length, in whole blocks), and on a CPU its
processes' runtime (measured: CPU_SERVER_RUNTIME, or CPU_SERVER_RUNTIME_TWO_PROCESSES when the model
runs in the engine's process, engine_runs_model). A teacher's server (distill/) is planned the same
way on the teacher's config, with the prompt logits it holds beside them (server_plan).

Beside them (node_plan), what each GPU a colocated server shares keeps free, and the host's part:
- headroom: vLLM's CUDA context and NCCL buffers, outside its fraction (vLLM 0.32's gpu_worker.init_device
  measures the budget of --gpu-memory-utilization after both exist), and the gathered float32 tensor the
  trainer's allocator keeps cached after a sync (the largest parameter, and its cast to the served dtype):
  colocation.fraction gives the server what the trainer's state and these leave;
- host: level-1 sleep's pinned copy of the weights, one per data-parallel engine (vLLM 0.32's cumem
  sleep backend offloads the tags "weights", "runtime" and "cudagraph" at level 1, and
  CuMemAllocator.sleep copies each such allocation to a pinned CPU tensor and drops the rest, the KV
  cache; the two small pools are not planned), the sync's directory (the serving copy in the served
  dtype and the part being written: host memory when it is /dev/shm), and rank 0's full float32 state
  dict (the launch copy a server starts from, LoRA's merge). Summed: the launch copy is freed before the first sleep, so without LoRA's merge the sum
  is an upper bound.
check refuses, each in one line naming the setting that fixes it: a rank against its GPU, this node's
ranks and server against the machine (a container's cgroup limit in place of the RAM when lower:
machine_bytes), the host's items, and a sync directory without room for its copy.
"""

import math
import os

import torch

from infra import policy, weight_sync  # what they hold: the logprob kernel's chunk, the sync's part

GB = 1e9
# Measured with saved-tensor hooks on this code's forward (policy.sequence_logprobs, sdpa, float32 CPU),
# Llama layers at six shapes and Qwen2 layers at four, every figure exact: a token and decoder layer keeps
# 6 h + 2 q + 4 i + 2 kv + heads + 2 values (h hidden, q = heads x head_dim, i the MLP's width, kv the
# keys' and values' width), and the model outside its layers about 4 h.
# A CPU server's processes without its weights and KV cache (PSS, SmolLM2-135M, BENCHMARKS.md): API server,
# engine and model runner 2.6-2.8 GB; 2.0 with VLLM_ENABLE_V1_MULTIPROCESSING=0 (the runner in the engine)
CPU_SERVER_RUNTIME = 2.7 * GB
CPU_SERVER_RUNTIME_TWO_PROCESSES = 2.0 * GB
CUDA_CONTEXT = 0.5 * GB  # a process's CUDA context on a GPU, beside its allocator: the trainer's, vLLM's engine's
# A rank's NCCL buffers for one communicator on 8 NVLink GPUs after its first collectives: about 1.6 GB
# (NVIDIA/nccl issue 864; 1.06 GB on 8 H100 in issue 1685 before any all-to-all, which took it to 4.3).
# NCCL allocates them itself, beside torch's allocator; each communicator has its own.
NCCL_BUFFERS = 1.6 * GB


def shape(mc):
    """(layers, hidden, query width, MLP width, key/value width, heads) of a model config."""
    heads = mc.num_attention_heads
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
    kv_heads = getattr(mc, "num_key_value_heads", None) or heads
    mlp = getattr(mc, "intermediate_size", None) or 4 * mc.hidden_size
    return mc.num_hidden_layers, mc.hidden_size, heads * head_dim, mlp, kv_heads * head_dim, heads


def activation_values(mc, checkpointing):
    """Values the forward keeps for backward, per token of a micro-batch (the docstring's count)."""
    layers, h, q, i, kv, heads = shape(mc)
    layer = 6 * h + 2 * q + 4 * i + 2 * kv + heads + 2
    # checkpointed, a layer keeps its input (the first layer's is the embeddings' output, in the 4 h)
    return ((layers - 1) * h + layer if checkpointing else layers * layer) + 4 * h


def share_tokens(cfg, world_size):
    """A rank's tokens in the forward when every sequence has its full length: its samples, their
    prompt once a group with shared prompts; capped by the micro-batch budget; and whether a step
    then packs several micro-batches."""
    seqs = cfg.num_unique_prompts_rollout * cfg.num_samples_per_prompt_rollout // cfg.num_mini_batches
    per_rank = -(-seqs // (world_size // cfg.sequence_parallel_size))
    prompts = -(-per_rank // cfg.num_samples_per_prompt_rollout) if cfg.shared_prefix else per_rank
    tokens = prompts * cfg.max_prompt_length + per_rank * cfg.response_length
    # under sequence parallelism a rank holds 1/S of each packed row (sequence_parallel.piece)
    piece = -(-min(tokens, cfg.max_tokens_per_micro_batch) // cfg.sequence_parallel_size)
    return piece, tokens > cfg.max_tokens_per_micro_batch


def trainer_plan(cfg, mc, meta_model, world_size, cuda):
    """{item: bytes} of one trainer rank (the docstring's items); "per_token" is the activations'
    bytes a token of a micro-batch, for the plan at a step's own micro-batch (at_tokens)."""
    dtype = 2 if cuda else 4
    shard = cfg.fsdp_shard_size or world_size
    total = sum(p.numel() for p in meta_model.parameters())
    trainable = sum(p.numel() for p in meta_model.parameters() if p.requires_grad)  # with LoRA, its adapter's
    layers = [sum(p.numel() for p in layer.parameters()) for layer in meta_model.model.layers]
    unit = max(max(layers), total - sum(layers))  # a decoder layer, or the root's embeddings and head
    tokens, several = share_tokens(cfg, world_size)
    per_token = activation_values(mc, cfg.activation_checkpointing) * dtype
    offloaded = cuda and cfg.offload_params  # shards, gradients and AdamW state in host memory
    separate_ref = cfg.uses_reference and not cfg.lora_rank and not cfg.teacher_model_name_or_path  # a teacher: its server
    return dict(parameters=0 if offloaded else 4 * total // shard,
                gathered=3 * unit * dtype,
                gradients=0 if offloaded else 4 * trainable // (1 if several else shard),
                optimizer=0 if offloaded else 8 * trainable // shard,
                reference=4 * total // shard if separate_ref and not (cuda and cfg.offload_ref_policy) else 0,
                activations=tokens * per_token,
                lm_head=2 * policy.CHUNK * mc.vocab_size * 4,
                weight_sync=0 if cuda else sync_part(cfg, mc, meta_model),
                runtime=CUDA_CONTEXT if cuda else resident_bytes(),
                per_token=per_token)


def sync_part(cfg, mc, meta_model):
    """What rank 0 holds of the serving copy in a weight sync: a part (weight_sync.serving_parts: the
    budget, or one larger tensor) and the next tensor gathered; with LoRA's merge the whole float32
    state dict and the merged copy of (nearly) every weight, the tied head copied for the server;
    with its adapter sync as good as nothing (the adapter alone)."""
    whole = 4 * (sum(p.numel() for p in meta_model.parameters()) + mc.vocab_size * mc.hidden_size * tied(mc))
    largest = 4 * max(p.numel() for p in meta_model.parameters())
    if cfg.lora_rank:
        return 2 * whole if cfg.lora_weight_sync == "merged" else 0
    return min(whole, max(weight_sync.PART_BYTES, largest) + largest)


def kv_cache_bytes(cfg, mc, cuda):
    """The launched server's KV cache for the run's own sequences (server_sequences), each in whole
    blocks of max_prompt_length + response_length tokens (no episode grows past it), at least one
    sequence of vllm_max_model_len, and the block vLLM keeps back; keys and values of every layer in
    the served dtype (served_bytes)."""
    layers, _, _, _, kv, _ = shape(mc)
    block = 16 if cuda else 32  # vllm_server.server_command's --block-size on a CPU, vLLM's default on a GPU
    blocks = server_sequences(cfg) * math.ceil((cfg.max_prompt_length + cfg.response_length) / block)
    blocks = max(blocks, math.ceil((cfg.vllm_max_model_len or 0) / block)) + 1
    return blocks * block * 2 * layers * kv * served_bytes(cfg, cuda)


def served_bytes(cfg, cuda):
    """Bytes of a value in the served dtype (weight_sync.served_dtype: vllm_dtype, "auto" the trainer's)."""
    return torch.finfo(weight_sync.served_dtype(cfg, cuda)).bits // 8


def server_sequences(cfg):
    """Sequences the server may run at once (its --max-num-seqs when its KV cache is the plan's): a
    batch's, or an evaluation's prompts if more; both with generation ahead (async_steps), where an
    evaluation may run beside the next batch. None waits for another's room to run."""
    batch = cfg.num_unique_prompts_rollout * cfg.num_samples_per_prompt_rollout
    evals = cfg.num_eval_prompts if cfg.eval_freq > 0 else 0
    return batch + evals if cfg.async_steps else max(batch, evals)


def server_plan(cfg, mc, meta_model, cuda):
    """{item: bytes} of the policy's server we launch (none with vllm_server_urls: yours); a teacher's
    (distill/teacher.py) is its own plan's, joined to this one by train.py."""
    return {} if cfg.vllm_server_urls else model_server(cfg, mc, meta_model, cuda)


def model_server(cfg, mc, meta_model, cuda):
    """{item: bytes} of a server we launch on the model of config mc: its weights, KV cache and runtime."""
    kv = int(cfg.vllm_kv_cache_space_gb * GB) if cfg.vllm_kv_cache_space_gb else kv_cache_bytes(cfg, mc, cuda)
    return dict(weights=serving_values(mc, meta_model) * served_bytes(cfg, cuda), kv_cache=kv,
                runtime=0 if cuda else CPU_SERVER_RUNTIME_TWO_PROCESSES
                if engine_runs_model(cfg, os.environ) else CPU_SERVER_RUNTIME)


def server_cores(cfg):
    """(the cores this process may use, those a CPU server we launch computes on): all of them in the
    synchronous loop, the last half with async_steps, the last vllm_cpu_threads when set
    (vllm_server.cpu_placement binds them)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    n = min(len(cores), cfg.vllm_cpu_threads or (len(cores) if cfg.async_steps == 0 else max(1, len(cores) // 2)))
    return cores, cores[-n:]


def engine_runs_model(cfg, environ):
    """Whether a CPU server we launch runs the model in its engine's process (VLLM_ENABLE_V1_MULTIPROCESSING
    =0, one process fewer): as `environ` sets that variable (vLLM reads it as an integer), else when the
    server computes on every core and `environ` binds no cores itself (VLLM_CPU_OMP_THREADS_BIND: only
    vLLM's worker process is bound)."""
    if (value := environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")) is not None:
        return value.strip().lstrip("+-").isdigit() and int(value) == 0
    cores, bound = server_cores(cfg)
    return len(bound) == len(cores) and "VLLM_CPU_OMP_THREADS_BIND" not in environ


def serving_values(mc, meta_model):
    """Values of the serving copy: every parameter, the head untied (weight_sync.untie)."""
    return sum(p.numel() for p in meta_model.parameters()) + mc.vocab_size * mc.hidden_size * tied(mc)


def node_plan(cfg, mc, meta_model, world_size, cuda, colocated):
    """(headroom, host): {item: bytes} of what each GPU a colocated server shares keeps free, and of the
    host's part (the docstring's items). `colocated`: colocation.colocated's answer."""
    gpus = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # this node's: one engine of ours on each
    return (headroom_plan(cfg, meta_model, world_size, cuda, colocated),
            host_plan(cfg, mc, meta_model, cuda, colocated, gpus))


def headroom_plan(cfg, meta_model, world_size, cuda, colocated):
    """A colocated GPU's headroom (none otherwise): vLLM's CUDA context; NCCL buffers, a set per
    communicator on the GPU (the trainer's world, HSDP's second dimension, sequence parallelism's, vLLM's
    own under tensor parallelism); the sync's cache: the largest parameter gathered whole in float32
    (weight_sync.serving_parts) and its cast to the served dtype, both kept by the allocator."""
    if not (cuda and colocated):
        return {}
    shard = cfg.fsdp_shard_size or world_size
    communicators = 1 + (shard < world_size) + (cfg.sequence_parallel_size > 1) + (cfg.vllm_tensor_parallel_size > 1)
    adapter = cfg.lora_rank and cfg.lora_weight_sync == "adapter"  # it gathers the adapter alone
    largest = max(p.numel() for p in meta_model.parameters() if p.requires_grad or not adapter)
    cast = served_bytes(cfg, cuda) if served_bytes(cfg, cuda) != 4 and not cfg.lora_rank else 0  # LoRA's: float32
    return dict(vllm_context=CUDA_CONTEXT, nccl_buffers=communicators * NCCL_BUFFERS, sync_cache=largest * (4 + cast))


def host_plan(cfg, mc, meta_model, cuda, colocated, gpus):
    """The host's items (the docstring's): a colocated server's sleep copies, one per engine (a replica of
    vllm_tensor_parallel_size GPUs pins its weights once, split over them); the sync's directory; on a GPU
    rank 0's full float32 state dict (on a CPU the trainer's weight_sync item holds the sync's, and the
    launch copy comes before any activation)."""
    copy = serving_values(mc, meta_model)
    engines = gpus // cfg.vllm_tensor_parallel_size
    merged = cfg.lora_rank and cfg.lora_weight_sync == "merged"  # the state dict and its merged copy
    return dict(sleep_copies=engines * copy * served_bytes(cfg, cuda) if cuda and colocated else 0,
                sync_dir=sync_dir_bytes(cfg, mc, meta_model, cuda),
                state_dict=(2 if merged else 1) * 4 * copy if cuda else 0)


def sync_dir_bytes(cfg, mc, meta_model, cuda):
    """What the filesystem sync keeps in its directory at most (weight_sync.write_weights): the serving copy
    in the served dtype and the part being written beside its last version; LoRA's merge writes float32 in
    one part, its adapter sync the adapter (the new one beside the last)."""
    if cfg.weight_sync_transport != "filesystem":
        return 0
    if cfg.lora_rank and cfg.lora_weight_sync == "adapter":
        return 2 * 4 * sum(p.numel() for p in meta_model.parameters() if p.requires_grad)
    if cfg.lora_rank:
        return 2 * 4 * serving_values(mc, meta_model)
    served = served_bytes(cfg, cuda)
    copy = serving_values(mc, meta_model) * served
    return copy + min(copy, max(weight_sync.PART_BYTES, max(p.numel() for p in meta_model.parameters()) * served))


def tied(mc):
    """1 when the model's LM head is its embedding (the served copy then holds the head twice)."""
    return int(bool(getattr(mc, "tie_word_embeddings", False)))


def resident_bytes():
    """This process's resident set now (VmRSS; 0 where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except OSError:
        return 0


def machine_bytes(root="/"):
    """(bytes, whose) of the memory the run may hold at most: this machine's physical memory, or its
    container's limit when lower (container_bytes; the kernel's OOM killer enforces it). Not what is free,
    which other jobs move from moment to moment: the same run must not be refused on one start and pass
    on the next."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = container_bytes(root)
    return (limit, "its container's") if limit is not None and limit < physical else (physical, "this machine's")


def container_bytes(root="/"):
    """The memory limit of this process's cgroup, the lowest on its path (a parent's holds too), or None:
    cgroup v2's memory.max ("max": none), v1's memory.limit_in_bytes (a number near 2**63: none), each
    under /sys/fs/cgroup at the path /proc/self/cgroup names (inside a container's namespace "/"). Files
    under `root`: a test gives a tree of the kernel's files."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    limits = []
    for _, controllers, path in lines:
        if controllers == "":  # v2: one hierarchy
            base, name = os.path.join(root, "sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts) + 1):  # the mount's own files too: a container sees its cgroup there
            try:
                with open(os.path.join(base, *parts[:depth], name)) as f:
                    value = f.read().strip()
            except OSError:
                continue
            if value.isdigit() and int(value) < 2**62:
                limits.append(int(value))
    return min(limits) if limits else None


def rank_total(trainer):
    return sum(v for k, v in trainer.items() if k != "per_token")


def at_tokens(trainer, tokens):
    """A rank's plan at a micro-batch of `tokens` tokens (a step's own largest), in bytes."""
    return rank_total(trainer) - trainer["activations"] + tokens * trainer["per_token"]


def knob(cfg, trainer, server):
    """The setting that frees the most of the largest item."""
    items = dict(activations=trainer["activations"], reference=trainer["reference"], kv_cache=server.get("kv_cache", 0),
                 model=sum(trainer[k] for k in ("parameters", "gathered", "gradients", "optimizer")))
    largest = max(items, key=items.get)
    if largest == "activations":
        return ("lower max_tokens_per_micro_batch" if cfg.activation_checkpointing else
                "set activation_checkpointing=True") + f" (now {cfg.max_tokens_per_micro_batch} tokens a micro-batch)"
    if largest == "reference":
        return "set offload_ref_policy=True (GPU) or train with lora_rank, whose reference is an adapter"
    if largest == "kv_cache":
        return ("lower vllm_kv_cache_space_gb" if cfg.vllm_kv_cache_space_gb else
                "lower num_samples_per_prompt_rollout, num_unique_prompts_rollout, num_eval_prompts or response_length")
    return "shard over more ranks, set offload_params=True (GPU), or train adapters with lora_rank"


def check(cfg, trainer, server, headroom, host, local_ranks, cuda, device_bytes=None, host_bytes=None,
          sync_free=None):
    """Refuse, in one line naming the setting that fixes it, a plan this machine cannot hold: on a GPU a
    rank's plan and the headroom it keeps while training (vLLM's context, NCCL's buffers) against its GPU
    (the server's fraction off in single_gpu_mode), and the host's items against its memory; on a CPU this
    node's ranks, the server we launch and the sync's copy in /dev/shm against the machine's memory; and
    the sync's directory without room for its copy. Measured unless given: device_bytes (the GPU; on a CPU
    the machine), host_bytes (bytes, whose: machine_bytes), sync_free (weight_sync.free_bytes)."""
    limit, whose = host_bytes or machine_bytes()
    in_memory = host["sync_dir"] if weight_sync.sync_base(cfg.weight_sync_dir, cfg.output_dir) == "/dev/shm" else 0
    container = ", or raise the container's memory limit (docker run --memory)" if whose == "its container's" else ""
    if cuda:
        gpu = device_bytes or torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        gpu *= (1 - cfg.vllm_gpu_memory_utilization) if cfg.single_gpu_mode else 1
        need = rank_total(trainer) + headroom.get("vllm_context", 0) + headroom.get("nccl_buffers", 0)
        if need > gpu:
            raise ValueError(f"memory plan: a trainer rank needs {need / GB:.1f} GB of its GPU's {gpu / GB:.1f} GB; "
                             f"{knob(cfg, trainer, server)}")
        held = dict(host, sync_dir=in_memory)
        need = sum(held.values())
        items = ", ".join(f"{k} {v / GB:.1f}" for k, v in held.items())
        what = f"this node's host memory needs {need / GB:.1f} GB ({items})"
        fix = host_knob(cfg, held)
    else:
        limit = device_bytes or limit
        # the weight sync's part is rank 0's alone (weight_sync.serving_parts)
        sync = trainer["weight_sync"]
        need = local_ranks * (rank_total(trainer) - sync) + sync + sum(server.values()) + in_memory
        what = f"{local_ranks} trainer rank(s) and the vLLM server need {need / GB:.1f} GB"
        fix = knob(cfg, trainer, server)
    if need > limit:
        raise ValueError(f"memory plan: {what} of {whose} {limit / GB:.1f} GB; {fix}{container}")
    check_sync_dir(cfg, host["sync_dir"], sync_free)


def host_knob(cfg, host):
    """The setting that frees the most of the host's largest item."""
    largest = max(host, key=host.get)
    if largest == "sleep_copies":
        return ("raise vllm_tensor_parallel_size (each replica pins one copy of the weights), or give the servers "
                "GPUs of their own (scripts/launch_8gpu.sh)")
    if largest == "sync_dir":
        return "set weight_sync_dir to a directory on a disk"
    return ("set lora_weight_sync='adapter' (the merge holds a second copy)" if cfg.lora_rank else
            "run on a node with more memory") + " (rank 0 holds the whole float32 state dict)"


def check_sync_dir(cfg, need, free=None):
    """Refuse a sync directory without room for what the sync keeps there (sync_dir_bytes): a container's
    /dev/shm is 64 MB unless it is given more. `free`: its free bytes, measured unless given."""
    if not need:  # the NCCL transport writes no files
        return
    base = weight_sync.sync_base(cfg.weight_sync_dir, cfg.output_dir)
    free = weight_sync.free_bytes(base) if free is None else free
    if need > free:
        fix = ("set weight_sync_dir to a directory on a disk, or give the container a larger /dev/shm (docker run "
               "--shm-size)" if base == "/dev/shm" else "set weight_sync_dir to a directory with room")
        raise ValueError(f"memory plan: the weight sync keeps {need / GB:.2f} GB in {base} (the serving copy and the "
                         f"part it replaces), which has {free / GB:.2f} GB free; {fix}")


def describe(trainer, server, headroom=None, host=None):
    """The start-up line: a rank's figure and the server's, each with its parts, a colocated GPU's headroom
    and the host's items, in GB."""
    parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in trainer.items() if k != "per_token" and v)
    line = f"memory plan: trainer rank {rank_total(trainer) / GB:.2f} GB ({parts})"
    for name, items in (("vLLM server", server), ("GPU headroom", headroom), ("host", host)):
        if items and any(items.values()):
            line += (f"; {name} {sum(items.values()) / GB:.2f} GB ("
                     + ", ".join(f"{k} {v / GB:.2f}" for k, v in items.items() if v) + ")")
    return line + "; GB = 1e9 bytes, sequences at full length"
