"""The run's plan, worked out before anything starts and without torch: the device mesh a world of
ranks makes (mesh_shape), each rank's share of a step's batch (batch_plan), the seeds a run's requests
take (max_seed), where a launched vLLM server would sit on GPUs (check_launch), and Config's rules on the
batch and the ranks (check_batch, check_distributed). Used by: Config.__post_init__ (the rules and
max_seed); startup.load_inputs, which refuses a world or a GPU run that does not fit before any process
group starts, and startup.announce, which prints the plan; train.main; parallel.setup_distributed (the
mesh of mesh_shape).
"""


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


def batch_plan(cfg, world_size: int) -> dict:
    """Derive the per-rank batch arithmetic; refuse meshes that do not fit the world (mesh_shape). Rollout:
    prompts x samples sequences, split into num_mini_batches optimizer steps of whole groups, each spread over
    world_size ranks by tokens (packing.py) and packed into micro-batches of at most max_tokens_per_micro_batch
    tokens (gradient accumulation). How many depends on the completions' lengths: the plan gives the count
    when every sequence has its full length, an upper estimate."""
    mesh_shape(cfg, world_size)
    seqs = cfg.num_unique_prompts_rollout * cfg.num_samples_per_prompt_rollout
    per_mini = seqs // cfg.num_mini_batches
    per_rank = -(-per_mini // (world_size // cfg.sequence_parallel_size))  # a sequence-parallel group shares its rows
    full = per_rank * (cfg.max_prompt_length + cfg.response_length)
    return dict(sequences=seqs, mini_batches=cfg.num_mini_batches, per_mini_batch=per_mini, per_rank=per_rank,
                micro_batches_at_full_length=-(-full // cfg.max_tokens_per_micro_batch),
                optimizer_steps=cfg.num_mini_batches * cfg.num_epochs)


def max_seed(cfg) -> int:
    """The largest seed whose every rollout request seed fits vLLM's int64: rollout.rollout_batch seeds a
    request seed * 2**32 + (step * (rounds + 1) + round) * turns * prompts * n + offset within the round
    (below turns * prompts * n), and vLLM seeds its sample j with that + j
    (vllm/v1/engine/parallel_sampling.py), so the largest offset is (steps+1)(rounds+1)TPN - 1."""
    offset = ((cfg.num_training_steps + 1) * (cfg.active_sampling_max_rounds + 1) * cfg.episode_turns
              * cfg.num_unique_prompts_rollout * cfg.num_samples_per_prompt_rollout - 1)
    return (2**63 - 1 - offset) // 2**32


def check_launch(cfg, cuda: bool):
    """Refuse, before any model loads, a GPU run that would launch its vLLM server on a training GPU:
    launch_server starts it on the first visible GPU, rank 0's, to take vllm_gpu_memory_utilization of
    a GPU the policy already fills. In a world of one as well, where single_gpu_mode is the way to share."""
    if cuda and not cfg.vllm_server_urls and not cfg.single_gpu_mode:
        raise ValueError("on GPUs, without vllm_server_urls rank 0 would launch its vLLM server on its own "
                         "training GPU; give the servers GPUs of their own with bash scripts/launch_8gpu.sh (or "
                         "pass vllm_server_urls of servers you run), or set single_gpu_mode=True to share one GPU "
                         "in a single process")


def check_batch(cfg):
    """Config's rules on the batch: a micro-batch holds a whole sequence, a mini-batch whole groups."""
    if cfg.max_tokens_per_micro_batch < cfg.max_prompt_length + cfg.response_length:
        return (f"max_tokens_per_micro_batch={cfg.max_tokens_per_micro_batch} cannot hold one sequence of "
                f"max_prompt_length + response_length = {cfg.max_prompt_length + cfg.response_length} tokens; "
                f"raise it to at least {cfg.max_prompt_length + cfg.response_length}")
    if cfg.num_unique_prompts_rollout % cfg.num_mini_batches:
        return (f"num_unique_prompts_rollout={cfg.num_unique_prompts_rollout} must be divisible by "
                f"num_mini_batches={cfg.num_mini_batches} (each mini-batch takes whole groups)")


def check_distributed(cfg):
    """Config's rules on the ranks and GPUs: sequence parallelism, single_gpu_mode, the collectives' timeout."""
    if problem := check_sequence_parallel(cfg):
        return problem
    if cfg.single_gpu_mode and cfg.vllm_server_urls:
        return ("single_gpu_mode=True shares the trainer's GPU with a server we launch (in sleep mode); "
                "remove vllm_server_urls or set single_gpu_mode=False")
    if cfg.single_gpu_mode and cfg.weight_sync_transport == "nccl":
        return ("single_gpu_mode=True cannot use weight_sync_transport='nccl' (NCCL cannot link two processes "
                "on one GPU); use weight_sync_transport='filesystem'")
    if cfg.single_gpu_mode and cfg.vllm_gpu_memory_utilization > 0.5:
        return (f"single_gpu_mode=True with vllm_gpu_memory_utilization={cfg.vllm_gpu_memory_utilization} "
                "leaves too little of the GPU for the trainer's weights and AdamW state, which stay on it "
                "while vLLM generates; set it to at most 0.5 (0.3 is a start)")
    if cfg.weight_sync_timeout >= 60 * cfg.backend_timeout:
        return (f"weight_sync_timeout={cfg.weight_sync_timeout}s must be below backend_timeout="
                f"{cfg.backend_timeout} min: the other ranks wait for rank 0's sync in a collective that "
                "backend_timeout ends first; lower weight_sync_timeout or raise backend_timeout")


def check_sequence_parallel(cfg):
    sp = cfg.sequence_parallel_size
    if sp > 1 and cfg.fsdp_shard_size and cfg.fsdp_shard_size % sp:
        return (f"sequence_parallel_size={sp} must divide fsdp_shard_size={cfg.fsdp_shard_size}: a sequence's "
                "ranks sit in one shard group (one node), where the all-to-alls run on the fast links")
    if sp > 1 and cfg.attn_implementation != "packed_sdpa":
        return (f"sequence_parallel_size={sp} runs packed_sdpa on whole rows between its all-to-alls; "
                f"attn_implementation={cfg.attn_implementation!r} is not supported with it: set packed_sdpa")
    if sp > 1 and cfg.objective and cfg.objective.sequences:
        return (f"loss_fn={cfg.loss_fn!r} with sequence_parallel_size={sp}: the sequence ratio needs all of a sequence's "
                "tokens, which may sit on two ranks; pick another loss_fn or sequence_parallel_size=1")
    if sp > 1 and cfg.vllm_importance_sampling_mask == "sequence":
        return (f"vllm_importance_sampling_mask='sequence' with sequence_parallel_size={sp}: a sequence's tokens "
                "may sit on two ranks; use the token mask or sequence_parallel_size=1")
    if sp > 1 and cfg.single_gpu_mode:
        return f"single_gpu_mode=True runs one trainer process; sequence_parallel_size={sp} needs {sp} ranks"
